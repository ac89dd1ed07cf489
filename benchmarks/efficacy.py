"""Where does attention distillation reduce forgetting? The efficacy study, in one command.

For each scenario (class-, task- and domain-incremental) the study

1. writes its plan (regime, seeds, every method's validation grid, the strategies to test)
   to ``--out/plan.json`` and to the ``--json`` report before anything runs; a later start
   with another plan stops with one line;
2. tunes every method family on the validation split with the same number of settings
   (LwF alpha and T, EWC lambda, PAD weight, StreamKL alpha, T and layers, replay's batch
   share at a fixed memory), each on at least two validation seeds (``--part tune``);
3. runs every strategy on the test seeds with each component's chosen setting
   (``--part test``), and reports per-seed values, accuracy matrices, mean ± std, and
   paired differences with raw 95 % t-intervals and Holm-adjusted p-values.

Regimes: ``short`` (32 px mnist5k, 8 px patches: 17 tokens, on a CPU), ``long`` (cluttered
MNIST on a 128 px canvas, 4 px patches: 1025 tokens, early convolutions) and ``long4097``
(256 px canvas: 4097 tokens; its decisive comparisons only, with 1025's settings
``--settings-from`` and in the scenarios ``--plan-scenarios decisive`` picks by a fixed rule).
Each (scenario, strategy, seed, setting) run is one unit for a pool of worker processes.
Finished units are kept under ``--out`` and skipped when the command starts again;
``--max-units`` and ``--time-limit`` end a start cleanly (a unit
stopped between experiences resumes from its checkpoint), ``--archive`` /
``--from-archive`` carry the folder between machines (``--max-unfinished`` bounds how many
unfinished units, and so checkpoints, it holds), and ``--from-report`` restores the finished
units from a committed report.

Run from the repository root with the package installed::

    python benchmarks/efficacy.py --regime short --device cpu --workers 2 --json benchmarks/results/efficacy-short.json
    python benchmarks/efficacy.py --regime long --part tune --scenarios task --device cuda --workers 15 \\
        --time-limit 8 --json benchmarks/results/efficacy-long.json
    python benchmarks/efficacy.py --tables benchmarks/results/efficacy-short.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import io
import json
import multiprocessing
import os
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _harness import efficacy_units
from _harness.efficacy_plan import (
    DEFAULT_SEEDS, PARTS, REGIMES, SCENARIOS, SETTINGS_PER_METHOD, TESTED, Unit, choose, fingerprint, make_plan,
    test_units, tuning_units,
)
from _harness.efficacy_report import build_report, tuning_scores
from _harness.efficacy_tables import decisive_scenarios, side_by_side
from _harness.efficacy_units import (
    InProcess, finished_records, init_worker, load_data, reference_rates, run_units, seconds_left,
)
from _harness.report import add_json_flag, write_json
from cl_streamkl.experiment.config import ExperimentConfig

# A part of an archive stays below what a machine returns per file (16 MiB).
ARCHIVE_PART_BYTES = 15 * 2**20


def check_plan(root: Path, report_path: Path | None, plan: dict[str, Any]) -> str | None:
    """Why this start may not use ``root`` or ``report_path`` (another plan's), or None."""
    stamp = fingerprint(plan)
    plan_file = root / "plan.json"
    if plan_file.is_file() and fingerprint(json.loads(plan_file.read_text())) != stamp:
        return (f"{plan_file} holds another plan (fingerprint {fingerprint(json.loads(plan_file.read_text()))}, "
                f"this start's {stamp}): the grid and seeds are fixed once a study starts; use another --out")
    if report_path is not None and report_path.is_file():
        previous = json.loads(report_path.read_text()).get("plan_fingerprint")
        if previous not in (None, stamp):
            return (f"{report_path} reports a study with plan {previous}, this start's is {stamp}: the grid and "
                    "seeds are fixed once a study starts; write another --json")
    return None


def restore_records(report: dict[str, Any], plan: dict[str, Any], root: Path) -> str | None:
    """Write the finished units' records of ``report`` under ``root/units``; why not, or None.

    Records already under ``root`` are kept; a report of another plan is refused.
    """
    if report.get("plan_fingerprint") != fingerprint(plan):
        return (f"--from-report holds plan {report.get('plan_fingerprint')}, this start's is {fingerprint(plan)}: "
                f"the same options resume it")
    units = root / "units"
    units.mkdir(parents=True, exist_ok=True)
    for name, record in report.get("records", {}).items():
        if not (units / f"{name}.json").is_file():
            (units / f"{name}.json").write_text(json.dumps(record) + "\n")
    return None


def archive_parts(path: Path) -> list[Path]:
    """An archive's files: ``path``, then ``path.1``, ``path.2``, ... as they exist."""
    parts = [path]
    while parts[-1].with_name(f"{path.name}.{len(parts)}").is_file():
        parts.append(path.with_name(f"{path.name}.{len(parts)}"))
    return parts


def write_archive(root: Path, path: Path) -> list[Path]:
    """plan.json, every finished unit's record and the unfinished units' checkpoints, as a .tar.gz.

    Written in parts of at most :data:`ARCHIVE_PART_BYTES` (``path``, ``path.1``, ...), so each
    comes back from a machine that returns files up to a size.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in archive_parts(path)[1:]:
        stale.unlink()
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w:gz") as archive:
        for name in ("plan.json", "units", "runs"):
            if (root / name).exists():
                archive.add(root / name, arcname=name)
    data = whole.getvalue()
    parts = [path if i == 0 else path.with_name(f"{path.name}.{i}")
             for i in range(max(1, -(-len(data) // ARCHIVE_PART_BYTES)))]
    for i, part in enumerate(parts):
        part.write_bytes(data[i * ARCHIVE_PART_BYTES:(i + 1) * ARCHIVE_PART_BYTES])
    return parts


def read_archive(path: Path, root: Path) -> None:
    """Unpack every part of an archive from :func:`write_archive` into ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    data = b"".join(part.read_bytes() for part in archive_parts(path))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        archive.extractall(root, filter="data")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", choices=tuple(REGIMES))
    parser.add_argument("--tables", nargs="+", type=Path, metavar="REPORT",
                        help="print the tables of these reports (one per regime, side by side) and exit")
    parser.add_argument("--part", choices=("plan", *PARTS, "all"), default="all",
                        help="plan: write the plan only; tune: validation runs; test: test runs (after tuning); "
                             "all: both (default: %(default)s)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                        help="scenarios to run now (the plan holds all, or those of --plan-scenarios)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="worker processes; 0 runs every unit in this process")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=1, help="spread the workers over this many GPUs")
    parser.add_argument("--seeds", nargs="+", type=int, help="test seeds (default: 200-207; long4097: 200-204)")
    parser.add_argument("--val-seeds", nargs="+", type=int, help="validation seeds, at least two (default: 100 101)")
    parser.add_argument("--epochs", type=int, help="replace the regime's epochs (a quick check; changes the plan)")
    parser.add_argument("--settings-per-method", type=int, default=SETTINGS_PER_METHOD,
                        help="the first N settings of every grid (a quick check; changes the plan)")
    parser.add_argument("--strategies", nargs="+", metavar="NAME",
                        help="test only these strategies (a costly regime's decisive comparisons; changes the plan)")
    parser.add_argument("--settings-from", type=Path, metavar="REPORT",
                        help="take the chosen settings from another regime's report instead of tuning")
    parser.add_argument("--plan-scenarios", nargs="+", choices=(*SCENARIOS, "decisive"), metavar="SCENARIO",
                        help="the plan holds only these scenarios (a costly regime's: where a cheaper regime showed "
                             "the effect; changes the plan); decisive: those the fixed rule picks from the finished "
                             "--settings-from report (docs/efficacy.md)")
    parser.add_argument("--max-units", type=int, help="start at most this many units, then stop")
    parser.add_argument("--time-limit", type=float, metavar="MINUTES",
                        help="start no experience that would end after this many minutes (a unit that would "
                             "not finish still starts; it goes on from its checkpoints in the next start)")
    parser.add_argument("--hard-limit", type=float, metavar="MINUTES",
                        help="kill the workers still training this many minutes after the start (each unit loses "
                             "the experience it is in and keeps its checkpoints), then write the report and "
                             "--archive: for a machine that ends the call at its own limit, should an experience "
                             "run past --time-limit; needs --workers >= 1")
    parser.add_argument("--max-unfinished", type=int, metavar="N",
                        help="with --time-limit: a unit not begun yet that would not finish in this start begins "
                             "only while fewer than N units are begun and unfinished, so that --archive, which "
                             "carries their checkpoints, stays within what the next machine can take")
    parser.add_argument("--last-start", action="store_true",
                        help="with --time-limit: the machine's last start, so start no unit that would not finish "
                             "in it (its checkpoints would be lost with the machine)")
    parser.add_argument("--out", type=Path, help="folder of the units (default: runs/efficacy-<regime>)")
    parser.add_argument("--archive", type=Path, metavar="TAR_GZ", help="at the end, pack --out into this file")
    parser.add_argument("--from-archive", type=Path, metavar="TAR_GZ", help="first unpack this --archive into --out")
    parser.add_argument("--from-report", type=Path, metavar="REPORT",
                        help="first restore the finished units recorded in this report (of the same plan) "
                        "into --out: a committed report resumes the study on a new machine")
    compiling = parser.add_mutually_exclusive_group()
    compiling.add_argument("--compile-layers", action="store_true",
                           help="run every layer norm and MLP through torch.compile (fewer GPU kernels; rounding "
                           "differs, the plan does not; recorded with each unit)")
    compiling.add_argument("--compile-model", action="store_true",
                           help="run the whole ViT through torch.compile, Q/K captured from it (the fewest GPU "
                           "kernels; rounding differs, the plan does not; recorded with each unit)")
    add_json_flag(parser, "write the report as JSON")
    parser.add_argument("--commit", help="commit to record when the tree has no .git (default: git rev-parse)")
    return parser.parse_args(argv)


