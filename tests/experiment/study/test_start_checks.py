"""Where a study start writes and what it runs on, checked before anything is written: a user's
folder or JSON file, a regime that climbs out of runs/, a folder another start holds, --device cuda
without a GPU, --part test before tuning, a data_root that does not exist."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch
from study_helpers import files_under, one_line_error, tiny_plan, write_plan

from cl_streamkl.experiment.run_lock import run_folder_lock
from cl_streamkl.experiment.study.command import main


def _refused(capsys, tmp_path, argv, message):
    before = files_under(tmp_path)
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert message in line, line
    assert files_under(tmp_path) == before
    return line


def test_a_folder_of_the_users_that_holds_no_study_is_not_written_into(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "report.md").write_text("my own notes\n")
    _refused(capsys, tmp_path, [str(plan), "--part", "plan", "--out", str(mine)],
             f"--out {mine} holds files but no study (no plan.json)")
    # An empty folder, and a study's own, are taken.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(plan), "--part", "plan", "--out", str(empty)]) == 0
    assert main([str(plan), "--part", "plan", "--out", str(empty)]) == 0


def test_a_json_file_that_is_no_study_report_is_not_overwritten(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"config": {"dataset": "digits"}, "runs": [{"strategy": "naive"}]}))
    _refused(capsys, tmp_path, [str(plan), "--part", "plan", "--out", str(tmp_path / "out"), "--json", str(results)],
             f"--json {results} is not a study report")
    assert not (tmp_path / "out").exists()


def test_a_regime_with_a_path_separator_cannot_name_the_default_folder(tmp_path, capsys, monkeypatch):
    work = tmp_path / "a" / "b" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan(regime="x/../../../escaped"))
    _refused(capsys, tmp_path, [str(plan), "--part", "plan"], "regime 'x/../../../escaped' cannot name the default")
    assert not (work / "runs").exists()


def test_a_second_start_on_a_held_folder_is_refused_at_once(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    out = tmp_path / "out"
    with run_folder_lock(out):  # a start that is training in this folder
        before = files_under(out)
        assert main([str(plan), "--part", "plan", "--out", str(out)]) == 2
        assert f"--out {out} is in use by another cl-streamkl start" in one_line_error(capsys)
        assert files_under(out) == before and not (out / "plan.json").exists()
    assert main([str(plan), "--part", "plan", "--out", str(out)]) == 0  # free again


def test_device_cuda_without_a_gpu_is_refused_before_the_plan_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    _refused(capsys, tmp_path, [str(plan), "--device", "cuda", "--workers", "2", "--out", str(tmp_path / "out")],
             "--device cuda: no CUDA GPU is visible here")
    assert not (tmp_path / "out").exists()


def test_part_test_before_tuning_writes_nothing(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    _refused(capsys, tmp_path, [str(plan), "--part", "test", "--workers", "0", "--out", str(tmp_path / "out")],
             "the tuning of scenario class is not finished; run --part tune first")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dataset, advice", [("imagefolder", "point it at your image folder"),
                                             ("cifar10", "set download: true in settings to fetch cifar10")])
def test_a_data_root_that_does_not_exist_is_one_line_without_a_flag_the_study_lacks(tmp_path, capsys, dataset,
                                                                                    advice):
    settings = {**tiny_plan()["settings"], "dataset": dataset, "data_root": str(tmp_path / "missing")}
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan(settings=settings))
    line = _refused(capsys, tmp_path, [str(plan), "--part", "tune", "--workers", "0", "--out", str(tmp_path / "out")],
                    f"settings.data_root '{tmp_path / 'missing'}' does not exist")
    assert advice in line and "--download" not in line and str(plan) in line
    assert not (tmp_path / "out").exists()


def test_a_model_that_cannot_be_built_is_refused_before_the_plan_is_written(tmp_path, capsys):
    settings = {**tiny_plan()["settings"], "model_kwargs": {"depth": "abc", "embed_dim": 16, "num_heads": 2}}
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan(settings=settings))
    line = _refused(capsys, tmp_path, [str(plan), "--part", "tune", "--workers", "0", "--out", str(tmp_path / "out")],
                    "depth: 'abc' is not an int")
    assert str(plan) in line and not (tmp_path / "out").exists()


def test_an_archive_path_holding_a_users_file_is_not_overwritten(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    theirs = tmp_path / "notes.tar.gz"
    theirs.write_text("not an archive\n")
    _refused(capsys, tmp_path, [str(plan), "--part", "plan", "--out", str(tmp_path / "out"), "--archive", str(theirs)],
             f"--archive {theirs} exists and is no study archive of this plan")


def test_a_users_own_tar_gz_or_another_plans_archive_is_not_overwritten(tmp_path, capsys):
    """A real .tar.gz (a dataset's release, a backup) or another plan's archive is no archive of this study."""
    plan = write_plan(tmp_path / "a.yaml", tiny_plan(val_seeds=[7, 8]))
    other = write_plan(tmp_path / "b.yaml", tiny_plan(val_seeds=[5, 6]))
    release = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(release, "w:gz") as packed:
        packed.add(plan, arcname="cifar-10-batches-py/data_batch_1")
    theirs = tmp_path / "theirs.tar.gz"
    assert main([str(other), "--part", "plan", "--out", str(tmp_path / "b"), "--archive", str(theirs)]) == 0
    stray = tmp_path / "backup.tar.gz.1"  # a later part's name, without its first part
    stray.write_text("my own file\n")
    for archive in (release, theirs, tmp_path / "backup.tar.gz"):
        _refused(capsys, tmp_path, [str(plan), "--part", "plan", "--out", str(tmp_path / "out"), "--archive",
                                    str(archive)], "exists and is no study archive of this plan")
    # This plan's own archive is written again.
    mine = tmp_path / "mine.tar.gz"
    assert main([str(plan), "--part", "plan", "--out", str(tmp_path / "out"), "--archive", str(mine)]) == 0
    assert main([str(plan), "--part", "plan", "--out", str(tmp_path / "out"), "--archive", str(mine)]) == 0


def test_a_damaged_record_in_the_folder_is_named(tmp_path, capsys):
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    out = tmp_path / "out"
    assert main([str(plan), "--part", "plan", "--out", str(out)]) == 0
    (out / "units").mkdir()
    (out / "units" / "x.json").write_text('{"unit": ')
    _refused(capsys, tmp_path, [str(plan), "--part", "test", "--workers", "0", "--out", str(out)],
             f"--out's record {out / 'units' / 'x.json'} is not JSON")
