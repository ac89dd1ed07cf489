"""Accuracy of a model on each experience's evaluation data (one row of the accuracy matrices)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from cl_streamkl.distributed.data_parallel import DataParallel
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
    task_heads: bool = False,
    data_parallel: DataParallel | None = None,
) -> tuple[list[float], list[float]]:
    """Top-1 accuracy on each dataset, with one shared head or each experience's own.

    In a data-parallel run rank r evaluates samples r, r + W, r + 2W, ... of each dataset
    and the ranks' counts are summed: every rank returns the accuracy on the whole data.

    Args:
        model: maps (B, C, S, S) images to (B, num_classes) logits; with ``task_heads``,
            ``model(images, j)`` gives experience j's head.
        datasets: one dataset per experience, items ``(image, label, ...)``.
        batch_size: evaluation batch size.
        device: where the model lives.
        amp: autocast mode used for the forward pass.
        class_sets: the classes of each experience (shared head only). When given, the
            second list holds Task-IL accuracy: the argmax taken over that experience's
            classes only, which tells how much class information the features keep,
            apart from the classifier's bias toward recent classes.
        task_heads: evaluate experience j with head j (the task scenario).
        data_parallel: this process's place in the run (default: a single process); every
            rank must call this with the same datasets.

    Returns:
        ``(accuracy, task_il)``: accuracies in [0, 1] per dataset (0.0 for an empty
        dataset); ``task_il`` is empty without ``class_sets``.
    """
    if class_sets is not None and len(class_sets) != len(datasets):
        raise ValueError(f"class_sets has {len(class_sets)} entries for {len(datasets)} datasets")
    if class_sets is not None and task_heads:
        raise ValueError("class_sets restricts a shared head; with task_heads every experience has its own")
    rank, world_size = (0, 1) if data_parallel is None else (data_parallel.rank, data_parallel.world_size)
    was_training = model.training
    model.eval()
    # Per dataset: correct, correct within the experience's classes, evaluated.
    counts = torch.zeros(len(datasets), 3, dtype=torch.int64)
    try:
        for index, dataset in enumerate(datasets):
            correct, task_correct, total = 0, 0, 0
            share = range(rank, len(dataset), world_size)
            for batch in DataLoader(dataset, batch_size=batch_size, sampler=share):
                images, labels = batch[0].to(device), batch[1].to(device)
                with autocast(device, amp):
                    logits = (model(images, index) if task_heads else model(images)).float()
                correct += int((logits.argmax(dim=1) == labels).sum())
                if class_sets is not None:
                    classes = torch.as_tensor(list(class_sets[index]), device=device)
                    predicted = classes[logits[:, classes].argmax(dim=1)]
                    task_correct += int((predicted == labels).sum())
                total += len(labels)
            counts[index] = torch.tensor([correct, task_correct, total])
    finally:
        model.train(was_training)
    if data_parallel is not None:
        counts = data_parallel.all_sum(counts)
    accuracies, task_accuracies = [], []
    for correct, task_correct, total in counts.tolist():
        accuracies.append(correct / total if total else 0.0)
        if class_sets is not None:
            task_accuracies.append(task_correct / total if total else 0.0)
    return accuracies, task_accuracies
