"""``--resume DIR`` continues in DIR: moved, copied and relative run folders, nothing written elsewhere."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import SMALL, one_line_error

from cl_streamkl.experiment import cli, runner


def _interrupted_run(monkeypatch, out: Path | str) -> None:
    """A run of two experiences stopped right after its first checkpoint."""
    real_save = runner.save_checkpoint

    def save_then_stop(path, state, identity):
        real_save(path, state, identity)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "save_checkpoint", save_then_stop)
    assert cli.main(["run", *SMALL, "--out", str(out)]) == 130
    monkeypatch.setattr(runner, "save_checkpoint", real_save)


def _counting_saves(monkeypatch) -> list[Path]:
    real_save, saved = runner.save_checkpoint, []

    def save(path, state, identity):
        saved.append(Path(path))
        real_save(path, state, identity)

    monkeypatch.setattr(runner, "save_checkpoint", save)
    return saved


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_moved_run_folder_continues_where_it_now_is(tmp_path, monkeypatch):
    _interrupted_run(monkeypatch, tmp_path / "before")
    moved = tmp_path / "after"
    shutil.move(tmp_path / "before", moved)
    saved = _counting_saves(monkeypatch)
    assert cli.main(["run", "--resume", str(moved), "--no-progress"]) == 0
    # one experience left to train, in the moved folder; the old path stays gone
    assert saved == [moved / "checkpoints" / "naive-seed0.pt"]
    assert not (tmp_path / "before").exists()
    results = json.loads((moved / "results.json").read_text())
    assert results["config"]["out"] == str(moved) and len(results["runs"][0]["accuracy_matrix"]) == 2


def test_a_copy_resumes_from_its_own_checkpoints_and_leaves_the_original_alone(tmp_path, monkeypatch, capsys):
    original = tmp_path / "original"
    _interrupted_run(monkeypatch, original)
    before = _snapshot(original)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    # the copy's own checkpoint is what is read: damaged, it is refused
    ckpt = copy / "checkpoints" / "naive-seed0.pt"
    good = ckpt.read_bytes()
    ckpt.write_bytes(good[: len(good) // 2])
    capsys.readouterr()
    assert cli.main(["run", "--resume", str(copy), "--no-progress"]) == 2
    assert f"checkpoint {ckpt} is truncated" in one_line_error(capsys)
    ckpt.write_bytes(good)
    assert cli.main(["run", "--resume", str(copy), "--no-progress"]) == 0
    assert (copy / "results.json").is_file()
    assert _snapshot(original) == before


def test_a_relative_run_folder_resumes_from_another_directory(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    _interrupted_run(monkeypatch, "run")  # config.json records the relative "run"
    assert json.loads((tmp_path / "a" / "run" / "config.json").read_text())["out"] == "run"
    monkeypatch.chdir(tmp_path / "b")
    saved = _counting_saves(monkeypatch)
    assert cli.main(["run", "--resume", os.path.join("..", "a", "run"), "--no-progress"]) == 0
    assert [p.resolve() for p in saved] == [tmp_path / "a" / "run" / "checkpoints" / "naive-seed0.pt"]
    assert list((tmp_path / "b").iterdir()) == []
    assert (tmp_path / "a" / "run" / "results.json").is_file()


@pytest.mark.parametrize("out, resumes", [(None, True), ("/elsewhere", True), (5, False)])
def test_the_saved_out_is_ignored_and_checked(tmp_path, monkeypatch, capsys, out, resumes):
    folder = tmp_path / "run"
    _interrupted_run(monkeypatch, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "out": out}))
    capsys.readouterr()
    rc = cli.main(["run", "--resume", str(folder), "--no-progress"])
    if resumes:
        assert rc == 0 and (folder / "results.json").is_file()
        assert not Path("/elsewhere").exists()
    else:
        assert rc == 2
        assert "config.json: out must be a string or null; got 5" in one_line_error(capsys)
