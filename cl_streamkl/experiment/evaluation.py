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
    class_sets: Sequence[Sequence[int]] | None = None,
) -> tuple[list[float], list[float]]:
    """Top-1 accuracy on each dataset, class-incremental and (optionally) task-aware.

    Args:
        model: maps (B, C, S, S) images to (B, num_classes) logits.
        datasets: one dataset per experience, items ``(image, label, ...)``.
        batch_size: evaluation batch size.
        device: where the model lives.
        amp: autocast mode used for the forward pass.
        class_sets: the classes of each experience. When given, the second list holds the
            task-aware accuracy: the argmax taken over that experience's classes only. It
            tells how much class information the features keep, apart from the
            classifier's bias toward recent classes.

    Returns:
        ``(class_incremental, task_aware)``: accuracies in [0, 1] per dataset (0.0 for an
        empty dataset); ``task_aware`` is empty without ``class_sets``.
    """
    if class_sets is not None and len(class_sets) != len(datasets):
        raise ValueError(f"class_sets has {len(class_sets)} entries for {len(datasets)} datasets")
    was_training = model.training
    model.eval()
    accuracies, task_accuracies = [], []
    try:
        for index, dataset in enumerate(datasets):
            correct, task_correct, total = 0, 0, 0
            for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False):
                images, labels = batch[0].to(device), batch[1].to(device)
                with autocast(device, amp):
                    logits = model(images).float()
                correct += int((logits.argmax(dim=1) == labels).sum())
                if class_sets is not None:
                    classes = torch.as_tensor(list(class_sets[index]), device=device)
                    predicted = classes[logits[:, classes].argmax(dim=1)]
                    task_correct += int((predicted == labels).sum())
                total += len(labels)
            accuracies.append(correct / total if total else 0.0)
            if class_sets is not None:
                task_accuracies.append(task_correct / total if total else 0.0)
    finally:
        model.train(was_training)
    return accuracies, task_accuracies
