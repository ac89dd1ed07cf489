"""SIGTERM stops `cl-streamkl run` as Ctrl-C does: a message, the --resume command, exit status 143."""

from __future__ import annotations

import os
import signal
import time

import pytest
from cli_helpers import SMALL

from cl_streamkl.experiment import cli, preflight, runner
from cl_streamkl.experiment.interrupts import Terminated, sigterm_raises


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)  # the handler raises within the sleep; a process SIGTERM ended would not get here


def test_sigterm_during_training_says_how_to_continue(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_save = runner.save_checkpoint

    def save_then_terminate(path, state, identity):
        real_save(path, state, identity)
        _terminate_self()

    monkeypatch.setattr(runner, "save_checkpoint", save_then_terminate)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["run", *SMALL, "--out", str(out)]) == 143
    assert signal.getsignal(signal.SIGTERM) is before
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"terminated (SIGTERM); continue with: cl-streamkl run --resume {out}")
    monkeypatch.setattr(runner, "save_checkpoint", real_save)
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert (out / "results.json").is_file()


def test_sigterm_before_training_leaves_nothing_to_continue(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setattr(preflight, "check_experiment", lambda *args: _terminate_self())
    assert cli.main(["run", *SMALL, "--out", str(out)]) == 143
    assert capsys.readouterr().err.strip() == "terminated (SIGTERM)"
    assert not out.exists()


def test_ctrl_c_keeps_its_status(tmp_path, monkeypatch, capsys):
    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(preflight, "check_experiment", interrupt)
    assert cli.main(["run", *SMALL, "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_sigterm_raises_only_within_the_block():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_raises():
        _terminate_self()
    assert signal.getsignal(signal.SIGTERM) is before
    assert issubclass(Terminated, KeyboardInterrupt)
