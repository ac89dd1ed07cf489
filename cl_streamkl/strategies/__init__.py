"""Continual-learning strategies built on StreamKL attention distillation.

:class:`AttentionDistiller` is framework-free. :class:`StreamKLPlugin` and the penalty
metrics adapt it to Avalanche and are imported on first use, so the distiller works
where Avalanche is not installed.
"""

from __future__ import annotations

from typing import Any

from cl_streamkl.strategies.distiller import AttentionDistiller
from cl_streamkl.strategies.teacher import frozen_copy

__all__ = [
    "AttentionDistiller",
    "StreamKLPenaltyMetric",
    "StreamKLPlugin",
    "frozen_copy",
    "streamkl_penalty_metrics",
]

_AVALANCHE_NAMES = {
    "StreamKLPlugin": "cl_streamkl.strategies.plugin",
    "StreamKLPenaltyMetric": "cl_streamkl.strategies.penalty_metrics",
    "streamkl_penalty_metrics": "cl_streamkl.strategies.penalty_metrics",
}


def __getattr__(name: str) -> Any:
    if name in _AVALANCHE_NAMES:
        import importlib

        return getattr(importlib.import_module(_AVALANCHE_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
