"""`cl-streamkl run` on cluttered MNIST with the convolutional stem and a schedule; its refusals."""

from __future__ import annotations

import json

import pytest
from cli_helpers import one_line_error

from cl_streamkl.experiment import cli, runner
from cl_streamkl.experiment.lr_schedule import LRSchedulePlugin

TINY_MODEL = ["--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "--batch-size", "128", "--no-progress"]


class RecordingSchedule(LRSchedulePlugin):
    """The runner's schedule, remembering every rate it sets."""

    rates: list[float] = []

    def before_training_iteration(self, strategy, *args, **kwargs):
        super().before_training_iteration(strategy, *args, **kwargs)
        self.rates.append(strategy.optimizer.param_groups[0]["lr"])


@pytest.mark.slow
def test_run_on_cluttered_mnist_with_conv_stem_and_cosine_schedule(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "LRSchedulePlugin", RecordingSchedule)
    monkeypatch.setattr(RecordingSchedule, "rates", [])
    out, cache = tmp_path / "run", tmp_path / "cache"
    rc = cli.main(["run", "--dataset", "cluttered-mnist", "--canvas", "32", "--clutter", "2", "--stem", "conv",
                   "--patch-size", "4", "--strategies", "streamkl", "--experiences", "2", "--epochs", "2",
                   "--lr-schedule", "cosine", "--warmup-epochs", "1", "--data-root", str(cache), "--seeds", "0",
                   "--out", str(out), *TINY_MODEL])
    assert rc == 0
    config = json.loads((out / "results.json").read_text())["config"]
    assert (config["canvas"], config["clutter"], config["clutter_size"], config["image_size"]) == (32, 2, 8, 32)
    assert (config["stem"], config["lr_schedule"], config["warmup_epochs"]) == ("conv", "cosine", 1)
    assert [path.name for path in cache.iterdir()] == ["cluttered-mnist-canvas32-clutter2-size8-split0-v1.npz"]
    # Two experiences, each warming up over its first epoch and then falling: the schedule restarts.
    rates = RecordingSchedule.rates
    steps = len(rates) // 2
    for experience in (rates[:steps], rates[steps:]):
        peak = experience.index(max(experience))
        assert experience[peak] == pytest.approx(1e-3) and 0 < peak < steps - 1
        assert experience[:peak + 1] == sorted(experience[:peak + 1])
        assert experience[peak:] == sorted(experience[peak:], reverse=True) and experience[-1] < 2e-4


@pytest.mark.parametrize("options, named", [
    (["--canvas", "20"], "canvas"),
    (["--canvas", "100000", "--image-size", "64"], "canvas must be 28 to 1024 px"),
    (["--clutter", "-1"], "clutter"),
    (["--clutter", "1000000000"], "clutter must be 0 to 1024 pieces"),
    (["--canvas", "32", "--clutter-size", "40"], "clutter_size"),
    (["--dataset", "mnist5k", "--canvas", "64"], "canvas"),
    (["--stem", "conv", "--patch-size", "6", "--image-size", "120"], "power of two"),
    (["--epochs", "2", "--warmup-epochs", "2"], "warmup_epochs"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, capsys, options, named):
    out, cache = tmp_path / "run", tmp_path / "cache"
    argv = ["run", "--dataset", "cluttered-mnist", "--data-root", str(cache), "--out", str(out), *options]
    assert cli.main(argv) == 2
    assert named in one_line_error(capsys)
    assert not out.exists() and not cache.exists()