def _argument_error(args: argparse.Namespace) -> str | None:
    if args.regime is None:
        return "--regime is required (or --tables to print finished reports)"
    if args.val_seeds is not None and len(set(args.val_seeds)) < 2:
        return "--val-seeds needs at least two distinct seeds"
    if args.seeds is not None and len(set(args.seeds)) < 2:
        return "--seeds needs at least two distinct seeds"
    for name in ("max_units", "settings_per_method", "epochs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    known = {name for arms in TESTED.values() for names in arms.values() for name in names}
    unknown = sorted(set(args.strategies or ()) - known)
    if unknown:
        return f"--strategies: {', '.join(unknown)} not in the study ({', '.join(sorted(known))})"
    if args.time_limit is not None and args.time_limit <= 0:
        return "--time-limit must be > 0"
    if args.hard_limit is not None:
        if args.workers == 0:
            return "--hard-limit needs worker processes (--workers >= 1)"
        if args.hard_limit < (args.time_limit or 0) or args.hard_limit <= 0:
            return "--hard-limit must be > 0 and not below --time-limit"
    if args.max_unfinished is not None:
        if args.max_unfinished < 1:
            return "--max-unfinished must be >= 1"
        if args.time_limit is None:
            return "--max-unfinished needs --time-limit (without it every unit runs to its end)"
    if args.last_start and args.time_limit is None:
        return "--last-start needs --time-limit"
    if "decisive" in (args.plan_scenarios or ()):
        if len(args.plan_scenarios) > 1:
            return "--plan-scenarios decisive stands alone"
        if args.settings_from is None:
            return "--plan-scenarios decisive needs --settings-from (the report the rule reads)"
    for name in ("from_archive", "from_report", "settings_from"):
        path = getattr(args, name)
        if path is not None and not path.is_file():
            return f"--{name.replace('_', '-')} {path}: no such file"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    # --workers 0 trains in this process: no time carried over from an earlier start.
    efficacy_units._seconds_per_weight.clear()
    args = parse_args(argv)
    if args.tables:
        print(side_by_side([json.loads(path.read_text()) for path in args.tables]))
        return 0
    error = _argument_error(args)
    if error is not None:
        print(f"efficacy.py: {error}", file=sys.stderr)
        return 2
    start = time.time()
    deadline = None if args.time_limit is None else start + 60 * args.time_limit
    hard_deadline = None if args.hard_limit is None else start + 60 * args.hard_limit
    val_seeds, test_seeds = DEFAULT_SEEDS[args.regime]
    settings_from = None if args.settings_from is None else json.loads(args.settings_from.read_text())
    # A kind no unit of this plan has finished is guessed by its cost relative to others there.
    args.reference = reference_rates(settings_from)
    if args.plan_scenarios == ["decisive"]:
        try:
            args.plan_scenarios = decisive_scenarios(settings_from)
        except ValueError as error:
            print(f"efficacy.py: --plan-scenarios decisive: --settings-from {args.settings_from}: {error}",
                  file=sys.stderr)
            return 2
        print(f"the fixed rule picks from {args.settings_from}: {' '.join(args.plan_scenarios)}", flush=True)
    try:
        plan = make_plan(args.regime, args.val_seeds or val_seeds, args.seeds or test_seeds, args.epochs,
                         args.settings_per_method, args.strategies, settings_from, args.plan_scenarios)
    except ValueError as error:
        print(f"efficacy.py: --settings-from {args.settings_from}: {error}", file=sys.stderr)
        return 2
    missing = sorted(set(plan["settings"]) - {f.name for f in dataclasses.fields(ExperimentConfig)})
    if missing and args.part != "plan":
        print(f"efficacy.py: regime {args.regime} needs configuration fields this checkout lacks: "
              f"{', '.join(missing)}", file=sys.stderr)
        return 2
    args.out = args.out or Path("runs") / f"efficacy-{args.regime}"
    if args.from_archive is not None:
        read_archive(args.from_archive, args.out)
    if args.from_report is not None:
        error = restore_records(json.loads(args.from_report.read_text()), plan, args.out)
        if error is not None:
            print(f"efficacy.py: {error}", file=sys.stderr)
            return 2
    error = check_plan(args.out, args.json, plan)
    if error is not None:
        print(f"efficacy.py: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    import torch

    from _harness.report import describe_environment

    environment = describe_environment(torch.device(args.device), args.commit)
    args.execution = {"commit": environment.get("commit"), "device": environment.get("device"),
                      "compile_layers": args.compile_layers, "compile_model": args.compile_model}
    if args.compile_layers or args.compile_model:
        # Many workers compile at once: one compile process each, not one per core each.
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if args.json:
        write_json(args.json, build_report(plan, finished_records(args.out), environment))
    started = unfinished = failed = experiences = 0
    planned: list[Unit] = []  # every unit this start was to run, finished or not
    if args.part != "plan":
        context = multiprocessing.get_context("spawn")
        counter = context.Value("i", 0)
        if args.workers == 0:
            torch.set_num_threads(args.threads)
        pool = (InProcess() if args.workers == 0 else
                concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context, initializer=init_worker,
                                                       initargs=(args.threads, args.gpus, counter)))
        with pool:
            for part in PARTS if args.part == "all" else (args.part,):
                records = finished_records(args.out)
                units = []
                for scenario in [name for name in args.scenarios if name in plan["scenarios"]]:
                    if part == "tune":
                        units += tuning_units(plan, scenario)
                        continue
                    tables, complete = choose(plan, scenario, tuning_scores(plan, records))
                    if not complete:
                        if args.part == "test":
                            print(f"efficacy.py: the tuning of scenario {scenario} is not finished; run --part tune "
                                  "first", file=sys.stderr)
                            return 2
                        continue
                    units += test_units(plan, scenario, {name: t["chosen"] for name, t in tables.items()})
                todo = [unit for unit in units if unit.name not in records]
                planned += todo
                if args.max_units is not None:
                    todo = todo[:max(0, args.max_units - started)]
                if todo:
                    load_data(todo[0], plan)  # generated here once, not by every worker at the same time
                outcome = run_units(todo, pool, plan, args, deadline, hard_deadline)
                started += outcome.finished + outcome.unfinished + outcome.failed
                unfinished, failed = unfinished + outcome.unfinished, failed + outcome.failed
                experiences += outcome.experiences
                if hard_deadline is not None and time.time() >= hard_deadline:
                    break  # the workers are gone
    report = build_report(plan, finished_records(args.out), environment)
    if args.json:
        write_json(args.json, report)
    if args.archive:
        parts = write_archive(args.out, args.archive)
        print(f"archive: {', '.join(str(part) for part in parts)}")
    print(side_by_side([report]))
    print(f"plan {report['plan_fingerprint']}: " + "; ".join(
        f"{part} {done}/{total} units" for part, (done, total) in report["units"].items())
        + (f"; {unfinished} unfinished, not started or stopped by the time limit (they resume from their "
           "checkpoints)" if unfinished else "")
        + (f"; {experiences} experiences trained and kept" if args.part != "plan" else "")
        + (f"; {failed} failed (see above)" if failed else "")
        + f"; {time.time() - start:.0f} s" + _time_left(planned, plan, args))
    return 1 if failed else 0


def _time_left(units: list[Unit], plan: dict[str, Any], args: argparse.Namespace) -> str:
    """What the unfinished ``units`` would still take with ``--workers`` sharing the machine, as the
    finished units' slowest rates (measured with as many sharing) say: to plan device time by."""
    count, seconds = seconds_left(units, plan, args.out, args.reference)
    if not count or seconds is None:
        return ""
    workers = max(1, args.workers)
    return f"; the {count} units left need about {seconds / 60 / workers:.0f} min with {workers} workers at the " \
           "slowest rates seen"


if __name__ == "__main__":
    sys.exit(main())
