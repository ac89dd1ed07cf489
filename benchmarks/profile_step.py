"""Where a distillation training step spends its time.

Same model and set-up as ``e2e_distillation.py``. ``--teacher`` times one frozen-teacher
forward per variant (eager, compiled, another compile mode); per step method it prints the
median wall time and, on CUDA, the summed kernel time, the GPU's idle time and the kernel
time by category (``--gaps``: what the host was doing in the longest idle gaps).
docs/benchmarks.md (Method, Training steps) describes the variants and methods.

Examples (from the repository root, with the package installed: ``pip install -e .``)::

    python benchmarks/profile_step.py --teacher --methods none capture triton
    python benchmarks/profile_step.py --compile-teacher --methods triton --gaps 10
    python benchmarks/profile_step.py --device cpu --tiny --teacher
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from _harness.measure import PeakMemory, free_memory, median_ms, sync
from _harness.options import COMPILE_MODES, add_compile_teacher_flag, add_run_flags, checked_device
from _harness.options import compile_teacher_option, describe_teacher
from _harness.report import describe_environment, environment_line, write_json
from _harness.vit_training import (
    DEFAULT_MODEL,
    EXTRA_METHODS,
    METHODS,
    TINY_MODEL_KWARGS,
    Trainer,
    build_model,
    build_trainer,
    random_batch,
    time_steps,
)
from cl_streamkl.capture import QKCapture
from cl_streamkl.capture import graph_reads_disabled
from cl_streamkl.strategies import AttentionDistiller, frozen_copy

CAPTURE_METHODS = ("capture", "capture-full")
STEP_METHODS = METHODS + EXTRA_METHODS + CAPTURE_METHODS
# Kernel-name fragments, first match wins.
CATEGORIES = (
    ("_attention_kl_fwd", "streamkl fwd"),
    ("_attention_kl_bwd_dq", "streamkl dq"),
    ("_attention_kl_bwd_dk", "streamkl dk"),
    ("flash", "sdpa"),
    ("fmha", "sdpa"),
    ("sdpa", "sdpa"),
    ("triton_", "inductor"),
    ("gemm", "gemm"),
    ("nvjet", "gemm"),
    ("cutlass", "gemm"),
    ("layer_norm", "layernorm"),
    ("adam", "optimizer"),
    ("elementwise", "elementwise"),
    ("reduce", "reduction"),
    ("copy", "copy"),
)
GAP_US = 50.0


class CaptureOnlyDistiller(AttentionDistiller):
    """``capture``: the student's Q/K are captured as in (c), the penalty is zero, no teacher runs."""

    def teacher_qk(self, x: torch.Tensor, *args, **kwargs) -> None:
        return None

    def penalty(self, x: torch.Tensor, capture, *, teacher=None, **kwargs) -> torch.Tensor:
        return torch.zeros((), device=x.device)


class FullWatchDistiller(CaptureOnlyDistiller):
    """``capture-full``: as ``capture``, but every forward is watched with the TorchFunctionMode."""

    @contextmanager
    def student_capture(self, model: nn.Module) -> Iterator[QKCapture]:
        with graph_reads_disabled(), super().student_capture(model) as capture:
            yield capture


