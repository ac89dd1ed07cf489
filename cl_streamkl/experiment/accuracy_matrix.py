"""Continual-learning metrics computed from an accuracy matrix.

``acc[i, j]`` is the accuracy on experience j's evaluation data after training on
experiences 0..i; the matrix is (T, T) with T experiences.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _as_matrix(acc: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
    matrix = np.asarray(acc, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise ValueError(f"accuracy matrix must be square (T, T) with T >= 1; got {matrix.shape}")
    return matrix


def average_accuracy_per_experience(acc: Sequence[Sequence[float]] | np.ndarray) -> list[float]:
    """Mean accuracy over the experiences seen so far, after each experience: (T,)."""
    matrix = _as_matrix(acc)
    return [float(matrix[i, : i + 1].mean()) for i in range(len(matrix))]


def final_average_accuracy(acc: Sequence[Sequence[float]] | np.ndarray) -> float:
    """Mean accuracy over all experiences after training on the last one."""
    return float(_as_matrix(acc)[-1].mean())


def stream_accuracy(acc: Sequence[Sequence[float]] | np.ndarray, sizes: Sequence[int]) -> float:
    """Accuracy over every evaluation sample of the stream after the last experience.

    Avalanche's stream accuracy (``Top1_Acc_Stream``): correct predictions over all samples
    of all experiences, so each experience weighs by its number of samples, unlike
    :func:`final_average_accuracy`, the unweighted mean over experiences.

    Args:
        acc: (T, T) accuracy matrix.
        sizes: (T,) evaluation samples per experience.
    """
    matrix = _as_matrix(acc)
    weights = np.asarray(sizes, dtype=np.float64)
    if weights.shape != (len(matrix),) or (weights < 0).any() or weights.sum() == 0:
        raise ValueError(f"sizes must hold {len(matrix)} counts >= 0, not all zero; got {list(sizes)}")
    return float(matrix[-1] @ weights / weights.sum())


def learning_accuracy(acc: Sequence[Sequence[float]] | np.ndarray) -> float:
    """Mean over experiences of the accuracy on each right after learning it (the diagonal).

    Riemer et al. 2019. Low values mean the experiences were never learned, which makes
    forgetting meaningless: there was little to forget.
    """
    return float(np.diag(_as_matrix(acc)).mean())


def average_forgetting(acc: Sequence[Sequence[float]] | np.ndarray) -> float:
    """Mean over experiences j < T-1 of (best accuracy on j before the end − final accuracy on j).

    Chaudhry et al. 2018, not clipped: negative when accuracy rose later. 0.0 for a single
    experience. Larger means more forgetting.
    """
    matrix = _as_matrix(acc)
    t = len(matrix)
    if t == 1:
        return 0.0
    return float(np.mean([matrix[j:t - 1, j].max() - matrix[t - 1, j] for j in range(t - 1)]))


def backward_transfer(acc: Sequence[Sequence[float]] | np.ndarray) -> float:
    """Mean over j < T-1 of (final accuracy on j − accuracy on j right after learning it).

    Lopez-Paz & Ranzato 2017; negative values mean forgetting. 0.0 for one experience.
    """
    matrix = _as_matrix(acc)
    t = len(matrix)
    if t == 1:
        return 0.0
    return float(np.mean([matrix[t - 1, j] - matrix[j, j] for j in range(t - 1)]))
