"""How fast do the efficacy study's units run on one GPU? Kernel time per step, and units per minute.

Three measurements on a regime of the study (default ``long``: cluttered MNIST, 1025 tokens,
batch 32, bf16 autocast, the 4-block 64-wide ViT with early convolutions):

- ``step``: one process trains the regime's model on one fixed batch; per training step
  (forward, cross-entropy, backward, Adam) the wall time and the summed GPU kernel time
  (``torch.profiler``), eager, with ``--compile-layers`` (layer norms and MLPs compiled), with
  ``--compile-model`` (the whole ViT compiled, Q/K recorded for capture) and the whole model
  through a plain ``torch.compile`` (what compiling everything reaches without Q/K capture).
  ``--penalties streamkl pad`` also times the step with the study's attention distillation
  (the plugin's teacher forward, capture and penalty, alpha 1, every block; PAD the published
  asymmetric variant, streamed): what each adds to a step, and the kernels that take the most
  time in each (kept in the report); the ``steady`` part takes the same penalties.
- ``steady``: P processes train the same way at once, timed only after every one has warmed
  up (compiled): the wall time per step of all processes together, the steady-state rate of
  the study's workers, which the ``units`` part mixes with each process's compile time.
- ``units``: P processes at once, each training one tuning unit of the study (LwF, EWC,
  PAD, StreamKL in turn, task scenario) shortened to ``--epochs`` epochs per experience:
  units per minute (also as if every experience ran at the rate of the third and later, whose
  graphs are compiled by then), and each unit's training and CPU seconds (a process waiting for the GPU
  spins, so CPU seconds near the training seconds do not mean the host is the limit; compare
  ``steady`` at one process and at P). With NVIDIA's MPS daemon running
  (``nvidia-cuda-mps-control -d``), kernels of different processes run side by side.

The table's ``step wall (ms)`` is, for ``steady`` rows, the wall time per step of all P
processes together: a GPU that is the limit shows it near the kernel time of one step.

Run from the repository root::

    PYTHONPATH=. python benchmarks/efficacy_throughput.py --device cuda --parts step units --processes 14 \\
        --epochs 6 --variants eager compile-model --json benchmarks/results/study-throughput.json
    PYTHONPATH=. python benchmarks/efficacy_throughput.py --device cuda --parts step --variants eager compile-model \
        --penalties none streamkl pad --json benchmarks/results/study-step-penalties.json
    PYTHONPATH=. python benchmarks/efficacy_throughput.py --tiny --device cpu   # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from cl_streamkl.experiment.study.plan import experience_weights, load_plan, tuning_units
from cl_streamkl.experiment.study.units import load_data, run_unit

STUDIES = Path(__file__).resolve().parent / "studies"
# The study plans whose units this measures, by regime (benchmarks/studies/efficacy-<regime>.yaml).
REGIMES = ("short", "long", "long4097")


def study_plan(regime: str) -> dict[str, Any]:
    """The project's study plan of ``regime``."""
    return load_plan(STUDIES / f"efficacy-{regime}.yaml")
from _harness.measure import gpu_kernel_times_us, sync
from _harness.options import add_run_flags, checked_device
from _harness.report import describe_environment, table_header, write_json

PARTS = ("step", "steady", "units")
WARM_STEPS = 3  # the compiled variants compile in the first step
STEP_VARIANTS = ("eager", "compile-layers", "compile-model", "whole model compiled")
# The variants a study unit can run as (the study command's flags), and what each sets.
UNIT_VARIANTS = {"eager": {}, "compile-layers": {"compile_layers": True}, "compile-model": {"compile_model": True}}
# Attention distillation a step can carry (``--penalties``): none, or a plugin of the study's.
PENALTIES = ("none", "streamkl", "pad")
TOP_KERNELS = 15  # the kernels a step's record keeps, by time
# A smoke run: the short regime's data at 8 px, a 1-block 16-wide model, one epoch.
TINY = {"dataset": "digits", "image_size": 8, "patch_size": 4, "stem": "patch", "batch_size": 16, "amp": "none",
        "model_kwargs": {"depth": 1, "embed_dim": 16, "num_heads": 2}}


