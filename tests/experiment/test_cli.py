"""`cl-streamkl run` end to end on a tiny configuration, resume, and the error cases."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cl_streamkl.experiment import cli
from cl_streamkl.experiment import runner

TINY = ["--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "--image-size", "8",
        "--patch-size", "4", "--epochs", "1", "--batch-size", "64", "--no-progress"]


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[int, Path]:
    out = tmp_path / name
    return cli.main(["run", *TINY, "--out", str(out), *extra]), out


def test_run_end_to_end(tmp_path, capsys):
    rc, out = _run(tmp_path, "e2e", "--strategies", "naive", "lwf+streamkl", "--seeds", "0", "1")
    printed = capsys.readouterr().out
    assert rc == 0
    # the aligned comparison table, one row per strategy, mean ± std over two seeds
    table = printed[printed.index("Strategy"):].splitlines()
    assert table[0].split()[:4] == ["Strategy", "Class-IL", "acc", "(%)"]
    assert [line.split()[0] for line in table[2:4]] == ["naive", "lwf+streamkl"]
    assert "±" in table[2] and len({len(line) for line in table[:4]}) == 1

    results = json.loads((out / "results.json").read_text())
    assert results["config"]["strategies"] == ["naive", "lwf+streamkl"]
    assert results["config"]["model_kwargs"] == {"depth": 1, "embed_dim": 16, "num_heads": 2}
    assert results["environment"]["versions"]["avalanche-lib"] and results["environment"]["versions"]["timm"]
    assert len(results["runs"]) == 4
    for run in results["runs"]:
        matrix = run["accuracy_matrix"]
        assert len(matrix) == 5 and all(len(row) == 5 for row in matrix)
        assert all(0.0 <= a <= 1.0 for row in matrix for a in row)
        assert 0.0 <= run["final_average_accuracy"] <= 1.0
        assert run["final_average_accuracy"] == pytest.approx(sum(matrix[-1]) / 5)
        assert -1.0 <= run["backward_transfer"] <= 1.0 and run["wall_time_s"] > 0
        assert len(run["average_accuracy"]) == 5
        task_il = run["task_il_matrix"]
        assert len(task_il) == 5 and all(0.0 <= a <= 1.0 for row in task_il for a in row)
        # restricting the argmax to an experience's classes can only help
        assert all(t >= a for tr, ar in zip(task_il, matrix) for t, a in zip(tr, ar))
        assert run["learning_accuracy"] == pytest.approx(sum(matrix[i][i] for i in range(5)) / 5)
        if "streamkl" in run["strategy"]:
            # 5 experiences × 1 epoch × ceil(~260/64) iterations, no penalty before a teacher exists
            assert len(run["penalties"]) >= 5 * 4
            assert all(p == 0.0 for p in run["penalties"][:4]) and max(run["penalties"]) > 0
        else:
            assert run["penalties"] == []
    summary = results["summary"]["lwf+streamkl"]
    assert summary["seeds"] == [0, 1]
    # no lwf run to pair lwf+streamkl with: nothing to compare
    assert results["paired"] == [] and "paired differences" not in printed
    assert len(summary["accuracy_matrix"]["mean"]) == 5

    with open(out / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["strategy"], r["seed"]) for r in rows] == [
        ("naive", "0"), ("lwf+streamkl", "0"), ("naive", "1"), ("lwf+streamkl", "1")]
    with open(out / "summary.csv") as handle:
        assert [r["strategy"] for r in csv.DictReader(handle)] == ["naive", "lwf+streamkl"]
    for png in ["average_accuracy.png", "accuracy_matrix_naive.png", "accuracy_matrix_lwf_plus_streamkl.png"]:
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    ckpt = torch.load(out / "checkpoints" / "lwf+streamkl-seed1.pt", weights_only=True)
    assert ckpt["finished"] and ckpt["experiences_done"] == 5
    assert set(ckpt["plugins"]) == {"lwf", "streamkl"}


@pytest.mark.parametrize("scenario, strategies, accuracy_title", [
    ("class", ["naive", "streamkl", "wa", "wa+streamkl", "pad", "joint"], "Class-IL"),
    ("task", ["naive", "lwf", "lwf+pad", "streamkl", "replay+streamkl", "replay", "joint"], "Task-IL"),
    ("domain", ["naive", "streamkl", "pad", "ewc", "joint"], "Domain-IL"),
])
def test_every_scenario_end_to_end(tmp_path, capsys, scenario, strategies, accuracy_title):
    extra = ["--first-experience-classes", "4"] if scenario != "domain" else ["--domain-shift", "permute"]
    rc, out = _run(tmp_path, scenario, "--scenario", scenario, "--experiences", "3", "--mem-size", "30",
                   "--strategies", *strategies, "--seeds", "0", "1", *extra)
    printed = capsys.readouterr().out
    assert rc == 0
    assert printed[printed.index("Strategy"):].split()[1] == accuracy_title
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["scenario"] == scenario
    for run in results["runs"]:
        assert len(run["accuracy_matrix"]) == 3 and 0.0 <= run["learning_accuracy"] <= 1.0
        assert bool(run["task_il_matrix"]) == (scenario == "class")
        if {"streamkl", "pad"} & set(run["strategy"].split("+")):
            assert max(run["penalties"]) > 0
        if run["strategy"] == "joint":
            # trained once on the union, evaluated once: identical rows, nothing to forget
            assert all(row == run["accuracy_matrix"][0] for row in run["accuracy_matrix"])
            assert run["average_forgetting"] == 0.0 and run["backward_transfer"] == 0.0
            assert run["penalties"] == [] and run["learning_accuracy"] == run["final_average_accuracy"]
    pairs = {(e["strategy"], e["baseline"], e["metric"]): e for e in results["paired"]}
    expected = {"class": [("streamkl", "naive"), ("wa+streamkl", "wa"), ("pad", "naive"), ("streamkl", "pad")],
                "task": [("streamkl", "naive"), ("lwf+pad", "lwf"), ("replay+streamkl", "replay")],
                "domain": [("streamkl", "naive"), ("pad", "naive"), ("streamkl", "pad")]}[scenario]
    assert {(s, b) for s, b, _ in pairs} == set(expected)
    entry = pairs[(*expected[0], "mean_experience_accuracy")]
    by_seed = {(r["strategy"], r["seed"]): r["final_average_accuracy"] for r in results["runs"]}
    diffs = [100 * (by_seed[(expected[0][0], s)] - by_seed[(expected[0][1], s)]) for s in (0, 1)]
    assert entry["n"] == 2 and entry["mean_diff"] == pytest.approx(sum(diffs) / 2)
    assert "paired differences" in printed
    if scenario == "task":
        ckpt = torch.load(out / "checkpoints" / "streamkl-seed0.pt", weights_only=True)
        assert {k for k in ckpt["model"] if k.startswith("heads.")} == {
            "heads.0.weight", "heads.0.bias", "heads.1.weight", "heads.1.bias", "heads.2.weight", "heads.2.bias"}
        assert ckpt["model"]["heads.0.weight"].shape[0] == 4 and ckpt["model"]["heads.1.weight"].shape[0] == 3


def test_resume_reproduces_uninterrupted_run(tmp_path, monkeypatch, capsys):
    strategies = ["--strategies", "ewc", "replay+streamkl", "lwf", "--mem-size", "40", "--experiences", "2"]
    rc, full = _run(tmp_path, "full", *strategies)
    assert rc == 0

    real_save = runner.save_checkpoint
    saves = []

    def save_then_stop(path, state, identity):
        real_save(path, state, identity)
        saves.append(path)
        if len(saves) == 3:  # ewc finished, replay+streamkl after its first experience
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "save_checkpoint", save_then_stop)
    rc, cut = _run(tmp_path, "cut", *strategies)
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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "naive", "gem"], "unknown strategy component 'gem'"),
        (["--scenario", "task", "--strategies", "wa"], "needs scenario 'class'"),
        (["--scenario", "domain", "--first-experience-classes", "4"], "first_experience_classes needs scenario"),
        (["--experiences", "3"], "must divide the 10 classes"),
        (["--dataset", "mnist"], "invalid choice: 'mnist'"),
        (["--model", "vit_tinyy_patch16_224"], "unknown timm model 'vit_tinyy_patch16_224'; did you mean"),
        (["--model", "resnet18"], "ViT-family"),
        (["--dataset", "cifar10"], "needs --data-root"),
        (["--dataset", "cifar10", "--data-root", "/nonexistent/cifar"], "does not exist"),
        (["--image-size", "30", "--patch-size", "4"], "not divisible by patch size"),
        (["--layers", "first"], "expected 'all', an integer"),
        (["--eval-split", "val", "--val-fraction", "0"], "val_fraction > 0"),
        (["--pretrained-file", "/nonexistent/w.pth"], "does not exist"),
        (["--strategies", "naive", "joint+lwf"], "joint trains once on every experience's data together"),
        (["--model-kwargs", "pretrained=True"], "would download weights, and nothing is downloaded here: pass a "
                                                "local weights file with --pretrained-file"),
        # Found by building the model and running the penalty before anything is written:
        (["--layers", "7"], "strategy 'streamkl': streamkl cannot distil vit_tiny_patch16_224: layers=7 selects"),
        (["--layers", "0,9"], "layer index 9 is out of range for a model with 4 blocks"),
        (["--strategies", "pad", "--layers", "0,-5"], "strategy 'pad': pad cannot distil"),
        (["--temperature", "1e-40"], "scale / temperature"),
        (["--scenario", "domain", "--experiences", "200"], "training samples for 200 domains"),
    ],
)
def test_errors_exit_nonzero_with_message(tmp_path, capsys, args, message):
    out = tmp_path / "x"
    rc = cli.main(["run", "--no-progress", "--epochs", "1", "--out", str(out), *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("usage:") or err.count("\n") == 1  # argparse's own errors show the usage
    # Checked before the folder is claimed: the same --out takes a corrected run (and --resume has nothing).
    assert not out.exists()


def test_backend_that_cannot_run_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    import cl_streamkl.kernels.triton as triton_kernels

    monkeypatch.setattr(triton_kernels, "INTERPRETING", False)  # a CPU without Triton's interpreter
    rc, out = _run(tmp_path, "triton", "--kl-backend", "triton", "--strategies", "streamkl")
    assert rc == 2
    assert "backend='triton' needs CUDA tensors" in capsys.readouterr().err
    assert not out.exists()


def test_registered_attention_whose_scores_cannot_be_read_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import torch.nn.functional as F
    from timm.layers import Attention

    def einsum_forward(self, x, attn_mask=None, **kwargs):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        weights = F.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale, dim=-1)
        return self.proj(torch.einsum("bhqk,bhkd->bhqd", weights, v).transpose(1, 2).reshape(b, n, c))

    # timm's Attention stays registered, but its scores are now formed in a way QKCapture cannot read.
    monkeypatch.setattr(Attention, "forward", einsum_forward)
    rc, out = _run(tmp_path, "einsum", "--strategies", "naive", "lwf+streamkl")
    assert rc == 2
    err = capsys.readouterr().err
    assert "strategy 'lwf+streamkl': streamkl cannot distil" in err and "cannot read the attention scores" in err
    assert not out.exists()


def test_wandb_logger_reports_scalars_with_the_installed_wandb(tmp_path, monkeypatch):
    from cl_streamkl.experiment.config import ExperimentConfig
    from cl_streamkl.experiment.loggers import build_evaluator, build_loggers, close_loggers

    monkeypatch.setenv("WANDB_MODE", "disabled")
    (logger,) = build_loggers(["wandb"], tmp_path, "streamkl", 0, ExperimentConfig().resolved())
    build_evaluator([logger], penalty=True)
    logger.log_metrics([])
    logger.log_single_metric("Top1_Acc_Exp/eval_phase/test_stream/Exp000", 0.5, 3)
    assert logger.step == 3
    close_loggers([logger])


def test_missing_wandb_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    rc, out = _run(tmp_path, "wandb", "--log", "wandb")
    assert rc == 2
    assert "--log wandb needs the wandb package: pip install wandb" in capsys.readouterr().err
    assert not out.exists()


def test_resume_rejects_other_options_and_non_run_folders(tmp_path, capsys):
    assert cli.main(["run", "--resume", str(tmp_path)]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    assert cli.main(["run", "--resume", str(tmp_path), "--epochs", "3"]) == 2
    assert "drop --epochs" in capsys.readouterr().err


def test_pretrained_file_is_loaded(tmp_path, capsys):
    from cl_streamkl.experiment.model import build_model

    source = build_model("vit_tiny_patch16_224", image_size=8, patch_size=4, in_chans=1, num_classes=10,
                         model_kwargs={"depth": 1, "embed_dim": 16, "num_heads": 2})
    weights = tmp_path / "w.pth"
    torch.save(source.state_dict(), weights)
    # different image size and classifier: timm resamples position embeddings, drops the head
    loaded = build_model("vit_tiny_patch16_224", image_size=16, patch_size=4, in_chans=1, num_classes=4,
                         model_kwargs={"depth": 1, "embed_dim": 16, "num_heads": 2}, pretrained_file=weights)
    torch.testing.assert_close(loaded.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    assert loaded.pos_embed.shape[1] == 1 + 16 and loaded.head.out_features == 4
    rc, out = _run(tmp_path, "pre", "--strategies", "naive", "--experiences", "2",
                   "--pretrained-file", str(weights))
    assert rc == 0
    assert json.loads((out / "results.json").read_text())["config"]["pretrained_file"] == str(weights)


def test_help_lists_strategies_and_datasets(capsys):
    assert cli.main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    for word in ["lwf+streamkl", "tiny-imagenet", "mnist5k", "--scenario", "--first-experience-classes",
                 "--resume", "--image-size", "--amp"]:
        assert word in text


def test_compile_teacher_flag_reaches_the_plugin():
    from cl_streamkl.experiment.cli import _config_from_args, build_parser
    from cl_streamkl.experiment.strategy_plugins import build_plugins

    args = build_parser().parse_args(["run", *TINY, "--strategies", "streamkl", "--compile-teacher"])
    config = _config_from_args(args).resolved()
    assert config.compile_teacher is True
    assert build_plugins("streamkl", config, None, 0)["streamkl"].distiller.compile_options == {}
    default = _config_from_args(build_parser().parse_args(["run", *TINY])).resolved()
    assert build_plugins("streamkl", default, None, 0)["streamkl"].distiller.compile_options is None
    with pytest.raises(ValueError, match="compile_teacher must be true or false"):
        type(config)(compile_teacher="yes").resolved()


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("cl-streamkl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_resume_refuses_checkpoints_that_do_not_belong(tmp_path, capsys):
    rc, out = _run(tmp_path, "run", "--strategies", "streamkl", "replay+streamkl", "--experiences", "2")
    assert rc == 0
    ckpt = out / "checkpoints" / "replay+streamkl-seed0.pt"
    good_ckpt, good_config = ckpt.read_bytes(), (out / "config.json").read_text()
    capsys.readouterr()

    def resume_fails_with(*fragments: str) -> None:
        assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 2
        err = _one_line_error(capsys)
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


@pytest.mark.parametrize("failure", ["read-only checkpoints", "full disk"])
def test_failed_checkpoint_write_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                failure):
    from test_checkpoints import disk_full_after, read_only

    from cl_streamkl.experiment.checkpoint import RunIdentity, load_checkpoint

    real_save = runner.save_checkpoint

    def save_then_fail_next(path, state, identity):
        real_save(path, state, identity)
        monkeypatch.setattr(runner, "save_checkpoint", real_save)
        if failure == "full disk":
            disk_full_after(monkeypatch, 1 << 16)
        else:
            read_only(monkeypatch, path.parent)

    monkeypatch.setattr(runner, "save_checkpoint", save_then_fail_next)
    rc, out = _run(tmp_path, "run", "--strategies", "naive", "--experiences", "2")
    monkeypatch.undo()
    assert rc == 1
    err = _one_line_error(capsys)
    ckpt = out / "checkpoints" / "naive-seed0.pt"
    reason = "No space left on device" if failure == "full disk" else "Permission denied"
    assert f"cannot write {ckpt}: {reason}; the previous version is kept" in err
    assert f"continue with: cl-streamkl run --resume {out}" in err
    assert [p.name for p in ckpt.parent.iterdir()] == [ckpt.name]
    from cl_streamkl.experiment.outputs import read_config

    config = read_config(out).resolved()
    assert load_checkpoint(ckpt, RunIdentity("naive", 0, config.fingerprint_json()))["experiences_done"] == 1
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0


def test_read_only_output_folder_is_one_line(tmp_path, capsys, monkeypatch):
    from test_checkpoints import read_only

    read_only(monkeypatch, tmp_path / "locked")
    rc, out = _run(tmp_path, "locked", "--strategies", "naive", "--experiences", "2")
    assert rc == 1
    assert f"cannot write {out / 'config.json'}: Permission denied" in _one_line_error(capsys)


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
    assert "chance is 10.0 %" in err
    # The file's own --out is not reused, and --config does not combine with --resume.
    assert cli.main(["run", "--resume", str(out), "--config", str(config_file)]) == 2
    assert "drop --config" in capsys.readouterr().err


def test_loggers_write_under_out_without_changing_results(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plain_rc, plain = _run(tmp_path, "plain", "--strategies", "streamkl", "--experiences", "2")
    rc, out = _run(tmp_path, "logged", "--strategies", "streamkl", "--experiences", "2",
                   "--log", "tensorboard", "--log", "csv")
    assert rc == plain_rc == 0
    runs = [json.loads((folder / "results.json").read_text())["runs"] for folder in (plain, out)]
    assert runs[0][0]["accuracy_matrix"] == runs[1][0]["accuracy_matrix"]

    (events,) = (out / "tensorboard" / "streamkl-seed0").glob("events.out.tfevents.*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert any(t.startswith("Loss_Epoch/train_phase/train_stream") for t in tags)
    assert any(t.startswith("StreamKL_Penalty_Epoch/train_phase/train_stream") for t in tags)
    assert {t for t in tags if t.startswith("Top1_Acc_Exp/eval_phase/test_stream")} == {
        "Top1_Acc_Exp/eval_phase/test_stream/Exp000", "Top1_Acc_Exp/eval_phase/test_stream/Exp001"}
    with open(out / "csv" / "streamkl-seed0" / "eval_results.csv") as handle:
        rows = list(csv.DictReader(handle))
    # after each of the 2 training experiences, both experiences evaluated: the accuracy matrix's rows
    assert [(r["training_exp"], r["eval_exp"]) for r in rows] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    matrix = runs[1][0]["accuracy_matrix"]
    assert [float(r["eval_accuracy"]) for r in rows] == pytest.approx([a for row in matrix for a in row], abs=1e-4)
    with open(out / "csv" / "streamkl-seed0" / "training_results.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 2  # one epoch per experience


def test_help_imports_no_heavy_library_and_prints_no_warning():
    code = ("import sys\nfrom cl_streamkl.experiment.cli import main\nassert main(['run', '--help']) == 0\n"
            "print(sorted(m for m in ('avalanche', 'timm', 'matplotlib', 'sklearn', 'torchvision', 'scipy', "
            "'triton') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert result.stderr == ""
    assert "--config FILE" in result.stdout and "--log LOGGER" in result.stdout


def test_quiet_third_party_warnings_is_targeted():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        cli.quiet_third_party_warnings()
        message = "no QP solver found on your system, you can install solvers from PyPI"
        warnings.warn_explicit(message, UserWarning, "solvers/__init__.py", 1088, module="qpsolvers.solvers")
        warnings.warn_explicit(message, UserWarning, "elsewhere.py", 1, module="elsewhere")
        warnings.warn_explicit("something else", UserWarning, "solvers/__init__.py", 1, module="qpsolvers.solvers")
    assert [(str(w.message)[:9], w.filename) for w in caught] == [("no QP sol", "elsewhere.py"),
                                                                   ("something", "solvers/__init__.py")]
