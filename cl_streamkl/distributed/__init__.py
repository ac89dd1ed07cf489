"""StreamKL across processes: everything a run over several processes needs, on torch alone.

* :mod:`~cl_streamkl.distributed.context_parallel`: :func:`attention_kl_key_sharded`, the op
  over keys sharded in a process group (context parallelism).
* :mod:`~cl_streamkl.distributed.data_parallel`: the process group torchrun describes
  (:class:`DataParallel`, :func:`start_data_parallel`), and :func:`unwrap_data_parallel`.
* :mod:`~cl_streamkl.distributed.sharding`: each rank's share of every batch (:class:`BatchShards`).
* :mod:`~cl_streamkl.distributed.lost_peers`: a process lost by the others, as one line
  (:class:`LostPeerError`, :func:`peers_checked`).

Kept out of the top-level namespace (but for :func:`attention_kl_key_sharded`), as torch
keeps its collectives under ``torch.distributed``.
"""

from cl_streamkl.distributed.context_parallel import attention_kl_key_sharded
from cl_streamkl.distributed.data_parallel import (
    DataParallel,
    resolve_device,
    start_data_parallel,
    stop_data_parallel,
    unwrap_data_parallel,
)
from cl_streamkl.distributed.lost_peers import LostPeerError, peers_checked
from cl_streamkl.distributed.sharding import BatchShards, sharded_loader

__all__ = [
    "BatchShards",
    "DataParallel",
    "LostPeerError",
    "attention_kl_key_sharded",
    "peers_checked",
    "resolve_device",
    "sharded_loader",
    "start_data_parallel",
    "stop_data_parallel",
    "unwrap_data_parallel",
]
