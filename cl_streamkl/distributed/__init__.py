"""StreamKL across processes: context parallelism over keys sharded in a process group.

Kept out of the top-level ``cl_streamkl`` namespace, as torch keeps its collectives under
``torch.distributed``: the single-device API stays free of process-group concerns.
"""

from cl_streamkl.distributed.context_parallel import attention_kl_key_sharded

__all__ = ["attention_kl_key_sharded"]
