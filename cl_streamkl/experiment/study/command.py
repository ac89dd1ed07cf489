"""``cl-streamkl study PLAN``: tune, test and report a study a plan file describes.

For each scenario of the plan the study

1. writes the plan to ``--out/plan.json`` before anything runs; a later start with another
   plan stops with one line (the grid and the seeds are fixed once a study starts);
2. tunes every method family on the validation split with the same number of settings, each
   on every validation seed (``--part tune``);
3. runs every tested strategy on the test seeds with each component's chosen setting
   (``--part test``), and reports per-seed values, accuracy matrices, mean ± std, and paired
   differences with raw 95 % t-intervals and Holm-adjusted p-values over the plan's family;
4. for a confirmatory plan (one with ``hypotheses``, registered with ``--register`` once
   committed), runs its units (``--part confirm``) and gives a verdict per hypothesis.

Each (scenario, strategy, seed, setting) run is one unit for a pool of worker processes.
Finished units are kept under ``--out`` and skipped when the command starts again; the
report (``report.json``, ``report.md``, ``paired.png``) is rewritten at the end of every start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cl_streamkl.experiment.option_parser import OptionParser
from cl_streamkl.experiment.study import units as study_units
from cl_streamkl.experiment.study.carry_checks import archive_records, report_records
from cl_streamkl.experiment.study.files import StudyFileError, open_archive, read_json, unpack_archive, write_archive
from cl_streamkl.experiment.study.plan import (
    PlanError, Unit, chosen_test_units, fingerprint, first_units, load_plan, tuning_units,
)
from cl_streamkl.experiment.study.rates import finished_records
from cl_streamkl.experiment.study.spent import spent_files
from cl_streamkl.experiment.study.start_checks import (
    check_archive_file, check_data, check_device, check_out, check_report_file, default_out, hold_folder,
)
from cl_streamkl.experiment.study.tables import tables_of

PROG = "cl-streamkl study"
PARTS = ("plan", "tune", "test", "all", "confirm")

# The help's first lines, plain text (the module docstring's first line without its markup).
_DESCRIPTION = "cl-streamkl study PLAN: tune, test and report a study that a plan file (YAML, TOML or JSON) describes."

_EPILOG = """\
examples:
  cl-streamkl study my-plan.yaml --part tune --device cuda --workers 8
  cl-streamkl study my-plan.yaml --part test --device cuda --workers 8 --time-limit 50
  cl-streamkl study my-plan.yaml --register      # a committed confirmatory plan, once
  cl-streamkl study my-plan.yaml --part confirm --device cuda --workers 12
  cl-streamkl study --tables runs/study-long/report.json

