"""Plan values of the wrong shape, comparisons and hypotheses naming what the plan does not run, and a
``settings_from`` report whose validation seeds are the plan's test seeds: one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
from study_helpers import files_under, one_line_error, tiny_plan, write_plan

from cl_streamkl.experiment.study.command import main
from cl_streamkl.experiment.study.plan import check_plan, fingerprint

HYPOTHESIS = {"id": "H1", "role": "primary", "scenario": "class", "arm": "", "strategy": "lwf+streamkl",
              "baseline": "lwf", "metric": "forgetting", "direction": "lower"}


def _with(path, value, **hypothesis):
    """The tiny plan with ``value`` set at the dotted ``path`` (or a hypothesis changed by ``hypothesis``)."""
    plan = tiny_plan(hypotheses=[{**HYPOTHESIS, **hypothesis}])
    if path:
        *parents, last = path.split(".")
        node = plan
        for key in parents:
            node = node[key]
        node[last] = value
    return plan


CASES = {
    # Comparisons and hypotheses naming what the plan does not run.
    "hypothesis strategy not tested": (_with("", None, strategy="pad"), "hypotheses[0]: 'pad' is not tested"),
    "hypothesis baseline not tested": (_with("", None, baseline="ewc"), "hypotheses[0]: 'ewc' is not tested"),
    "hypothesis scenario not run": (_with("", None, scenario="task"), "scenario 'task' is not in the plan"),
    "hypothesis unknown metric": (_with("", None, metric="accuracy"), "metric 'accuracy' cannot be a hypothesis"),
    "repeated hypothesis id": (_with("hypotheses", [HYPOTHESIS, {**HYPOTHESIS, "metric": "stream_accuracy"}]),
                               "hypotheses[1]: id 'H1' is given twice"),
    "comparison unknown metric": (tiny_plan(comparisons=[{"scenario": "class", "strategy": "lwf+streamkl",
                                                          "baseline": "lwf", "metrics": ["accuracy"]}]),
                                  "comparisons[0]: unknown metric 'accuracy'"),
    "comparison baseline not tested": (tiny_plan(comparisons=[{"scenario": "class", "strategy": "lwf",
                                                               "baseline": "ewc"}]), "'ewc' is not tested"),
    "comparison arm a list": (tiny_plan(comparisons=[{"scenario": "class", "arm": [], "strategy": "lwf",
                                                      "baseline": "naive"}]), "comparisons[0].arm must be a string"),
    # Values of the wrong type.
    "scenario a list": (_with("scenarios.class", ["options"]), "scenarios.class must be a mapping"),
    "tuning a list": (_with("scenarios.class.tuning", [{"strategy": "lwf"}]),
                      "scenarios.class.tuning must be a mapping"),
    "options a list": (_with("scenarios.class.options", ["experiences"]), "scenarios.class.options must be a mapping"),
    "grid entry a string": (_with("scenarios.class.tuning.lwf.grid", ["lwf_alpha=1", "lwf_alpha=4"]),
                            "scenarios.class.tuning.lwf.grid must be a list of mappings"),
    "tuning arm a list": (_with("scenarios.class.tuning.lwf.arm", [""]), "scenarios.class.tuning.lwf.arm must be"),
    "hypotheses a mapping": (_with("hypotheses", HYPOTHESIS), "hypotheses must be a list of mappings"),
    "comparisons a string": (tiny_plan(comparisons="lwf+streamkl vs lwf"), "comparisons must be a list of mappings"),
    "hypothesis id a list": (_with("", None, id=["H1"]), "hypotheses[0].id must be a string"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_plan_that_names_what_it_does_not_run_or_has_a_wrong_type_is_one_line(tmp_path, capsys, case):
    plan, message = CASES[case]
    path = write_plan(tmp_path / "plan.json", plan)
    before = files_under(tmp_path)
    assert main([str(path), "--part", "plan", "--out", str(tmp_path / "out")]) == 2
    line = one_line_error(capsys)
    assert message in line and str(path) in line
    assert files_under(tmp_path) == before


def test_a_number_as_a_key_is_named(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps(tiny_plan()).replace('"mem20pc": {"mem_per_class"', '"mem20pc": {5'))
    path.write_text(path.read_text().replace('{5: 20}', '{5: 20, "mem_per_class": 20}'))
    assert main([str(path), "--part", "plan", "--out", str(tmp_path / "out")]) == 2
    assert "arms.mem20pc: key 5 must be a string" in one_line_error(capsys)


def _report(tmp_path, val_seeds):
    """A finished study report whose tuning chose the tiny plan's first settings on ``val_seeds``."""
    plan = check_plan(tiny_plan(val_seeds=val_seeds))
    chosen = {family: spec["grid"][0] for family, spec in plan["scenarios"]["class"]["tuning"].items()}
    path = tmp_path / "exploratory.json"
    path.write_text(json.dumps({"plan_fingerprint": fingerprint(plan), "plan": plan,
                                "scenarios": {"class": {"chosen": chosen}}}))
    return path


def _confirmatory(tmp_path, test_seeds):
    plan = tiny_plan(val_seeds=[], test_seeds=test_seeds, hypotheses=[HYPOTHESIS], settings_from="exploratory.json")
    for part in plan["scenarios"].values():
        part["tuning"] = {}
    return write_plan(tmp_path / "confirm.yaml", plan)


def test_settings_chosen_on_a_seed_are_not_tested_on_it_across_plans(tmp_path, capsys):
    _report(tmp_path, val_seeds=[7, 8])
    leaking = _confirmatory(tmp_path, test_seeds=[8, 9, 10])
    before = files_under(tmp_path)
    assert main([str(leaking), "--part", "plan", "--out", str(tmp_path / "out")]) == 2
    line = one_line_error(capsys)
    assert "test_seeds [8] are validation seeds of settings_from exploratory.json (its plan.val_seeds)" in line
    assert str(leaking) in line and files_under(tmp_path) == before
    fresh = _confirmatory(tmp_path, test_seeds=[9, 10])
    assert main([str(fresh), "--part", "plan", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["test_seeds"] == [9, 10]


def test_a_settings_from_report_of_the_wrong_shape_is_one_line(tmp_path, capsys):
    path = _report(tmp_path, val_seeds=[7, 8])
    report = json.loads(path.read_text())
    for damaged, message in (({**report, "scenarios": ["class"]}, "exploratory.json is not a study report"),
                             ({**report, "scenarios": {"class": {"chosen": ["lwf"]}}}, "chosen is not a mapping"),
                             ({**report, "scenarios": {"class": ["lwf"]}}, "its scenarios.class is not a mapping"),
                             ({**report, "plan": {"val_seeds": "7, 8"}}, "plan.val_seeds (the seeds its")):
        path.write_text(json.dumps(damaged))
        assert main([str(_confirmatory(tmp_path, [9, 10])), "--part", "plan", "--out", str(tmp_path / "out")]) == 2
        assert message in one_line_error(capsys)
