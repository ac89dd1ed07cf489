"""Calibrate cluttered MNIST: are its experiences learned, and does the sequence length matter?

For each choice of clutter (pieces per canvas) and learning-rate schedule, three trainings
of the default 4-block, 64-wide ViT with the early-convolution stem, on one seed:

- ``joint``: all 10 classes at once on the canvas (128 px, 4-px patches: 1025 tokens),
  one head; the test accuracy over the 1,000 test images;
- ``control``: the same, with the same canvases shrunk to 32 px and 8-px patches (17
  tokens), so the digit occupies a few tokens only: if the long sequence carries the
  information, this accuracy is far lower;
- ``learning``: naive fine-tuning through 5 experiences of 2 classes with one head per
  experience (task-incremental), every experience starting with fresh Adam moments and a
  fresh schedule; the learning accuracy of each experience (test accuracy right after
  training on it) and the final average.

The trainings use the library's data (:mod:`cl_streamkl.experiment.data.cluttered`), model
(:func:`~cl_streamkl.experiment.model.build_model`, ``stem="conv"``) and schedule
(:func:`~cl_streamkl.experiment.lr_schedule.lr_factor`) in a plain loop over images held on
the device (the CLI's Avalanche loop costs more per step than the model). Each training is
a task for a pool of worker processes sharing the device.

Run from the repository root::

    PYTHONPATH=. python benchmarks/cluttered_calibration.py --device cuda --workers 12 \\
        --json benchmarks/results/cluttered-calibration.json
    PYTHONPATH=. python benchmarks/cluttered_calibration.py --tiny --device cpu --workers 0   # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from _harness.options import add_run_flags, checked_device
from _harness.report import describe_environment, table_header, write_json

KINDS = ("joint", "control", "learning")
SETTINGS = {"canvas": 128, "patch_size": 4, "control_size": 32, "control_patch_size": 8, "clutter_size": 8,
            "epochs": 30, "batch_size": 32, "lr": 1e-3, "warmup_epochs": 0, "experiences": 5, "seed": 0,
            "train_images": 4000, "model_kwargs": {"depth": 4, "embed_dim": 64, "num_heads": 2}}
TINY = {"canvas": 32, "control_size": 16, "epochs": 1, "train_images": 100,
        "model_kwargs": {"depth": 1, "embed_dim": 16, "num_heads": 2}}


@dataclasses.dataclass(frozen=True)
class Unit:
    """One training: ``kind`` (one of :data:`KINDS`) on canvases with ``clutter`` pieces, under ``schedule``."""

    kind: str
    clutter: int
    schedule: str


def _images(pixels: np.ndarray, size: int, device: torch.device) -> torch.Tensor:
    """(N, S, S) uint8 canvases → (N, 1, size, size) uint8 on ``device``, shrunk as the loader does."""
    from cl_streamkl.experiment.data.images import resize_to_uint8

    images = torch.from_numpy(pixels).unsqueeze(1)
    if size != pixels.shape[-1]:
        images = resize_to_uint8(images.float() / 255.0, size)
    return images.to(device)


def _normalised(images: torch.Tensor) -> torch.Tensor:
    """uint8 images → float in [-1, 1], as :class:`~cl_streamkl.experiment.data.images.TensorImages` gives."""
    return (images.float() / 255.0 - 0.5) / 0.5


def _train(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, settings: dict[str, Any], schedule: str,
           amp: bool, head: int | None, generator: torch.Generator) -> None:
    """``settings["epochs"]`` epochs of Adam with the schedule, fresh moments; ``head``: the task's head."""
    from cl_streamkl.experiment.lr_schedule import lr_factor

    optimizer = torch.optim.Adam(model.parameters(), lr=settings["lr"])
    batch = settings["batch_size"]
    steps_per_epoch = math.ceil(len(images) / batch)
    total, warmup = settings["epochs"] * steps_per_epoch, settings["warmup_epochs"] * steps_per_epoch
    model.train()
    step = 0
    for _ in range(settings["epochs"]):
        order = torch.randperm(len(images), generator=generator).to(images.device)
        for start in range(0, len(images), batch):
            index = order[start:start + batch]
            for group in optimizer.param_groups:
                group["lr"] = settings["lr"] * lr_factor(schedule, step, total, warmup)
            with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=amp):
                inputs = _normalised(images[index])
                logits = model(inputs) if head is None else model(inputs, head)
                loss = F.cross_entropy(logits.float(), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1


@torch.no_grad()
def _accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, amp: bool, head: int | None) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(images), 500):
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=amp):
            inputs = _normalised(images[start:start + 500])
            logits = model(inputs) if head is None else model(inputs, head)
        correct += int((logits.argmax(1) == labels[start:start + 500]).sum())
    return correct / len(images)


