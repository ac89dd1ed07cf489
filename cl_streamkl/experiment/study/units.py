"""Running a study's units: one unit in a worker process, a pool of them under a deadline.

A unit (:class:`~cl_streamkl.experiment.study.plan.Unit`) trains through the experiment runner
into ``root/runs/<name>`` and, when finished, writes its record to ``root/units/<name>.json``
(atomically) and drops its checkpoints. A ``first`` unit (plans with a shared first experience)
trains one seed's first experience and keeps its checkpoint as ``root/first/<name>.pt``, which
every test unit of that seed starts from. A deadline ends a start cleanly: see
:data:`~cl_streamkl.experiment.study.rates._seconds_per_weight`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import fcntl
import json
import multiprocessing
import os
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.files import write_atomically
from cl_streamkl.experiment.study.plan import Unit, experience_weights, first_unit, shares_first_experience

from cl_streamkl.experiment.study.rates import (
    _progress_path, _seconds_per_weight, _trained, estimate, known_rates, rate_key,
)

_splits_cache: dict[str, Any] = {}


class _OutOfTime(Exception):
    """Raised after a checkpointed experience when the next one would pass the deadline."""


class _FirstDone(Exception):
    """Raised after a ``first`` unit's experience: the shared first experience is trained."""


def first_path(root: str, unit: Unit) -> Path:
    """Where a ``first`` unit keeps the checkpoint its seed's test units start from."""
    return Path(root) / "first" / f"{unit.name}.pt"


def _unit_config(unit: Unit, plan: dict[str, Any], device: str, out: Path,
                 execution: dict[str, Any]) -> ExperimentConfig:
    return ExperimentConfig.from_dict({**unit.config_fields(plan), "device": device, "out": str(out),
                                       "compile_layers": bool(execution.get("compile_layers")),
                                       "compile_model": bool(execution.get("compile_model"))}).resolved()


def shared_first_experience(unit: Unit, plan: dict[str, Any], device: str, root: str,
                            execution: dict[str, Any]) -> dict[str, Any] | None:
    """The verified checkpoint a test unit of a plan with a shared first experience starts
    from; None where the plan trains first experiences per unit.

    Raises:
        FileNotFoundError: the seed's ``first`` unit has not finished.
        CheckpointError: its checkpoint is damaged or of another configuration.
    """
    if unit.part != "test" or not shares_first_experience(plan):
        return None
    from cl_streamkl.experiment.checkpoint import RunIdentity, load_checkpoint

    first = first_unit(unit)
    path = first_path(root, first)
    if not path.is_file():
        raise FileNotFoundError(f"unit {unit.name} starts from {first.name}, which has not finished")
    config = _unit_config(first, plan, device, path.parent, execution)
    return load_checkpoint(path, RunIdentity(first.strategy, first.seed, config.fingerprint_json()))


def _begun_path(root: str, unit: Unit) -> Path:
    """Marks a unit begun and not finished, beside its run folder (archived with it)."""
    return Path(root) / "runs" / f"{unit.name}.begun"


def _unfinished(root: str) -> int:
    """How many units under ``root`` have begun (a marker or checkpoints) and not finished (a
    marker whose record exists is stale)."""
    runs, units = Path(root) / "runs", Path(root) / "units"
    names = {path.stem for pattern in ("*.begun", "*.trained") for path in runs.glob(pattern)}
    return sum(not (units / f"{name}.json").is_file() for name in names)


