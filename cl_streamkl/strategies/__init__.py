"""Continual-learning strategies built on attention distillation, and the comparators they meet.

:class:`AttentionDistiller` (StreamKL) and :class:`PooledAttentionDistiller` (PAD) are
framework-free. The Avalanche plugins (:class:`StreamKLPlugin`, :class:`PADPlugin`,
:class:`WeightAlignPlugin`) and the penalty metrics are imported on first use, so the
distillers work where Avalanche is not installed.
"""

from __future__ import annotations

from cl_streamkl._lazy import lazy_attributes
from cl_streamkl.strategies.distiller import AttentionDistiller
from cl_streamkl.strategies.pooled_attention import PooledAttentionDistiller, pooled_attention_distance
from cl_streamkl.strategies.teacher import frozen_copy

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

_AVALANCHE_NAMES = {
    "AttentionDistillationPlugin": "cl_streamkl.strategies.plugin",
    "PADPlugin": "cl_streamkl.strategies.plugin",
    "StreamKLPlugin": "cl_streamkl.strategies.plugin",
    "WeightAlignPlugin": "cl_streamkl.strategies.weight_aligning",
    "StreamKLPenaltyMetric": "cl_streamkl.strategies.penalty_metrics",
    "streamkl_penalty_metrics": "cl_streamkl.strategies.penalty_metrics",
}


__getattr__ = lazy_attributes(__name__, _AVALANCHE_NAMES)
