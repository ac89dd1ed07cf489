"""Avalanche metrics that report the StreamKL penalty to every logger.

Add them to the strategy's ``EvaluationPlugin`` next to the usual metrics; Interactive,
Text, Tensorboard and W&B loggers then show ``StreamKL_Penalty_MB`` /
``StreamKL_Penalty_Epoch`` / ``StreamKL_Penalty_Exp``. (Avalanche's ``CSVLogger`` writes
a fixed set of accuracy/loss columns and ignores other metrics; its training loss column
already contains the penalty, since the plugin adds it to ``strategy.loss``.)

Example:
    >>> evaluator = EvaluationPlugin(
    ...     loss_metrics(epoch=True), streamkl_penalty_metrics(minibatch=True, epoch=True),
    ...     loggers=[InteractiveLogger(), TensorboardLogger()])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from avalanche.evaluation import GenericPluginMetric
from avalanche.evaluation.metrics.mean import Mean

from cl_streamkl.strategies.plugin import StreamKLPlugin

if TYPE_CHECKING:
    from avalanche.training.templates import SupervisedTemplate

__all__ = ["StreamKLPenaltyMetric", "streamkl_penalty_metrics"]

_PERIODS = {"iteration": "MB", "epoch": "Epoch", "experience": "Exp"}


class StreamKLPenaltyMetric(GenericPluginMetric[float, Mean]):
    """Mean StreamKL penalty per pattern over a minibatch, epoch or training experience.

    It reads ``last_penalty`` of the strategy's :class:`StreamKLPlugin` after every
    training iteration, weighted by the minibatch size like Avalanche's loss metrics.

    Args:
        period: ``"iteration"``, ``"epoch"`` or ``"experience"``: when the mean is reset
            and emitted.

    Raises:
        ValueError: unknown ``period``.
        RuntimeError: (at training start) the strategy has no :class:`StreamKLPlugin`.
    """

    def __init__(self, period: str = "epoch") -> None:
        if period not in _PERIODS:
            raise ValueError(f"period must be one of {sorted(_PERIODS)}, got {period!r}")
        self._period = period
        super().__init__(Mean(), reset_at=period, emit_at=period, mode="train")

    @staticmethod
    def _plugin(strategy: SupervisedTemplate) -> StreamKLPlugin:
        plugins = [p for p in strategy.plugins if isinstance(p, StreamKLPlugin)]
        if len(plugins) != 1:
            raise RuntimeError(
                f"StreamKLPenaltyMetric needs exactly one StreamKLPlugin in the strategy's plugins, found {len(plugins)}"
            )
        return plugins[0]

    def before_training(self, strategy: SupervisedTemplate):
        self._plugin(strategy)
        return super().before_training(strategy)

    def update(self, strategy: SupervisedTemplate) -> None:
        self._metric.update(self._plugin(strategy).last_penalty, weight=len(strategy.mb_y))

    def __str__(self) -> str:
        return f"StreamKL_Penalty_{_PERIODS[self._period]}"


def streamkl_penalty_metrics(
    *, minibatch: bool = False, epoch: bool = True, experience: bool = False
) -> list[StreamKLPenaltyMetric]:
    """The StreamKL penalty metrics to pass to ``EvaluationPlugin``.

    Args:
        minibatch: report every iteration (``StreamKL_Penalty_MB``).
        epoch: report the epoch mean (``StreamKL_Penalty_Epoch``).
        experience: report the training-experience mean (``StreamKL_Penalty_Exp``).
    """
    chosen = [("iteration", minibatch), ("epoch", epoch), ("experience", experience)]
    return [StreamKLPenaltyMetric(period) for period, wanted in chosen if wanted]
