"""Per-iteration progress bar and penalty recording, as an Avalanche plugin."""

from __future__ import annotations

from typing import Any

import torch
from avalanche.training.plugins import SupervisedPlugin
from tqdm.auto import tqdm

from cl_streamkl.distributed.data_parallel import DataParallel


class ProgressPlugin(SupervisedPlugin, supports_distributed=True):
    """Shows a tqdm bar per training experience and records StreamKL's penalty.

    Must come after plugins that replace the data loader (replay) so the bar
    length counts the real iterations.

    In a data-parallel run each rank's penalty is the mean over its share of the batch;
    after each experience the ranks' penalties, weighted as their losses are, are
    averaged into the whole batch's penalty (one collective per experience), so
    ``penalties`` holds what one process would record. The bar shows the rank's own.

    Args:
        description: bar label, e.g. ``"lwf+streamkl seed 0"``.
        n_experiences: experiences in the stream (for the ``exp i/n`` label).
        penalty_source: an object with ``last_penalty`` and ``last_share`` floats (the StreamKL plugin)
            or None; its value after every backward pass is appended to ``penalties``.
        enabled: False hides the bars (penalties are still recorded).
        data_parallel: this process's place in the run (default: a single process).
    """

    def __init__(
        self, description: str, n_experiences: int, penalty_source: Any = None, enabled: bool = True,
        data_parallel: DataParallel | None = None,
    ) -> None:
        super().__init__()
        self.description = description
        self.n_experiences = n_experiences
        self.penalty_source = penalty_source
        self.enabled = enabled
        self.data_parallel = DataParallel() if data_parallel is None else data_parallel
        self.penalties: list[float] = []
        # This experience's penalties so far, each times the loss weight of its step.
        self._weighted: list[float] = []
        self._last = 0.0
        self._bar: tqdm | None = None

    def before_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        exp_id = strategy.experience.current_experience
        self._bar = tqdm(
            total=strategy.train_epochs * len(strategy.dataloader),
            desc=f"{self.description} exp {exp_id + 1}/{self.n_experiences}",
            leave=False, disable=not self.enabled, dynamic_ncols=True,
        )

    def after_backward(self, strategy: Any, **kwargs: Any) -> None:
        if self.penalty_source is not None:
            self._last = float(self.penalty_source.last_penalty)
            self._weighted.append(self._last * getattr(strategy, "loss_weight", 1.0))

    def after_training_iteration(self, strategy: Any, **kwargs: Any) -> None:
        if self._bar is not None:
            postfix = {"loss": f"{float(strategy.loss.detach()):.3f}"}
            if self.penalty_source is not None and self._weighted:
                postfix["kl"] = f"{self._last:.1e}"
                # The penalty's share of the loss it was added to: whether alpha makes it act at all.
                postfix["kl/loss"] = f"{float(getattr(self.penalty_source, 'last_share', 0.0)):.2%}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        weighted, self._weighted = self._weighted, []
        if self.data_parallel.distributed and self.penalty_source is not None:
            world = self.data_parallel.world_size
            weighted = (self.data_parallel.all_sum(torch.tensor(weighted, dtype=torch.float64)) / world).tolist()
        self.penalties.extend(weighted)
