"""Speed and memory of StreamKL against eager PyTorch, torch.compile and SDPA (issue 5).

Implementations, all timed on the same inputs in one process:

* ``triton``   — ``attention_kl(..., backend="triton")``, the fused kernels.
* ``torch``    — ``attention_kl(..., backend="torch")``, the PyTorch streaming backend.
* ``eager``    — the usual distillation code: both score matrices materialised, fp32
  ``log_softmax`` of each, ``F.kl_div(log_p_student, log_p_teacher, log_target=True)``
  summed over keys and averaged over rows (``cl_streamkl.kernels.eager_attention_kl``).
* ``compiled`` — ``torch.compile(eager_attention_kl, dynamic=False)``, recompiled for every
  problem (``torch._dynamo.reset()``) so each shape gets its own static graph.
* ``sdpa``     — ``F.scaled_dot_product_attention`` at the same (B, H, N, D), the speed of
  light; the flash backend when it accepts the inputs, else memory-efficient, else math
  (the row says which).

The student's q, k require grad; the teacher's q, k do not (a frozen teacher). SDPA's q, k, v
all require grad and its backward gets a random upstream gradient.

Modes:

* ``fwd``     — forward with autograd recording (as in training).
* ``bwd``     — the forward runs once, untimed; the timed call is
  ``backward(retain_graph=True)`` on that graph.
* ``fwd+bwd`` — forward then backward.

Timing: median of ``triton.testing.do_bench`` (``return_mode="median"``, gradients set to
None before every call). The first call of each row runs untimed and its wall time is
printed as ``first s``: it contains Triton autotuning and torch.compile compilation.

FLOP counts behind the TFLOP/s-equivalent column (halved for causal):

* KL implementations (triton, torch, eager, compiled): fwd = 2 QKᵀ products = 4·B·H·N²·D;
  bwd = 4 products (the two score matrices recomputed, dQ = dS·K, dK = dSᵀ·Q) = 8·B·H·N²·D;
  fwd+bwd = 12·B·H·N²·D. The same count is used for every KL implementation, whatever it
  actually computes, so their TFLOP/s compare like their times.
* SDPA: fwd = 2 products (QKᵀ, PV) = 4·B·H·N²·D; bwd = 5 products = 10·B·H·N²·D;
  fwd+bwd = 14·B·H·N²·D (FlashAttention's convention).

GPU time (``--gpu-time``, CUDA only): the summed device time of every kernel one call
launches, from ``torch.profiler`` (column ``GPU ms``), and the speedup over torch.compile
in that measure (``GPU vs comp``). Where the GPU work is shorter than the host's
launch and autograd-engine overhead (ViT sizes), ``ms`` is what a caller waits and
``GPU ms`` what the GPU actually spends.

Peak extra memory (CUDA only): ``torch.cuda.max_memory_allocated`` during the row's work
minus ``memory_allocated`` just before it, minus what the work legitimately leaves behind:
the forward's output (fwd, fwd+bwd) and the input gradients (bwd, fwd+bwd). Inputs exist
before the baseline is taken. For ``bwd`` the baseline already holds the forward's saved
tensors, so the column is the backward's own workspace; ``fwd+bwd`` is the figure the
issue's 16 bytes per (batch, head, query row) target refers to (column ``B/row``).

Before timing, every problem is checked: the selected KL implementations against the
float64 reference on a problem of the same length (up to 16384), head dim and dtype with
B = 1 and H ≤ 2 (H = 1 beyond 2048 tokens), relative RMS error of the per-row KL and of
dQ, dK (upstream gradient random, not 1). Keeping the length keeps the autotuned tiles and
the ragged tail of the timed problem.

Out-of-memory is a result: the row prints ``OOM`` and the run goes on.

Run time is mostly compilation: one static ``torch.compile`` graph per problem and, for the
Triton kernels, autotuning per (length bucket, head dim, dtype, causal). Both caches live
on disk, so a second run on the same machine is much faster. Results are printed and the
``--json`` file rewritten after every problem, so a run cut short keeps what it measured.

Examples::

    PYTHONPATH=. python benchmarks/bench_attention_kl.py --json bench.json
    PYTHONPATH=. python benchmarks/bench_attention_kl.py --quick
    PYTHONPATH=. python benchmarks/bench_attention_kl.py --shapes 4x12x4096x64 --modes fwd --impls triton sdpa
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_attention_kl.py --device cpu \\
        --shapes 1x2x64x32 --fp32-shapes --causal-shapes
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from cl_streamkl import attention_kl, attention_kl_reference
from cl_streamkl.kernels import eager_attention_kl

Shape = tuple[int, int, int, int]

IMPLEMENTATIONS = ("triton", "torch", "eager", "compiled", "sdpa")
# The implementations that call attention_kl; each name is the backend it passes.
KL_IMPLEMENTATIONS = ("triton", "torch")
MODES = ("fwd", "bwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

DEFAULT_SHAPES: tuple[Shape, ...] = (
    (8, 12, 1024, 64),
    (2, 12, 4096, 64),
    (1, 12, 8192, 64),
    (1, 12, 16384, 64),
    (1, 12, 32768, 64),
    (1, 16, 8192, 128),
    (32, 12, 197, 64),
    (16, 12, 577, 64),
    (4, 12, 1025, 64),
)
DEFAULT_FP32_SHAPES: tuple[Shape, ...] = ((8, 12, 1024, 64), (2, 12, 4096, 64))
DEFAULT_CAUSAL_SHAPES: tuple[Shape, ...] = ((1, 12, 8192, 64),)
QUICK_SHAPES: tuple[Shape, ...] = ((2, 12, 4096, 64), (32, 12, 197, 64))
QUICK_FP32_SHAPES: tuple[Shape, ...] = ()
QUICK_CAUSAL_SHAPES: tuple[Shape, ...] = ()

CHECK_MAX_HEADS = 2
# The check keeps the problem's length, so the Triton kernels run with the tiles tuned for
# its length bucket and with its ragged tail (a check clipped to 1024 tokens once hid a
# tail-tile bug at 4097). Past 16384 tokens the float64 reference's (N, N) matrices would
# need far more than 20 GiB.
CHECK_MAX_SEQ = 16384
CHECK_ONE_HEAD_FROM_SEQ = 2049
# Loose sanity bounds for the pre-timing check: a kernel bug gives O(1) errors, while
# bfloat16 rounding of the scores (eager) or of dQ/dK (every implementation) stays near 1e-2.
CHECK_BOUNDS = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
CPU_TIMING_REPEATS = 3

KL_FLOP_PRODUCTS = {"fwd": 2, "bwd": 4, "fwd+bwd": 6}
SDPA_FLOP_PRODUCTS = {"fwd": 2, "bwd": 5, "fwd+bwd": 7}


@dataclass(frozen=True)
class Problem:
    """One benchmark problem: q, k, v, teacher q, k all of shape (batch, heads, seq, head_dim)."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: torch.dtype
    causal: bool = False

    @property
    def shape(self) -> Shape:
        return (self.batch, self.heads, self.seq, self.head_dim)

    @property
    def label(self) -> str:
        return "x".join(str(size) for size in self.shape)

    @property
    def dtype_name(self) -> str:
        return next(name for name, dtype in DTYPES.items() if dtype == self.dtype)

    def flops(self, impl: str, mode: str) -> float:
        """FLOP-equivalent of one call, per the counts in the module docstring."""
        products = (SDPA_FLOP_PRODUCTS if impl == "sdpa" else KL_FLOP_PRODUCTS)[mode]
        flops = 2.0 * products * self.batch * self.heads * self.seq**2 * self.head_dim
        return flops / 2 if self.causal else flops


