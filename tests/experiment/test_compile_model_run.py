"""``--compile-model``: a run distils through the compiled model; it is refused with --compile-layers or dropout."""

from __future__ import annotations

import json

import pytest
from cli_helpers import one_line_error, run_cli

pytestmark = pytest.mark.usefixtures("traced_not_generated")


def test_a_run_distils_through_the_compiled_model_as_the_eager_one_does(tmp_path):
    options = ["--strategies", "lwf+streamkl", "pad", "--scenario", "task", "--experiences", "2"]
    status, eager = run_cli(tmp_path, "eager", *options)
    assert status == 0
    status, compiled = run_cli(tmp_path, "compiled", "--compile-model", *options)
    assert status == 0
    results = json.loads((compiled / "results.json").read_text())
    assert results["config"]["compile_model"] is True
    expected = json.loads((eager / "results.json").read_text())["runs"]
    for run, reference in zip(results["runs"], expected, strict=True):
        assert len(run["accuracy_matrix"]) == 2 and run["mean_penalty"] > 0
        # float32 on the CPU: the traced graph rounds like the eager model up to reordering.
        for row, reference_row in zip(run["accuracy_matrix"], reference["accuracy_matrix"], strict=True):
            assert row == pytest.approx(reference_row, abs=0.02)
        assert run["mean_penalty"] == pytest.approx(reference["mean_penalty"], rel=1e-3)


@pytest.mark.parametrize("extra, message", [
    (["--compile-layers"], "compile_model compiles the layer norms and MLPs too; drop compile_layers"),
    (["--compile-teacher"], "compile_model compiles the teacher snapshots too; drop compile_teacher"),
    (["--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "proj_drop_rate=0.1"], "has dropout"),
])
def test_what_it_cannot_compile_is_refused_in_one_line(tmp_path, capsys, extra, message):
    status, out = run_cli(tmp_path, "run", "--compile-model", "--strategies", "streamkl", *extra)
    assert status == 2 and message in one_line_error(capsys)
    assert not out.exists()


def test_an_eager_checkpoint_resumes_compiled(tmp_path):
    """compile_model is left out of the checkpoint fingerprint: it changes rounding, not the run."""
    from cl_streamkl.experiment import runner
    from cl_streamkl.experiment.config import ExperimentConfig

    fields = {"model_kwargs": {"depth": 1, "embed_dim": 16, "num_heads": 2}, "image_size": 8, "patch_size": 4,
              "epochs": 1, "batch_size": 64, "strategies": ["streamkl"], "experiences": 2, "seeds": [0],
              "device": "cpu", "out": str(tmp_path / "run")}

    def stop(trained, count):
        raise KeyboardInterrupt

    eager = ExperimentConfig.from_dict(fields).resolved()
    with pytest.raises(KeyboardInterrupt):
        runner.run_experiment(eager, tmp_path / "run", show_progress=False, after_experience=stop)
    compiled = ExperimentConfig.from_dict({**fields, "compile_model": True}).resolved()
    [resumed] = runner.run_experiment(compiled, tmp_path / "run", resume=True, show_progress=False)
    [whole] = runner.run_experiment(eager, tmp_path / "whole", show_progress=False)
    assert resumed.accuracy_matrix[0] == whole.accuracy_matrix[0]  # the first experience, read back
    for row, reference in zip(resumed.accuracy_matrix[1], whole.accuracy_matrix[1], strict=True):
        assert row == pytest.approx(reference, abs=0.02)  # the second, compiled: rounding apart


def test_a_compiled_study_unit_records_its_check(tmp_path):
    from cl_streamkl.experiment.study.plan import check_plan, tuning_units
    from cl_streamkl.experiment.study.units import load_data, run_unit

    plan = check_plan({
        "regime": "tiny", "val_seeds": [100, 101], "test_seeds": [200, 201],
        "settings": {"dataset": "digits", "image_size": 16, "patch_size": 8, "epochs": 1, "batch_size": 64,
                     "amp": "none", "model_kwargs": {"depth": 1, "embed_dim": 16, "num_heads": 2}},
        "scenarios": {"task": {"options": {"experiences": 3, "first_experience_classes": 6},
                               "tuning": {"streamkl": {"strategy": "streamkl", "arm": "", "grid": [{"alpha": 1.0}]}},
                               "test": {"": ["naive", "streamkl"]}}}})
    # A StreamKL unit: the teacher snapshot and the student's capture both run compiled.
    unit = tuning_units(plan, "task")[0]
    load_data(unit, plan)
    record = run_unit(unit, plan, "cpu", str(tmp_path), None, execution={"compile_model": True})
    assert 0 <= record["execution"]["compiled_qk_check"] < 1e-3
    assert record["execution"]["compile_model"] is True and record["mean_penalty"] > 0