def _experience(images: torch.Tensor, labels: torch.Tensor, classes: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The images of ``classes`` and their labels renumbered within the experience (0, 1, ...)."""
    classes = torch.as_tensor(classes, device=labels.device)
    keep = torch.isin(labels, classes)
    relabel = torch.full((10,), -1, device=labels.device)
    relabel[classes] = torch.arange(len(classes), device=labels.device)
    return images[keep], relabel[labels[keep]]


def run_unit(unit: Unit, settings: dict[str, Any], device_name: str, cache_dir: str | None) -> dict[str, Any]:
    """Train ``unit`` and measure it: ``accuracy`` (joint, control) or ``learning`` and ``final`` accuracies."""
    from cl_streamkl.experiment.data.cluttered import default_cache_dir, load_arrays
    from cl_streamkl.experiment.data.names import ClutterOptions
    from cl_streamkl.experiment.model import build_model

    start = time.perf_counter()
    device = torch.device(device_name)
    amp = device.type == "cuda"
    options = ClutterOptions(settings["canvas"], unit.clutter, settings["clutter_size"])
    arrays = load_arrays(options, 0, cache_dir or default_cache_dir())
    control = unit.kind == "control"
    size = settings["control_size"] if control else settings["canvas"]
    patch = settings["control_patch_size"] if control else settings["patch_size"]
    train = _images(arrays["train_pixels"][:settings["train_images"]], size, device)
    train_labels = torch.from_numpy(arrays["train_targets"][:settings["train_images"]]).to(device)
    test, test_labels = _images(arrays["test_pixels"], size, device), torch.from_numpy(arrays["test_targets"]).to(device)
    seed = settings["seed"]
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    task = unit.kind == "learning"
    order = np.random.default_rng(seed).permutation(10).reshape(settings["experiences"], -1)
    model = build_model("vit_tiny_patch16_224", image_size=size, patch_size=patch, in_chans=1, num_classes=10,
                        model_kwargs=settings["model_kwargs"], stem="conv",
                        head_sizes=[len(classes) for classes in order] if task else None).to(device)
    result: dict[str, Any] = {"tokens": (size // patch) ** 2 + 1}
    if not task:
        _train(model, train, train_labels, settings, unit.schedule, amp, None, generator)
        result["accuracy"] = _accuracy(model, test, test_labels, amp, None)
    else:
        learning, last_row = [], []
        for head, classes in enumerate(order):
            _train(model, *_experience(train, train_labels, classes), settings, unit.schedule, amp, head, generator)
            learning.append(_accuracy(model, *_experience(test, test_labels, classes), amp, head))
        for head, classes in enumerate(order):
            last_row.append(_accuracy(model, *_experience(test, test_labels, classes), amp, head))
        result.update(learning=learning, final=sum(last_row) / len(last_row), class_order=order.tolist())
    result["seconds"] = time.perf_counter() - start
    return result


def _unit_file(folder: Path, unit: Unit) -> Path:
    return folder / f"{unit.kind}-clutter{unit.clutter}-{unit.schedule}.json"


def _finished(unit: Unit, result: dict[str, Any], results: dict[Unit, dict[str, Any]], out: Path | None) -> None:
    """Keep ``unit``'s result (in ``out`` too, where a later start finds it) and print it."""
    results[unit] = result
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _unit_file(out, unit).write_text(json.dumps(result))
    print(f"{unit.kind} clutter {unit.clutter} {unit.schedule}: {result}", flush=True)


def table(results: dict[Unit, dict[str, Any]], clutters: Sequence[int], schedules: Sequence[str]) -> dict[str, Any]:
    """The table file's ``columns`` and ``rows`` (one row per clutter and schedule)."""
    tokens = {kind: next(r["tokens"] for u, r in results.items() if u.kind == kind) for kind in KINDS}
    columns = [
        {"name": "clutter", "align": "right", "format": "d"}, {"name": "lr schedule"},
        {"name": f"joint acc., {tokens['joint']} tok.", "align": "right", "format": ".3f"},
        {"name": f"joint acc., {tokens['control']} tok.", "align": "right", "format": ".3f"},
        {"name": "gap (pp)", "align": "right", "format": ".1f"},
        {"name": "learning acc. per experience (task-IL)", "align": "right"},
        {"name": "min learning acc.", "align": "right", "format": ".3f"},
        {"name": "naive final acc. (task-IL)", "align": "right", "format": ".3f"},
    ]
    rows = []
    for clutter in clutters:
        for schedule in schedules:
            joint, control, learning = (results[Unit(kind, clutter, schedule)] for kind in KINDS)
            rows.append([clutter, schedule, joint["accuracy"], control["accuracy"],
                         100 * (joint["accuracy"] - control["accuracy"]),
                         " / ".join(f"{a:.2f}" for a in learning["learning"]), min(learning["learning"]),
                         learning["final"]])
    return {"columns": columns, "rows": rows}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clutter", nargs="+", type=int, default=[4, 8], help="pieces per canvas to compare")
    parser.add_argument("--schedules", nargs="+", choices=("constant", "cosine"), default=["constant", "cosine"])
    parser.add_argument("--epochs", type=int, help=f"epochs per training (default: {SETTINGS['epochs']})")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 32-px canvas, 100 images, 1 epoch")
    parser.add_argument("--workers", type=int, default=12, help="worker processes; 0 trains in this process")
    parser.add_argument("--cache-dir", help="cluttered-mnist cache folder (default: the library's)")
    parser.add_argument("--out", type=Path, help="keep each training's result here; a later start skips those "
                        "found (an interrupted run resumes)")
    add_run_flags(parser, "write the table file as JSON")
    args = parser.parse_args(argv)
    args.device = checked_device(parser, args.device)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = {**SETTINGS, **(TINY if args.tiny else {})}
    if args.epochs is not None:
        settings["epochs"] = args.epochs
    units = [Unit(kind, clutter, schedule) for clutter in args.clutter for schedule in args.schedules for kind in KINDS]
    environment = describe_environment(args.device, args.commit)
    print(" | ".join(f"{key} {value}" for key, value in environment.items()))
    start = time.perf_counter()
    results = {unit: json.loads(_unit_file(args.out, unit).read_text()) for unit in units
               if args.out is not None and _unit_file(args.out, unit).is_file()}
    to_train = [unit for unit in units if unit not in results]
    if args.workers == 0:
        for unit in to_train:
            _finished(unit, run_unit(unit, settings, str(args.device), args.cache_dir), results, args.out)
    elif to_train:
        # Generate each clutter's canvases once, before the workers read them.
        from cl_streamkl.experiment.data.cluttered import default_cache_dir, load_arrays
        from cl_streamkl.experiment.data.names import ClutterOptions

        for clutter in sorted({unit.clutter for unit in to_train}):
            load_arrays(ClutterOptions(settings["canvas"], clutter, settings["clutter_size"]), 0,
                        args.cache_dir or default_cache_dir())
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context) as pool:
            futures = {pool.submit(run_unit, unit, settings, str(args.device), args.cache_dir): unit
                       for unit in to_train}
            for future in concurrent.futures.as_completed(futures):
                _finished(futures[future], future.result(), results, args.out)
    report = table(results, args.clutter, args.schedules)
    wall = time.perf_counter() - start
    for row in report["rows"]:
        print(" | ".join(str(cell) for cell in row))
    print(f"{len(to_train)} trainings in {wall:.0f} s")
    if args.json is not None:
        from importlib.metadata import version

        import timm

        write_json(args.json, {
            "title": (f"Cluttered MNIST calibration: conv stem, {settings['canvas']}-px canvas, {settings['clutter_size']}-px "
                      f"pieces, {settings['epochs']} epochs, {settings['train_images']} training images, batch "
                      f"{settings['batch_size']}, Adam {settings['lr']:g}, one seed"),
            **table_header(environment), "timm": timm.__version__, "avalanche": version("avalanche-lib"),
            "settings": settings, "wall_s": round(wall, 1),
            "units": [{**dataclasses.asdict(unit), **results[unit]} for unit in units], **report,
        })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
