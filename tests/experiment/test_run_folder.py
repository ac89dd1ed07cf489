"""One run per folder: a second run on a folder in use is refused; a killed run leaves no stale lock."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import SMALL, one_line_error

from cl_streamkl.experiment import cli
from cl_streamkl.experiment.run_folder import refuse_used_folder
from cl_streamkl.experiment.run_lock import LOCK_FILE

ROOT = Path(__file__).resolve().parents[2]
HOLD_LOCK = ("import sys, time\nfrom cl_streamkl.experiment.run_lock import run_folder_lock\n"
             "with run_folder_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(300)\n")


@pytest.fixture
def lock_holder():
    """Start a process that holds a folder's lock the way a running run does; it is killed at the end."""
    processes = []

    def hold(folder: Path) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE)
        processes.append(process)
        assert process.stdout.readline().strip() == "locked"
        return process

    yield hold
    for process in processes:
        process.kill()
        process.wait()


def test_a_folder_in_use_is_refused_and_a_killed_run_leaves_it_free(tmp_path, capsys, lock_holder):
    out = tmp_path / "run"
    holder = lock_holder(out)
    assert cli.main(["run", *SMALL, "--out", str(out)]) == 2
    assert f"'{out}' is in use by another cl-streamkl run" in one_line_error(capsys)
    assert [p.name for p in out.iterdir()] == [LOCK_FILE]  # nothing of the refused run
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert cli.main(["run", *SMALL, "--out", str(out)]) == 0
    assert (out / "results.json").is_file()


def test_resuming_a_folder_in_use_is_refused(tmp_path, capsys, lock_holder):
    out = tmp_path / "run"
    assert cli.main(["run", *SMALL, "--out", str(out)]) == 0
    results = (out / "results.json").read_bytes()
    lock_holder(out)
    capsys.readouterr()
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 2
    assert "is in use by another cl-streamkl run" in one_line_error(capsys)
    assert (out / "results.json").read_bytes() == results


@pytest.mark.parametrize("under", [False, True], ids=["out a file", "out under a file"])
def test_an_out_that_is_or_lies_under_a_file_is_refused_in_one_line(tmp_path, capsys, under):
    blocking = tmp_path / "notes.txt"
    blocking.write_text("mine\n")
    out = blocking / "run" if under else blocking
    assert cli.main(["run", *SMALL, "--out", str(out)]) == 2
    assert f"--out {out}: {blocking} is a file, not a folder" in one_line_error(capsys)
    assert blocking.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("name", ["results.json", "summary.md", "accuracy_matrix_naive.png", "checkpoints"])
def test_a_new_run_never_overwrites_files_of_its_names_already_in_out(tmp_path, capsys, name):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("kept\n")
    if name == "checkpoints":
        (out / name).mkdir()
        (out / name / "naive-seed0.pt").write_bytes(b"my own weights")
    else:
        (out / name).write_text("precious\n")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert cli.main(["run", *SMALL, "--out", str(out)]) == 2
    assert f"'{out}' holds {name}, which a new run would overwrite" in one_line_error(capsys)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_folder_of_other_files_takes_a_run(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "slurm-1234.out").write_text("a scheduler's log\n")
    assert cli.main(["run", *SMALL, "--out", str(out)]) == 0
    assert (out / "slurm-1234.out").read_text() == "a scheduler's log\n" and (out / "results.json").is_file()


def test_every_name_a_run_writes_is_one_a_new_run_refuses(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["run", *SMALL, "--out", str(out), "--log", "csv"]) == 0
    for entry in out.iterdir():
        if entry.name in (LOCK_FILE, "config.json"):
            continue
        other = tmp_path / f"other-{entry.name}"
        other.mkdir()
        (other / entry.name).touch()
        with pytest.raises(ValueError, match=f"holds {entry.name}, which a new run would overwrite"):
            refuse_used_folder(other, resume=False)
