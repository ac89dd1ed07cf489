"""`cl-streamkl run` end to end on a tiny configuration, resume, and the error cases."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from cl_streamkl import cli
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
    ("class", ["naive", "streamkl", "wa", "wa+streamkl", "pad"], "Class-IL"),
    ("task", ["naive", "lwf", "lwf+pad", "streamkl", "replay+streamkl", "replay"], "Task-IL"),
    ("domain", ["naive", "streamkl", "pad", "ewc"], "Domain-IL"),
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
    pairs = {(e["strategy"], e["baseline"], e["metric"]): e for e in results["paired"]}
    expected = {"class": [("streamkl", "naive"), ("wa+streamkl", "wa"), ("pad", "naive"), ("streamkl", "pad")],
                "task": [("streamkl", "naive"), ("lwf+pad", "lwf"), ("replay+streamkl", "replay")],
                "domain": [("streamkl", "naive"), ("pad", "naive"), ("streamkl", "pad")]}[scenario]
    assert {(s, b) for s, b, _ in pairs} == set(expected)
    entry = pairs[(*expected[0], "final_avg_acc")]
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

    def save_then_stop(path, state):
        real_save(path, state)
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
    ],
)
def test_errors_exit_nonzero_with_message(tmp_path, capsys, args, message):
    rc = cli.main(["run", "--no-progress", "--epochs", "1", "--out", str(tmp_path / "x"), *args])
    assert rc == 2
    assert message in capsys.readouterr().err


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
    from cl_streamkl.cli import _config_from_args, build_parser
    from cl_streamkl.experiment.strategy_plugins import build_plugins

    args = build_parser().parse_args(["run", *TINY, "--strategies", "streamkl", "--compile-teacher"])
    config = _config_from_args(args).resolved()
    assert config.compile_teacher is True
    assert build_plugins("streamkl", config, None, 0)["streamkl"].distiller.compile_options == {}
    default = _config_from_args(build_parser().parse_args(["run", *TINY])).resolved()
    assert build_plugins("streamkl", default, None, 0)["streamkl"].distiller.compile_options is None
    with pytest.raises(ValueError, match="compile_teacher must be true or false"):
        type(config)(compile_teacher="yes").resolved()
