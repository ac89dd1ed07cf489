"""The git commit that runs and benchmarks record."""

import subprocess
from pathlib import Path

import pytest

from cl_streamkl import _provenance
from cl_streamkl._provenance import git_commit


def test_git_commit_names_the_checkout_head():
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the tests do not run from a git checkout")
    assert git_commit() == head
    short = git_commit(short=True, mark_dirty=True)
    assert len(short.removesuffix("+dirty")) < len(head) and head.startswith(short.removesuffix("+dirty"))


def test_git_commit_outside_a_checkout_is_none(tmp_path, monkeypatch):
    monkeypatch.setattr(_provenance, "_PACKAGE_DIR", tmp_path)
    assert git_commit(short=True, mark_dirty=True) is None
