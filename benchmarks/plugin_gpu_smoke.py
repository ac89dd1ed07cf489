"""GPU smoke run of the StreamKL plugin: a timm ViT at 1024 tokens under autocast.

Two short experiences on random images, the second with the StreamKL penalty, through
Avalanche's ``Naive`` with :class:`StreamKLPlugin` (or, without Avalanche or with
``--no-avalanche``, a plain loop driving :class:`AttentionDistiller`). Every distillation
iteration's penalty is checked against the float64 reference; the exit code is 1 if any
check fails. docs/benchmarks.md (Method, The plugin run) has the details.

Examples (from the repository root, with the package installed: ``pip install -e .``)::

    python benchmarks/plugin_gpu_smoke.py
    python benchmarks/plugin_gpu_smoke.py --model eva02_small_patch14_224 --img-size 448 --patch-size 14
    python benchmarks/plugin_gpu_smoke.py --no-avalanche --dtype fp16 --json smoke.json
    python benchmarks/plugin_gpu_smoke.py --device cpu --img-size 32 --patch-size 8 \\
        --depth 2 --embed-dim 64 --heads 2 --batch 2 --iters 2 --backend torch   # CPU dry run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import timm
import torch
import torch.nn.functional as F
from torch import nn

from _harness.measure import PeakMemory
from _harness.options import DTYPES
from _harness.report import add_json_flag, describe_environment, environment_line, write_json
from cl_streamkl import attention_kl_reference
from cl_streamkl.capture import QKCapture
from cl_streamkl.strategies import AttentionDistiller

NUM_CLASSES = 10


@dataclass
class Row:
    experience: int
    iteration: int
    penalty: float
    reference: float | None
    rel_err: float | None
    step_ms: float
    peak_gib: float | None
    passed: bool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_base_patch16_224", help="timm model name (random init)")
    parser.add_argument("--img-size", type=int, default=512)
    parser.add_argument("--patch-size", type=int, default=16, help="512/16 -> 1024 patch tokens (+1 cls)")
    parser.add_argument("--depth", type=int, default=None, help="override the model's depth")
    parser.add_argument("--embed-dim", type=int, default=None, help="override the model's width")
    parser.add_argument("--heads", type=int, default=None, help="override the number of heads")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--iters", type=int, default=6, help="training iterations per experience")
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--layers", default="all", help="'all', n (last n blocks) or comma-separated indices")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="autocast dtype")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-avalanche", action="store_true", help="plain loop even if avalanche imports")
    add_json_flag(parser, "write the rows and summary as JSON")
    return parser.parse_args(argv)


def parse_layers(text: str) -> str | int | list[int]:
    if text == "all":
        return text
    if "," in text:
        return [int(part) for part in text.split(",")]
    return int(text)


def header(args: argparse.Namespace, device: torch.device, mode: str) -> str:
    return (
        f"# {environment_line(describe_environment(device))} | timm {timm.__version__} | mode {mode} | "
        f"{args.model} img {args.img_size} patch {args.patch_size} batch {args.batch} autocast {args.dtype} "
        f"backend {args.backend}"
    )


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    overrides = {"depth": args.depth, "embed_dim": args.embed_dim, "num_heads": args.heads}
    kwargs = {key: value for key, value in overrides.items() if value is not None}
    model = timm.create_model(
        args.model, pretrained=False, img_size=args.img_size, patch_size=args.patch_size,
        num_classes=NUM_CLASSES, **kwargs,
    )
    return model.to(device)


def make_data(args: argparse.Namespace, experience: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (iters·batch, 3, S, S) and labels from this experience's 5 classes, on the CPU."""
    generator = torch.Generator().manual_seed(1000 + experience)
    count = args.iters * args.batch
    x = torch.randn(count, 3, args.img_size, args.img_size, generator=generator)
    y = torch.randint(5 * experience, 5 * experience + 5, (count,), generator=generator)
    return x, y


