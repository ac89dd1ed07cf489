"""Speed and memory of StreamKL against eager PyTorch, torch.compile and SDPA.

Times the forward, the backward and both of every implementation (``triton``, ``torch``,
``eager``, ``compiled``; ``sdpa``: SDPA's default backend, the fastest attention a user gets,
cuDNN attention on Hopper, named in each row; ``sdpa_fa2``: SDPA pinned to its flash
backend, FlashAttention-2) on the same inputs in one process, with the extra memory per query
row, after checking each problem against the float64 reference. docs/benchmarks.md (Method)
says what each column measures; the kernel tables of docs/bench-kernel.md come from this
script. The implementations and the check live in ``_harness.kl_workloads`` and
``_harness.kl_checks``.

Examples (from the repository root, with the package installed: ``pip install -e .``)::

    python benchmarks/bench_attention_kl.py --json          # benchmarks/results/bench_attention_kl-<date>.json
    python benchmarks/bench_attention_kl.py --quick
    python benchmarks/bench_attention_kl.py --shapes 4x12x4096x64 --modes fwd --impls triton sdpa
    TRITON_INTERPRET=1 python benchmarks/bench_attention_kl.py --device cpu \\
        --shapes 1x2x64x32 --fp32-shapes --causal-shapes
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from _harness.kl_checks import CheckResult, check_problem
from _harness.kl_workloads import IMPLEMENTATIONS, MODES, Problem, Workload, make_inputs, make_workload
from _harness.kl_workloads import peak_extra_bytes
from _harness.measure import free_memory, gpu_kernel_times_us, median_ms, sync
from _harness.options import DTYPES, Shape, add_run_flags, checked_device, parse_shape, shape_label
from _harness.report import aligned, cell, describe_environment, environment_line, header_line, run_settings, write_json
from cl_streamkl.kernels.triton import INTERPRETING, KERNEL_LAUNCHERS

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
    extra = peak_extra_bytes(workload, mode, device)
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
