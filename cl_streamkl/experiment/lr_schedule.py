"""The learning rate within each experience: constant or cosine, after an optional linear warm-up.

Every experience starts the schedule afresh, as it starts Adam's moments afresh (the runner
resets the optimizer): each is a training run of its own, the same for every strategy. The
rate follows from the iteration within the experience alone, so a run resumed from a
checkpoint (taken between experiences) follows the schedule of an uninterrupted one.
"""

from __future__ import annotations

import math
from typing import Any

from avalanche.training.plugins import SupervisedPlugin

from cl_streamkl.experiment.config import LR_SCHEDULES


def lr_factor(schedule: str, step: int, total_steps: int, warmup_steps: int = 0) -> float:
    """The multiple of the base rate at optimizer step ``step`` (0-based) of ``total_steps``.

    Warm-up rises linearly over the first ``warmup_steps`` steps (1/w, 2/w, ..., 1); then
    ``constant`` stays at 1 and ``cosine`` falls along half a cosine from 1 towards 0, which
    it would reach one step after the last.

    Raises:
        ValueError: unknown schedule, or steps out of range.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}; got {schedule!r}")
    if not 0 <= warmup_steps <= total_steps or not 0 <= step < max(total_steps, 1):
        raise ValueError(f"step {step} and warmup_steps {warmup_steps} must lie within {total_steps} steps")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))


class LRSchedulePlugin(SupervisedPlugin):
    """Sets every parameter group's learning rate before each training iteration.

    Args:
        schedule: ``"constant"`` or ``"cosine"`` (see :func:`lr_factor`).
        base_lr: the rate the schedule multiplies.
        warmup_epochs: epochs of linear warm-up at the start of every experience, fewer
            than the experience's epochs.
    """

    def __init__(self, schedule: str, base_lr: float, warmup_epochs: int = 0) -> None:
        super().__init__()
        if schedule not in LR_SCHEDULES:
            raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}; got {schedule!r}")
        self.schedule, self.base_lr, self.warmup_epochs = schedule, base_lr, warmup_epochs
        self.total_steps = self.warmup_steps = 0

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        steps_per_epoch = len(strategy.dataloader)
        self.total_steps = strategy.train_epochs * steps_per_epoch
        self.warmup_steps = self.warmup_epochs * steps_per_epoch

    def before_training_iteration(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        step = strategy.clock.train_exp_iterations
        lr = self.base_lr * lr_factor(self.schedule, step, self.total_steps, self.warmup_steps)
        for group in strategy.optimizer.param_groups:
            group["lr"] = lr