def _model(settings: dict[str, Any], device: torch.device) -> torch.nn.Module:
    from cl_streamkl.experiment.config import DEFAULT_MODEL, DEFAULT_MODEL_KWARGS
    from cl_streamkl.experiment.model import build_model

    torch.manual_seed(0)
    return build_model(DEFAULT_MODEL, image_size=settings["image_size"], patch_size=settings["patch_size"],
                       in_chans=1, num_classes=10, model_kwargs=settings.get("model_kwargs", DEFAULT_MODEL_KWARGS),
                       stem=settings.get("stem", "patch")).to(device)


def _plugin(penalty: str) -> Any:
    """The study's distillation plugin for ``penalty`` (see :data:`PENALTIES`); for ``none``
    Avalanche's base plugin, whose hooks do nothing."""
    from avalanche.core import SupervisedPlugin

    from cl_streamkl.strategies import PADPlugin, StreamKLPlugin

    if penalty == "none":
        return SupervisedPlugin()
    return StreamKLPlugin(alpha=1.0) if penalty == "streamkl" else PADPlugin(alpha=1.0, variant=study_plan("long")["pad_variant"])


def _training_step(settings: dict[str, Any], variant: str, device: torch.device,
                   penalty: str = "none") -> Callable[[], None]:
    """One training step (forward, cross-entropy, backward, Adam) of ``variant`` on a fixed batch,
    with ``penalty``'s plugin called where the study's template calls it (teacher and forward under
    autocast, the penalty added before backward) against a snapshot of the model as teacher."""
    from cl_streamkl.capture import compile_model
    from cl_streamkl.experiment.compiled_layers import compile_layers
    from cl_streamkl.experiment.template import autocast

    model = _model(settings, device)
    if variant == "compile-layers":
        compile_layers(model)
    elif variant == "compile-model":
        compile_model(model)
    forward: Callable[[torch.Tensor], torch.Tensor] = torch.compile(model) if variant.startswith("whole") else model
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    size = settings["image_size"]
    images = torch.randn(settings["batch_size"], 1, size, size, device=device)
    labels = torch.randint(0, 10, (settings["batch_size"],), device=device)
    plugin = _plugin(penalty)
    strategy = SimpleNamespace(model=model, mb_x=images, loss=None)
    plugin.before_training(strategy)
    plugin.after_training_exp(strategy)  # the teacher: a frozen snapshot, as after an experience

    def step() -> None:
        with autocast(device, settings["amp"]):
            plugin.before_forward(strategy)
            logits = forward(images)
        plugin.after_forward(strategy)
        strategy.loss = F.cross_entropy(logits, labels)
        plugin.before_backward(strategy)
        strategy.loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def step_times(settings: dict[str, Any], variant: str, device: torch.device, steps: int,
               penalty: str = "none") -> dict[str, Any]:
    """Wall and GPU kernel milliseconds per training step of one variant (see :data:`STEP_VARIANTS`)
    with ``penalty``, and (CUDA) the :data:`TOP_KERNELS` kernels with the most time, microseconds per step.

    The kernel times are None off CUDA.
    """
    step = _training_step(settings, variant, device, penalty)
    start = time.perf_counter()
    for _ in range(WARM_STEPS):  # compiles here
        step()
    sync(device)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    wall_ms = 1e3 * (time.perf_counter() - start) / steps
    kernels = gpu_kernel_times_us(step) if device.type == "cuda" else None
    top = None if kernels is None else dict(sorted(kernels.items(), key=lambda item: -item[1])[:TOP_KERNELS])
    return {"penalty": penalty, "wall_ms": wall_ms, "kernel_ms": None if kernels is None else sum(kernels.values()) / 1e3,
            "first_steps_s": first_s, "top_kernels_us": top}


