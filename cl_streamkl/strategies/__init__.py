"""Continual-learning strategies built on attention distillation, and the comparators they meet.

:class:`AttentionDistiller` (StreamKL) and :class:`PooledAttentionDistiller` (PAD) do the
work and know nothing of Avalanche; the Avalanche plugins (:class:`StreamKLPlugin`,
:class:`PADPlugin`, :class:`WeightAlignPlugin`) and the penalty metrics adapt them to its
training loop.

``pip install "cl-streamkl[strategies]"`` brings timm and Avalanche. The distillers need timm
only: Avalanche (several seconds to import) is imported when a plugin or metric is first
named, so a plain training loop neither waits for it nor needs it installed.
"""

import importlib
from typing import Any

from cl_streamkl._extras import require_extra

require_extra(__name__, "strategies", {"timm": "timm"})

from cl_streamkl.strategies.distiller import AttentionDistiller  # noqa: E402 (after the check)
from cl_streamkl.strategies.pooled_attention import PooledAttentionDistiller, pooled_attention_distance  # noqa: E402
from cl_streamkl.strategies.teacher import frozen_copy  # noqa: E402

# The names that need Avalanche, and the module of this package that defines each.
_AVALANCHE_NAMES = {
    "AttentionDistillationPlugin": "plugin",
    "PADPlugin": "plugin",
    "StreamKLPlugin": "plugin",
    "StreamKLPenaltyMetric": "penalty_metrics",
    "streamkl_penalty_metrics": "penalty_metrics",
    "WeightAlignPlugin": "weight_aligning",
}

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


def __getattr__(name: str) -> Any:
    """Import an Avalanche-backed name on first use (PEP 562), naming the extra if Avalanche is missing."""
    module = _AVALANCHE_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require_extra(f"{__name__}.{name}", "strategies", {"avalanche": "avalanche-lib"})
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
