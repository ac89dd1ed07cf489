"""One classification head per experience on a shared timm backbone (the task-incremental model)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from avalanche.benchmarks.scenarios import CLExperience
from avalanche.models import MultiTaskModule
from torch import nn


class MultiHeadViT(MultiTaskModule):
    """A timm vision transformer whose classifier is one linear head per task.

    Every head exists from the start, so the model's parameters never change shape
    (checkpoints and optimizers need no adaptation). It is an Avalanche
    ``MultiTaskModule``: strategies call ``model(x, task_labels)``, and LwF reads every
    head at once through ``model(x, None)``.

    Args:
        backbone: a timm model built with ``num_classes=0`` (its forward returns the
            pooled features, (B, num_features)).
        head_sizes: outputs of each task's head.
    """

    def __init__(self, backbone: nn.Module, head_sizes: Sequence[int]) -> None:
        super().__init__()
        if not head_sizes or any(int(n) < 1 for n in head_sizes):
            raise ValueError(f"head_sizes must be positive integers; got {list(head_sizes)}")
        self.backbone = backbone
        self.heads = nn.ModuleList(nn.Linear(backbone.num_features, int(n)) for n in head_sizes)

    def adaptation(self, experience: CLExperience) -> None:
        """Nothing to adapt: the heads of all tasks are built up front."""

    def forward(self, x: torch.Tensor, task_labels: int | torch.Tensor | None = None
                ) -> torch.Tensor | dict[int, torch.Tensor]:
        """Logits of each sample's own task head.

        Args:
            x: (B, C, S, S) images.
            task_labels: one task for the batch (int), one per sample ((B,) tensor), or
                ``None`` for every head's logits.

        Returns:
            (B, head size) logits. With per-sample tasks of different head sizes the
            rows are padded to the largest head with ``-inf`` (zero probability under
            softmax, so cross-entropy over a row sees only its own head). With
            ``None``, ``{task: (B, head size) logits}`` for every task.
        """
        features = self.backbone(x)
        if task_labels is None:
            return {task: head(features) for task, head in enumerate(self.heads)}
        if isinstance(task_labels, int):
            return self.heads[task_labels](features)
        tasks = torch.unique(task_labels).tolist()
        if len(tasks) == 1:
            return self.heads[tasks[0]](features)
        width = max(self.heads[task].out_features for task in tasks)
        logits = features.new_full((len(features), width), float("-inf"))
        for task in tasks:
            rows = task_labels == task
            head_logits = self.heads[task](features[rows])
            logits[rows, : head_logits.shape[1]] = head_logits.to(logits.dtype)
        return logits