def _steady_steps(settings: dict[str, Any], variant: str, device: str, steps: int, ready: Any,
                  penalty: str) -> tuple[float, float]:
    """One process of :func:`concurrent_steps`: warm up (compile), wait for all, time ``steps`` steps."""
    torch.set_num_threads(1)
    step = _training_step(settings, variant, torch.device(device), penalty)
    for _ in range(WARM_STEPS):
        step()
    sync(torch.device(device))
    ready.wait()  # every process compiled: what follows is the steady state only
    start = time.time()
    for _ in range(steps):
        step()
    sync(torch.device(device))
    return start, time.time()


def concurrent_steps(settings: dict[str, Any], variant: str, processes: int, steps: int, device: str,
                     penalty: str = "none") -> dict[str, Any]:
    """``processes`` processes training at once after all have warmed up: the steady state of the study's
    workers without their compile time. ``wall_ms`` is the wall time per step of all processes together."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        ready = manager.Barrier(processes)
        spans = list(pool.map(_steady_steps, [settings] * processes, [variant] * processes, [device] * processes,
                              [steps] * processes, [ready] * processes, [penalty] * processes))
    wall_s = max(end for _, end in spans) - min(start for start, _ in spans)
    return {"processes": processes, "penalty": penalty, "steps": steps, "wall_ms": 1e3 * wall_s / (processes * steps)}


def _one_unit(index: int, regime: str, settings: dict[str, Any], epochs: int, device: str,
              variant: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    # The 1025-token plan's task tuning units, with the parent's settings and epochs.
    plan = {**study_plan("long"), "settings": {**settings, "epochs": epochs}}
    units = tuning_units(plan, "task")
    unit = units[(8 * index) % len(units)]  # LwF, EWC, PAD, StreamKL in turn
    load_data(unit, plan)
    start, cpu = time.perf_counter(), time.process_time()
    record = run_unit(unit, plan, device, tempfile.mkdtemp(), None, execution=UNIT_VARIANTS[variant])
    weights = experience_weights(unit, plan)
    # From the third experience on: the training, evaluation and teacher graphs are compiled by then.
    later = [(weights[number - 1], seconds) for number, seconds in record["experience_s"] if number >= 3]
    steady_s = sum(weights) * sum(s for _, s in later) / sum(w for w, _ in later)
    return {"strategy": unit.strategy, "train_s": record["wall_time_s"], "unit_s": time.perf_counter() - start,
            "steady_unit_s": steady_s, "cpu_s": time.process_time() - cpu, "experience_s": record["experience_s"]}


def units_per_minute(regime: str, settings: dict[str, Any], processes: int, epochs: int, device: str,
                     variant: str) -> dict[str, Any]:
    """``processes`` units at once, one per process; units per minute over the slowest unit's time."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        results = list(pool.map(_one_unit, range(processes), [regime] * processes, [settings] * processes,
                                [epochs] * processes, [device] * processes, [variant] * processes))
    slowest = max(result["unit_s"] for result in results)
    return {"processes": processes, "units_per_min": 60 * processes / slowest,
            "steady_units_per_min": 60 * processes / max(result["steady_unit_s"] for result in results),
            "train_s": sum(r["train_s"] for r in results) / processes,
            "cpu_s": sum(r["cpu_s"] for r in results) / processes, "units": results}


def _label(variant: str, penalty: str) -> str:
    """``compile-model``, or ``compile-model + streamkl`` for a step that distils."""
    return variant if penalty == "none" else f"{variant} + {penalty}"


