"""Running the efficacy study's units: one unit in a worker process, a pool of them under a deadline.

A unit (:class:`~_harness.efficacy_plan.Unit`) trains through the experiment runner into
``root/runs/<name>`` and, when finished, writes its record to ``root/units/<name>.json``
(atomically) and drops its checkpoints. A deadline ends a start cleanly: see
:data:`_seconds_per_weight`.
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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from _harness.efficacy_plan import Unit, experience_weights
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.files import write_atomically

# Seconds per unit of experience weight (:func:`experience_weights`: one pass over all
# classes' data) this worker has measured at most per rate key (:func:`rate_key`: a unit's
# first experience, or its later ones, per kind of unit) in its own experiences; a unit starting
# also reads the finished units' rates from disk (:func:`known_rates`), so a worker knows what
# the others finished since the start began. A running unit stops after an experience when the
# next would pass the deadline, so a time-limited start ends between experiences, every one of
# them checkpointed. Per kind, because kinds differ two-fold (a domain StreamKL unit against a
# task LwF one): one rate for all would let a start's last minutes, which fit a cheap unit, go
# unused. First experiences apart, because they have no earlier model: no teacher, no penalty,
# no replayed images; at 1025 tokens an LwF unit's first experience took as long as naive's per
# image and its later ones seven times naive's later ones (medians; its teacher forwards run in
# float32). A key not measured yet is judged by a guess (:func:`estimate`) that its first
# measured experience replaces.
_seconds_per_weight: dict[tuple[str, str, str], float] = {}
# The strategy part of the rate key of every unit's first experience.
FIRST = "first experience"
_splits_cache: dict[str, Any] = {}


class _OutOfTime(Exception):
    """Raised after a checkpointed experience when the next one would pass the deadline."""


def _progress_path(root: str, unit: Unit) -> Path:
    """How many experiences an unfinished unit has checkpointed, beside its run folder (archived with it)."""
    return Path(root) / "runs" / f"{unit.name}.trained"


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


def _trained(root: str, unit: Unit) -> int:
    """How many experiences ``unit`` has checkpointed under ``root`` (0: none, or its run folder is gone)."""
    progress = _progress_path(root, unit)
    return int(progress.read_text()) if (Path(root) / "runs" / unit.name).exists() and progress.is_file() else 0


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
    rates = known_rates(root, plan)
    guessed = {key for key in keys if key not in rates}  # until this unit measures them
    left = [estimate(key, rates, reference) * weight for key, weight in zip(keys[trained:], weights[trained:])]
    if deadline is not None and not may_start(left, deadline, start_seconds is not None):
        if start_seconds is not None and left[0] > start_seconds:
            basis = " (guessed: no unit has measured it)" if keys[trained] in guessed else ""
            print(f"efficacy.py: unit {unit.name}: its next experience needs about {left[0]:.0f} s"
                  f"{basis}, more than a whole start ({start_seconds:.0f} s); it cannot run under this --time-limit",
                  file=sys.stderr, flush=True)
        return None
    if (max_unfinished is not None and deadline is not None and start_seconds is not None and not trained
            and not _claim(root, unit, max_unfinished, time.time() + sum(left) <= deadline)):
        return None
    config = ExperimentConfig.from_dict({**unit.config_fields(plan), "device": device, "out": str(out),
                                         "compile_layers": bool(execution.get("compile_layers")),
                                         "compile_model": bool(execution.get("compile_model"))}).resolved()
    splits = load_data(unit, plan, config)
    start = last = time.perf_counter()
    seconds: list[list[float]] = []  # [experience number, seconds] of those trained in this start

    def after_experience(trained: int, count: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if count == len(weights):
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
        if (deadline is not None and trained < count
                and time.time() + estimate(keys[trained], rates, reference) * weights[trained] > deadline):
            raise _OutOfTime

    try:
        result = run_experiment(config, out, resume=out.exists(), show_progress=False, splits=splits,
                                after_experience=after_experience)[0]
    except _OutOfTime:
        return None
    payload = {"unit": dataclasses.asdict(unit), **result.to_dict(), "process_s": time.perf_counter() - start,
               "experience_s": seconds, "execution": _with_check(execution)}
    # Atomically: a start killed at its time limit leaves no half-written record.
    write_atomically(record, lambda handle: handle.write((json.dumps(payload) + "\n").encode()))
    shutil.rmtree(out, ignore_errors=True)  # its checkpoint is no longer needed
    progress.unlink(missing_ok=True)
    _begun_path(root, unit).unlink(missing_ok=True)
    return payload


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


def finished_records(root: Path) -> dict[str, dict[str, Any]]:
    """Every finished unit's record under ``root/units``, by unit name."""
    return {path.stem: json.loads(path.read_text()) for path in sorted((root / "units").glob("*.json"))}