@dataclass
class Row:
    """One measured (implementation, mode, problem); ``ms is None`` means out of memory."""

    impl: str
    mode: str
    shape: str
    dtype: str
    causal: bool
    ms: float | None
    tflops: float | None
    extra_mib: float | None
    extra_bytes_per_row: float | None
    first_call_s: float | None
    backend: str = ""
    ratio_to_sdpa: float | None = None
    speedup_vs_eager: float | None = None
    speedup_vs_compiled: float | None = None
    gpu_ms: float | None = None
    gpu_speedup_vs_compiled: float | None = None

    @property
    def oom(self) -> bool:
        return self.ms is None


@dataclass
class CheckResult:
    """Relative RMS errors of one implementation against the float64 reference."""

    impl: str
    shape: str
    dtype: str
    causal: bool
    checked_shape: str
    kl: float
    dq: float
    dk: float
    bound: float
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passed = max(self.kl, self.dq, self.dk) <= self.bound


@dataclass
class Workload:
    """Inputs and the forward/backward closures of one implementation on one problem.

    Attributes:
        leaves: tensors whose gradients the backward produces (cleared between calls).
        forward: runs the forward and returns its output (a scalar loss, or SDPA's
            (B, H, N, D) output).
        backward: ``backward(output, retain_graph)`` back-propagates from ``output``.
        backend: which kernel family runs (only SDPA chooses one).
    """

    leaves: list[torch.Tensor]
    forward: Callable[[], torch.Tensor]
    backward: Callable[[torch.Tensor, bool], None]
    backend: str = ""

    def clear_grads(self) -> None:
        for tensor in self.leaves:
            tensor.grad = None

    def grad_bytes(self) -> int:
        return sum(t.grad.nbytes for t in self.leaves if t.grad is not None)


