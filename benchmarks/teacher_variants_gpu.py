"""How the frozen teacher runs, side by side in one process: ViT training steps with StreamKL.

Builds one trainer per variant from the same seed (student, AdamW, the plugin's distiller at
temperature 1, both models' log-sum-exps passed as the plugin passes them) and times them
interleaved: each round runs every variant for a few steps, so drift of the machine over the
run touches every variant alike. Reports the median step time, the median host time per step
(until the step's last launch returns, before synchronising: a host-bound step has host ≈ step)
and each variant's ratio to (a), the step without distillation. Before timing, each teacher's
penalty on one perturbed batch is checked against the float64 reference.

Variants: ``none`` (a); ``eager`` (the plugin's default teacher); ``compiled`` (``compile_teacher``:
``torch.compile``, its log-sum-exps recorded in the graph); ``graphs`` (the same in
``mode="reduce-overhead"``: CUDA graphs); ``*-online`` (the student's log-sum-exp withheld, so
the forward computes both online); ``compiled-unfused`` (the forward, then the backward kernels:
``kernel_options(fused_gradients="off")``); ``fp8`` (the compiled teacher's linear layers in
float8, torchao; ``_harness.low_precision``); ``t-eager`` / ``t-compiled`` / ``t-fp8`` (the
teacher's forward and the captures without the penalty).

Examples (from the repository root, with the package installed)::

    python benchmarks/teacher_variants_gpu.py --json     # JSON: benchmarks/results/
    python benchmarks/teacher_variants_gpu.py --device cpu --tiny --variants none eager t-eager
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from _harness.low_precision import float8_teacher
from _harness.measure import free_memory, sync
from _harness.options import add_run_flags, checked_device, timing_batches
from _harness.penalty_check import PERTURBATION_STD, _perturb, reference_penalty
from _harness.report import aligned, cell, describe_environment, environment_line, header_line, run_settings
from _harness.report import table_header, write_json
from _harness.vit_training import DEFAULT_MODEL, TINY_MODEL_KWARGS, Trainer, build_trainer, random_batch, student_qk
from cl_streamkl.capture import QKCapture
from cl_streamkl.kernels.config import kernel_options
from cl_streamkl.strategies import frozen_copy

# name → (method of build_trainer, compile_teacher, pass the student's log-sum-exps)
VARIANTS = {
    "none": ("none", False, True),
    "eager": ("triton", False, True),
    "eager-online": ("triton", False, False),
    "compiled": ("triton", True, True),
    "compiled-online": ("triton", True, False),
    "graphs": ("triton", {"mode": "reduce-overhead"}, True),
    "compiled-unfused": ("triton", True, True),
    "fp8": ("triton", True, True),
    "t-eager": ("teacher", False, True),
    "t-compiled": ("teacher", True, True),
    "t-fp8": ("teacher", True, True),
}
# Kernel options a variant's steps run under, and the variants with a float8 teacher.
VARIANT_OPTIONS = {"compiled-unfused": {"fused_gradients": "off"}}
FLOAT8_VARIANTS = ("fp8", "t-fp8")
DEFAULT_VARIANTS = ("none", "eager", "compiled", "compiled-online", "graphs", "t-eager", "t-compiled")
DEFAULT_IMAGE_SIZES, DEFAULT_BATCHES = (224, 512, 1024), (64, 16, 4)


@dataclass
class VariantResult:
    """One variant at one image size: every timed step's wall and host milliseconds."""

    image_size: int
    tokens: int
    batch: int
    variant: str
    step_ms: list[float] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)
    penalty: float | None = None
    penalty_reference: float | None = None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.step_ms) if self.step_ms else None

    @property
    def median_host_ms(self) -> float | None:
        return statistics.median(self.host_ms) if self.host_ms else None

    @property
    def penalty_error(self) -> float | None:
        """|penalty − float64| / |float64|, or None where no penalty was checked."""
        if self.penalty is None or not self.penalty_reference:
            return None
        return abs(self.penalty - self.penalty_reference) / abs(self.penalty_reference)


