"""Speed and memory of StreamKL against eager PyTorch, torch.compile and SDPA.

Times the forward, the backward and both of every implementation (``triton``, ``torch``,
``eager``, ``compiled``; ``sdpa``: SDPA's default backend, the fastest attention a user gets,
cuDNN attention on Hopper, named in each row; ``sdpa_fa2``: SDPA pinned to its flash
backend, FlashAttention-2) on the same inputs in one process, with the extra memory per query row, after checking each
problem against the float64 reference. BENCHMARKS.md (Method) says what each column
measures; its kernel tables come from this script.

Examples (from the repository root, with the package installed: ``pip install -e .``)::

    python benchmarks/bench_attention_kl.py --json bench.json
    python benchmarks/bench_attention_kl.py --quick
    python benchmarks/bench_attention_kl.py --shapes 4x12x4096x64 --modes fwd --impls triton sdpa
    TRITON_INTERPRET=1 python benchmarks/bench_attention_kl.py --device cpu \\
        --shapes 1x2x64x32 --fp32-shapes --causal-shapes
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from _harness.measure import PeakMemory, free_memory, gpu_kernel_times_us, median_ms, relative_error, sync
from _harness.options import DTYPES, KL_IMPLEMENTATIONS, Shape, add_run_flags, checked_device, parse_shape, shape_label
from _harness.report import aligned, cell, describe_environment, environment_line, header_line, run_settings, write_json
from cl_streamkl import attention_kl, attention_kl_reference
from cl_streamkl.kernels import eager_attention_kl
from cl_streamkl.kernels.triton import INTERPRETING, KERNEL_LAUNCHERS

IMPLEMENTATIONS = ("triton", "torch", "eager", "compiled", "sdpa", "sdpa_fa2")
SDPA_IMPLEMENTATIONS = ("sdpa", "sdpa_fa2")
# torch._fused_sdp_choice's answer → the backend's name (torch.nn.attention.SDPBackend order).
_SDPA_CHOICES = {int(b): name.lower().removesuffix("_attention") for name, b in SDPBackend.__members__.items()
                 if name not in ("ERROR", "OVERRIDEABLE")}
MODES = ("fwd", "bwd", "fwd+bwd")

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

# Matrix products (each 2·B·H·N²·D FLOP) per call behind the TFLOP/s-equivalent column. Every
# KL implementation gets the KL count (fwd: QKᵀ of student and teacher; bwd: both recomputed,
# dQ = dS·K, dK = dSᵀ·Q), whatever it actually computes; SDPA gets FlashAttention's.
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
        return shape_label(self.shape)

    @property
    def dtype_name(self) -> str:
        return next(name for name, dtype in DTYPES.items() if dtype == self.dtype)

    def flops(self, impl: str, mode: str) -> float:
        """FLOP-equivalent of one call, per the product counts above (halved for causal)."""
        products = (SDPA_FLOP_PRODUCTS if impl in SDPA_IMPLEMENTATIONS else KL_FLOP_PRODUCTS)[mode]
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
    ratio_to_fa2: float | None = None
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


def _default_sdpa_backend(inputs: dict[str, torch.Tensor], causal: bool) -> str:
    """The backend F.scaled_dot_product_attention picks for these inputs when left alone."""
    choice = torch._fused_sdp_choice(inputs["q"], inputs["k"], inputs["v"], is_causal=causal)
    return _SDPA_CHOICES.get(int(choice), f"backend {int(choice)}")


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
    if impl in SDPA_IMPLEMENTATIONS:
        pinned = _pick_sdpa_backend(inputs, causal) if impl == "sdpa_fa2" else None
        grad_out = inputs["grad_out"]

        def forward() -> torch.Tensor:
            if pinned is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            with sdpa_kernel(pinned):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def backward(output: torch.Tensor, retain_graph: bool) -> None:
            output.backward(grad_out, retain_graph=retain_graph)

        return Workload(
            leaves=[q, k, v],
            forward=forward,
            backward=backward,
            backend=(_default_sdpa_backend(inputs, causal) if pinned is None
                     else pinned.name.lower().removesuffix("_attention")),
        )
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")


def _peak_extra_bytes(workload: Workload, mode: str, device: torch.device) -> int | None:
    """Peak memory of one call of ``mode`` beyond its inputs, outputs and gradients (CUDA only)."""
    if device.type != "cuda":
        return None
    workload.clear_grads()
    output = workload.forward() if mode == "bwd" else None
    kept = 0
    with PeakMemory(device) as memory:
        if mode == "bwd":
            workload.backward(output, False)
        else:
            output = workload.forward()
            kept += output.nbytes
            if mode == "fwd+bwd":
                workload.backward(output, False)
    kept += workload.grad_bytes()
    workload.clear_grads()
    return memory.extra_bytes - kept


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
    sync(device)
    first_call_s = time.perf_counter() - start
    ms = median_ms(step, device, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=workload.leaves)
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
    return Row(impl, mode, problem.label, problem.dtype_name, problem.causal,
               ms=None, tflops=None, extra_mib=None, extra_bytes_per_row=None, first_call_s=None, backend=backend)


def add_ratios(rows: list[Row]) -> None:
    """Fill ratio to SDPA and speedups over eager/compiled from rows of the same problem and mode."""
    times = {(row.impl, row.mode): row.ms for row in rows}
    for row in rows:
        if row.oom:
            continue
        sdpa, fa2, eager, compiled = (times.get((name, row.mode)) for name in ("sdpa", "sdpa_fa2", "eager", "compiled"))
        row.ratio_to_sdpa = row.ms / sdpa if sdpa else None
        row.ratio_to_fa2 = row.ms / fa2 if fa2 else None
        row.speedup_vs_eager = eager / row.ms if eager else None
        row.speedup_vs_compiled = compiled / row.ms if compiled else None
    gpu_times = {(row.impl, row.mode): row.gpu_ms for row in rows}
    for row in rows:
        compiled_gpu = gpu_times.get(("compiled", row.mode))
        if row.gpu_ms and compiled_gpu:
            row.gpu_speedup_vs_compiled = compiled_gpu / row.gpu_ms


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
                kl=relative_error(rows, reference_rows),
                dq=relative_error(dq, reference_dq),
                dk=relative_error(dk, reference_dk),
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
    ("impl", 18),
    ("mode", 7),
    ("shape", 13),
    ("dtype", 5),
    ("causal", 6),
    ("ms", 10),
    ("TFLOP/s", 8),
    ("extra MiB", 10),
    ("B/row", 8),
    ("xSDPA", 6),
    ("xFA2", 6),
    ("vs eager", 8),
    ("vs compiled", 11),
    ("first s", 8),
    ("GPU ms", 8),
    ("GPU vs comp", 11),
)


def format_table_header() -> str:
    """Column titles aligned like :func:`format_row`."""
    return header_line(COLUMNS)


def format_row(row: Row) -> str:
    """One aligned table line; ratios are time/SDPA time, speedups baseline time/time."""
    impl = f"{row.impl}/{row.backend}" if row.backend else row.impl
    if row.oom:
        measured = ["OOM"] + ["-"] * 10
    else:
        measured = [
            cell(row.ms, ".3f"),
            cell(row.tflops, ".1f"),
            cell(row.extra_mib, ".1f"),
            cell(row.extra_bytes_per_row, ".1f"),
            cell(row.ratio_to_sdpa, ".2f"),
            cell(row.ratio_to_fa2, ".2f"),
            cell(row.speedup_vs_eager, ".2f"),
            cell(row.speedup_vs_compiled, ".2f"),
            cell(row.first_call_s, ".1f"),
            cell(row.gpu_ms, ".3f"),
            cell(row.gpu_speedup_vs_compiled, ".2f"),
        ]
    cells = [impl, row.mode, row.shape, row.dtype, "yes" if row.causal else "no", *measured]
    return aligned(cells, COLUMNS)


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
        help="shapes run at every --dtypes (default: " + " ".join(map(shape_label, DEFAULT_SHAPES)) + ")",
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
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warmup (default 25)")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time (default 100)")
    parser.add_argument(
        "--gpu-time", action="store_true",
        help="also measure each row's summed kernel time with torch.profiler (CUDA)",
    )
    add_run_flags(parser)
    args = parser.parse_args(argv)
    args.device = checked_device(parser, args.device)
    if args.device.type == "cpu" and "triton" in args.impls and not INTERPRETING:
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
    write_json(path, {
        "environment": environment,
        "settings": run_settings(args),
        "checks": [asdict(check) for check in checks],
        "rows": [asdict(row) for row in rows],
        "elapsed_s": elapsed,
    })


def autotuned_tiles() -> list[str]:
    """One line per tuning key the StreamKL kernels were autotuned for in this process."""
    lines = []
    for name, launcher in KERNEL_LAUNCHERS.items():
        for key, config in getattr(launcher.kernel, "cache", {}).items():
            lines.append(f"{name} {key}: {config}")
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
    print(environment_line(environment), flush=True)
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
