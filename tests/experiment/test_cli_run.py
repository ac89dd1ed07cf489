"""`cl-streamkl run` end to end on tiny configurations: every scenario, loggers, weights files."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import TINY, run_cli

from cl_streamkl.experiment import cli


def test_run_end_to_end(tmp_path, capsys):
    rc, out = run_cli(tmp_path, "e2e", "--strategies", "naive", "lwf+streamkl", "--seeds", "0", "1", "--experiences", "5")
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

    # one unit per file, named in it: fractions in results.json and the CSV files, percent in summary.md
    assert results["units"].startswith("fractions:")
    summary_md = (out / "summary.md").read_text()
    assert "in percent; paired differences in percentage points" in summary_md
    assert printed[printed.index("Strategy"):printed.index("\nwrote")].strip() in summary_md
    with open(out / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[0]["final_average_accuracy_fraction"]) == pytest.approx(
        results["runs"][0]["final_average_accuracy"])
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
    rc, out = run_cli(tmp_path, scenario, "--scenario", scenario, "--experiences", "3", "--mem-size", "30",
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
    diffs = [by_seed[(expected[0][0], s)] - by_seed[(expected[0][1], s)] for s in (0, 1)]  # fractions
    assert entry["n"] == 2 and entry["mean_diff"] == pytest.approx(sum(diffs) / 2)
    assert "paired differences" in printed
    if scenario == "task":
        ckpt = torch.load(out / "checkpoints" / "streamkl-seed0.pt", weights_only=True)
        assert {k for k in ckpt["model"] if k.startswith("heads.")} == {
            "heads.0.weight", "heads.0.bias", "heads.1.weight", "heads.1.bias", "heads.2.weight", "heads.2.bias"}
        assert ckpt["model"]["heads.0.weight"].shape[0] == 4 and ckpt["model"]["heads.1.weight"].shape[0] == 3


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
    rc, out = run_cli(tmp_path, "pre", "--strategies", "naive", "--experiences", "2",
                   "--pretrained-file", str(weights))
    assert rc == 0
    assert json.loads((out / "results.json").read_text())["config"]["pretrained_file"] == str(weights)


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


def test_loggers_write_under_out_without_changing_results(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plain_rc, plain = run_cli(tmp_path, "plain", "--strategies", "streamkl", "--experiences", "2")
    rc, out = run_cli(tmp_path, "logged", "--strategies", "streamkl", "--experiences", "2",
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
    # forgetting as the accuracy matrix gives it once the experience was trained, else empty (not 0)
    forgetting = {(r["training_exp"], r["eval_exp"]): r["forgetting"] for r in rows}
    assert float(forgetting[("1", "0")]) == pytest.approx(matrix[0][0] - matrix[1][0], abs=1e-4)
    assert forgetting[("0", "1")] == ""
    with open(out / "csv" / "streamkl-seed0" / "training_results.csv") as handle:
        training = list(csv.DictReader(handle))
    assert len(training) == 2  # one epoch per experience
    # nothing is validated while training: no validation numbers, rather than zeros
    assert all(r["val_accuracy"] == r["val_loss"] == "" and float(r["training_loss"]) > 0 for r in training)


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


def test_help_lists_strategies_and_datasets(capsys):
    assert cli.main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    for word in ["lwf+streamkl", "tiny-imagenet", "mnist5k", "--scenario", "--first-experience-classes",
                 "--resume", "--image-size", "--amp"]:
        assert word in text


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
