"""The wheel and the sdist build from a clone and pass ``twine check``, so publishing is one upload."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def distributions(tmp_path_factory) -> list[Path]:
    """A wheel and an sdist built from a copy of the checkout's tracked files (no build folders, no runs)."""
    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    # No isolation: the installed setuptools builds it, so the test needs no index.
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir",
                           str(out), str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return sorted(out.iterdir())


@pytest.mark.slow
def test_wheel_and_sdist_pass_twine_check(distributions):
    assert sorted(path.suffix for path in distributions) == [".gz", ".whl"]
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, distributions)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2


@pytest.mark.slow
def test_the_wheel_holds_the_package_and_its_command(distributions):
    wheel = next(path for path in distributions if path.suffix == ".whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cl_streamkl/attention_kl.py" in names and "cl_streamkl/experiment/cli.py" in names
    assert not any(name.startswith(("tests/", "benchmarks/")) for name in names)
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "cl-streamkl = cl_streamkl.experiment.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    sdist = next(path for path in distributions if path.suffix == ".gz")
    with tarfile.open(sdist) as archive:
        assert any(name.endswith("/README.md") for name in archive.getnames())