class Meter:
    """Step timing (device-synchronised) and per-step peak memory."""

    def __init__(self, device: torch.device) -> None:
        self.memory = PeakMemory(device)
        self.start = 0.0

    def begin(self) -> None:
        self.memory.start()
        self.start = time.perf_counter()

    def end(self) -> tuple[float, float | None]:
        self.memory.stop()
        step_ms = 1e3 * (time.perf_counter() - self.start)
        peak = None if self.memory.peak_bytes is None else self.memory.peak_bytes / 2**30
        return step_ms, peak


def reference_penalty(
    distiller: AttentionDistiller, x: torch.Tensor, student_qk: list[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """alpha · mean float64 KL on the student's captured Q/K and the teacher's Q/K of batch x."""
    teacher = distiller.teacher_qk(x)
    per_layer = []
    for (q, k), (q_t, k_t) in zip(student_qk, teacher.qk):
        if q_t.dtype != q.dtype:
            q_t, k_t = q_t.to(q.dtype), k_t.to(q.dtype)
        per_layer.append(
            attention_kl_reference(
                q.detach(), k.detach(), q_t, k_t, temperature=distiller.temperature, reduction="mean"
            )
        )
    return distiller.alpha * torch.stack(per_layer).mean().item()


def make_row(args, experience, iteration, penalty, reference, step_ms, peak) -> Row:
    if reference is None:
        return Row(experience, iteration, penalty, None, None, step_ms, peak, penalty == 0.0)
    rel_err = abs(penalty - reference) / max(abs(reference), 1e-30)
    passed = abs(penalty - reference) <= args.rtol * abs(reference) + args.atol
    return Row(experience, iteration, penalty, reference, rel_err, step_ms, peak, passed)


def print_row(row: Row) -> None:
    reference = "-" if row.reference is None else f"{row.reference:.6e}"
    rel_err = "-" if row.rel_err is None else f"{row.rel_err:.1e}"
    peak = "-" if row.peak_gib is None else f"{row.peak_gib:.2f}"
    print(
        f"{row.experience:>3} {row.iteration:>4} {row.penalty:>13.6e} {reference:>13} {rel_err:>8} "
        f"{row.step_ms:>9.1f} {peak:>9} {'ok' if row.passed else 'FAIL':>5}",
        flush=True,
    )


def run_plain(args: argparse.Namespace, device: torch.device) -> list[Row]:
    """Both experiences in a plain loop around AttentionDistiller."""
    model = build_model(args, device)
    distiller = AttentionDistiller(
        alpha=args.alpha, layers=parse_layers(args.layers), temperature=args.temperature, backend=args.backend
    )
    distiller.validate(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")
    autocast = torch.autocast(device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "fp32")
    meter, rows = Meter(device), []
    for experience in (0, 1):
        if experience == 1:
            distiller.update_teacher(model)
        images, labels = make_data(args, experience)
        for iteration in range(args.iters):
            batch = slice(iteration * args.batch, (iteration + 1) * args.batch)
            x, y = images[batch].to(device), labels[batch].to(device)
            meter.begin()
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                with distiller.student_capture(model) as capture:
                    logits = model(x)
                penalty = distiller.penalty(x, capture)
                loss = F.cross_entropy(logits, y) + penalty
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step_ms, peak = meter.end()
            reference = None
            if distiller.teacher is not None:
                with autocast:
                    reference = reference_penalty(distiller, x, capture.qk)
            capture.clear()
            row = make_row(args, experience, iteration, penalty.item(), reference, step_ms, peak)
            print_row(row)
            rows.append(row)
    return rows


def run_avalanche(args: argparse.Namespace, device: torch.device) -> list[Row]:
    """Both experiences through avalanche's Naive strategy with StreamKLPlugin."""
    from avalanche.benchmarks import tensors_benchmark
    from avalanche.training import Naive
    from avalanche.training.plugins import EvaluationPlugin, SupervisedPlugin

    from cl_streamkl.strategies import StreamKLPlugin

    plugin = StreamKLPlugin(
        alpha=args.alpha, layers=parse_layers(args.layers), temperature=args.temperature, backend=args.backend
    )
    meter, rows = Meter(device), []

    class Probe(SupervisedPlugin):
        """Times iterations and checks each penalty; must come after StreamKLPlugin."""

        def __init__(self) -> None:
            super().__init__()
            self.capture: QKCapture | None = None
            self.iteration = 0

        def before_training_exp(self, strategy, *a, **kw) -> None:
            self.iteration = 0

        def before_training_iteration(self, strategy, *a, **kw) -> None:
            meter.begin()

        def before_forward(self, strategy, *a, **kw) -> None:
            if plugin.teacher is not None:
                self.capture = QKCapture(strategy.model, plugin.distiller.layers).__enter__()

        def after_forward(self, strategy, *a, **kw) -> None:
            if self.capture is not None:
                self.capture.remove_hooks()

        def after_training_iteration(self, strategy, *a, **kw) -> None:
            step_ms, peak = meter.end()
            reference = None
            if self.capture is not None:
                with torch.autocast(device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "fp32"):
                    reference = reference_penalty(plugin.distiller, strategy.mb_x, self.capture.qk)
                self.capture = None
            experience = strategy.experience.current_experience
            row = make_row(args, experience, self.iteration, plugin.last_penalty, reference, step_ms, peak)
            print_row(row)
            rows.append(row)
            self.iteration += 1

    model = build_model(args, device)
    plugin.check_model(model)
    train = [list(make_data(args, experience)) for experience in (0, 1)]
    benchmark = tensors_benchmark(train_tensors=train, test_tensors=train, task_labels=[0, 0])
    strategy = Naive(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr), criterion=nn.CrossEntropyLoss(),
        train_mb_size=args.batch, train_epochs=1, eval_mb_size=args.batch, device=device,
        plugins=[plugin, Probe()], evaluator=EvaluationPlugin(loggers=[]),
    )
    for experience in benchmark.train_stream:
        with torch.autocast(device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != "fp32"):
            strategy.train(experience, num_workers=0, shuffle=False)
    return rows


def avalanche_available() -> bool:
    try:
        import avalanche.training  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    mode = "plain" if args.no_avalanche or not avalanche_available() else "avalanche"
    print(header(args, device, mode))
    print(f"{'exp':>3} {'iter':>4} {'penalty':>13} {'reference':>13} {'rel_err':>8} {'step ms':>9} {'peak GiB':>9} {'check':>5}")
    rows = run_avalanche(args, device) if mode == "avalanche" else run_plain(args, device)

    def median_ms(experience: int) -> float:
        # The first step of each experience pays for warm-up (autotuning, allocator growth).
        times = [row.step_ms for row in rows if row.experience == experience][1:]
        return statistics.median(times) if times else float("nan")

    peaks = [row.peak_gib for row in rows if row.peak_gib is not None]
    summary = {
        "mode": mode,
        "median_step_ms_no_teacher": median_ms(0),
        "median_step_ms_streamkl": median_ms(1),
        "peak_gib_no_teacher": max((r.peak_gib for r in rows if r.experience == 0 and r.peak_gib), default=None),
        "peak_gib_streamkl": max((r.peak_gib for r in rows if r.experience == 1 and r.peak_gib), default=None),
        "max_rel_err": max((r.rel_err for r in rows if r.rel_err is not None), default=None),
        "positive_penalty_after_first_step": all(r.penalty > 0 for r in rows if r.experience == 1 and r.iteration > 0),
        "all_checks_passed": all(r.passed for r in rows),
    }
    ratio = summary["median_step_ms_streamkl"] / summary["median_step_ms_no_teacher"]
    print(
        f"# median step: {summary['median_step_ms_no_teacher']:.1f} ms without teacher, "
        f"{summary['median_step_ms_streamkl']:.1f} ms with StreamKL ({ratio:.2f}x); "
        f"peak {max(peaks) if peaks else float('nan'):.2f} GiB; max rel err {summary['max_rel_err']}; "
        f"{'PASS' if summary['all_checks_passed'] and summary['positive_penalty_after_first_step'] else 'FAIL'}"
    )
    if args.json is not None:
        write_json(args.json, {"header": header(args, device, mode), "rows": [asdict(r) for r in rows],
                               "summary": summary})
    return 0 if summary["all_checks_passed"] and summary["positive_penalty_after_first_step"] else 1


if __name__ == "__main__":
    sys.exit(main())
