"""Smoke test of benchmarks/penalty_descent.py on a tiny run's checkpoint, on the CPU.

The script replays a study checkpoint's next experience on an H200; this keeps its replay,
its float64 checks and its refusals from breaking in between.
"""

import json

import penalty_descent as script
import pytest

from cl_streamkl.experiment import runner
from cl_streamkl.experiment.config import ExperimentConfig


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny naive run's checkpoint after its first of two experiences, and one after both.

    Batches of 4: the replay's cost is the Triton interpreter's, one program per image and head.
    """
    root = tmp_path_factory.mktemp("runs")

    def config(name):
        return ExperimentConfig.from_dict({
            "model_kwargs": {"depth": 2, "embed_dim": 16, "num_heads": 2}, "image_size": 8, "patch_size": 4,
            "epochs": 1, "batch_size": 4, "strategies": ["naive"], "experiences": 2, "seeds": [0],
            "device": "cpu", "out": str(root / name)}).resolved()

    def stop_after_one(trained, count):
        if trained == 1:
            raise Stop

    with pytest.raises(Stop):
        runner.run_experiment(config("cut"), root / "cut", show_progress=False, after_experience=stop_after_one)
    runner.run_experiment(config("whole"), root / "whole", show_progress=False)
    return root / "cut" / "checkpoints" / "naive-seed0.pt", root / "whole" / "checkpoints" / "naive-seed0.pt"


def test_replays_the_next_experience_per_backend_with_float64_checks(checkpoints, tmp_path, capsys):
    out = tmp_path / "descent.json"
    assert script.main(["--checkpoint", str(checkpoints[0]), "--device", "cpu", "--steps", "3",
                        "--backends", "torch", "triton", "--penalty-only", "--check-every", "2",
                        "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "experience 2 of 2, 5 tokens" in printed and printed.count("worst gradient rel. err.") == 4
    payload = json.loads(out.read_text())
    assert payload["title"].startswith("StreamKL penalty replaying experience 2 of a study checkpoint (naive seed 0,")
    assert [row[:4] for row in payload["rows"]] == [["torch", "cross-entropy + penalty", 4, 3],
                                                    ["triton", "cross-entropy + penalty", 4, 3],
                                                    ["torch", "penalty alone", 4, 3], ["triton", "penalty alone", 4, 3]]
    assert all(len(row) == len(payload["columns"]) and row[8] == 2 for row in payload["rows"])
    assert [(run["backend"], run["cross_entropy"]) for run in payload["runs"]] == [
        ("torch", True), ("triton", True), ("torch", False), ("triton", False)]
    for run in payload["runs"]:
        assert len(run["penalties"]) == len(run["losses"]) == 3
        assert [check["step"] for check in run["checks"]] == [0, 2]
        # The student starts as the teacher: no penalty before the first step (no BatchNorm here).
        assert run["penalties"][0] == pytest.approx(0.0, abs=1e-6)
        for check in run["checks"]:
            assert check["value"] == pytest.approx(check["reference"], rel=1e-3, abs=1e-6)
            assert check["grad_rel_err"] < 1e-2 or check["reference"] < 1e-6
    # One seed, same data order: the two backends train alike, cross-entropy and penalty both.
    torch_run, triton_run = payload["runs"][:2]
    assert triton_run["penalties"] == pytest.approx(torch_run["penalties"], rel=1e-2, abs=1e-5)
    assert triton_run["losses"] == pytest.approx(torch_run["losses"], rel=1e-3)


def test_refuses_what_it_cannot_replay(checkpoints, tmp_path, capsys):
    with pytest.raises(SystemExit, match="2 experiences done; 1 to 1 leave one to replay"):
        script.main(["--checkpoint", str(checkpoints[1]), "--device", "cpu", "--steps", "1"])
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit, match=f"--checkpoint {empty} cannot be read"):
        script.main(["--checkpoint", str(empty), "--device", "cpu"])
    with pytest.raises(SystemExit) as stopped:
        script.main(["--checkpoint", str(tmp_path / "missing.pt")])
    assert stopped.value.code == 2 and "--checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        script.main(["--checkpoint", str(checkpoints[0]), "--steps", "0"])
    assert stopped.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err
