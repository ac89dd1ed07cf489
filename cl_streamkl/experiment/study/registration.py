"""Pre-registration: a confirmatory plan is committed, registered, and then unchangeable.

``cl-streamkl study PLAN --register`` checks that the plan file (one with ``hypotheses``) is
committed and unmodified, and writes ``PLAN.registration.json`` beside it: the SHA-256 of the
file's bytes, its plan fingerprint and the commit that added it. Commit that file too. The
confirmatory part (``--part confirm``) then refuses to start unless the plan file still has
those bytes; where the tree is a git checkout holding the file's history it also checks that
the commit named added the file with those bytes. Every confirmatory unit records the registration, so a report shows
that all its units ran under the registered plan.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

from cl_streamkl.experiment.study.files import StudyFileError, read_json


# What a registration records (and a confirmatory start checks).
REGISTRATION_KEYS = ("sha256", "plan_fingerprint", "commit")


def registration_path(plan_file: Path) -> Path:
    """``PLAN.registration.json`` beside the plan file."""
    return plan_file.with_name(plan_file.name + ".registration.json")


def file_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git(folder: Path, *args: str) -> str | None:
    """A git command's output in ``folder``'s checkout; None where there is no git or no checkout."""
    try:
        done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=False, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode(errors="replace") if done.returncode == 0 else None


def _added_by(plan_file: Path) -> tuple[str, bytes] | None:
    """The commit that added ``plan_file`` and the file's bytes there; None outside a checkout."""
    folder = plan_file.resolve().parent
    top = _git(folder, "rev-parse", "--show-toplevel")
    if top is None:
        return None
    root = Path(top.strip())
    relative = plan_file.resolve().relative_to(root).as_posix()
    commits = (_git(root, "log", "--diff-filter=A", "--format=%H", "--", relative) or "").split()
    if not commits:
        raise StudyFileError(f"{plan_file} is not committed: commit the pre-registration before registering it")
    commit = commits[-1]
    done = subprocess.run(["git", "show", f"{commit}:{relative}"], cwd=root, capture_output=True, check=False)
    return commit, done.stdout


def register(plan_file: Path, plan: dict[str, Any], fingerprint: str) -> Path:
    """Write the registration of a committed, unmodified confirmatory plan file; its path.

    Raises:
        StudyFileError: the plan has no hypotheses, is not in a git checkout, is not committed,
            or differs from the commit that added it; a registration exists already.
    """
    if not plan.get("hypotheses"):
        raise StudyFileError(f"{plan_file} has no hypotheses: only a confirmatory plan is registered")
    path = registration_path(plan_file)
    if path.exists():
        raise StudyFileError(f"{path} exists: a plan is registered once")
    added = _added_by(plan_file)
    if added is None:
        raise StudyFileError(f"{plan_file} is not in a git checkout: registering needs the commit that added it")
    commit, committed = added
    data = plan_file.read_bytes()
    if committed != data:
        raise StudyFileError(f"{plan_file} differs from the commit that added it ({commit[:12]}): a "
                             "pre-registration is registered as it was committed")
    record = {"plan_file": plan_file.name, "sha256": file_sha256(data), "plan_fingerprint": fingerprint,
              "commit": commit, "registered": datetime.date.today().isoformat()}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def check_registration(plan_file: Path, fingerprint: str) -> dict[str, Any]:
    """The registration of a confirmatory plan file, checked; what each unit records.

    Raises:
        StudyFileError: no registration, or the plan file changed since it was registered (or,
            in a checkout, since the commit that added it).
    """
    path = registration_path(plan_file)
    if not path.is_file():
        raise StudyFileError(f"{plan_file} is not registered: commit it, run cl-streamkl study {plan_file} --register "
                             f"and commit {path.name} before --part confirm")
    record = read_json(path, "registration")
    lacking = [key for key in REGISTRATION_KEYS if not isinstance(record.get(key), str)]
    if lacking:
        raise StudyFileError(f"{path} is not a complete registration: its {', '.join(lacking)} "
                             f"{'is' if len(lacking) == 1 else 'are'} missing or not text; restore the committed file")
    data = plan_file.read_bytes()
    if record.get("sha256") != file_sha256(data) or record.get("plan_fingerprint") != fingerprint:
        raise StudyFileError(f"{plan_file} changed since it was registered ({path.name}): a pre-registered plan "
                             "cannot change; write a new plan file")
    try:
        added = _added_by(plan_file)
    except StudyFileError:  # a checkout without the file's history (a copied tree): the bytes decide
        added = None
    if added is not None and added[0] != record.get("commit") and (
            _git(plan_file.resolve().parent, "rev-parse", "--is-shallow-repository") or "").strip() == "true":
        added = None  # a shallow clone (CI's, a GPU machine's) shows its oldest commit adding every file
    if added is not None and (added[0] != record.get("commit") or added[1] != data):
        raise StudyFileError(f"{plan_file}: the commit that added it ({added[0][:12] or 'none'}) is not the "
                             f"registered {str(record.get('commit'))[:12]} with these bytes")
    return {"sha256": record["sha256"], "commit": record["commit"]}
