"""What a start carries into its folder (``--from-archive``, ``--from-report``), checked by content.

A unit record written into ``units/`` is read again by every later start: a truncated one, a
string, or one whose unit is no mapping would end each of them in a traceback or, worse, in a
report built on garbage. So every carried record (and every count of a stopped unit's trained
experiences) is parsed and checked before any is written, and an archive is taken only when it
holds this plan's ``plan.json``.
"""

from __future__ import annotations

import dataclasses
import json
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

from cl_streamkl.experiment.study.files import StudyFileError, safe_name
from cl_streamkl.experiment.study.plan import Unit, fingerprint

UNIT_KEYS = tuple(field.name for field in dataclasses.fields(Unit))
# What a start and its report read from every record besides its unit.
RECORD_KEYS = ("strategy", "seed", "class_order", "accuracy_matrix", "task_il_matrix", "eval_sizes", "wall_time_s",
               "peak_memory_mb", "process_s")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_record(record: Any, where: str) -> dict[str, Any]:
    """``record`` if it is a finished unit's record as :func:`~cl_streamkl.experiment.study.units.run_unit`
    writes it; else a one-line :class:`StudyFileError` starting with ``where``."""
    if not isinstance(record, dict):
        raise StudyFileError(f"{where} is not a unit record (a JSON object); nothing was written")
    unit = record.get("unit")
    if not isinstance(unit, dict) or sorted(unit) != sorted(UNIT_KEYS):
        raise StudyFileError(f"{where}: its unit is not a mapping of {', '.join(UNIT_KEYS)}; nothing was written")
    if not (all(isinstance(unit[key], str) for key in ("part", "scenario", "arm", "strategy"))
            and isinstance(unit["seed"], int) and isinstance(unit["overrides"], list)
            and all(isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                    for pair in unit["overrides"])):
        raise StudyFileError(f"{where}: its unit's values are not those of a unit (names, a seed, [setting, value] "
                             "pairs); nothing was written")
    missing = [key for key in RECORD_KEYS if key not in record]
    if missing:
        raise StudyFileError(f"{where}: the record lacks {', '.join(missing)}; nothing was written")
    matrix = record["accuracy_matrix"]
    if not (isinstance(matrix, list) and matrix and all(
            isinstance(row, list) and row and all(_number(v) for v in row) for row in matrix)):
        raise StudyFileError(f"{where}: its accuracy_matrix is not rows of accuracies; nothing was written")
    if not all(_number(record[key]) for key in ("wall_time_s", "process_s")):
        raise StudyFileError(f"{where}: its wall_time_s and process_s are not numbers; nothing was written")
    return record


def report_records(report: dict[str, Any], plan: dict[str, Any], path: Path) -> dict[str, dict[str, Any]]:
    """The records a ``--from-report`` report carries, every name and record checked."""
    if report.get("plan_fingerprint") != fingerprint(plan):
        raise StudyFileError(f"--from-report holds plan {report.get('plan_fingerprint')}, this start's is "
                             f"{fingerprint(plan)}")
    records = report.get("records", {})
    if not isinstance(records, dict):
        raise StudyFileError("--from-report: its records are not a mapping of unit names")
    names = [safe_name(name, "--from-report") for name in records]
    return {name: check_record(records[name], f"--from-report {path}: record {name}") for name in names}


def archive_records(archive: tarfile.TarFile, held: Any, plan: dict[str, Any], path: Path
                    ) -> dict[str, dict[str, Any]]:
    """The records a checked ``--from-archive`` archive (:func:`~cl_streamkl.experiment.study.files.open_archive`)
    carries, each parsed and checked; the archive must hold this plan's ``plan.json``."""
    if held is None:
        raise StudyFileError(f"--from-archive {path} holds no plan.json: it is no archive of cl-streamkl study "
                             "--archive; nothing was unpacked")
    if fingerprint(held) != fingerprint(plan):
        raise StudyFileError(f"--from-archive {path} holds plan {fingerprint(held)}, this start's is "
                             f"{fingerprint(plan)}; nothing was unpacked")
    records = {}
    for member in archive.getmembers():
        parts = PurePosixPath(member.name).parts
        where = f"--from-archive {path}: {member.name}"
        if parts[0] == "runs" and member.name.endswith(".trained") and member.isfile():
            if not _read(archive, member, where).strip().isdigit():  # read by every later start
                raise StudyFileError(f"{where} does not count trained experiences; nothing was unpacked")
            continue
        if parts[0] != "units" or member.isdir():
            continue
        if len(parts) != 2 or not parts[1].endswith(".json"):
            raise StudyFileError(f"{where} is not a unit record (units/<unit>.json); nothing was unpacked")
        name = safe_name(parts[1].removesuffix(".json"), f"--from-archive {path}")
        try:
            data = json.loads(_read(archive, member, where))
        except ValueError as err:
            raise StudyFileError(f"{where} is not JSON ({err}); nothing was unpacked") from None
        records[name] = check_record(data, where)
    return records


def _read(archive: tarfile.TarFile, member: tarfile.TarInfo, where: str) -> str:
    try:
        return archive.extractfile(member).read().decode()
    except (UnicodeDecodeError, tarfile.TarError, EOFError, OSError) as err:
        raise StudyFileError(f"{where} cannot be read ({err}); nothing was unpacked") from None
