"""Peak memory of one stretch of a run: CUDA allocations on a GPU, sampled resident memory on a CPU.

The operating system's own high-water mark (``ru_maxrss``) covers the whole process and
never falls, so every run after the largest would report that run's peak. On the CPU a
background thread instead samples the process's resident set size while the run works,
so each run reports the highest value seen during its own training and evaluation.
"""

from __future__ import annotations

import threading

import psutil
import torch

SAMPLE_INTERVAL_S = 0.005


class PeakMemory:
    """Context manager measuring the peak memory while its block runs, in MiB.

    On CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak on entry (the
    tensors the run allocates, not the allocator's cache). On the CPU: the peak resident
    set size of the whole process (model, data, libraries) sampled every 5 ms, so a spike
    shorter than that can be missed.

    Args:
        device: where the run computes.

    Example:
        >>> with PeakMemory(torch.device("cpu")) as memory:
        ...     train()
        >>> memory.peak_mb
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process = psutil.Process()

    def _sample(self) -> None:
        self.peak_mb = max(self.peak_mb, self._process.memory_info().rss / 2**20)

    def _watch(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self._sample()

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._sample()
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="cl-streamkl-peak-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.device.type == "cuda":
            self.peak_mb = max(self.peak_mb, torch.cuda.max_memory_allocated(self.device) / 2**20)
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._sample()