def parse_shape(text: str) -> Shape:
    """Parse ``"BxHxNxD"`` (e.g. ``8x12x1024x64``) into four positive ints."""
    parts = text.lower().split("x")
    try:
        sizes = tuple(int(part) for part in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 4 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"shape must be BxHxNxD with four positive integers, e.g. 8x12x1024x64; got {text!r}"
        )
    return sizes  # type: ignore[return-value]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device, collect: bool = True) -> None:
    """Return cached blocks so one row's leftovers cannot push the next into OOM.

    ``collect`` also runs the garbage collector (for tensors kept alive by reference
    cycles, e.g. after an OOM); it costs a few tenths of a second with torch, triton and
    timm loaded, so callers skip it when nothing failed.
    """
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_inputs(problem: Problem, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random student/teacher q, k, SDPA's v and upstream gradient, all (B, H, N, D)."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def tensor(requires_grad: bool) -> torch.Tensor:
        values = torch.randn(problem.shape, generator=generator, device=device, dtype=problem.dtype)
        return values.requires_grad_(requires_grad)

    return {
        "q": tensor(True),
        "k": tensor(True),
        "v": tensor(True),
        "q_teacher": tensor(False),
        "k_teacher": tensor(False),
        "grad_out": tensor(False),
    }


def _pick_sdpa_backend(inputs: dict[str, torch.Tensor], causal: bool) -> SDPBackend:
    # Eligibility depends on dtype, head dim and device, not on N, so a tiny slice decides.
    q, k, v = (inputs[name][:1, :1, :16] for name in ("q", "k", "v"))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        except RuntimeError:
            continue
        return backend
    return SDPBackend.MATH


def _backward_scalar(output: torch.Tensor, retain_graph: bool) -> None:
    output.backward(retain_graph=retain_graph)


def make_workload(impl: str, problem: Problem, inputs: dict[str, torch.Tensor]) -> Workload:
    """Bind one implementation to the problem's inputs.

    Raises:
        ValueError: ``impl`` is not one of :data:`IMPLEMENTATIONS`.
    """
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    q_teacher, k_teacher = inputs["q_teacher"], inputs["k_teacher"]
    causal = problem.causal
    if impl in KL_IMPLEMENTATIONS:
        return Workload(
            leaves=[q, k],
            forward=lambda: attention_kl(q, k, q_teacher, k_teacher, causal=causal, backend=impl),
            backward=_backward_scalar,
        )
    if impl == "eager":
        return Workload(
            leaves=[q, k],
            forward=lambda: eager_attention_kl(q, k, q_teacher, k_teacher, causal=causal),
            backward=_backward_scalar,
        )
    if impl == "compiled":
        # A fresh static graph per problem; without the reset, the recompile limit would
        # silently send later shapes back to eager.
        torch._dynamo.reset()
        compiled = torch.compile(eager_attention_kl, dynamic=False)
        return Workload(
            leaves=[q, k],
            forward=lambda: compiled(q, k, q_teacher, k_teacher, causal=causal),
            backward=_backward_scalar,
        )
    if impl == "sdpa":
        backend = _pick_sdpa_backend(inputs, causal)
        grad_out = inputs["grad_out"]

        def forward() -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def backward(output: torch.Tensor, retain_graph: bool) -> None:
            output.backward(grad_out, retain_graph=retain_graph)

        return Workload(
            leaves=[q, k, v],
            forward=forward,
            backward=backward,
            backend=backend.name.lower().removesuffix("_attention"),
        )
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def time_ms(
    fn: Callable[[], object],
    leaves: Sequence[torch.Tensor],
    device: torch.device,
    warmup_ms: float,
    rep_ms: float,
) -> float:
    """Median milliseconds of ``fn()``; gradients of ``leaves`` are set to None before each call.

    CUDA uses ``triton.testing.do_bench``; other devices (the CPU smoke test) a few
    wall-clock calls.
    """
    if device.type == "cuda":
        return triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(leaves), return_mode="median"
        )
    times = []
    for _ in range(CPU_TIMING_REPEATS):
        for tensor in leaves:
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