def category(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((label for fragment, label in CATEGORIES if fragment in name), "other")


def teacher_rows(args: argparse.Namespace, image_size: int, batch: int) -> list[dict]:
    """Table 1 at one image size: one row per teacher variant."""
    device = args.device
    torch.manual_seed(0)
    model = build_model(args.model, args.model_kwargs, image_size, device)
    teacher = frozen_copy(model)
    images = torch.randn(batch, 3, image_size, image_size, device=device)
    variants: dict[str, Callable[[], object]] = {}

    def full_forward() -> None:
        with torch.no_grad():
            teacher(images)

    variants["eager-full"] = full_forward
    options = {"eager": False, "compiled": True}
    if args.compile_mode:
        options[f"compiled {args.compile_mode}"] = {"mode": args.compile_mode}
    for name, compile_teacher in options.items():
        distiller = AttentionDistiller(layers="all", compile_teacher=compile_teacher)
        distiller.update_teacher(model)
        variants[name] = lambda distiller=distiller: distiller.teacher_qk(images)
    rows = []
    for name, forward in variants.items():

        def run(forward=forward) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                forward()

        start = time.perf_counter()
        run()
        sync(device)
        first_s = time.perf_counter() - start
        with PeakMemory(device) as memory:
            ms = median_ms(run, device, rep_ms=max(100, 10 * args.steps), cpu_repeats=args.steps)
        extra = None if memory.extra_bytes is None else memory.extra_bytes / 2**30
        rows.append({"image_size": image_size, "batch": batch, "teacher": name, "first_call_s": first_s,
                     "ms": ms, "extra_peak_gib": extra})
        print(f"teacher {image_size}px × {batch} {name}: {ms:.2f} ms (first call {first_s:.1f} s)", flush=True)
    return rows


def build_step_trainer(args: argparse.Namespace, method: str, image_size: int) -> Trainer:
    if method not in CAPTURE_METHODS:
        return build_trainer(
            method, args.model, args.model_kwargs, image_size, 1.0, args.device, args.compile_teacher
        )
    trainer = build_trainer("none", args.model, args.model_kwargs, image_size, 1.0, args.device)
    distiller_class = FullWatchDistiller if method == "capture-full" else CaptureOnlyDistiller
    trainer.distiller = distiller_class(layers="all")
    trainer.distiller.update_teacher(trainer.model)
    return trainer


def profiled_steps(trainer: Trainer, images, labels, steps: int, trace_path: Path) -> list[dict]:
    """Chrome-trace events of ``steps`` training steps (CPU ops and CUDA kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            trainer.step(images, labels)
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(trace_path))
    return json.loads(trace_path.read_text())["traceEvents"]


def gpu_gaps(kernels: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals (µs) between the end of all earlier kernels and the start of the next one."""
    gaps, busy_until = [], kernels[0][0]
    for start, end in kernels:
        if start > busy_until:
            gaps.append((busy_until, start))
        busy_until = max(busy_until, end)
    return gaps


def gap_causes(events: list[dict], gaps: Sequence[tuple[float, float]]) -> collections.Counter:
    """ms of GPU idle per innermost host op running at each long gap's midpoint."""
    host_ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    causes: collections.Counter = collections.Counter()
    for start, end in gaps:
        if end - start <= GAP_US:
            continue
        middle = (start + end) / 2
        running = [e for e in host_ops if e["ts"] <= middle <= e["ts"] + e["dur"]]
        name = min(running, key=lambda e: e["dur"])["name"] if running else "(no host op)"
        causes[name[:70]] += (end - start) / 1e3
    return causes


def step_row(args: argparse.Namespace, method: str, image_size: int, batch: int, trace_dir: Path) -> dict:
    """Table 2, one method: wall median, and on CUDA kernel sums, idle time and categories."""
    trainer = build_step_trainer(args, method, image_size)
    wall_ms, _ = time_steps(trainer, batch, image_size, args.warmup_steps, args.steps)
    row = {"image_size": image_size, "batch": batch, "method": method, "wall_ms": wall_ms}
    if args.device.type == "cuda":
        images, labels = random_batch(batch, image_size, trainer.num_classes, args.device)
        events = profiled_steps(trainer, images, labels, args.profile_steps, trace_dir / f"{method}.json")
        kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
        by_category: collections.Counter = collections.Counter()
        for event in events:
            if event.get("cat") == "kernel":
                by_category[category(event["name"])] += event["dur"] / 1e3 / args.profile_steps
        row["kernel_ms"] = sum(by_category.values())
        row["idle_ms"] = row["wall_ms"] - row["kernel_ms"]
        row["categories"] = dict(by_category.most_common())
        if args.gaps:
            causes = gap_causes(events, gpu_gaps(kernels))
            row["gap_causes_ms_per_step"] = {k: v / args.profile_steps for k, v in causes.most_common(args.gaps)}
    return row


def format_step_row(row: dict) -> str:
    text = f"step {row['image_size']}px × {row['batch']} {row['method']}: wall {row['wall_ms']:.1f} ms"
    if "kernel_ms" in row:
        text += f", kernels {row['kernel_ms']:.1f} ms, GPU idle {row['idle_ms']:.1f} ms\n    "
        text += ", ".join(f"{name} {ms:.2f}" for name, ms in row["categories"].items())
    for name, ms in row.get("gap_causes_ms_per_step", {}).items():
        text += f"\n    idle {ms:6.2f} ms/step while the host ran {name}"
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--teacher", action="store_true", help="also time the teacher's forward alone (table 1)")
    parser.add_argument(
        "--compile-mode", default=None, choices=COMPILE_MODES[1:],
        help="one more compiled teacher variant in this mode",
    )
    parser.add_argument(
        "--methods", nargs="*", choices=STEP_METHODS, default=["none", "capture", "teacher", "triton"],
        help="step methods of table 2 (default: none capture teacher triton; none at all: skip table 2)",
    )
    add_compile_teacher_flag(parser)
    parser.add_argument("--image-size", type=int, default=None, help="default 512 (tiny: 32)")
    parser.add_argument("--batch", type=int, default=None, help="default 16 (tiny: 2)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tiny", action="store_true", help="a depth-2, width-32 ViT at 32 px for smoke runs")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (and teacher calls on the CPU)")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler (CUDA)")
    parser.add_argument("--gaps", type=int, default=0, metavar="N", help="list the N largest causes of GPU idle")
    add_run_flags(parser, json_help="also write the rows here")
    args = parser.parse_args(argv)
    args.device = checked_device(parser, args.device, "--device cpu --tiny")
    args.compile_teacher = compile_teacher_option(args.compile_teacher)
    args.model_kwargs = dict(TINY_MODEL_KWARGS) if args.tiny else {}
    args.image_size = args.image_size or (32 if args.tiny else 512)
    args.batch = args.batch or (2 if args.tiny else 16)
    for flag, value in {"--steps": args.steps, "--profile-steps": args.profile_steps, "--batch": args.batch}.items():
        if value < 1:
            parser.error(f"{flag} must be positive, got {value}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    environment = describe_environment(args.device, args.commit)
    print(environment_line(environment), flush=True)
    print(f"teacher of the step methods: {describe_teacher(args.compile_teacher)}", flush=True)
    result: dict = {"environment": environment, "teacher": [], "steps": []}
    if args.teacher:
        result["teacher"] = teacher_rows(args, args.image_size, args.batch)
        free_memory(args.device)
    with tempfile.TemporaryDirectory() as trace_dir:
        for method in args.methods:
            row = step_row(args, method, args.image_size, args.batch, Path(trace_dir))
            result["steps"].append(row)
            print(format_step_row(row), flush=True)
            free_memory(args.device)
    if args.json is not None:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
