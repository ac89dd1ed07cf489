"""Replay buffers, balanced over experiences or over classes, whose content is a small, restorable set of indices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from avalanche.benchmarks.utils.data import AvalancheDataset
from avalanche.benchmarks.utils.utils import concat_datasets
from avalanche.training.storage_policy import ExemplarsBuffer


class SeededExperienceBuffer(ExemplarsBuffer):
    """Keeps ``max_size`` samples split evenly over the experiences seen so far.

    Avalanche's ``ExperienceBalancedBuffer`` stores dataset objects drawn with the
    global RNG, which cannot be written to a checkpoint. This buffer stores, per
    experience, a random permutation of that experience's sample indices drawn from
    its own generator (seed, experience id); the buffer holds the first
    ``quota`` entries of each. Its state is those index tensors, so a resumed run
    rebuilds exactly the same buffer.

    Args:
        max_size: total number of stored samples.
        train_datasets: the stream's training dataset per experience (indices refer to them).
        seed: run seed; the buffer draws do not touch the global RNG.
    """

    def __init__(self, max_size: int, train_datasets: Sequence[AvalancheDataset], seed: int) -> None:
        super().__init__(max_size)
        self.train_datasets = list(train_datasets)
        self.seed = seed
        self.order: dict[int, torch.Tensor] = {}

    def post_adapt(self, agent_state: Any, exp: Any) -> None:
        """Add the experience just trained on and shrink the older shares."""
        exp_id = int(exp.current_experience)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + exp_id)
        self.order[exp_id] = torch.randperm(len(self.train_datasets[exp_id]), generator=generator)
        self._rebuild()

    def update(self, strategy: Any, **kwargs: Any) -> None:
        """What Avalanche's ``ReplayPlugin`` calls after each experience: :meth:`post_adapt`.

        Overridden so the call skips the base class's deprecated ``update``, whose warning
        also resets Python's warning filters on every experience.
        """
        self.post_adapt(strategy, strategy.experience)

    def resize(self, strategy: Any, new_size: int) -> None:
        """Change the capacity and redistribute it over the stored experiences."""
        self.max_size = new_size
        self._rebuild()

    def quotas(self) -> dict[int, int]:
        """Samples kept per stored experience; the first experiences get the remainder."""
        ids = sorted(self.order)
        if not ids:
            return {}
        base, extra = divmod(self.max_size, len(ids))
        return {exp_id: base + (rank < extra) for rank, exp_id in enumerate(ids)}

    def _rebuild(self) -> None:
        parts = [
            self.train_datasets[exp_id].subset(self.order[exp_id][:quota].tolist())
            for exp_id, quota in self.quotas().items() if quota > 0
        ]
        self.buffer = concat_datasets(parts)

    def state_dict(self) -> dict[str, Any]:
        """``{"max_size": int, "order": {experience id: (n,) int64 permutation}}``."""
        return {"max_size": self.max_size, "order": {k: v.clone() for k, v in self.order.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` and rebuild the buffer."""
        self.max_size = int(state["max_size"])
        self.order = {int(k): v.clone() for k, v in state["order"].items()}
        self._rebuild()


class SeededClassBuffer(SeededExperienceBuffer):
    """Keeps the same number of samples of every class seen so far (class- and task-incremental streams).

    The draws are :class:`SeededExperienceBuffer`'s: one seeded permutation of each
    experience's sample indices; a class keeps the first samples of its label along its
    experience's permutation, so the buffer is a seeded random subset per class and its
    state is the same index tensors. A class is keyed by (experience, label), which also
    separates the task scenario's per-experience labels.

    Args:
        max_size: total number of stored samples, split evenly over the classes seen (the
            first classes get the remainder); unused when ``per_class`` is set.
        train_datasets: the stream's training dataset per experience (with ``targets``).
        seed: run seed; the buffer draws do not touch the global RNG.
        per_class: when > 0, keep this many samples of every class instead (the buffer
            grows with the classes seen).
    """

    def __init__(self, max_size: int, train_datasets: Sequence[AvalancheDataset], seed: int,
                 per_class: int = 0) -> None:
        if per_class < 0:
            raise ValueError(f"per_class must be >= 0; got {per_class}")
        super().__init__(max_size, train_datasets, seed)
        self.per_class = per_class
        self._labels: dict[int, torch.Tensor] = {}

    def labels(self, exp_id: int) -> torch.Tensor:
        """(n,) int64 labels of experience ``exp_id``'s training samples, read once."""
        if exp_id not in self._labels:
            self._labels[exp_id] = torch.as_tensor(list(self.train_datasets[exp_id].targets), dtype=torch.int64)
        return self._labels[exp_id]

    def class_quotas(self) -> dict[tuple[int, int], int]:
        """Samples kept per stored (experience, label), in experience then label order."""
        classes = [(exp_id, int(label)) for exp_id in sorted(self.order)
                   for label in torch.unique(self.labels(exp_id)).tolist()]
        if self.per_class > 0:
            return dict.fromkeys(classes, self.per_class)
        if not classes:
            return {}
        base, extra = divmod(self.max_size, len(classes))
        return {key: base + (rank < extra) for rank, key in enumerate(classes)}

    def _rebuild(self) -> None:
        quotas = self.class_quotas()
        parts = []
        for exp_id, order in sorted(self.order.items()):
            labels = self.labels(exp_id)[order]
            keep = torch.zeros_like(order, dtype=torch.bool)
            for label in torch.unique(labels).tolist():
                positions = torch.nonzero(labels == label).flatten()[:quotas[(exp_id, int(label))]]
                keep[positions] = True
            if keep.any():
                parts.append(self.train_datasets[exp_id].subset(order[keep].tolist()))
        self.buffer = concat_datasets(parts)
