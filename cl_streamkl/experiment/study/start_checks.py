"""Checks of where a study start writes and what it runs on, made before anything is written.

``--out`` must be a new or empty folder, or a study's (it holds a ``plan.json`` of this plan):
a folder of a user's notes and data is never written into. ``--json`` overwrites only a study
report of this plan, ``--archive`` only a study archive of this plan. The default folder,
``runs/study-<regime>``, stays below the working directory. ``--device cuda`` needs a GPU, and
the plan's data must load and its model build, before the plan is written. While a start
writes, it holds ``--out``'s lock (the lock of ``cl-streamkl run``): a second start on the same
folder is refused at once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from cl_streamkl.experiment.files import OutputWriteError
from cl_streamkl.experiment.run_lock import LOCK_FILE, FolderInUseError, run_folder_lock
from cl_streamkl.experiment.study.files import StudyFileError, archive_parts, open_archive, read_json
from cl_streamkl.experiment.study.plan import PlanError, Unit, fingerprint, test_units, tuning_units
from cl_streamkl.experiment.study.tables import REPORT_KEYS

# Datasets that ``download: true`` fetches into a missing data_root.
DOWNLOADABLE = ("cifar10", "cifar100", "tiny-imagenet")


def default_out(plan: dict[str, Any]) -> Path:
    """``runs/study-<regime>``; a regime holding a path separator is refused (it would climb out)."""
    regime = plan["regime"]
    if any(separator in regime for separator in ("/", "\\", "\0")):
        raise StudyFileError(f"regime {regime!r} cannot name the default folder runs/study-<regime>: it holds a "
                             "path separator; give --out, or a regime without '/'")
    return Path("runs") / f"study-{regime}"


def check_out(root: Path, plan: dict[str, Any]) -> None:
    """Refuse a folder that holds files but no study, or another plan's study (or a damaged ``plan.json``)."""
    if not root.is_dir():
        return
    if not (root / "plan.json").is_file():
        if any(entry.name != LOCK_FILE for entry in root.iterdir()):
            raise StudyFileError(f"--out {root} holds files but no study (no plan.json): a study writes its plan, "
                                 "units and reports there; choose a new or empty folder")
        return
    held, stamp = fingerprint(read_json(root / "plan.json", "--out's plan.json")), fingerprint(plan)
    if held != stamp:
        raise StudyFileError(f"{root / 'plan.json'} holds another plan (fingerprint {held}, this start's {stamp}): "
                             "the grid and seeds are fixed once a study starts; use another --out")


def check_report_file(path: Path | None, plan: dict[str, Any]) -> None:
    """Refuse a ``--json`` file that exists and is no study report of this plan (it would be overwritten)."""
    if path is None or not path.is_file():
        return
    report = read_json(path, "--json")
    if report.get("plan_fingerprint", fingerprint(plan)) != fingerprint(plan):
        raise StudyFileError(f"{path} reports a study with plan {report['plan_fingerprint']}, this start's is "
                             f"{fingerprint(plan)}: write another --json")
    if not set(REPORT_KEYS) <= set(report):
        raise StudyFileError(f"--json {path} is not a study report (cl-streamkl study's report.json): it is not "
                             "overwritten; write another --json")


def check_archive_file(path: Path | None, plan: dict[str, Any]) -> None:
    """Refuse an ``--archive`` whose files exist and are no study archive of this plan (they would be
    overwritten): a user's own .tar.gz, such as a dataset's release, holds no study's ``plan.json``."""
    if path is None:
        return
    existing = [part for part in archive_parts(path) if part.is_file()]
    if not existing:
        return
    refusal = (f"--archive {existing[0]} exists and is no study archive of this plan (a study's --archive): it is "
               "not overwritten; write another --archive")
    if not path.is_file():
        raise StudyFileError(refusal)
    try:
        archive, held = open_archive(path)
    except StudyFileError:
        raise StudyFileError(refusal) from None
    archive.close()
    if held is None or fingerprint(held) != fingerprint(plan):
        raise StudyFileError(refusal)


def check_device(device: str, gpus: int) -> None:
    """Refuse ``--device cuda`` where no GPU is visible, and ``--gpus`` beyond those visible."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise StudyFileError("--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                             "use --device cpu")
    if gpus > torch.cuda.device_count():
        raise StudyFileError(f"--gpus {gpus}: only {torch.cuda.device_count()} CUDA GPUs are visible here")


def _first_unit(plan: dict[str, Any], scenarios: list[str]) -> Unit:
    """A unit of the scenarios to run (a test unit stands in with each family's first setting)."""
    name = scenarios[0]
    part = plan["scenarios"][name]
    chosen = part.get("chosen_from", {}).get("chosen") or {
        family: spec["grid"][0] for family, spec in part["tuning"].items()}
    return (tuning_units(plan, name) + test_units(plan, name, chosen))[0]


def check_data(plan: dict[str, Any], scenarios: list[str]) -> None:
    """Load the plan's data and build its model once, as every unit will (the load is kept for them).

    Raises:
        PlanError: ``settings.data_root`` is missing, or the data, the stream or the model is
            refused (one line naming the setting).
    """
    from cl_streamkl.experiment.config import ExperimentConfig
    from cl_streamkl.experiment.study.units import load_data

    settings = plan["settings"]
    dataset, root = settings.get("dataset", ExperimentConfig().dataset), settings.get("data_root")
    if root is None and dataset in (*DOWNLOADABLE, "imagefolder"):
        raise PlanError(f"settings: dataset {dataset!r} needs data_root (the folder holding its files)")
    if dataset in (*DOWNLOADABLE, "imagefolder") and not Path(root).expanduser().exists():
        if dataset == "imagefolder":
            raise PlanError(f"settings.data_root {root!r} does not exist: point it at your image folder")
        if not settings.get("download"):
            raise PlanError(f"settings.data_root {root!r} does not exist: point it at the {dataset} files, or set "
                            f"download: true in settings to fetch {dataset} there")
    try:
        load_data(_first_unit(plan, scenarios), plan)
    except ValueError as err:
        raise PlanError(f"settings: {err}") from None


def hold_folder(stack: contextlib.ExitStack, root: Path) -> None:
    """Take ``root``'s lock (creating the folder) until ``stack`` closes; refused at once if it is held."""
    try:
        stack.enter_context(run_folder_lock(root))
    except FolderInUseError:
        raise StudyFileError(f"--out {root} is in use by another cl-streamkl start (it holds {LOCK_FILE}); wait "
                             "for it to end, or choose another --out") from None
    except OutputWriteError as err:
        raise StudyFileError(f"--out {root}: {err}") from None