def unit_kind(unit: Unit) -> tuple[str, str, str]:
    """What a unit's cost depends on besides its data: (scenario, replay arm, strategy)."""
    return unit.scenario, unit.arm, unit.strategy


def rate_key(unit: Unit, index: int) -> tuple[str, str, str]:
    """What experience ``index`` (from 0) of ``unit`` costs like: its :func:`unit_kind` after the
    first; the first, with no earlier model, like every first experience of its scenario and arm."""
    return (unit.scenario, unit.arm, FIRST) if index == 0 else unit_kind(unit)


def seconds_per_weight_of(records: Iterable[dict[str, Any]], plan: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """Per :func:`rate_key`, the most seconds per unit of experience weight a finished unit of ``plan`` took.

    From each record's experience times (``experience_s``: those of the start that finished it,
    the first one compiling); a record without them counts its whole time at one rate for all
    its experiences.
    """
    rates: dict[tuple[str, str, str], float] = {}
    for record in records:
        unit = Unit.from_record(record["unit"])
        if unit.scenario not in plan["scenarios"]:
            continue
        weights = experience_weights(unit, plan)
        timed = record.get("experience_s") or [[number + 1, record["wall_time_s"] * weight / sum(weights)]
                                               for number, weight in enumerate(weights)]
        spent: dict[tuple[str, str, str], list[float]] = {}
        for number, seconds in timed:
            totals = spent.setdefault(rate_key(unit, number - 1), [0.0, 0.0])
            totals[0], totals[1] = totals[0] + seconds, totals[1] + weights[number - 1]
        for key, (seconds, weight) in spent.items():
            rates[key] = max(seconds / weight, rates.get(key, 0.0))
    return rates


def known_rates(root: str, plan: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """Per :func:`rate_key`, the most seconds per weight that a finished unit under ``root``
    took or that this worker measured in one experience."""
    rates = seconds_per_weight_of(finished_records(Path(root)).values(), plan)
    for key, rate in _seconds_per_weight.items():
        rates[key] = max(rate, rates.get(key, 0.0))
    return rates


def reference_rates(report: dict[str, Any] | None) -> dict[tuple[str, str, str], float]:
    """:func:`seconds_per_weight_of` the test part of another regime's report (how the costly
    regimes' units run); empty without one, or without records."""
    if report is None or "plan" not in report:
        return {}
    return seconds_per_weight_of([record for record in report.get("records", {}).values()
                                  if record["unit"]["part"] == "test"], report["plan"])


def estimate(key: tuple[str, str, str], rates: dict[tuple[str, str, str], float],
             reference: dict[tuple[str, str, str], float] | None = None) -> float:
    """Seconds per weight of experiences of :func:`rate_key` ``key``: its rate; else a guess from
    the keys of its scenario that have one, first experiences from first experiences if any
    (kinds differ less within a scenario than across: at 1025 tokens a domain EWC unit took
    twice a class one), else from any key (0 when nothing was measured).

    Of those keys, the ones whose strategies share the most components with ``key``'s
    (``lwf`` for ``lwf+pad``) serve, when any shares one. The guess scales each serving key's
    rate by how much slower ``key`` was than it in ``reference`` (another regime's rates,
    :func:`reference_rates`) and takes the largest; with no reference for the pair, the slowest
    serving key's rate. Why the scaling: at 4097 tokens only the naive units had finished when
    the teacher-bearing kinds began, and naive's rate guessed them at a fraction of what they
    take. Why the nearest kinds: a ratio to naive carries every cost a kind shares with its
    components, also one that changed between the regimes: LwF's penalty ran in float32 at 1025
    tokens and in bf16 at 4097, where ``lwf`` took 2.4 times naive's time a weight, yet
    ``lwf+pad`` was guessed from naive at 8 times (from ``lwf``, 1.03 times ``lwf``'s).
    """
    if key in rates:
        return rates[key]
    scenario = {other: rate for other, rate in rates.items() if other[0] == key[0]} or rates
    alike = {other: rate for other, rate in scenario.items() if (other[2] == FIRST) == (key[2] == FIRST)} or scenario
    shared = {other: len(_components(other) & _components(key)) for other in alike}
    nearest = {other: rate for other, rate in alike.items() if shared[other] == max(shared.values())}
    reference = reference or {}
    return max((rate * reference[key] / reference[other] if reference.get(key) and reference.get(other) else rate
                for other, rate in nearest.items()), default=0.0)


def _components(key: tuple[str, str, str]) -> set[str]:
    """The strategy components of a :func:`rate_key` (none for a first experience)."""
    return set() if key[2] == FIRST else set(key[2].split("+"))


def seconds_left(units: Iterable[Unit], plan: dict[str, Any], root: Path,
                 reference: dict[tuple[str, str, str], float] | None = None) -> tuple[int, float | None]:
    """How many of ``units`` are unfinished, and the seconds of one worker they still need at the
    slowest rates finished units took, keys not measured yet guessed (:func:`estimate` with
    ``reference``; checkpointed experiences count as done); None when no unit of ``plan`` has
    finished, so there is no rate to go by."""
    records = finished_records(root)
    rates = seconds_per_weight_of(records.values(), plan)
    left = [unit for unit in units if unit.name not in records]
    if not rates:
        return len(left), None
    total = 0.0
    for unit in left:
        weights = experience_weights(unit, plan)
        total += sum(estimate(rate_key(unit, index), rates, reference) * weights[index]
                     for index in range(_trained(str(root), unit), len(weights)))
    return len(left), total


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
              deadline: float | None, hard_deadline: float | None = None) -> Outcome:
    """Run ``units``; returns what became of them (:class:`Outcome`).

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
    try:
        for future in concurrent.futures.as_completed(futures, timeout=waiting):
            unit = futures[future]
            try:
                record = future.result()
            except Exception as err:
                failed += 1
                detail = "".join(traceback.format_exception(err)).rstrip()
                print(f"efficacy.py: unit {unit.name} failed: {type(err).__name__}: {err}\n{detail}",
                      file=sys.stderr, flush=True)
                continue
            if record is None:
                stopped += 1
                continue
            done.add(unit)
            last = record["accuracy_matrix"][-1]
            print(f"[{len(done)}/{len(units)}] {unit.name}: mean experience accuracy "
                  f"{100 * sum(last) / len(last):.1f} % ({record['process_s']:.0f} s)", flush=True)
    except concurrent.futures.TimeoutError:
        cut = sum(not future.done() for future in futures)
        pool.shutdown(wait=False, cancel_futures=True)
        _kill_workers()
        stopped += cut
        print(f"efficacy.py: --hard-limit reached: {cut} units stopped or never started (those training lose "
              "the experience they were in and resume from their checkpoints)", file=sys.stderr, flush=True)
    experiences = sum((len(experience_weights(unit, plan)) if unit in done else _trained(str(args.out), unit))
                      - trained for unit, trained in before.items())
    return Outcome(len(done), stopped, failed, experiences)


def _kill_workers() -> None:
    """Kill this process's child processes (the pool's workers), waiting up to 10 s for them."""
    children = multiprocessing.active_children()
    for child in children:
        child.kill()  # not terminate(): a process inside a CUDA call may not act on SIGTERM soon
    for child in children:
        child.join(10)
