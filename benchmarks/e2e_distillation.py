"""Attention distillation on real ViT training steps: step time, memory, largest batch.

Trains a timm ViT-B/16 at 197, 1025 and 4097 tokens with (a) no distillation, (b) the usual
penalty materialising both attention maps, (c) StreamKL triton, (d) StreamKL torch and, on
request, (t) the teacher's forward without a penalty; checks that the penalties agree,
times a step at a fixed batch and searches the largest batch that fits. docs/benchmarks.md
(Method, Training steps) describes the set-up and the three phases; the check and the search
live in ``_harness.penalty_check`` and ``_harness.batch_search``.

Examples (from the repository root, with the package installed: ``pip install -e .``)::

    python benchmarks/e2e_distillation.py --json --plot e2e.png   # JSON: benchmarks/results/
    python benchmarks/e2e_distillation.py --device cpu --tiny --methods none eager torch
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from _harness.batch_search import batch_fits, largest_batch
from _harness.measure import free_memory
from _harness.options import add_compile_teacher_flag, add_run_flags, checked_device, timing_batches
from _harness.options import compile_teacher_option, describe_teacher
from _harness.penalty_check import PENALTY_METHODS, PenaltyCheck, check_penalties, format_check
from _harness.report import aligned, cell, describe_environment, environment_line, header_line, run_settings, write_json
from _harness.vit_training import (
    DEFAULT_MODEL,
    EXTRA_METHODS,
    METHODS,
    TINY_MODEL_KWARGS,
    build_trainer,
    time_steps,
)

METHOD_LABELS = {
    "none": "(a) no distillation",
    "eager": "(b) eager, materialised",
    "triton": "(c) StreamKL triton",
    "torch": "(d) StreamKL torch",
    "teacher": "(t) teacher fwd, no KL",
}

DEFAULT_IMAGE_SIZES = (224, 512, 1024)
DEFAULT_BATCHES = (64, 16, 4)
# The batch search never goes past this many tokens per step, so a search cannot run away;
# by a rough activation count ViT-B/16 training needs over 200 GB there.
MAX_TOKENS_PER_STEP = 2**19

TINY_IMAGE_SIZES = (32, 48)
TINY_BATCHES = (2, 2)
TINY_MAX_BATCH = 8


@dataclass
class Result:
    """One (image size, method): timing at ``batch`` and the largest batch found.

    ``step_ms is None`` means the timing batch ran out of memory; ``max_batch_exact`` is
    False when the search was cut short by the time budget or stopped at the cap, so the
    true largest batch is at least ``max_batch``.
    """

    image_size: int
    tokens: int
    method: str
    batch: int
    step_ms: float | None = None
    peak_gib: float | None = None
    max_batch: int | None = None
    max_batch_exact: bool = False
    search_s: float | None = None


def _tokens(model: nn.Module) -> int:
    return model.patch_embed.num_patches + getattr(model, "num_prefix_tokens", 1)


COLUMNS = (
    ("image", 5),
    ("tokens", 6),
    ("method", 23),
    ("batch", 5),
    ("step ms", 9),
    ("x (a)", 6),
    ("peak GiB", 8),
    ("max batch", 9),
    ("x (b)", 6),
)


def format_table(results: Sequence[Result]) -> str:
    """Aligned table; ``x (a)`` is step time over (a)'s, ``x (b)`` max batch over (b)'s."""
    lookup = {(r.image_size, r.method): r for r in results}
    lines = [header_line(COLUMNS)]
    for r in results:
        plain, eager = lookup.get((r.image_size, "none")), lookup.get((r.image_size, "eager"))
        time_ratio = r.step_ms / plain.step_ms if r.step_ms and plain and plain.step_ms else None
        batch_ratio = r.max_batch / eager.max_batch if r.max_batch and eager and eager.max_batch else None
        if r.max_batch is None:
            max_batch = "-"
        else:
            max_batch = ("" if r.max_batch_exact else ">=") + str(r.max_batch)
        cells = [
            str(r.image_size),
            str(r.tokens),
            METHOD_LABELS[r.method],
            str(r.batch),
            "OOM" if r.step_ms is None else f"{r.step_ms:.1f}",
            cell(time_ratio, ".2f"),
            cell(r.peak_gib, ".2f"),
            max_batch,
            cell(batch_ratio, ".1f"),
        ]
        lines.append(aligned(cells, COLUMNS))
    return "\n".join(lines)


def plot_results(results: Sequence[Result], path: Path) -> None:
    """PNG: peak memory at the timing batch (left) and largest batch (right) vs tokens.

    A largest batch that is only a lower bound (search cut short or at the cap) gets an
    upward triangle.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    figure, (memory_axis, batch_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in METHODS + EXTRA_METHODS:
        rows = sorted((r for r in results if r.method == method), key=lambda r: r.tokens)
        memory = [(r.tokens, r.peak_gib) for r in rows if r.peak_gib is not None]
        batches = [(r.tokens, r.max_batch) for r in rows if r.max_batch]
        if memory:
            memory_axis.plot(*zip(*memory), marker="o", label=METHOD_LABELS[method])
        if batches:
            (line,) = batch_axis.plot(*zip(*batches), marker="o", label=METHOD_LABELS[method])
            bounds = [(r.tokens, r.max_batch) for r in rows if r.max_batch and not r.max_batch_exact]
            if bounds:
                batch_axis.plot(*zip(*bounds), linestyle="none", marker="^", markersize=10, color=line.get_color())
    tokens = sorted({r.tokens for r in results})
    timing = ", ".join(f"{r.tokens} tok × {r.batch}" for r in results if r.method == results[0].method)
    memory_axis.set(xlabel="tokens per image", ylabel="peak device memory (GiB)", xscale="log")
    memory_axis.set_title(f"peak memory per training step\n(batch: {timing})", fontsize=10)
    batch_axis.set(xlabel="tokens per image", ylabel="largest batch that fits", xscale="log", yscale="log")
    batch_axis.set_title("largest batch that fits (▲ = at least)", fontsize=10)
    for axis in (memory_axis, batch_axis):
        axis.set_xticks(tokens, labels=[str(t) for t in tokens])
        axis.xaxis.set_minor_locator(NullLocator())
        axis.grid(True, which="both", alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    plt.close(figure)


def _json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--model-kwargs must be a JSON object: {error}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"--model-kwargs must be a JSON object, got {value!r}")
    return parsed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--methods", nargs="+", choices=METHODS + EXTRA_METHODS, default=list(METHODS),
        help="default: none eager triton torch; also teacher",
    )
    parser.add_argument("--image-sizes", nargs="+", type=int, default=None, help="default: 224 512 1024")
    parser.add_argument(
        "--batches", nargs="+", type=int, default=None,
        help="timing batch per image size (default: 64 16 4, about 16k tokens per step)",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"timm model name (default {DEFAULT_MODEL})")
    parser.add_argument(
        "--model-kwargs", type=_json_object, default=None,
        help='JSON object passed to timm.create_model, e.g. \'{"depth": 2}\'',
    )
    parser.add_argument(
        "--tiny", action="store_true",
        help="smoke-test preset: depth 2, width 32, images 32 and 48 px, batch 2, max batch 8",
    )
    add_compile_teacher_flag(parser)
    parser.add_argument("--alpha", type=float, default=1.0, help="penalty weight (default 1)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--probe-steps", type=int, default=2, help="steps per batch-search probe (default 2)")
    parser.add_argument(
        "--max-batch", type=int, default=None,
        help=f"batch search cap (default: {MAX_TOKENS_PER_STEP} tokens per step)",
    )
    parser.add_argument(
        "--time-budget-s", type=float, default=450.0,
        help="wall-clock budget of the whole run; the batch searches share what is left (default 450)",
    )
    parser.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    parser.add_argument("--check-batch", type=int, default=2, help="batch of the penalty check (default 2)")
    parser.add_argument("--check-rtol", type=float, default=1e-3, help="penalty agreement bound (default 1e-3)")
    add_run_flags(parser)
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG plot here")
    args = parser.parse_args(argv)

    args.device = checked_device(parser, args.device, "--device cpu --tiny")
    args.compile_teacher = compile_teacher_option(args.compile_teacher)
    if args.image_sizes is None:
        args.image_sizes = list(TINY_IMAGE_SIZES if args.tiny else DEFAULT_IMAGE_SIZES)
    defaults = dict(zip(TINY_IMAGE_SIZES, TINY_BATCHES) if args.tiny else zip(DEFAULT_IMAGE_SIZES, DEFAULT_BATCHES))
    args.batches = timing_batches(parser, args.image_sizes, args.batches, defaults)
    if args.model_kwargs is None:
        args.model_kwargs = dict(TINY_MODEL_KWARGS) if args.tiny else {}
    if args.max_batch is None and args.tiny:
        args.max_batch = TINY_MAX_BATCH
    positive = {
        "--image-sizes": min(args.image_sizes),
        "--batches": min(args.batches),
        "--steps": args.steps,
        "--probe-steps": args.probe_steps,
        "--check-batch": args.check_batch,
        "--max-batch": args.max_batch if args.max_batch is not None else 1,
    }
    for flag, value in positive.items():
        if value < 1:
            parser.error(f"{flag} must be positive, got {value}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    return args


def _write_json(path: Path, environment: dict, args: argparse.Namespace, checks, results, elapsed: float) -> None:
    write_json(path, {
        "environment": environment,
        "settings": run_settings(args),
        "penalty_checks": [{**asdict(check), "passed": check.passed} for check in checks],
        "results": [asdict(result) for result in results],
        "elapsed_s": elapsed,
    })


def time_method(args: argparse.Namespace, method: str, image_size: int, batch: int) -> Result:
    """Step time and peak memory of one method at one image size (a fresh student and teacher)."""
    trainer = build_trainer(
        method, args.model, args.model_kwargs, image_size, args.alpha, args.device, args.compile_teacher
    )
    result = Result(image_size, _tokens(trainer.model), method, batch)
    try:
        result.step_ms, result.peak_gib = time_steps(trainer, batch, image_size, args.warmup_steps, args.steps)
    except torch.OutOfMemoryError:
        pass
    return result


def search_start(result: Result, device: torch.device) -> int:
    """First batch to probe: the timing batch scaled by device memory over its peak.

    Counting the fixed memory (weights, AdamW state, teacher) as if it grew with the batch
    makes this an underestimate of the limit, usually by a few percent, which saves the
    doublings from the small timing batch. Without a measured peak it is the timing batch.
    """
    if result.peak_gib is None or device.type != "cuda":
        return result.batch
    total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    return max(result.batch, int(result.batch * total_gib / result.peak_gib))


def search_method(args: argparse.Namespace, result: Result, deadline: float) -> None:
    """Fill ``result.max_batch`` by a batch search on a fresh student and teacher."""
    trainer = build_trainer(
        result.method, args.model, args.model_kwargs, result.image_size, args.alpha, args.device,
        args.compile_teacher,
    )
    timed = result.step_ms is not None
    result.max_batch, result.max_batch_exact = largest_batch(
        lambda batch: batch_fits(trainer, batch, result.image_size, args.probe_steps),
        start=search_start(result, args.device),
        cap=args.max_batch or max(1, MAX_TOKENS_PER_STEP // result.tokens),
        deadline=deadline,
        known_fit=result.batch if timed else 0,
        known_fail=None if timed else result.batch,
    )


def run_timings(args: argparse.Namespace, report: Callable[[], None]) -> list[Result]:
    """Phase 2: every (image size, method) at its timing batch."""
    results = []
    for image_size, batch in zip(args.image_sizes, args.batches):
        for method in args.methods:
            result = time_method(args, method, image_size, batch)
            # The trainer is gone with time_method's frame; give its memory back before the next.
            free_memory(args.device)
            results.append(result)
            if result.step_ms is None:
                status = "OOM"
            else:
                status = f"{result.step_ms:.1f} ms, peak {cell(result.peak_gib, '.2f')} GiB"
            print(f"timed {image_size}px {METHOD_LABELS[method]} batch {batch}: {status}", flush=True)
        report()
    return results


def run_searches(
    args: argparse.Namespace, results: Sequence[Result], deadline: float, report: Callable[[], None]
) -> None:
    """Phase 3: the largest batch of every result, longest sequences first, sharing the time left."""
    pending = sorted(results, key=lambda r: -r.tokens)
    for index, result in enumerate(pending):
        now = time.perf_counter()
        share = max(0.0, deadline - now) / (len(pending) - index)
        search_method(args, result, now + share)
        result.search_s = time.perf_counter() - now
        free_memory(args.device)
        bound = "" if result.max_batch_exact else ">="
        print(
            f"searched {result.image_size}px {METHOD_LABELS[result.method]}: largest batch "
            f"{bound}{result.max_batch} ({result.search_s:.0f} s)",
            flush=True,
        )
        report()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three phases; returns 1 when a penalty check failed, else 0."""
    args = parse_args(argv)
    start = time.perf_counter()
    environment = describe_environment(args.device, args.commit)
    print(environment_line(environment), flush=True)
    print(f"teacher: {describe_teacher(args.compile_teacher)}", flush=True)
    checks: list[PenaltyCheck] = []
    results: list[Result] = []

    def report() -> None:
        # Rewritten after every step of progress so a run cut short still leaves its results.
        if args.json is not None:
            _write_json(args.json, environment, args, checks, results, time.perf_counter() - start)

    if any(method in PENALTY_METHODS for method in args.methods):
        for image_size in args.image_sizes:
            check = check_penalties(
                args.methods, args.model, args.model_kwargs, image_size, args.check_batch,
                args.alpha, args.check_rtol, args.device, args.compile_teacher,
            )
            checks.append(check)
            print(format_check(check), flush=True)
            free_memory(args.device)
        report()
    results += run_timings(args, report)
    if not args.no_search:
        run_searches(args, results, start + args.time_budget_s, report)
    print(format_table(results), flush=True)
    if args.plot is not None:
        plot_results(results, args.plot)
    report()
    failed = [check for check in checks if not check.passed]
    print(f"done in {time.perf_counter() - start:.0f} s; {len(failed)} failed penalty checks", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
