"""Per-iteration progress bar and penalty recording, as an Avalanche plugin."""

from __future__ import annotations

from typing import Any

from avalanche.training.plugins import SupervisedPlugin
from tqdm.auto import tqdm


class ProgressPlugin(SupervisedPlugin):
    """Shows a tqdm bar per training experience and records StreamKL's penalty.

    Must come after plugins that replace the data loader (replay) so the bar
    length counts the real iterations.

    Args:
        description: bar label, e.g. ``"lwf+streamkl seed 0"``.
        n_experiences: experiences in the stream (for the ``exp i/n`` label).
        penalty_source: an object with a ``last_penalty`` float (the StreamKL plugin)
            or None; its value after every backward pass is appended to ``penalties``.
        enabled: False hides the bars (penalties are still recorded).
    """

    def __init__(
        self, description: str, n_experiences: int, penalty_source: Any = None, enabled: bool = True
    ) -> None:
        super().__init__()
        self.description = description
        self.n_experiences = n_experiences
        self.penalty_source = penalty_source
        self.enabled = enabled
        self.penalties: list[float] = []
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
            self.penalties.append(float(self.penalty_source.last_penalty))

    def after_training_iteration(self, strategy: Any, **kwargs: Any) -> None:
        if self._bar is not None:
            postfix = {"loss": f"{float(strategy.loss.detach()):.3f}"}
            if self.penalty_source is not None and self.penalties:
                postfix["kl"] = f"{self.penalties[-1]:.4f}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