def ratios_to_plain(results: Sequence[VariantResult]) -> list[float | None]:
    """Each result's median step time over that of (a) ``none`` at its image size."""
    plain = {r.image_size: r.median_ms for r in results if r.variant == "none"}
    return [r.median_ms / plain[r.image_size] if r.median_ms and plain.get(r.image_size) else None for r in results]


def build(variant: str, args: argparse.Namespace, image_size: int) -> Trainer:
    """The variant's trainer; every variant starts from the same weights (seed 0)."""
    method, compile_teacher, student_lse = VARIANTS[variant]
    if method == "triton" and args.device.type == "cpu":
        method = "torch"  # a smoke run: the kernels need CUDA (or Triton's slow interpreter)
    trainer = build_trainer(method, args.model, args.model_kwargs, image_size, 1.0, args.device, compile_teacher)
    trainer.pass_student_lse = student_lse
    if variant in FLOAT8_VARIANTS:
        # The penalty is checked against the float64 penalty of the teacher before quantising.
        trainer.reference_teacher = frozen_copy(trainer.distiller.teacher)
        float8_teacher(trainer.distiller.teacher)
    return trainer


def check_penalty(trainer: Trainer, result: VariantResult, image_size: int, batch: int) -> None:
    """The variant's penalty (its teacher, both log-sum-exps as the step passes them) and float64's,
    on a copy of the student perturbed away from the teacher."""
    distiller = trainer.distiller
    student = frozen_copy(trainer.model)
    _perturb(student, PERTURBATION_STD)
    images, _ = random_batch(batch, image_size, trainer.num_classes, trainer.device)
    with torch.no_grad(), torch.autocast(trainer.device.type, dtype=torch.bfloat16):
        teacher = distiller.teacher_qk(images)
        with distiller.student_capture(student) as capture:
            student(images)
        penalty = distiller.penalty(images, student_qk(capture, trainer.pass_student_lse), teacher=teacher)
        unquantised = getattr(trainer, "reference_teacher", distiller.teacher)
        with QKCapture(unquantised, "all") as reference_teacher:
            unquantised(images)
    result.penalty = float(penalty)
    result.penalty_reference = reference_penalty(capture, reference_teacher)


def time_round(trainer: Trainer, result: VariantResult, images: torch.Tensor, labels: torch.Tensor,
               steps: int) -> None:
    """``steps`` steps, each synchronised, appending wall and host milliseconds."""
    for _ in range(steps):
        sync(trainer.device)
        start = time.perf_counter()
        with kernel_options(**VARIANT_OPTIONS.get(result.variant, {})):
            trainer.step(images, labels)
        host = time.perf_counter()
        sync(trainer.device)
        result.step_ms.append((time.perf_counter() - start) * 1e3)
        result.host_ms.append((host - start) * 1e3)


def run_size(args: argparse.Namespace, image_size: int, batch: int) -> list[VariantResult]:
    """Every variant at one image size: build, check, warm up, then the interleaved rounds."""
    trainers = {variant: build(variant, args, image_size) for variant in args.variants}
    tokens = next(iter(trainers.values())).model.patch_embed.num_patches + 1
    results = {variant: VariantResult(image_size, tokens, batch, variant) for variant in args.variants}
    images, labels = random_batch(batch, image_size, next(iter(trainers.values())).num_classes, args.device)
    for variant, trainer in trainers.items():
        if trainer.distiller is not None and VARIANTS[variant][0] != "teacher":
            # At the timing batch: a compiled teacher meets no second input signature (no recompile).
            check_penalty(trainer, results[variant], image_size, batch)
        with kernel_options(**VARIANT_OPTIONS.get(variant, {})):
            for _ in range(args.warmup_steps):
                trainer.step(images, labels)
        print(f"{image_size}px {variant}: ready", flush=True)
    for _ in range(args.rounds):
        for variant, trainer in trainers.items():
            time_round(trainer, results[variant], images, labels, args.steps)
    del trainers
    free_memory(args.device)
    return list(results.values())


COLUMNS = (("tokens", 6), ("batch", 5), ("variant", 15), ("step ms", 8), ("host ms", 8), ("x (a)", 6),
           ("penalty rel. err", 16))


