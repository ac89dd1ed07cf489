"""Avalanche metrics that report the StreamKL penalty and its share of the loss to every logger.

Add them to the strategy's ``EvaluationPlugin`` next to the usual metrics; Interactive,
Text, Tensorboard and W&B loggers then show ``StreamKL_Penalty_MB`` /
``StreamKL_Penalty_Epoch`` / ``StreamKL_Penalty_Exp`` (alpha × the KL, as added to the
loss) and ``StreamKL_PenaltyShare_MB`` / ``_Epoch`` / ``_Exp`` (that penalty over the loss
it was added to: 0.01 is 1 %). (Avalanche's ``CSVLogger`` writes
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
# What a metric reports → the plugin's attribute and the metric's name.
_QUANTITIES = {"penalty": ("last_penalty", "Penalty"), "share": ("last_share", "PenaltyShare")}


class StreamKLPenaltyMetric(GenericPluginMetric[float, Mean]):
    """Mean StreamKL penalty, or its share of the loss, over a minibatch, epoch or training experience.

    It reads ``last_penalty`` (or ``last_share``) of the strategy's :class:`StreamKLPlugin`
    after every training iteration, weighted by the minibatch size like Avalanche's loss
    metrics.

    Args:
        period: ``"iteration"``, ``"epoch"`` or ``"experience"``: when the mean is reset
            and emitted.
        quantity: ``"penalty"`` (alpha × the KL) or ``"share"`` (the penalty over the loss it
            was added to).

    Raises:
        ValueError: unknown ``period`` or ``quantity``.
        RuntimeError: (at training start) the strategy has no :class:`StreamKLPlugin`.
    """

    def __init__(self, period: str = "epoch", quantity: str = "penalty") -> None:
        if period not in _PERIODS:
            raise ValueError(f"period must be one of {sorted(_PERIODS)}, got {period!r}")
        if quantity not in _QUANTITIES:
            raise ValueError(f"quantity must be one of {sorted(_QUANTITIES)}, got {quantity!r}")
        self._period = period
        self._quantity = quantity
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
        value = getattr(self._plugin(strategy), _QUANTITIES[self._quantity][0])
        self._metric.update(value, weight=len(strategy.mb_y))

    def __str__(self) -> str:
        return f"StreamKL_{_QUANTITIES[self._quantity][1]}_{_PERIODS[self._period]}"


def streamkl_penalty_metrics(
    *, minibatch: bool = False, epoch: bool = True, experience: bool = False, share: bool = True
) -> list[StreamKLPenaltyMetric]:
    """The StreamKL penalty metrics to pass to ``EvaluationPlugin``.

    Args:
        minibatch: report every iteration (``StreamKL_Penalty_MB``).
        epoch: report the epoch mean (``StreamKL_Penalty_Epoch``).
        experience: report the training-experience mean (``StreamKL_Penalty_Exp``).
        share: also report the penalty's share of the loss at the same periods
            (``StreamKL_PenaltyShare_MB/Epoch/Exp``).
    """
    chosen = [period for period, wanted in (("iteration", minibatch), ("epoch", epoch), ("experience", experience))
              if wanted]
    quantities = ["penalty", "share"] if share else ["penalty"]
    return [StreamKLPenaltyMetric(period, quantity) for quantity in quantities for period in chosen]
