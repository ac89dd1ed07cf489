"""Continual-learning strategies built on attention distillation, and the comparators they meet.

:class:`AttentionDistiller` (StreamKL) and :class:`PooledAttentionDistiller` (PAD) do the
work and know nothing of Avalanche; the Avalanche plugins (:class:`StreamKLPlugin`,
:class:`PADPlugin`, :class:`WeightAlignPlugin`) and the penalty metrics adapt them to its
training loop.

Needs Avalanche and timm (``pip install "cl-streamkl[strategies]"``).
"""

from cl_streamkl._extras import require_extra

require_extra(__name__, "strategies", {"avalanche": "avalanche-lib", "timm": "timm"})

from cl_streamkl.strategies.distiller import AttentionDistiller  # noqa: E402 (after the check)
from cl_streamkl.strategies.penalty_metrics import StreamKLPenaltyMetric, streamkl_penalty_metrics  # noqa: E402
from cl_streamkl.strategies.plugin import AttentionDistillationPlugin, PADPlugin, StreamKLPlugin  # noqa: E402
from cl_streamkl.strategies.pooled_attention import PooledAttentionDistiller, pooled_attention_distance  # noqa: E402
from cl_streamkl.strategies.teacher import frozen_copy  # noqa: E402
from cl_streamkl.strategies.weight_aligning import WeightAlignPlugin  # noqa: E402

__all__ = [
    "AttentionDistillationPlugin",
    "AttentionDistiller",
    "PADPlugin",
    "PooledAttentionDistiller",
    "StreamKLPenaltyMetric",
    "StreamKLPlugin",
    "WeightAlignPlugin",
    "frozen_copy",
    "pooled_attention_distance",
    "streamkl_penalty_metrics",
]