Machines that end a call at a time limit: --time-limit starts no experience that would end
after it (a unit goes on from its checkpoint in the next start); --hard-limit kills the
workers still training then; --archive packs what the next start needs (in parts of at most
15 MiB) and --from-archive unpacks it on the next machine; --from-report restores finished
units from a committed report; --max-unfinished bounds the checkpoints an archive carries. Several worker
processes share a GPU (under NVIDIA MPS if it runs); --gpus spreads them over GPUs.
See docs/study.md for the plan file's keys.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The study command's options (also the ``study`` sub-command of ``cl-streamkl``)."""
    parser.add_argument("plan", nargs="?", type=Path, metavar="PLAN", help="the plan file (YAML, TOML or JSON)")
    parser.add_argument("--tables", nargs="+", type=Path, metavar="REPORT",
                        help="print the tables of these reports (side by side) and exit")
    parser.add_argument("--part", choices=PARTS,
                        help="plan: write the plan only; tune: validation runs; test: test runs (after tuning); "
                             "all: both; confirm: a registered confirmatory plan's runs (default: confirm for a "
                             "plan with hypotheses, else all)")
    parser.add_argument("--register", action="store_true",
                        help="register a committed confirmatory plan (writes PLAN.registration.json) and exit")
    parser.add_argument("--scenarios", nargs="+", metavar="SCENARIO", help="run only these of the plan's scenarios")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the workers train: cpu, or cuda (see --gpus) (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="worker processes; 0 runs every unit in this process (default: the CPU count "
                             "less one, here %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=1, help="spread the workers over this many GPUs")
    parser.add_argument("--max-units", type=int, help="start at most this many units, then stop")
    parser.add_argument("--time-limit", type=float, metavar="MINUTES",
                        help="start no experience that would end after this many minutes")
    parser.add_argument("--hard-limit", type=float, metavar="MINUTES",
                        help="kill the workers still training this many minutes after the start (each unit keeps "
                             "its checkpoints), then write the report and --archive; needs --workers >= 1")
    parser.add_argument("--max-unfinished", type=int, metavar="N",
                        help="with --time-limit: a unit that would not finish begins only while fewer than N units "
                             "are begun and unfinished (their checkpoints travel in --archive)")
    parser.add_argument("--last-start", action="store_true",
                        help="with --time-limit: start no unit that would not finish in this start")
    parser.add_argument("--out", type=Path, help="folder of the units (default: runs/study-<regime>)")
    parser.add_argument("--archive", type=Path, metavar="TAR_GZ",
                        help="at the end, pack --out into this file: the plan, the records, unfinished units' "
                             "checkpoints and the shared first experiences still needed")
    parser.add_argument("--from-archive", type=Path, metavar="TAR_GZ", help="first unpack this --archive into --out")
    parser.add_argument("--from-report", type=Path, metavar="REPORT",
                        help="first restore the finished units of this report (of the same plan) into --out")
    compiling = parser.add_mutually_exclusive_group()
    compiling.add_argument("--compile-layers", action="store_true",
                           help="run every layer norm and MLP through torch.compile (recorded with each unit)")
    compiling.add_argument("--compile-model", action="store_true",
                           help="run the whole ViT through torch.compile (recorded with each unit)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report to PATH")
    parser.add_argument("--commit", help="commit to record when the tree has no .git (default: git rev-parse)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OptionParser(prog=PROG, description=_DESCRIPTION, epilog=_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser.parse_args(argv)


def _argument_error(args: argparse.Namespace, plan: dict[str, Any]) -> str | None:
    if args.workers < 0 or args.threads < 1 or args.gpus < 1:
        return "--workers must be >= 0, --threads and --gpus >= 1"
    for name in ("max_units", "max_unfinished"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    for name in ("time_limit", "hard_limit"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"--{name.replace('_', '-')} must be a number of minutes > 0"
    if args.hard_limit is not None:
        if args.workers == 0:
            return "--hard-limit needs worker processes (--workers >= 1)"
        if args.hard_limit < (args.time_limit or 0):
            return "--hard-limit must not be below --time-limit"
    if (args.max_unfinished is not None or args.last_start) and args.time_limit is None:
        return "--max-unfinished and --last-start need --time-limit"
    unknown = sorted(set(args.scenarios or ()) - set(plan["scenarios"]))
    if unknown:
        return f"--scenarios: {unknown[0]} is not in the plan ({', '.join(plan['scenarios'])})"
    confirmatory = bool(plan.get("hypotheses"))
    args.part = args.part or ("confirm" if confirmatory else "all")
    if confirmatory and args.part in ("tune", "test", "all"):
        return f"--part {args.part}: {args.plan} is a confirmatory plan; its runs are --part confirm"
    if not confirmatory and args.part == "confirm":
        return f"--part confirm: {args.plan} has no hypotheses (a confirmatory plan lists them)"
    for name in ("from_archive", "from_report"):
        path = getattr(args, name)
        if path is not None and not path.is_file():
            return f"--{name.replace('_', '-')} {path}: no such file"
    for name in ("out", "json", "archive"):
        path = getattr(args, name)
        if path is not None and (path.is_dir() if name != "out" else path.exists() and not path.is_dir()):
            return f"--{name} {path} is {'a folder' if name != 'out' else 'not a folder'}"
        blocking = None if path is None else next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            return f"--{name} {path}: {blocking} is a file, not a folder"
    return None


def _environment(device: str, commit: str | None) -> dict[str, Any]:
    import platform

    import torch

    from cl_streamkl._provenance import git_commit

    name = (torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available()
            else f"cpu ({platform.machine()})")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": name, "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "commit": commit or git_commit(short=True, mark_dirty=True) or "unknown"}


def _same_layout(records: dict[str, dict[str, Any]], execution: dict[str, Any]) -> str | None:
    """Why a confirmatory start may not add units to these records (another commit, worker
    layout or registration), or None."""
    keys = ("commit", "workers", "gpus", "compile_layers", "compile_model", "preregistration")
    for name, record in records.items():
        held = record.get("execution") or {}
        differing = [key for key in keys if held.get(key) != execution.get(key)]
        if differing:
            return (f"confirmatory units run on one commit and one worker layout: unit {name} ran with "
                    + ", ".join(f"{key} {held.get(key)!r}" for key in differing) + ", this start has "
                    + ", ".join(f"{key} {execution.get(key)!r}" for key in differing))
    return None


def _units(plan: dict[str, Any], args: argparse.Namespace, part: str, records: dict[str, Any]) -> list[Unit] | str:
    """The units of ``part`` in the scenarios to run now; a reason when tuning is unfinished."""
    units: list[Unit] = []
    for scenario in [name for name in plan["scenarios"] if name in (args.scenarios or plan["scenarios"])]:
        if part == "tune":
            units += tuning_units(plan, scenario)
            continue
        from cl_streamkl.experiment.study.report import tuning_scores

        tests = chosen_test_units(plan, scenario, tuning_scores(plan, records))
        if tests is None:
            if args.part in ("test", "confirm"):
                return f"the tuning of scenario {scenario} is not finished; run --part tune first"
            continue
        units += tests
    if part == "first":
        return first_units(plan, units)
    return units


def _parts(args: argparse.Namespace, plan: dict[str, Any]) -> list[str]:
    if args.part == "plan":
        return []
    parts = {"all": ["tune", "test"], "confirm": ["tune", "test"]}.get(args.part, [args.part])
    if "test" in parts and plan.get("first_experience") == "shared":
        parts.insert(parts.index("test"), "first")
    return parts


def _prepare(args: argparse.Namespace, plan: dict[str, Any], stack: contextlib.ExitStack) -> None:
    """Check every file this start reads and writes, take --out's lock, then unpack and restore:
    nothing is written before every check has passed, and no record before every one is checked."""
    archive = held = None
    if args.from_archive is not None:
        archive, held = open_archive(args.from_archive)
    report = None if args.from_report is None else read_json(args.from_report, "--from-report")
    restored = {} if report is None else report_records(report, plan, args.from_report)
    unpacked = {} if archive is None else archive_records(archive, held, plan, args.from_archive)
    check_out(args.out, plan)
    check_report_file(args.json, plan)
    check_archive_file(args.archive, plan)
    if args.part == "test":
        records = {**unpacked, **restored, **(finished_records(args.out) if args.out.is_dir() else {})}
        units = _units(plan, args, "test", records)
        if isinstance(units, str):
            raise StudyFileError(units)
    if args.part != "plan":
        try:
            check_data(plan, [name for name in plan["scenarios"] if name in (args.scenarios or plan["scenarios"])])
        except PlanError as err:
            raise PlanError(f"{args.plan}: {err}") from None
    hold_folder(stack, args.out)
    check_out(args.out, plan)  # as it is now that no other start writes it
    if archive is not None:
        unpack_archive(archive, args.out)
    if report is not None:
        units_folder = args.out / "units"
        units_folder.mkdir(parents=True, exist_ok=True)
        for name, record in restored.items():
            if not (units_folder / f"{name}.json").is_file():  # records already there are kept
                (units_folder / f"{name}.json").write_text(json.dumps(record) + "\n")
    (args.out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cl-streamkl study``; exit status 0, 1 when a unit failed, 2 for bad input."""
    study_units._seconds_per_weight.clear()  # --workers 0 trains in this process
    args = parse_args(argv)
    args.command = " ".join([PROG, *(sys.argv[1:] if argv is None else argv)])
    try:
        return _main(args)
    except (PlanError, StudyFileError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if args.tables:
        print(tables_of(args.tables))
        return 0
    if args.plan is None:
        raise StudyFileError("a plan file is required (or --tables to print finished reports)")
    plan = load_plan(args.plan)
    error = _argument_error(args, plan)
    if error is not None:
        raise StudyFileError(error)
    from cl_streamkl.experiment.study.registration import check_registration, register

    if args.register:
        print(f"registered: {register(args.plan, plan, fingerprint(plan))} (commit it)")
        return 0
    registration = check_registration(args.plan, fingerprint(plan)) if args.part == "confirm" else None
    args.out = args.out or default_out(plan)
    check_device(args.device, args.gpus)
    with contextlib.ExitStack() as stack:
        _prepare(args, plan, stack)
        return _run(args, plan, registration)


def _run(args: argparse.Namespace, plan: dict[str, Any], registration: dict[str, Any] | None) -> int:
    from cl_streamkl.experiment.study.outputs import write_outputs
    from cl_streamkl.experiment.study.report import build_report
    from cl_streamkl.experiment.study.units import InProcess, init_worker, load_data, run_units

    start = time.time()
    deadline = None if args.time_limit is None else start + 60 * args.time_limit
    hard_deadline = None if args.hard_limit is None else start + 60 * args.hard_limit
    args.reference = {}
    environment = _environment(args.device, args.commit)
    args.execution = {"commit": environment["commit"], "device": environment["device"],
                      "compile_layers": args.compile_layers, "compile_model": args.compile_model,
                      "workers": args.workers, "gpus": args.gpus,
                      **({"preregistration": registration} if registration else {})}
    if registration is not None:
        refusal = _same_layout(finished_records(args.out), args.execution)
        if refusal is not None:
            raise StudyFileError(refusal)
    if args.compile_layers or args.compile_model:
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # many workers compile at once
    started = unfinished = failed = 0
    parts = _parts(args, plan)
    if parts:
        import torch

        context = multiprocessing.get_context("spawn")
        counter = context.Value("i", 0)
        if args.workers == 0:
            torch.set_num_threads(args.threads)
        pool = (InProcess() if args.workers == 0 else
                concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context, initializer=init_worker,
                                                       initargs=(args.threads, args.gpus, counter)))
        with pool:
            for part in parts:
                records = finished_records(args.out)
                units = _units(plan, args, part, records)
                if isinstance(units, str):
                    raise StudyFileError(units)
                todo = [unit for unit in units if unit.name not in records]
                if args.max_units is not None:
                    todo = todo[:max(0, args.max_units - started)]
                if todo:
                    load_data(todo[0], plan)  # generated here once, not by every worker at the same time
                outcome = run_units(todo, pool, plan, args, deadline, hard_deadline, part)
                started += outcome.finished + outcome.unfinished + outcome.failed
                unfinished, failed = unfinished + outcome.unfinished, failed + outcome.failed
                if hard_deadline is not None and time.time() >= hard_deadline:
                    break  # the workers are gone
    records = finished_records(args.out)
    report = build_report(plan, records, environment)
    report["command"] = args.command
    written = write_outputs(report, args.out, args.json)
    if args.archive:
        written += write_archive(args.out, args.archive, spent_files(args.out, plan, records))
    from cl_streamkl.experiment.study.tables import side_by_side

    print(side_by_side([report]))
    print(f"plan {report['plan_fingerprint']}: " + "; ".join(
        f"{part} {done}/{total} units" for part, (done, total) in report["units"].items())
        + (f"; {unfinished} unfinished (they resume from their checkpoints)" if unfinished else "")
        + (f"; {failed} failed (see above)" if failed else "") + f"; {time.time() - start:.0f} s")
    print("wrote " + ", ".join(str(path) for path in written))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
