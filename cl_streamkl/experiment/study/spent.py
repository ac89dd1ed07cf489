"""What a study folder holds that no later start reads: what ``--archive`` leaves out.

A finished unit's run folder and markers (``runs/<unit>/``, ``runs/<unit>.begun``,
``runs/<unit>.trained`` beside its record ``units/<unit>.json``) are stale: they arise where a
folder of finished records is overlaid with an older archive, and every start ignores them. A
shared first experience (``first/<first unit>.pt``) is read only by the test units of its
scenario and seed: once each of them has its record, no start reads it (the first unit's record
stays). An archive that carried them grew past what a time-limited machine may return.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cl_streamkl.experiment.study.plan import chosen_test_units, first_unit, first_units
from cl_streamkl.experiment.study.report import tuning_scores
from cl_streamkl.experiment.study.units import first_path

# The markers a unit's run folder has beside it (units.py's begun marker, rates.py's progress).
MARKERS = (".begun", ".trained")


def spent_files(root: Path, plan: dict[str, Any], records: dict[str, dict[str, Any]]) -> set[str]:
    """The paths under ``root`` no later start of ``plan`` reads, relative to it (``runs/<unit>``,
    ``runs/<unit>.begun``, ``first/<unit>.pt``, ...), as archive members are named.

    Args:
        root: the study folder.
        plan: its plan, checked.
        records: its finished units' records by unit name.

    A shared first experience stays while any test unit of its scenario and seed lacks a record,
    whatever part a start runs, and in every scenario whose test units are not known yet (its
    tuning is unfinished).
    """
    spent = set()
    runs = root / "runs"
    for path in runs.iterdir() if runs.is_dir() else ():
        name = next((path.name.removesuffix(end) for end in MARKERS if path.name.endswith(end)), path.name)
        if name in records and (path.is_dir() or name != path.name):
            spent.add(f"runs/{path.name}")
    scores = tuning_scores(plan, records)
    for scenario in plan["scenarios"]:
        tests = chosen_test_units(plan, scenario, scores)
        for first in first_units(plan, tests or []):
            if all(unit.name in records for unit in tests if first_unit(unit) == first):
                spent.add(first_path(str(root), first).relative_to(root).as_posix())
    return spent
