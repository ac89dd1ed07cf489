"""Checkpoints check themselves: checksum, identity, unreadable files, and writes that fail cleanly."""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import pytest
import torch

from cl_streamkl.experiment.checkpoint import CheckpointError, RunIdentity, load_checkpoint, rng_state, save_checkpoint
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.files import OutputWriteError

CONFIG = ExperimentConfig().resolved()
IDENTITY = RunIdentity("replay+streamkl", 0, CONFIG.fingerprint_json())


def make_state(experiences_done: int = 1) -> dict:
    torch.manual_seed(0)
    return {"experiences_done": experiences_done, "finished": False,
            "model": {"blocks.0.weight": torch.randn(4, 4), "blocks.0.bias": torch.zeros(4, dtype=torch.bfloat16)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]},
            "scaler": None, "plugins": {"streamkl": {"teacher": None, "layers": "all"}}, "clock": {"train_iterations": 7},
            "rng": rng_state(), "result": {"strategy": "replay+streamkl", "penalties": [0.0, 0.5]}}


def one_line_naming(error: CheckpointError, path: Path) -> str:
    message = str(error)
    assert "\n" not in message and str(path) in message and "weights_only" not in message
    return message


def test_round_trip_keeps_identity_and_checksum(tmp_path):
    path = tmp_path / "checkpoints" / "replay+streamkl-seed0.pt"
    save_checkpoint(path, make_state(), IDENTITY)
    state = load_checkpoint(path, IDENTITY)
    assert (state["strategy"], state["seed"]) == ("replay+streamkl", 0)
    assert state["config_fingerprint"] == IDENTITY.fingerprint and len(state["checksum"]) == 64
    assert torch.equal(state["model"]["blocks.0.weight"], make_state()["model"]["blocks.0.weight"])
    assert os.listdir(path.parent) == [path.name]


def test_equal_tensors_are_written_once_and_loaded_apart(tmp_path):
    state = make_state()
    weight = torch.randn(256, 256)
    teacher = {"blocks.0.weight": weight.clone(), "blocks.0.bias": torch.ones(4)}  # a copy, as after an experience
    state["model"]["blocks.0.weight"] = weight
    state["plugins"]["streamkl"]["teacher"] = teacher
    path, alone = tmp_path / "shared.pt", tmp_path / "alone.pt"
    save_checkpoint(path, state, IDENTITY)
    save_checkpoint(alone, {**state, "plugins": {"streamkl": {"teacher": None, "layers": "all"}}}, IDENTITY)
    assert path.stat().st_size < alone.stat().st_size + 4096  # the teacher's copy costs nothing
    loaded = load_checkpoint(path, IDENTITY)
    model, copy = loaded["model"]["blocks.0.weight"], loaded["plugins"]["streamkl"]["teacher"]["blocks.0.weight"]
    assert torch.equal(model, weight) and torch.equal(copy, weight)
    model.add_(1.0)  # the loaded tensors do not share memory: changing one leaves the other
    assert torch.equal(copy, weight) and torch.equal(loaded["plugins"]["streamkl"]["teacher"]["blocks.0.bias"],
                                                     torch.ones(4))


def test_a_changed_weight_fails_the_checksum(tmp_path):
    path = tmp_path / "run.pt"
    save_checkpoint(path, make_state(), IDENTITY)
    state = torch.load(path, weights_only=True)
    state["model"]["blocks.0.weight"][1, 2] = 1e37
    torch.save(state, path)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, IDENTITY)
    assert "fails its checksum" in one_line_naming(error.value, path)
    assert "delete it to restart replay+streamkl seed 0" in str(error.value)


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    path = tmp_path / "replay+streamkl-seed0.pt"
    save_checkpoint(path, make_state(), RunIdentity("streamkl", 0, IDENTITY.config))
    with pytest.raises(CheckpointError, match="belongs to streamkl seed 0, not replay\\+streamkl seed 0"):
        load_checkpoint(path, IDENTITY)
    save_checkpoint(path, make_state(), RunIdentity("replay+streamkl", 1, IDENTITY.config))
    with pytest.raises(CheckpointError, match="belongs to replay\\+streamkl seed 1"):
        load_checkpoint(path, IDENTITY)
    edited = ExperimentConfig(model_kwargs={"depth": 4, "embed_dim": 64, "num_heads": 4}, split_seed=3, lr=0.01)
    save_checkpoint(path, make_state(), RunIdentity("replay+streamkl", 0, edited.resolved().fingerprint_json()))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, IDENTITY)
    assert "another configuration than config.json (lr, model_kwargs, split_seed differ)" in one_line_naming(
        error.value, path)


