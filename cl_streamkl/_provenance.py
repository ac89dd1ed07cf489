"""The git commit that the running code comes from, for the records runs and benchmarks write."""

from __future__ import annotations

import subprocess
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=_PACKAGE_DIR, capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def git_commit(*, short: bool = False, mark_dirty: bool = False) -> str | None:
    """The commit of the git checkout this package is imported from; None outside one.

    Args:
        short: the abbreviated hash (``git rev-parse --short``) instead of the full one.
        mark_dirty: append ``+dirty`` when tracked files hold uncommitted edits.
    """
    try:
        commit = _git("rev-parse", "--short", "HEAD") if short else _git("rev-parse", "HEAD")
        dirty = mark_dirty and bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")