def format_table(results: Sequence[VariantResult]) -> str:
    """Median step and host ms, ratio to (a) at the same size, the penalty's error against float64."""
    lines = [header_line(COLUMNS)]
    for r, ratio in zip(results, ratios_to_plain(results)):
        lines.append(aligned([str(r.tokens), str(r.batch), r.variant, cell(r.median_ms, ".1f"),
                              cell(r.median_host_ms, ".1f"), cell(ratio, ".2f"), cell(r.penalty_error, ".1e")],
                             COLUMNS))
    return "\n".join(lines)


TABLE_COLUMNS = [
    {"name": "tokens (batch)"}, {"name": "teacher"}, {"name": "step ms", "align": "right", "format": ".1f"},
    {"name": "host ms", "align": "right", "format": ".1f"}, {"name": "× (a)", "align": "right", "format": ".2f"},
    {"name": "penalty vs float64", "align": "right", "format": ".1e"},
]
VARIANT_LABELS = {
    "none": "(a) no distillation",
    "eager": "eager, both LSEs given",
    "eager-online": "eager, student LSE withheld",
    "compiled": "compiled, both LSEs given",
    "compiled-online": "compiled, student LSE withheld",
    "graphs": "compiled + CUDA graphs, both LSEs given",
    "compiled-unfused": "compiled, both LSEs given, forward then backward kernels",
    "fp8": "compiled float8 teacher, both LSEs given",
    "t-fp8": "(t) compiled float8 teacher, no penalty",
    "t-eager": "(t) eager teacher, no penalty",
    "t-compiled": "(t) compiled teacher, no penalty",
}


def table_payload(environment: dict, results: Sequence[VariantResult]) -> dict:
    """The result file: a table ``benchmarks/tables.py`` renders, and every step's times beside it."""
    rows = [[f"{r.tokens} ({r.batch})", VARIANT_LABELS[r.variant], r.median_ms, r.median_host_ms, ratio,
             "–" if r.penalty_error is None else r.penalty_error]
            for r, ratio in zip(results, ratios_to_plain(results))]
    return {
        "title": "ViT training step with StreamKL by how the frozen teacher runs: one process, variants "
                 "interleaved; median step and host ms, ratio to the step without distillation",
        **table_header(environment), "columns": TABLE_COLUMNS, "rows": rows,
        "results": [{**asdict(r), "median_ms": r.median_ms, "median_host_ms": r.median_host_ms} for r in results],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS))
    parser.add_argument("--image-sizes", nargs="+", type=int, default=None, help="default: 224 512 1024")
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="default: 64 16 4")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"timm model name (default {DEFAULT_MODEL})")
    parser.add_argument("--tiny", action="store_true", help="smoke preset: depth 2, width 32, 32 px, batch 2")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps per variant (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant and round (default 6)")
    add_run_flags(parser)
    args = parser.parse_args(argv)
    args.device = checked_device(parser, args.device, "--device cpu --tiny")
    args.model_kwargs = dict(TINY_MODEL_KWARGS) if args.tiny else {}
    if args.image_sizes is None:
        args.image_sizes = [32] if args.tiny else list(DEFAULT_IMAGE_SIZES)
    defaults = {32: 2} if args.tiny else dict(zip(DEFAULT_IMAGE_SIZES, DEFAULT_BATCHES))
    args.batches = timing_batches(parser, args.image_sizes, args.batches, defaults)
    for flag, value in (("--rounds", args.rounds), ("--steps", args.steps), ("--batches", min(args.batches)),
                        ("--image-sizes", min(args.image_sizes))):
        if value < 1:
            parser.error(f"{flag} must be positive, got {value}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    environment = describe_environment(args.device, args.commit)
    print(environment_line(environment), flush=True)
    results: list[VariantResult] = []
    for image_size, batch in zip(args.image_sizes, args.batches):
        results += run_size(args, image_size, batch)
        print(format_table([r for r in results if r.image_size == image_size]), flush=True)
        if args.json is not None:  # rewritten after each size: a run cut short keeps what it measured
            write_json(args.json, {**table_payload(environment, results), "settings": run_settings(args),
                                   "elapsed_s": time.perf_counter() - start})
    print(format_table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