def test_where_files_live_and_the_other_runs_are_not_part_of_the_fingerprint():
    moved = ExperimentConfig(out="elsewhere", data_root="/data", strategies=["joint"], seeds=[4, 5]).resolved()
    assert moved.fingerprint_json() == CONFIG.fingerprint_json()
    assert ExperimentConfig(temperature=2.0).resolved().fingerprint_json() != CONFIG.fingerprint_json()


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage, reason", [
    (lambda path: path.write_bytes(b""), "is empty"),
    (_truncated, "is truncated or not a checkpoint file"),
    (lambda path: path.write_bytes(b"\x80\x02garbage" * 50), "is truncated or not a checkpoint file"),
    (lambda path: path.write_bytes(b"\x80\x04not a checkpoint" * 10), "is truncated or not a checkpoint file"),
    (lambda path: torch.save({"finished": True}, path), "is not a checkpoint of this cl-streamkl version"),
    (lambda path: torch.save({"format": "cl_streamkl.run-checkpoint/2", "checksum": "0"}, path), "lacks"),
], ids=["empty", "truncated", "garbage", "garbage-protocol-4", "foreign", "incomplete"])
def test_unreadable_checkpoints_give_one_line_naming_the_file(tmp_path, recwarn, damage, reason):
    path = tmp_path / "replay+streamkl-seed0.pt"
    save_checkpoint(path, make_state(), IDENTITY)
    damage(path)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, IDENTITY)
    assert [str(w.message) for w in recwarn] == []  # nothing printed besides the error
    message = one_line_naming(error.value, path)
    assert reason in message and "delete it to restart replay+streamkl seed 0 from its first experience" in message


def read_only(monkeypatch, folder: Path) -> None:
    """Make ``folder`` behave as read-only (tests may run as root, where permissions do not bind)."""
    real_open, real_mkdir = builtins.open, os.mkdir

    def inside(path) -> bool:
        return Path(os.fspath(path)).absolute().is_relative_to(folder.absolute())

    def guarded_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and inside(file) and set(mode) & set("wax+"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    def guarded_mkdir(path, *args, **kwargs):
        if inside(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(os, "mkdir", guarded_mkdir)


def disk_full_after(monkeypatch, written: int) -> None:
    """``torch.save`` writes ``written`` bytes, then the disk is full."""
    def save(obj, handle, *args, **kwargs):
        handle.write(b"\0" * written)
        raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from OSError(
            errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("failure, reason", [(read_only, "Permission denied"),
                                             (lambda m, folder: disk_full_after(m, 4096), "No space left on device")],
                         ids=["read-only", "disk-full"])
def test_a_failed_write_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(tmp_path, monkeypatch,
                                                                                   failure, reason):
    path = tmp_path / "checkpoints" / "replay+streamkl-seed0.pt"
    save_checkpoint(path, make_state(1), IDENTITY)
    failure(monkeypatch, path.parent)
    with pytest.raises(OutputWriteError) as error:
        save_checkpoint(path, make_state(2), IDENTITY)
    monkeypatch.undo()
    assert str(error.value) == f"cannot write {path}: {reason}; the previous version is kept"
    assert os.listdir(path.parent) == [path.name]
    assert load_checkpoint(path, IDENTITY)["experiences_done"] == 1
