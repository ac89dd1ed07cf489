"""The outcome of one strategy on one seed, and the metrics derived from its accuracy matrix.

Kept apart from :mod:`~cl_streamkl.experiment.runner`, which produces it, so the modules that
write, summarise and compare results depend on the record alone and call down to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cl_streamkl.experiment.accuracy_matrix import (
    average_accuracy_per_experience,
    average_forgetting,
    backward_transfer,
    final_average_accuracy,
    learning_accuracy,
    stream_accuracy,
)

__all__ = ["RunResult"]


@dataclass
class RunResult:
    """Outcome of one strategy on one seed.

    Attributes:
        accuracy_matrix: (T, T) nested list, ``[i][j]`` = accuracy on experience j after
            training experience i, as the scenario measures it: Class-IL accuracy (one
            head, all classes) in ``class``, Task-IL accuracy (experience j's own head)
            in ``task``, accuracy under experience j's input shift in ``domain``. For
            ``joint``, trained once on every experience's data, all T rows are the one
            evaluation after that training (so forgetting and transfer are 0).
        task_il_matrix: ``class`` only: (T, T) like ``accuracy_matrix`` but each
            prediction restricted to the evaluated experience's classes (Task-IL
            accuracy of the shared head); empty in other scenarios.
        eval_sizes: evaluation samples per experience (weights of the stream accuracy;
            empty in results written before it was recorded).
        penalties: attention-distillation penalty (StreamKL or PAD) after every training
            iteration (empty without one).
        wall_time_s: training plus evaluation time, summed over every start when resumed
            (rank 0's in a data-parallel run).
        peak_memory_mb: this run's own peak, in MiB: CUDA peak allocated memory on a GPU;
            on a CPU the peak resident set size of the process sampled while this run
            trained and evaluated (it includes the data and libraries the process holds,
            so compare strategies by their differences). The largest over the processes
            of a data-parallel run.
    """

    strategy: str
    seed: int
    class_order: list[int]
    accuracy_matrix: list[list[float]]
    task_il_matrix: list[list[float]] = field(default_factory=list)
    eval_sizes: list[int] = field(default_factory=list)
    penalties: list[float] = field(default_factory=list)
    wall_time_s: float = 0.0
    peak_memory_mb: float = 0.0

    def metrics(self) -> dict[str, Any]:
        """The derived metrics: average accuracies, forgetting, BWT, learning accuracy."""
        return {
            "average_accuracy": average_accuracy_per_experience(self.accuracy_matrix),
            "final_average_accuracy": final_average_accuracy(self.accuracy_matrix),
            "stream_accuracy": (stream_accuracy(self.accuracy_matrix, self.eval_sizes)
                                if self.eval_sizes else None),
            "average_forgetting": average_forgetting(self.accuracy_matrix),
            "backward_transfer": backward_transfer(self.accuracy_matrix),
            "learning_accuracy": learning_accuracy(self.accuracy_matrix),
            "final_task_il_accuracy": (final_average_accuracy(self.task_il_matrix)
                                       if self.task_il_matrix else None),
            "mean_penalty": (sum(self.penalties) / len(self.penalties)) if self.penalties else None,
        }

    def to_dict(self) -> dict[str, Any]:
        """The recorded fields and :meth:`metrics`, as written to ``results.json``."""
        return {**asdict(self), **self.metrics()}
