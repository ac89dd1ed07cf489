"""cl-streamkl: streaming attention-KL distillation for continual learning with vision transformers.

The package itself is the op and needs torch and triton alone. The wings add what their
audiences need, each behind a pip extra: :mod:`cl_streamkl.capture` (``[capture]``, timm),
:mod:`cl_streamkl.strategies` (``[strategies]``, Avalanche) and :mod:`cl_streamkl.experiment`
(``[experiment]``, the command line and its data).
"""

from cl_streamkl.attention_kl import AttentionKLDivLoss, attention_kl, attention_kl_grouped
from cl_streamkl.distributed.context_parallel import attention_kl_key_sharded
from cl_streamkl.kernels.pooled_reference import pooled_attention_reference
from cl_streamkl.kernels.reference import attention_kl_reference
from cl_streamkl.pooled_attention import PooledAttention, pooled_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionKLDivLoss",
    "PooledAttention",
    "__version__",
    "attention_kl",
    "attention_kl_grouped",
    "attention_kl_key_sharded",
    "attention_kl_reference",
    "pooled_attention",
    "pooled_attention_reference",
]