def _claim(root: str, unit: Unit, cap: int, finishes: bool) -> bool:
    """Mark ``unit`` begun unless ``cap`` units are begun and unfinished already and it would not
    finish in this start; whether it may go on. Under a file lock, so workers claim one at a time."""
    marker = _begun_path(root, unit)
    if marker.is_file():
        return True
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(Path(root) / "runs" / ".claims.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not finishes and _unfinished(root) >= cap:
            return False
        marker.touch()
    return True


def may_start(left: Sequence[float], deadline: float, resumable: bool) -> bool:
    """Whether a unit starts now, given the seconds each experience it has ``left`` should take.

    Yes when all that is left would end before ``deadline``; or, when a later start will find
    its checkpoints (``resumable``: not ``--last-start``), when its next experience would.
    """
    now = time.time()
    if now + sum(left) <= deadline:
        return True
    return resumable and bool(left) and now + left[0] <= deadline


def init_worker(threads: int, gpus: int, counter: Any) -> None:
    import warnings

    with counter.get_lock():
        index = counter.value
        counter.value += 1
    if gpus > 1:
        # Before CUDA is initialised: worker i drives GPU i mod gpus.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
    import torch

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")


def load_data(unit: Unit, plan: dict[str, Any], config: Any = None) -> Any:
    """The regime's data, checked and loaded (or generated and cached) once per process.

    Args:
        unit, plan: a unit of the plan (its regime's data serves every unit).
        config: the unit's resolved configuration (default: built here, on the CPU).
    """
    from cl_streamkl.experiment.preflight import check_experiment

    key = json.dumps(plan["settings"], sort_keys=True)
    if key not in _splits_cache:
        _splits_cache[key] = check_experiment(
            config or ExperimentConfig.from_dict({**unit.config_fields(plan), "device": "cpu"}).resolved())
    return _splits_cache[key]


def run_unit(unit: Unit, plan: dict[str, Any], device: str, root: str, deadline: float | None,
             execution: dict[str, Any] | None = None, start_seconds: float | None = None,
             reference: dict[tuple[str, str, str], float] | None = None,
             max_unfinished: int | None = None) -> dict[str, Any] | None:
    """Train one unit and return its record (read back when done); None when stopped by the deadline.

    Each experience is judged, when the unit starts and after each experience, by its
    :func:`rate_key`'s rate among :func:`known_rates` (the finished units under ``root`` and this
    worker's own experiences), or else by :func:`estimate`'s guess from them and ``reference``
    (another regime's rates), which the unit's first experience of that key replaces.
    ``start_seconds``: how long a whole start lasts (``--time-limit``), None for the last start:
    then a unit starts only if it would finish (see :func:`may_start`). ``max_unfinished``
    (``--max-unfinished``): with ``start_seconds``, a unit not begun yet that would not finish
    in this start begins only while fewer units than that are begun and unfinished (their
    checkpoints are what ``--archive`` carries).
    ``execution``: how this start runs units, recorded with each (``commit``, ``device``, and
    ``compile_layers``, ``compile_model``: configuration that changes rounding only, so not part
    of the plan). The record's ``experience_s`` holds [experience number, seconds] of each
    experience trained by the start that finished the unit (its first one also compiles).
    """
    from cl_streamkl.experiment.runner import run_experiment

    execution = execution or {}
    record = Path(root) / "units" / f"{unit.name}.json"
    if record.is_file():
        return json.loads(record.read_text())
    weights = experience_weights(unit, plan)
    keys = [rate_key(unit, index) for index in range(len(weights))]
    out, progress = Path(root) / "runs" / unit.name, _progress_path(root, unit)
    trained = _trained(root, unit)
    done_before = max(trained, _shared_experiences(unit, plan))
    rates = known_rates(root, plan)
    guessed = {key for key in keys if key not in rates}  # until this unit measures them
    left = [estimate(key, rates, reference) * weight
            for key, weight in zip(keys[done_before:], weights[done_before:])]
    if deadline is not None and not may_start(left, deadline, start_seconds is not None):
        if start_seconds is not None and left[0] > start_seconds:
            basis = " (guessed: no unit has measured it)" if keys[done_before] in guessed else ""
            print(f"cl-streamkl study: unit {unit.name}: its next experience needs about {left[0]:.0f} s"
                  f"{basis}, more than a whole start ({start_seconds:.0f} s); it cannot run under this --time-limit",
                  file=sys.stderr, flush=True)
        return None
    if (max_unfinished is not None and deadline is not None and start_seconds is not None and not trained
            and not _claim(root, unit, max_unfinished, time.time() + sum(left) <= deadline)):
        return None
    config = _unit_config(unit, plan, device, out, execution)
    # A test unit of a plan with a shared first experience starts from its seed's (if it has
    # no checkpoint of its own yet); its first experience is then not trained here.
    shared = None if trained else shared_first_experience(unit, plan, device, root, execution)
    splits = load_data(unit, plan, config)
    start = last = time.perf_counter()
    seconds: list[list[float]] = []  # [experience number, seconds] of those trained in this start

    def after_experience(trained: int, count: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if unit.part == "first" or count == len(weights):
            done, key = weights[trained - 1], keys[trained - 1]
            # Atomically: --hard-limit may stop this process at any moment.
            write_atomically(progress, lambda handle: handle.write(f"{trained}\n".encode()))
        else:  # a joint run trains every experience in one step
            done, key = sum(weights), keys[0]
        seconds.append([trained, now - last])
        measured, last = (now - last) / done, now
        rates[key] = measured if key in guessed else max(rates[key], measured)
        guessed.discard(key)
        _seconds_per_weight[key] = max(_seconds_per_weight.get(key, 0.0), measured)
        if unit.part == "first":
            raise _FirstDone
        if (deadline is not None and trained < count
                and time.time() + estimate(keys[trained], rates, reference) * weights[trained] > deadline):
            raise _OutOfTime

    try:
        result = run_experiment(config, out, resume=out.exists(), show_progress=False, splits=splits,
                                after_experience=after_experience, first_experience=shared)[0]
    except _OutOfTime:
        return None
    except _FirstDone:
        result = _keep_first_experience(unit, config, out, root)
    # A first unit's matrix has one row: no metrics of a whole stream.
    outcome = dataclasses.asdict(result) if unit.part == "first" else result.to_dict()
    payload = {"unit": dataclasses.asdict(unit), **outcome, "process_s": time.perf_counter() - start,
               "experience_s": seconds, "execution": _with_check(execution)}
    # Atomically: a start killed at its time limit leaves no half-written record.
    write_atomically(record, lambda handle: handle.write((json.dumps(payload) + "\n").encode()))
    shutil.rmtree(out, ignore_errors=True)  # its checkpoint is no longer needed
    progress.unlink(missing_ok=True)
    _begun_path(root, unit).unlink(missing_ok=True)
    return payload


def _shared_experiences(unit: Unit, plan: dict[str, Any]) -> int:
    """Experiences of ``unit`` another unit trains (a shared first experience): 1 or 0."""
    return int(unit.part == "test" and shares_first_experience(plan))


def _keep_first_experience(unit: Unit, config: ExperimentConfig, out: Path, root: str) -> Any:
    """Move a ``first`` unit's checkpoint to :func:`first_path`; its result so far."""
    from cl_streamkl.experiment.checkpoint import RunIdentity, load_checkpoint
    from cl_streamkl.experiment.run_result import RunResult
    from cl_streamkl.experiment.runner import checkpoint_path

    source, target = checkpoint_path(out, unit.strategy, unit.seed), first_path(root, unit)
    state = load_checkpoint(source, RunIdentity(unit.strategy, unit.seed, config.fingerprint_json()))
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(source, target)
    return RunResult(**state["result"])


def _with_check(execution: dict[str, Any]) -> dict[str, Any]:
    """``execution`` and, for a compiled model, the largest relative Q/K difference between its
    compiled and eager forwards that this worker's first-call checks have seen."""
    if not execution.get("compile_model"):
        return execution
    from cl_streamkl.capture.compiled_model import compiled_model_checks

    return {**execution, "compiled_qk_check": compiled_model_checks()}


class InProcess(concurrent.futures.Executor):
    """``--workers 0``: every unit in this process, one after the other (tests, debugging)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as err:  # as a worker process would: the caller reads it from the future
            future.set_exception(err)
        return future


class Outcome(NamedTuple):
    """What a start did with its units."""

    finished: int
    """Units finished (their records written)."""
    unfinished: int
    """Units not started, stopped between experiences or cut by the hard deadline."""
    failed: int
    """Units that raised."""
    experiences: int
    """Experiences trained and kept (checkpointed, or in a finished unit) by this start: what a
    start that finished no unit still did."""


def run_units(units: Sequence[Unit], pool: concurrent.futures.Executor, plan: dict[str, Any], args: argparse.Namespace,
              deadline: float | None, hard_deadline: float | None = None, part: str = "") -> Outcome:
    """Run ``units``; returns what became of them (:class:`Outcome`), with a progress bar
    (``part`` names it) on stderr.

    A unit that raises is reported on stderr and the others go on: one broken run must not
    cost a time-limited machine call every other unit's work (its checkpoints stay in the
    archive). At ``hard_deadline`` (``--hard-limit``) the pool's worker processes are killed:
    the units they were training lose the experience they were in and keep their checkpoints,
    and the caller still writes its report and archive; the pool is then unusable.
    """
    # Units begun first, those with checkpoints before the others (stable: otherwise in plan
    # order): the last start finishes the work already paid for, and a unit begun holds one of
    # --max-unfinished's places until it finishes.
    before = {unit: _trained(str(args.out), unit) for unit in units}  # experiences checkpointed
    units = sorted(units, key=lambda unit: (before[unit] == 0, not _begun_path(str(args.out), unit).is_file()))
    # A unit that would not finish may begin now and go on in later starts, unless this is the last.
    start_seconds = None if args.time_limit is None or args.last_start else 60 * args.time_limit
    futures = {pool.submit(run_unit, unit, plan, args.device, str(args.out), deadline, args.execution, start_seconds,
                           args.reference, args.max_unfinished): unit for unit in units}
    stopped = failed = 0
    done: set[Unit] = set()  # finished
    waiting = None if hard_deadline is None else max(0.0, hard_deadline - time.time())
    from tqdm.auto import tqdm

    bar = tqdm(total=len(units), desc=f"{part or 'units'}", unit="unit", file=sys.stderr, disable=not units)
    try:
        for future in concurrent.futures.as_completed(futures, timeout=waiting):
            bar.update()
            unit = futures[future]
            try:
                record = future.result()
            except Exception as err:
                failed += 1
                bar.write(f"cl-streamkl study: unit {unit.name} failed: {type(err).__name__}: {err}\n"
                          f"{_failure_detail(err)}", file=sys.stderr)
                continue
            if record is None:
                stopped += 1
                continue
            done.add(unit)
            last = record["accuracy_matrix"][-1]
            bar.write(f"[{len(done)}/{len(units)}] {unit.name}: mean experience accuracy "
                      f"{100 * sum(last) / len(last):.1f} % ({record['process_s']:.0f} s)")
    except concurrent.futures.TimeoutError:
        cut = sum(not future.done() for future in futures)
        pool.shutdown(wait=False, cancel_futures=True)
        _kill_workers()
        stopped += cut
        print(f"cl-streamkl study: --hard-limit reached: {cut} units stopped or never started (those training lose "
              "the experience they were in and resume from their checkpoints)", file=sys.stderr, flush=True)
    finally:
        bar.close()
    experiences = sum((len(experience_weights(unit, plan)) if unit in done else _trained(str(args.out), unit))
                      - trained for unit, trained in before.items())
    return Outcome(len(done), stopped, failed, experiences)


def _failure_detail(err: BaseException) -> str:
    """What follows a failed unit's error line: what to do for running out of GPU memory (its
    traceback says nothing a user can act on), else the traceback."""
    if "out of memory" in str(err):
        return ("cl-streamkl study: the workers sharing its GPU together needed more memory than the GPU has; "
                "the unit goes on from its last checkpoint at the next start. Set PYTORCH_CUDA_ALLOC_CONF="
                "expandable_segments:True, or start a plan whose units have not begun with fewer --workers "
                "(a confirmatory family keeps its first unit's layout).")
    return "".join(traceback.format_exception(err)).rstrip()


def _kill_workers() -> None:
    """Kill this process's child processes (the pool's workers), waiting up to 10 s for them."""
    children = multiprocessing.active_children()
    for child in children:
        child.kill()  # not terminate(): a process inside a CUDA call may not act on SIGTERM soon
    for child in children:
        child.join(10)
