"""Waiting for the device, timing a call, the memory it takes, and how far a result is off."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device, collect: bool = True) -> None:
    """Return cached blocks so one measurement's leftovers cannot push the next into OOM.

    ``collect`` also runs the garbage collector (for tensors kept alive by reference
    cycles, e.g. after an OOM); it costs a few tenths of a second with torch, triton and
    timm loaded, so callers skip it when nothing failed.
    """
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def median_ms(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    grad_to_none: Sequence[torch.Tensor] = (),
    cpu_repeats: int = 3,
) -> float:
    """Median milliseconds of one ``fn()``, each call waited for.

    CUDA uses ``triton.testing.do_bench`` (``return_mode="median"``) with ``warmup_ms``
    and ``rep_ms``; other devices (the CPU smoke runs) time ``cpu_repeats`` calls by
    the wall clock. The gradients of ``grad_to_none`` are set to None before every call.
    """
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none), return_mode="median")
    times = []
    for _ in range(cpu_repeats):
        for tensor in grad_to_none:
            tensor.grad = None
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gpu_kernel_times_us(fn: Callable[[], object], iterations: int = 10) -> dict[str, float]:
    """Mean device time per call of each kernel ``fn`` launches (torch.profiler, CUDA)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:60]
            totals[name] = totals.get(name, 0.0) + event.device_time / iterations
    return totals


class PeakMemory:
    """Peak allocated device memory over a stretch of work (CUDA; None elsewhere).

    :meth:`start` waits for the device, notes what is allocated and resets the peak;
    :meth:`stop` waits again and reads the peak. Also a context manager doing both.

    Attributes:
        peak_bytes: the peak of ``torch.cuda.max_memory_allocated`` (everything allocated).
        extra_bytes: the peak above what was allocated at :meth:`start`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._baseline: int | None = None
        self.peak_bytes: int | None = None

    @property
    def extra_bytes(self) -> int | None:
        return None if self.peak_bytes is None else self.peak_bytes - self._baseline

    def start(self) -> None:
        sync(self.device)
        if self.device.type == "cuda":
            self._baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> None:
        sync(self.device)
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)

    def __enter__(self) -> PeakMemory:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """‖value − reference‖ / ‖reference‖ in float64; NaN if ``value`` is not finite.

    Where the reference is exactly zero (N = 1: every KL and gradient is 0) it is the
    absolute error.
    """
    value, reference = value.detach().double(), reference.detach().double()
    if not torch.isfinite(value).all():
        return float("nan")
    scale = reference.norm()
    return float((value - reference).norm() / (scale if scale > 0 else 1.0))
