"""The throughput benchmark of the efficacy study, as a smoke run on the CPU."""

from __future__ import annotations

import json

import pytest

throughput = pytest.importorskip("efficacy_throughput")


def test_step_and_unit_measurements_are_written(tmp_path):
    path = tmp_path / "throughput.json"
    assert throughput.main(["--tiny", "--device", "cpu", "--variants", "eager", "--steps", "2", "--processes", "1",
                            "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    (step, steady, units) = report["rows"]
    assert step[:3] == ["step", "eager", 1] and step[3] > 0
    assert steady[:3] == ["steady", "eager", 1] and steady[3] > 0
    assert units[:3] == ["units", "eager", 1] and units[5] > 0 and units[6] > 0 and units[7] > 0
    assert report["runs"][1]["steps"] == 2
    run = report["runs"][2]
    assert run["units"][0]["strategy"] == "lwf" and run["units"][0]["train_s"] > 0
    assert [number for number, _ in run["units"][0]["experience_s"]] == [1, 2, 3]
    assert report["title"].startswith("Efficacy study throughput, tiny smoke run")


def test_bad_counts_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        throughput.main(["--tiny", "--device", "cpu", "--processes", "0"])
    assert exit_info.value.code == 2 and "--processes must be >= 1" in capsys.readouterr().err


def test_steady_steps_time_every_process_after_all_warmed_up():
    # Two processes that distil: the steady part without a penalty runs in the test above (one
    # process), and the penalty only changes the step that each process builds. Each call starts
    # its own processes, seconds of imports apiece.
    settings = {**throughput.study_plan("short")["settings"], **throughput.TINY}
    result = throughput.concurrent_steps(settings, "eager", 2, 3, "cpu", "streamkl")
    assert result["processes"] == 2 and result["steps"] == 3 and result["wall_ms"] > 0
    assert result["penalty"] == "streamkl"


@pytest.mark.usefixtures("traced_not_generated")
def test_a_step_is_timed_with_each_distillation_penalty(tmp_path, monkeypatch):
    penalties = []
    real = throughput._plugin

    def plugin(penalty):
        made = real(penalty)
        penalties.append(type(made).__name__)
        if penalty != "none":
            def counted(strategy, real_hook=made.before_backward):
                real_hook(strategy)
                calls.append(made.last_penalty)
            made.before_backward = counted
        return made

    calls = []
    monkeypatch.setattr(throughput, "_plugin", plugin)
    path = tmp_path / "throughput.json"
    assert throughput.main(["--tiny", "--device", "cpu", "--parts", "step", "--variants", "eager", "compile-model",
                            "--penalties", "none", "streamkl", "pad", "--steps", "2", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert [row[1] for row in report["rows"]] == [
        "eager", "eager + streamkl", "eager + pad", "compile-model", "compile-model + streamkl", "compile-model + pad"]
    assert penalties == ["SupervisedPlugin", "StreamKLPlugin", "PADPlugin"] * 2
    # Every step of a distilling variant added its penalty (3 warm-up and 2 timed steps): zero at the
    # first, where the student still equals its snapshot, then positive as Adam moves it.
    assert len(calls) == 4 * 5
    for run in range(4):
        assert calls[5 * run] == 0 and all(value > 0 for value in calls[5 * run + 1:5 * run + 5])
    assert all(run["top_kernels_us"] is None and run["wall_ms"] > 0 for run in report["runs"])  # no CUDA here


@pytest.mark.usefixtures("traced_not_generated")
def test_the_compiled_model_variant_times_a_step(tmp_path):
    path = tmp_path / "throughput.json"
    assert throughput.main(["--tiny", "--device", "cpu", "--parts", "step", "--variants", "compile-model",
                            "--steps", "2", "--json", str(path)]) == 0
    [step] = json.loads(path.read_text())["rows"]
    assert step[:3] == ["step", "compile-model", 1] and step[3] > 0


def test_a_failing_variant_is_reported_and_the_others_measured(tmp_path, monkeypatch, capsys):
    real = throughput.step_times

    def step_times(settings, variant, device, steps, penalty):
        if variant == "compile-layers":
            raise RuntimeError("no compiler")
        return real(settings, variant, device, steps, penalty)

    monkeypatch.setattr(throughput, "step_times", step_times)
    path = tmp_path / "throughput.json"
    assert throughput.main(["--tiny", "--device", "cpu", "--parts", "step", "--variants", "compile-layers", "eager",
                            "--steps", "2", "--json", str(path)]) == 1
    assert "step compile-layers with 1 process(es) failed: RuntimeError: no compiler" in capsys.readouterr().err
    report = json.loads(path.read_text())
    assert [row[:2] for row in report["rows"]] == [["step", "eager"]]
    assert report["runs"][0]["error"] == "RuntimeError: no compiler"
