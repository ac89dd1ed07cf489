"""`--resume` from checkpoints: the results of an uninterrupted run, and checkpoints that do not belong refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_helpers import TINY, one_line_error, run_cli

from cl_streamkl.experiment import cli, runner


# Checkpoints written: ewc's two, then replay+streamkl's (3: after its first experience), then
# lwf+streamkl's (5: after its first, two teachers that are copies of the model).
@pytest.mark.parametrize("cut_after", [3, 5])
def test_resume_reproduces_uninterrupted_run(tmp_path, monkeypatch, capsys, cut_after):
    strategies = ["--strategies", "ewc", "replay+streamkl", "lwf+streamkl", "--mem-size", "40", "--experiences", "2"]
    rc, full = run_cli(tmp_path, "full", *strategies)
    assert rc == 0

    real_save = runner.save_checkpoint
    saves = []

    def save_then_stop(path, state, identity):
        real_save(path, state, identity)
        saves.append(path)
        if len(saves) == cut_after:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "save_checkpoint", save_then_stop)
    rc, cut = run_cli(tmp_path, "cut", *strategies)
    assert rc == 130
    assert "--resume" in capsys.readouterr().err
    assert not (cut / "results.json").exists()
    monkeypatch.setattr(runner, "save_checkpoint", real_save)

    assert cli.main(["run", "--resume", str(cut), "--no-progress"]) == 0
    expected = json.loads((full / "results.json").read_text())["runs"]
    resumed = json.loads((cut / "results.json").read_text())["runs"]
    for a, b in zip(expected, resumed, strict=True):
        assert a["strategy"] == b["strategy"]
        assert a["accuracy_matrix"] == b["accuracy_matrix"]
        assert a["penalties"] == pytest.approx(b["penalties"], rel=1e-6, abs=1e-9)
    final_a = torch.load(full / "checkpoints" / "replay+streamkl-seed0.pt", weights_only=True)
    final_b = torch.load(cut / "checkpoints" / "replay+streamkl-seed0.pt", weights_only=True)
    for key, value in final_a["model"].items():
        torch.testing.assert_close(final_b["model"][key], value, rtol=1e-5, atol=1e-6)


def test_resume_refuses_checkpoints_that_do_not_belong(tmp_path, capsys):
    rc, out = run_cli(tmp_path, "run", "--strategies", "streamkl", "replay+streamkl", "--experiences", "2")
    assert rc == 0
    ckpt = out / "checkpoints" / "replay+streamkl-seed0.pt"
    good_ckpt, good_config = ckpt.read_bytes(), (out / "config.json").read_text()
    capsys.readouterr()

    def resume_fails_with(*fragments: str) -> None:
        assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 2
        err = one_line_error(capsys)
        assert all(fragment in err for fragment in fragments), err
        ckpt.write_bytes(good_ckpt)
        (out / "config.json").write_text(good_config)

    shutil.copy(out / "checkpoints" / "streamkl-seed0.pt", ckpt)
    resume_fails_with(str(ckpt), "belongs to streamkl seed 0, not replay+streamkl seed 0")
    for field, old, new in [("num_heads", '"num_heads": 2', '"num_heads": 4'),
                            ("split_seed", '"split_seed": 0', '"split_seed": 1'),
                            ("lr", '"lr": 0.001', '"lr": 0.01')]:
        (out / "config.json").write_text(good_config.replace(old, new))
        resume_fails_with(str(out / "checkpoints"), "another configuration than config.json",
                          "model_kwargs" if field == "num_heads" else field)
    state = torch.load(ckpt, weights_only=True)
    state["model"]["blocks.0.attn.qkv.weight"][0, 0] = 1e37
    torch.save(state, ckpt)
    resume_fails_with(str(ckpt), "fails its checksum")
    for name, damaged in [("empty", b""), ("truncated", good_ckpt[: len(good_ckpt) // 3]),
                          ("garbage", b"\x80\x04not a checkpoint" * 10)]:
        ckpt.write_bytes(damaged)
        resume_fails_with(str(ckpt), "delete it to restart replay+streamkl seed 0 from its first experience")
    # Untouched, the folder resumes (both runs finished: nothing trains) to the same results.
    results = (out / "results.json").read_text()
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert json.loads((out / "results.json").read_text())["runs"] == json.loads(results)["runs"]


def test_resume_rejects_other_options_and_non_run_folders(tmp_path, capsys):
    assert cli.main(["run", "--resume", str(tmp_path)]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    assert cli.main(["run", "--resume", str(tmp_path), "--epochs", "3"]) == 2
    assert "drop --epochs" in capsys.readouterr().err


def test_config_file_starts_a_run_and_flags_override_it(tmp_path, capsys):
    saved = cli._config_from_args(cli.build_parser().parse_args(
        ["run", *TINY, "--strategies", "naive", "--experiences", "2", "--lr", "1e-9", "--split-seed", "3",
         "--out", str(tmp_path / "original")])).resolved()
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(saved.to_dict()))
    out = tmp_path / "from-config"
    rc = cli.main(["run", "--config", str(config_file), "--seeds", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    config = json.loads((out / "results.json").read_text())["config"]
    expected = {**saved.to_dict(), "seeds": [1], "out": str(out)}
    assert config == expected
    # lr 1e-9 learns nothing: a warning names the strategy, seed and experience.
    err = capsys.readouterr().err
    assert "cl-streamkl: warning: naive seed 1 did not learn experience 2: 0.0 % accuracy" in err
    assert "chance is 20.0 %" in err  # one over the experience's five classes
    # The file's own --out is not reused, and --config does not combine with --resume.
    assert cli.main(["run", "--resume", str(out), "--config", str(config_file)]) == 2
    assert "drop --config" in capsys.readouterr().err


def test_after_experience_follows_each_checkpoint_and_can_stop_the_run(tmp_path):
    from cl_streamkl.experiment.config import ExperimentConfig

    config = ExperimentConfig.from_dict({
        "model_kwargs": {"depth": 1, "embed_dim": 16, "num_heads": 2}, "image_size": 8, "patch_size": 4,
        "epochs": 1, "batch_size": 64, "strategies": ["naive"], "experiences": 5, "seeds": [0], "device": "cpu",
        "out": str(tmp_path / "whole")}).resolved()
    calls = []
    [whole] = runner.run_experiment(config, tmp_path / "whole", show_progress=False,
                                    after_experience=lambda trained, count: calls.append((trained, count)))
    assert calls == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]

    class Stop(Exception):
        pass

    def stop_after_two(trained, count):
        calls.append((trained, count))
        if trained == 2:
            raise Stop

    calls.clear()
    with pytest.raises(Stop):
        runner.run_experiment(config, tmp_path / "cut", show_progress=False, after_experience=stop_after_two)
    [resumed] = runner.run_experiment(config, tmp_path / "cut", resume=True, show_progress=False,
                                      after_experience=stop_after_two)
    assert calls == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]  # the resumed run trains from the third on
    assert resumed.accuracy_matrix == whole.accuracy_matrix
