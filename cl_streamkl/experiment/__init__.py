"""Class-incremental experiments: configuration, model and strategy factories, run loop, outputs."""

from cl_streamkl.experiment.config import DEFAULT_STRATEGIES, STRATEGY_COMPONENTS, ExperimentConfig
from cl_streamkl.experiment.accuracy_matrix import (
    average_accuracy_per_experience,
    average_forgetting,
    backward_transfer,
    final_average_accuracy,
)
from cl_streamkl.experiment.model import build_model
from cl_streamkl.experiment.runner import RunResult, run_experiment
from cl_streamkl.experiment.summary import format_table, summarize

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