def _peak_extra_bytes(workload: Workload, mode: str, device: torch.device) -> int | None:
    """Peak memory of one call of ``mode`` beyond its inputs, outputs and gradients (CUDA only)."""
    if device.type != "cuda":
        return None
    workload.clear_grads()
    output = workload.forward() if mode == "bwd" else None
    _sync(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    kept = 0
    if mode == "bwd":
        workload.backward(output, False)
    else:
        output = workload.forward()
        kept += output.nbytes
        if mode == "fwd+bwd":
            workload.backward(output, False)
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    kept += workload.grad_bytes()
    workload.clear_grads()
    return peak - baseline - kept


def measure_row(
    workload: Workload,
    impl: str,
    problem: Problem,
    mode: str,
    device: torch.device,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    gpu_time: bool = False,
) -> Row:
    """Time one (implementation, mode) on a problem and measure its peak extra memory.

    With ``gpu_time`` (CUDA), also the summed device time of the kernels of one call.

    Raises:
        torch.OutOfMemoryError: the device ran out of memory (the caller records OOM).
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    workload.clear_grads()
    start = time.perf_counter()
    if mode == "bwd":
        output = workload.forward()

        def step() -> None:
            workload.backward(output, True)

    elif mode == "fwd":
        step = workload.forward
    else:

        def step() -> None:
            workload.backward(workload.forward(), False)

    step()
    _sync(device)
    first_call_s = time.perf_counter() - start
    ms = time_ms(step, workload.leaves, device, warmup_ms, rep_ms)
    gpu_ms = None
    if gpu_time and device.type == "cuda":
        gpu_ms = sum(gpu_kernel_times_us(step).values()) / 1e3
        workload.clear_grads()
    if mode == "bwd":
        del output, step
    workload.clear_grads()
    extra = _peak_extra_bytes(workload, mode, device)
    rows = problem.batch * problem.heads * problem.seq
    return Row(
        impl=impl,
        mode=mode,
        shape=problem.label,
        dtype=problem.dtype_name,
        causal=problem.causal,
        ms=ms,
        tflops=problem.flops(impl, mode) / (ms * 1e-3) / 1e12,
        extra_mib=None if extra is None else extra / 2**20,
        extra_bytes_per_row=None if extra is None else extra / rows,
        first_call_s=first_call_s,
        backend=workload.backend,
        gpu_ms=gpu_ms,
    )


def oom_row(impl: str, problem: Problem, mode: str, backend: str = "") -> Row:
    """The row recorded when ``impl`` ran out of memory on ``problem`` in ``mode``."""
    return Row(
        impl=impl,
        mode=mode,
        shape=problem.label,
        dtype=problem.dtype_name,
        causal=problem.causal,
        ms=None,
        tflops=None,
        extra_mib=None,
        extra_bytes_per_row=None,
        first_call_s=None,
        backend=backend,
    )


def add_ratios(rows: list[Row]) -> None:
    """Fill ratio to SDPA and speedups over eager/compiled from rows of the same problem and mode."""
    times = {(row.impl, row.mode): row.ms for row in rows}
    for row in rows:
        if row.oom:
            continue
        sdpa, eager, compiled = (times.get((name, row.mode)) for name in ("sdpa", "eager", "compiled"))
        row.ratio_to_sdpa = row.ms / sdpa if sdpa else None
        row.speedup_vs_eager = eager / row.ms if eager else None
        row.speedup_vs_compiled = compiled / row.ms if compiled else None
    gpu_times = {(row.impl, row.mode): row.gpu_ms for row in rows}
    for row in rows:
        compiled_gpu = gpu_times.get(("compiled", row.mode))
        if row.gpu_ms and compiled_gpu:
            row.gpu_speedup_vs_compiled = compiled_gpu / row.gpu_ms


def _relative_rms(value: torch.Tensor, reference: torch.Tensor) -> float:
    """‖value − reference‖ / ‖reference‖ in float64; NaN if ``value`` is not finite."""
    value, reference = value.detach().double(), reference.detach().double()
    return float((value - reference).norm() / reference.norm().clamp_min(1e-300))


def checked_problem(problem: Problem) -> Problem:
    """The smaller problem :func:`check_problem` compares with float64 (see there)."""
    heads = 1 if problem.seq >= CHECK_ONE_HEAD_FROM_SEQ else min(problem.heads, CHECK_MAX_HEADS)
    return Problem(1, heads, min(problem.seq, CHECK_MAX_SEQ), problem.head_dim, problem.dtype, problem.causal)


def check_problem(problem: Problem, impls: Sequence[str], device: torch.device) -> list[CheckResult]:
    """Compare the KL implementations in ``impls`` with the float64 reference on a small problem.

    The checked problem keeps N (up to :data:`CHECK_MAX_SEQ`), D, dtype and causality but
    has B = 1 and H ≤ 2 (one head from :data:`CHECK_ONE_HEAD_FROM_SEQ` tokens), so the
    reference's (N, N) float64 matrices stay a few GiB. ``compiled`` is skipped (it is the
    eager code, and compiling an extra shape costs more than the check is worth).
    """
    checked = checked_problem(problem)
    inputs = make_inputs(checked, device, seed=1)
    q, k, q_teacher, k_teacher = (inputs[name] for name in ("q", "k", "q_teacher", "k_teacher"))
    weight = torch.rand(checked.shape[:3], device=device, dtype=torch.float64)
    reference_rows = attention_kl_reference(
        q, k, q_teacher, k_teacher, causal=problem.causal, reduction="none"
    )
    reference_dq, reference_dk = torch.autograd.grad((reference_rows * weight).sum(), (q, k))
    results = []
    for impl in impls:
        if impl in KL_IMPLEMENTATIONS:
            rows = attention_kl(q, k, q_teacher, k_teacher, causal=problem.causal, reduction="none", backend=impl)
        elif impl == "eager":
            rows = eager_attention_kl(q, k, q_teacher, k_teacher, causal=problem.causal, reduction="none")
        else:
            continue
        dq, dk = torch.autograd.grad((rows * weight).sum(), (q, k))
        results.append(
            CheckResult(
                impl=impl,
                shape=problem.label,
                dtype=problem.dtype_name,
                causal=problem.causal,
                checked_shape=checked.label,
                kl=_relative_rms(rows, reference_rows),
                dq=_relative_rms(dq, reference_dq),
                dk=_relative_rms(dk, reference_dk),
                bound=CHECK_BOUNDS[problem.dtype],
            )
        )
    return results


def benchmark_problem(
    problem: Problem,
    impls: Sequence[str],
    modes: Sequence[str],
    device: torch.device,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    gpu_time: bool = False,
) -> list[Row]:
    """Measure every (implementation, mode) on one problem; OOM becomes an ``OOM`` row."""
    inputs = make_inputs(problem, device)
    rows = []
    for impl in impls:
        workload = make_workload(impl, problem, inputs)
        for mode in modes:
            try:
                row = measure_row(workload, impl, problem, mode, device, warmup_ms, rep_ms, gpu_time)
            except torch.OutOfMemoryError:
                row = oom_row(impl, problem, mode, workload.backend)
            rows.append(row)
            workload.clear_grads()
            free_memory(device, collect=row.oom)
        del workload
        free_memory(device, collect=False)
    add_ratios(rows)
    return rows


COLUMNS = (
    ("impl", 14),
    ("mode", 7),
    ("shape", 13),
    ("dtype", 5),
    ("causal", 6),
    ("ms", 10),
    ("TFLOP/s", 8),
    ("extra MiB", 10),
    ("B/row", 8),
    ("xSDPA", 6),
    ("vs eager", 8),
    ("vs compiled", 11),
    ("first s", 8),
    ("GPU ms", 8),
    ("GPU vs comp", 11),
)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def format_table_header() -> str:
    """Column titles aligned like :func:`format_row`."""
    return "  ".join(title.rjust(width) for title, width in COLUMNS)


def format_row(row: Row) -> str:
    """One aligned table line; ratios are time/SDPA time, speedups baseline time/time."""
    impl = f"{row.impl}/{row.backend}" if row.backend else row.impl
    if row.oom:
        measured = ["OOM"] + ["-"] * 9
    else:
        measured = [
            _cell(row.ms, ".3f"),
            _cell(row.tflops, ".1f"),
            _cell(row.extra_mib, ".1f"),
            _cell(row.extra_bytes_per_row, ".1f"),
            _cell(row.ratio_to_sdpa, ".2f"),
            _cell(row.speedup_vs_eager, ".2f"),
            _cell(row.speedup_vs_compiled, ".2f"),
            _cell(row.first_call_s, ".1f"),
            _cell(row.gpu_ms, ".3f"),
            _cell(row.gpu_speedup_vs_compiled, ".2f"),
        ]
    cells = [impl, row.mode, row.shape, row.dtype, "yes" if row.causal else "no", *measured]
    return "  ".join(cell.rjust(width) for cell, (_, width) in zip(cells, COLUMNS))


def format_checks(results: Sequence[CheckResult]) -> str:
    """One line per problem: relative RMS errors of each implementation vs float64."""
    first = results[0]
    parts = [
        f"{r.impl} kl {r.kl:.1e} dq {r.dq:.1e} dk {r.dk:.1e} {'ok' if r.passed else 'FAIL'}"
        for r in results
    ]
    causal = " causal" if first.causal else ""
    return (
        f"check {first.shape} {first.dtype}{causal} on {first.checked_shape} "
        f"(rel. RMS vs float64, bound {first.bound:.0e}): " + " | ".join(parts)
    )


def git_commit() -> str:
    """Short commit hash of the repository holding this script, ``+dirty`` if edited; else "unknown"."""
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo, capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def describe_environment(device: torch.device, commit: str | None) -> dict[str, str]:
    """Device name and library versions for the header line and the JSON file."""
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        name = f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB)"
    else:
        name = f"{device.type} ({platform.processor() or platform.machine()})"
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit or git_commit(),
    }


def build_problems(
    shapes: Sequence[Shape],
    dtypes: Sequence[torch.dtype],
    fp32_shapes: Sequence[Shape],
    causal_shapes: Sequence[Shape],
    causal: bool,
) -> list[Problem]:
    """Every shape at every dtype (and causal too with ``causal``), then the fp32 and causal extras."""
    problems = [
        Problem(*shape, dtype, masked)
        for shape in shapes
        for dtype in dtypes
        for masked in ((False, True) if causal else (False,))
    ]
    problems += [Problem(*shape, torch.float32) for shape in fp32_shapes]
    problems += [Problem(*shape, dtypes[0], True) for shape in causal_shapes]
    return list(dict.fromkeys(problems))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--shapes", nargs="*", type=parse_shape, default=None, metavar="BxHxNxD",
        help="shapes run at every --dtypes (default: the nine shapes of issue 5)",
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"], help="default: bf16"
    )
    parser.add_argument(
        "--fp32-shapes", nargs="*", type=parse_shape, default=None, metavar="BxHxNxD",
        help="extra float32 problems (default: 8x12x1024x64 2x12x4096x64; give none to skip)",
    )
    parser.add_argument(
        "--causal-shapes", nargs="*", type=parse_shape, default=None, metavar="BxHxNxD",
        help="extra causal problems at the first dtype (default: 1x12x8192x64; give none to skip)",
    )
    parser.add_argument(
        "--causal", action="store_true", help="also run every --shapes problem with causal masking"
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--impls", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument(
        "--quick", action="store_true",
        help="defaults become 2x12x4096x64 and 32x12x197x64 in bf16, no extras (1-2 minutes)",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warmup (default 25)")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time (default 100)")
    parser.add_argument(
        "--gpu-time", action="store_true",
        help="also measure each row's summed kernel time with torch.profiler (CUDA)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write results here")
    parser.add_argument(
        "--commit", default=None, help="commit to print when the tree has no .git (default: git rev-parse)"
    )
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available; use --device cpu for a smoke run")
    if args.device.type == "cpu" and "triton" in args.impls:
        from cl_streamkl.kernels.triton_kl import INTERPRETING

        if not INTERPRETING:
            parser.error("--impls triton on --device cpu needs TRITON_INTERPRET=1 in the environment")
    if args.warmup_ms <= 0 or args.rep_ms <= 0:
        parser.error("--warmup-ms and --rep-ms must be > 0")
    if args.shapes is None:
        args.shapes = list(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    if args.fp32_shapes is None:
        args.fp32_shapes = list(QUICK_FP32_SHAPES if args.quick else DEFAULT_FP32_SHAPES)
    if args.causal_shapes is None:
        args.causal_shapes = list(QUICK_CAUSAL_SHAPES if args.quick else DEFAULT_CAUSAL_SHAPES)
    return args


def _write_json(
    path: Path, environment: dict, args: argparse.Namespace, checks: list, rows: list, elapsed: float
) -> None:
    settings = {
        key: str(value) if isinstance(value, (Path, torch.device)) else value for key, value in vars(args).items()
    }
    payload = {
        "environment": environment,
        "settings": settings,
        "checks": [asdict(check) for check in checks],
        "rows": [asdict(row) for row in rows],
        "elapsed_s": elapsed,
    }
    path.write_text(json.dumps(payload, indent=1))


def autotuned_tiles() -> list[str]:
    """One line per tuning key the StreamKL kernels were autotuned for in this process."""
    from cl_streamkl.kernels import triton_kl

    lines = []
    for name in ("_forward_kernel", "_backward_dq_kernel", "_backward_dk_kernel"):
        for key, config in getattr(getattr(triton_kl, name).kernel, "cache", {}).items():
            lines.append(f"{name.strip('_')} {key}: {config}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 1 when a correctness check failed, else 0."""
    args = parse_args(argv)
    start = time.perf_counter()
    device = args.device
    problems = build_problems(
        args.shapes, [DTYPES[name] for name in args.dtypes], args.fp32_shapes, args.causal_shapes, args.causal
    )
    environment = describe_environment(device, args.commit)
    print(" | ".join(f"{key} {value}" for key, value in environment.items()), flush=True)
    print(format_table_header(), flush=True)
    checks: list[CheckResult] = []
    rows: list[Row] = []
    for problem in problems:
        problem_checks = check_problem(problem, args.impls, device)
        if problem_checks:
            print(format_checks(problem_checks), flush=True)
        free_memory(device)
        problem_rows = benchmark_problem(
            problem, args.impls, args.modes, device, args.warmup_ms, args.rep_ms, args.gpu_time
        )
        for row in problem_rows:
            print(format_row(row), flush=True)
        checks += problem_checks
        rows += problem_rows
        if args.json is not None:
            # Rewritten after every problem so a run cut short still leaves its results.
            _write_json(args.json, environment, args, checks, rows, time.perf_counter() - start)
    failed = [check for check in checks if not check.passed]
    for line in autotuned_tiles():
        print(f"autotuned {line}", flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s; {len(failed)} failed checks", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
