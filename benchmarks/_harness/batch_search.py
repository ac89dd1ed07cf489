"""The largest batch that fits: probe, double or halve until bracketed, then bisect."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from _harness.measure import free_memory, sync
from _harness.vit_training import Trainer, random_batch

SEARCH_PRECISION = 32


def batch_fits(trainer: Trainer, batch: int, image_size: int, steps: int) -> bool:
    """Whether ``steps`` training steps at ``batch`` run without running out of memory."""
    try:
        images, labels = random_batch(batch, image_size, trainer.num_classes, trainer.device)
        for _ in range(steps):
            trainer.step(images, labels)
        sync(trainer.device)
    except torch.OutOfMemoryError:
        fits = False
    else:
        fits = True
    trainer.optimizer.zero_grad(set_to_none=True)
    free_memory(trainer.device, collect=not fits)
    return fits


def _next_probe(largest_fit: int, smallest_fail: int, cap: int) -> int:
    if smallest_fail > cap:  # no failure seen yet: grow
        return max(1, min(2 * largest_fit, cap))
    if largest_fit == 0:  # only failures seen: shrink
        return smallest_fail // 2
    return (largest_fit + smallest_fail) // 2


def largest_batch(
    fits: Callable[[int], bool],
    start: int,
    cap: int,
    deadline: float,
    known_fit: int = 0,
    known_fail: int | None = None,
) -> tuple[int, bool]:
    """Largest batch ≤ ``cap`` for which ``fits`` holds.

    Probes ``start`` first, then doubles (or halves, while nothing fits) until the limit is
    bracketed, then bisects until the gap is at most 1/``SEARCH_PRECISION`` of the batch.

    Args:
        fits: runs a probe at a batch size; False means out of memory.
        start: first batch to probe.
        cap: largest batch worth trying.
        deadline: ``time.perf_counter()`` value after which no new probe starts.
        known_fit: a batch already known to fit (0: none).
        known_fail: a batch already known not to fit (None: none).

    Returns:
        (batch, exact): batch 0 means even 1 does not fit; ``exact`` is False when the
        deadline stopped the search or ``cap`` itself fits (the answer is then a lower bound).
    """
    # Every probe lies strictly inside (largest_fit, smallest_fail), so the bracket shrinks
    # each time and the search ends.
    largest_fit = min(known_fit, cap)
    smallest_fail = cap + 1 if known_fail is None else min(known_fail, cap + 1)
    probe = min(start, cap)
    if not largest_fit < probe < smallest_fail:
        probe = _next_probe(largest_fit, smallest_fail, cap)
    while smallest_fail - largest_fit > max(1, largest_fit // SEARCH_PRECISION):
        if time.perf_counter() > deadline:
            return largest_fit, False
        if fits(probe):
            largest_fit = probe
        else:
            smallest_fail = probe
        probe = _next_probe(largest_fit, smallest_fail, cap)
    return largest_fit, smallest_fail <= cap
