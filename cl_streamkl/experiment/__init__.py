"""Continual-learning experiments: configuration, model and strategy factories, run loop, outputs.

:class:`ExperimentConfig` and the strategy names import cheaply (the command line builds
its help from them); everything that trains is imported on first use.
"""

from __future__ import annotations

from cl_streamkl._lazy import lazy_attributes
from cl_streamkl.experiment.config import DEFAULT_STRATEGIES, STRATEGY_COMPONENTS, ExperimentConfig

__all__ = [
    "DEFAULT_STRATEGIES",
    "STRATEGY_COMPONENTS",
    "ExperimentConfig",
    "RunResult",
    "average_accuracy_per_experience",
    "average_forgetting",
    "backward_transfer",
    "build_model",
    "final_average_accuracy",
    "format_table",
    "run_experiment",
    "summarize",
]

_LAZY = {
    "average_accuracy_per_experience": "cl_streamkl.experiment.accuracy_matrix",
    "average_forgetting": "cl_streamkl.experiment.accuracy_matrix",
    "backward_transfer": "cl_streamkl.experiment.accuracy_matrix",
    "final_average_accuracy": "cl_streamkl.experiment.accuracy_matrix",
    "build_model": "cl_streamkl.experiment.model",
    "RunResult": "cl_streamkl.experiment.runner",
    "run_experiment": "cl_streamkl.experiment.runner",
    "format_table": "cl_streamkl.experiment.summary",
    "summarize": "cl_streamkl.experiment.summary",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