def _measured(part: str, variant: str, processes: int, measure: Callable[[], dict[str, Any]],
              penalty: str = "none") -> dict[str, Any]:
    """One measurement's run record; a failure is recorded and reported, and the others go on."""
    try:
        result = measure()
    except Exception as err:  # a variant that fails to compile must not cost a GPU call the other numbers
        print(f"{part} {_label(variant, penalty)} with {processes} process(es) failed: {type(err).__name__}: {err}", file=sys.stderr)
        return {"part": part, "variant": variant, "penalty": penalty, "processes": processes,
                "error": f"{type(err).__name__}: {err}"}
    return {"part": part, "variant": variant, "processes": processes, **result}


def _row(run: dict[str, Any]) -> list[Any]:
    """The table row of one measurement (see ``columns`` in :func:`main`)."""
    if run["part"] == "units":
        return ["units", run["variant"], run["processes"], None, None, run["units_per_min"],
                run["steady_units_per_min"], run["cpu_s"] / run["train_s"]]
    return [run["part"], _label(run["variant"], run.get("penalty", "none")), run["processes"], run["wall_ms"],
            run.get("kernel_ms"), None, None, None]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime", choices=REGIMES, default="long")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--steps", type=int, default=40,
                        help="timed steps per variant and per process (default: %(default)s)")
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 14],
                        help="units at once, one per process (default: 1 14)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per experience of each unit (default: 1)")
    parser.add_argument("--variants", nargs="+", choices=STEP_VARIANTS, default=list(STEP_VARIANTS),
                        help="what to measure (units: all but the plain whole-model compile; default: all)")
    parser.add_argument("--penalties", nargs="+", choices=PENALTIES, default=["none"],
                        help="step and steady parts: also with the study's attention distillation (default: none)")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 8-px digits, a 1-block 16-wide model")
    add_run_flags(parser)
    args = parser.parse_args(argv)
    args.device = checked_device(parser, args.device, "--tiny --device cpu")
    for name in ("steps", "epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if min(args.processes) < 1:
        parser.error("--processes must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = {**study_plan("short")["settings"], **TINY} if args.tiny else dict(study_plan(args.regime)["settings"])
    environment = describe_environment(args.device, args.commit)
    # As in the study: many processes compile at once, one compile process each.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    runs = []
    if "step" in args.parts:
        for variant in args.variants:
            for penalty in args.penalties:
                runs.append(_measured("step", variant, 1, functools.partial(
                    step_times, settings, variant, args.device, args.steps, penalty), penalty))
    if "steady" in args.parts:
        for variant in args.variants:
            for penalty in args.penalties:
                for processes in args.processes:
                    runs.append(_measured("steady", variant, processes, functools.partial(
                        concurrent_steps, settings, variant, processes, args.steps, args.device.type, penalty),
                        penalty))
    if "units" in args.parts:
        for variant in [variant for variant in args.variants if variant in UNIT_VARIANTS]:
            for processes in args.processes:
                runs.append(_measured("units", variant, processes, functools.partial(
                    units_per_minute, args.regime, settings, processes, args.epochs, args.device.type, variant)))
    rows = [_row(run) for run in runs if "error" not in run]
    columns = [{"name": "measure"}, {"name": "variant"}, {"name": "processes", "align": "right", "format": "d"},
               {"name": "step wall (ms)", "align": "right", "format": ".2f"},
               {"name": "step kernels (ms)", "align": "right", "format": ".2f"},
               {"name": "units / min", "align": "right", "format": ".1f"},
               {"name": "units / min from exp. 3", "align": "right", "format": ".1f"},
               {"name": "CPU s / training s", "align": "right", "format": ".2f"}]
    for row in rows:
        print(" | ".join("-" if cell is None else f"{cell:.2f}" if isinstance(cell, float) else str(cell)
                         for cell in row))
    if args.json:
        regime = "tiny smoke run" if args.tiny else f"{args.regime} regime"
        write_json(args.json, {"title": f"Efficacy study throughput, {regime}, {args.epochs}-epoch units",
                               **table_header(environment), "settings": settings, "columns": columns,
                               "rows": rows, "runs": runs})
    return 1 if any("error" in run for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
