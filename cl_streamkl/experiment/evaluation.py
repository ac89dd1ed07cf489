"""Accuracy of a model on each experience's evaluation data (one row of the accuracy matrix)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from cl_streamkl.experiment.template import autocast


@torch.no_grad()
def accuracy_per_experience(
    model: nn.Module,
    datasets: Sequence[Dataset],
    *,
    batch_size: int,
    device: torch.device,
    amp: str = "none",
) -> list[float]:
    """Top-1 accuracy on each dataset, predicting over all classes (class-incremental).

    Args:
        model: maps (B, C, S, S) images to (B, num_classes) logits.
        datasets: one dataset per experience, items ``(image, label, ...)``.
        batch_size: evaluation batch size.
        device: where the model lives.
        amp: autocast mode used for the forward pass.

    Returns:
        One accuracy in [0, 1] per dataset (0.0 for an empty dataset).
    """
    was_training = model.training
    model.eval()
    accuracies = []
    try:
        for dataset in datasets:
            correct, total = 0, 0
            for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False):
                images, labels = batch[0].to(device), batch[1].to(device)
                with autocast(device, amp):
                    logits = model(images)
                correct += int((logits.argmax(dim=1) == labels).sum())
                total += len(labels)
            accuracies.append(correct / total if total else 0.0)
    finally:
        model.train(was_training)
    return accuracies
