"""A study's report from finished units' records: the choice, runs, strategy table, paired differences with
Holm over the plan's family, hypotheses' verdicts; and what a start writes (report.json, .md, paired.png)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from study_helpers import tiny_plan

from cl_streamkl.experiment.run_result import RunResult
from cl_streamkl.experiment.statistics import holm_adjust
from cl_streamkl.experiment.study.comparisons import earlier_final_accuracy, verdicts
from cl_streamkl.experiment.study.outputs import write_outputs
from cl_streamkl.experiment.study.plan import check_plan, first_units, tuning_units
from cl_streamkl.experiment.study.plan import (
    test_units as units_tested,  # not a test: pytest would collect it
)
from cl_streamkl.experiment.study.report import build_report
from cl_streamkl.experiment.study.tables import (
    executions,
    hypotheses_table,
    side_by_side,
    tuning_table,
    verdict_lines,
)

ENVIRONMENT = {"device": "cpu (x86_64)", "torch": "2", "triton": None, "python": "3", "commit": "abc1234"}
CHOSEN = {"lwf": {"lwf_alpha": 4.0}, "replay": {"mem_batch_size": 16}}


def _matrix(strategy, seed):
    """Three experiences: each learned to 0.9, earlier ones kept at 0.3, StreamKL keeping about 0.2 more."""
    keep = 0.3 + 0.05 * seed + (0.2 + 0.03 * (seed % 2) if "streamkl" in strategy else 0.0)
    return [[0.9 if j == i else keep if j < i else 0.0 for j in range(3)] for i in range(3)]


def _record(unit, matrix):
    result = RunResult(strategy=unit.strategy, seed=unit.seed, class_order=list(range(10)), accuracy_matrix=matrix,
                       task_il_matrix=matrix, eval_sizes=[100, 50, 50], penalties=[0.5, 1.5], wall_time_s=2.0)
    return {"unit": dataclasses.asdict(unit), **result.to_dict(), "mean_penalty": 1.0, "process_s": 3.0,
            "experience_s": [[1, 1.0], [2, 1.0], [3, 1.0]], "execution": {"commit": "abc1234"}}


def _records(plan, tune=True, test=True, leave_out=()):
    records = {}
    if tune:
        for unit in tuning_units(plan, "class"):
            better = dict(unit.overrides).items() & {**CHOSEN["lwf"], **CHOSEN["replay"]}.items()
            records[unit.name] = _record(unit, [[0.6 + 0.1 * bool(better)] * 3] * 3)
    if test:
        for unit in units_tested(plan, "class", CHOSEN):
            if (unit.strategy, unit.seed) not in leave_out:
                records[unit.name] = _record(unit, _matrix(unit.strategy, unit.seed))
    return records


def test_the_report_holds_the_choice_the_runs_and_the_paired_differences():
    plan = check_plan(tiny_plan(test_seeds=[0, 1, 2]))
    empty = build_report(plan, {}, ENVIRONMENT)
    assert empty["units"] == {"tune": [0, 8], "test": [0, 15]} and empty["records"] == {}
    part = empty["scenarios"]["class"]
    assert part["chosen"] is None and part["runs"] == [] and part["paired"] == []
    tuned = build_report(plan, _records(plan, test=False), ENVIRONMENT)
    assert tuned["scenarios"]["class"]["chosen"] == CHOSEN and tuned["units"]["tune"] == [8, 8]
    assert tuned["scenarios"]["class"]["tuning"]["lwf"]["rows"][1]["mean"] == pytest.approx(70.0)

    report = build_report(plan, _records(plan), ENVIRONMENT)
    assert report["units"] == {"tune": [8, 8], "test": [15, 15]} and report["plan"] == plan
    part = report["scenarios"]["class"]
    assert set(part["table"]) == {"naive", "lwf", "lwf+streamkl", "replay (mem20pc)", "replay+streamkl (mem20pc)"}
    assert part["table"]["lwf"]["seeds"] == [0, 1, 2] and part["worker_time_s"] == {"tune": 24.0, "test": 45.0}
    run = next(r for r in part["runs"] if r["label"] == "lwf+streamkl" and r["seed"] == 1)
    assert run["stream_accuracy"] == pytest.approx((0.58 * 100 + 0.58 * 50 + 0.9 * 50) / 200)
    pairs = {(e["strategy"], e["baseline"], e["metric"]): e for e in part["paired"]}
    forgetting = pairs[("lwf+streamkl", "lwf", "forgetting")]
    assert forgetting["differences"] == pytest.approx([-20.0, -23.0, -20.0]) and forgetting["n"] == 3
    assert forgetting["p_holm"] >= forgetting["p_value"] and forgetting["arm"] == ""
    replay = pairs[("replay+streamkl (mem20pc)", "replay (mem20pc)", "forgetting")]
    assert replay["arm"] == "mem20pc" and replay["mean_diff"] == pytest.approx(-21.0)
    assert pairs[("lwf+streamkl", "lwf", "learning_accuracy")]["p_holm"] is None  # outside Holm's family
    family = [e for e in part["paired"] if e["p_holm"] is not None]
    assert len(family) == len(part["paired"]) - 2 and all(e["p_holm"] >= e["p_value"] for e in family)
    # The records travel in the report, less the penalty of every iteration (their mean is kept).
    assert len(report["records"]) == 23 and not any("penalties" in r for r in report["records"].values())
    assert all(r["mean_penalty"] == 1.0 for r in report["records"].values())
    assert json.loads(json.dumps(report))["scenarios"] == json.loads(json.dumps(report["scenarios"]))


def test_listed_comparisons_are_the_only_pairs_and_holms_whole_family():
    comparison = {"scenario": "class", "strategy": "lwf+streamkl", "baseline": "lwf", "metrics": ["forgetting"]}
    plan = check_plan(tiny_plan(test_seeds=[0, 1, 2], comparisons=[comparison]))
    paired = build_report(plan, _records(plan), ENVIRONMENT)["scenarios"]["class"]["paired"]
    assert {(e["strategy"], e["baseline"]) for e in paired} == {("lwf+streamkl", "lwf")}
    adjusted = [e for e in paired if e["p_holm"] is not None]
    assert [e["metric"] for e in adjusted] == ["forgetting"] and adjusted[0]["p_holm"] == adjusted[0]["p_value"]


HYPOTHESES = [
    {"id": "H1", "scenario": "class", "arm": "", "strategy": "lwf+streamkl", "baseline": "lwf",
     "metric": "forgetting", "direction": "lower", "role": "primary"},
    {"id": "H2", "scenario": "class", "arm": "", "strategy": "lwf+streamkl", "baseline": "lwf",
     "metric": "stream_accuracy", "direction": "lower", "role": "primary"},
    {"id": "H3", "scenario": "class", "arm": "mem20pc", "strategy": "replay+streamkl", "baseline": "replay",
     "metric": "mean_experience_accuracy", "direction": "higher", "role": "secondary"},
]


def test_each_hypothesis_gets_a_verdict_with_holm_per_role():
    plan = check_plan(tiny_plan(test_seeds=[0, 1, 2], hypotheses=HYPOTHESES))
    report = build_report(plan, _records(plan, leave_out=[("replay+streamkl", 2)]), ENVIRONMENT)
    h1, h2, h3 = report["hypotheses"]
    assert h1["verdict"] == "confirmed" and h1["mean_diff"] == pytest.approx(-21.0) and h1["seeds"] == [0, 1, 2]
    assert h2["verdict"] == "not confirmed" and h2["mean_diff"] > 0  # significant, the other way
    assert h1["p_holm"] >= h1["p_value"] and h2["p_holm"] >= h2["p_value"]
    assert h3["verdict"] == "incomplete" and h3["seeds"] == [0, 1] and not h3["complete"]
    assert h3["p_holm"] == h3["p_value"]  # alone in its role's family
    # Beside each: learning accuracy and the final accuracy on earlier experiences, never tested.
    assert h1["beside"]["learning_accuracy"]["mean_diff"] == pytest.approx(0.0)
    assert h1["beside"]["earlier_final_accuracy"]["mean_diff"] == pytest.approx(-h1["mean_diff"])
    assert earlier_final_accuracy([[0.9]]) is None
    assert earlier_final_accuracy(_matrix("naive", 0)) == pytest.approx(0.3)
    rows = hypotheses_table(report)
    assert rows[2].startswith("| H1 | primary | class | lwf+streamkl − lwf | forgetting (lower) | 3 | -21.0 [")
    assert "**confirmed**" in rows[2] and "| incomplete |" in rows[4]
    assert verdicts({"hypotheses": [HYPOTHESES[0]], "test_seeds": [0, 1]}, {})[0]["verdict"] == "incomplete"


def _claim(name, strategy, role="primary", direction="lower"):
    return {"id": name, "scenario": "class", "arm": "", "strategy": strategy, "baseline": "base",
            "metric": "forgetting", "direction": direction, "role": role}


# Three primary hypotheses and three secondary ones, each a strategy against one baseline.
FAMILIES = {"test_seeds": [0, 1, 2], "hypotheses": [
    _claim("H1", "a"), _claim("H2", "b"), _claim("H3", "c"),
    _claim("S1", "d", "secondary"), _claim("S2", "e", "secondary", "higher"), _claim("S3", "f", "secondary")]}


def _runs(differences):
    """The test runs of scenario class: ``base`` forgets 0.5 on every seed, each strategy 0.5 plus
    its differences (pp) on seeds 0, 1, ... (as many seeds as differences)."""
    runs = [{"arm": "", "strategy": "base", "seed": seed, "forgetting": 0.5, "accuracy_matrix": [[0.9]]}
            for seed in range(3)]
    runs += [{"arm": "", "strategy": strategy, "seed": seed, "forgetting": 0.5 + value / 100,
              "accuracy_matrix": [[0.9]]} for strategy, values in differences.items() for seed, value in enumerate(values)]
    return {"class": runs}


def test_a_verdict_comes_before_its_family_is_complete_only_where_holms_bounds_settle_it():
    """While H3 and S3 lack a seed, Holm's p of the others lies between their raw p and 3 p."""
    runs = {"a": [-2, -3, -4], "b": [-20, -23, -20], "d": [-1, -2, -3], "e": [-20, -23, -20], "f": [-1, -2]}
    early = {e["id"]: e for e in verdicts(FAMILIES, _runs({**runs, "c": [-20, -21]}))}
    assert early["H2"]["p_value"] == pytest.approx(0.0023, abs=1e-4)
    assert early["H2"]["verdict"] == "confirmed"  # 3 · 0.0023 < 0.05, whatever H3's p turns out to be
    assert early["H1"]["p_value"] == pytest.approx(0.035, abs=1e-3)
    assert early["H1"]["verdict"] == "pending"  # 0.035 < 0.05 <= 3 · 0.035: H3 decides
    assert early["S1"]["p_value"] == pytest.approx(0.074, abs=1e-3) and early["S1"]["verdict"] == "not confirmed"
    assert early["S2"]["p_value"] < 0.01 and early["S2"]["verdict"] == "not confirmed"  # the other way
    assert early["H3"]["verdict"] == early["S3"]["verdict"] == "incomplete"
    rows = hypotheses_table({"hypotheses": list(early.values())})
    assert "| **confirmed** |" in rows[3] and "| pending |" in rows[2] and "| incomplete |" in rows[4]
    assert verdict_lines({"hypotheses": list(early.values())})[0].startswith("- **Pending** (H1, class scenario")
    # Complete, a family is Holm's as before: H1 is confirmed beside a strong H3, not beside a weak one.
    for last, expected in (([-20, -21, -25], ["confirmed"] * 3), ([-1, 1, -3], ["not confirmed", "confirmed",
                                                                                 "not confirmed"])):
        primary = [e for e in verdicts(FAMILIES, _runs({**runs, "c": last})) if e["role"] == "primary"]
        assert [e["p_holm"] for e in primary] == holm_adjust([e["p_value"] for e in primary])
        assert [e["verdict"] for e in primary] == expected


def test_a_shared_first_experience_is_counted_as_its_own_part():
    plan = check_plan(tiny_plan(first_experience="shared"))
    records = _records(plan, test=False)
    firsts = first_units(plan, units_tested(plan, "class", CHOSEN))
    records[firsts[0].name] = {"unit": dataclasses.asdict(firsts[0]), "process_s": 1.0}
    assert build_report(plan, records, ENVIRONMENT)["units"] == {"first": [1, 2], "tune": [8, 8], "test": [0, 10]}


def test_a_start_writes_the_report_as_json_markdown_and_a_plot(tmp_path):
    plan = check_plan(tiny_plan(test_seeds=[0, 1, 2], hypotheses=HYPOTHESES))
    report = build_report(plan, _records(plan), ENVIRONMENT)
    written = write_outputs({**report, "command": None}, tmp_path, tmp_path / "copy" / "report.json")
    assert [p.name for p in written] == ["report.json", "report.json", "report.md", "paired.png"]
    stored = json.loads((tmp_path / "report.json").read_text())
    assert stored["date"] and "command" not in stored  # None values are left out
    assert (tmp_path / "copy" / "report.json").read_text() == (tmp_path / "report.json").read_text()
    markdown = (tmp_path / "report.md").read_text()
    assert markdown.startswith(f"# Study `{report['plan_fingerprint']}`: tiny, 5 tokens\n")
    assert "| H1 | primary |" in markdown and (tmp_path / "paired.png").stat().st_size > 1000
    nothing = build_report(check_plan(tiny_plan()), {}, ENVIRONMENT)
    assert [p.name for p in write_outputs(nothing, tmp_path / "empty")] == ["report.json", "report.md"]


def test_the_tables_show_each_part_as_far_as_it_has_come():
    plan = check_plan(tiny_plan(test_seeds=[0, 1, 2]))
    report = build_report(plan, _records(plan), ENVIRONMENT)
    text = side_by_side([report])
    assert text.startswith("Status: 5 tokens: tune 8/8 units, test 15/15 units (plan `")
    assert "**class-incremental** (chosen on validation: 5 tokens: lwf (lwf_alpha 4); replay (mem_batch_size 16))" in text
    assert "| lwf+streamkl − lwf | " in text and "| lwf | **lwf_alpha 4** | 70.0 | 70.0 | 70.0 |" in text
    assert "No test runs yet" in side_by_side([build_report(plan, {}, ENVIRONMENT)])
    taken = {**report, "scenarios": {"class": {**report["scenarios"]["class"], "chosen_from": "f" * 16}}}
    assert tuning_table(taken, "class") == [f"5 tokens: settings taken from plan `{'f' * 16}`, not tuned."]
    taken["scenarios"]["class"]["chosen_from"] = ["a" * 16, "b" * 16]  # settings_from a list of reports
    assert tuning_table(taken, "class") == [f"5 tokens: settings taken from plan `{'a' * 16}` and `{'b' * 16}`, "
                                            "not tuned."]
    assert executions(report) == "commit `abc1234` (8 validation runs, eager; 15 test runs, eager)"


def test_the_source_line_counts_units_by_commit_and_setting():
    def record(part, execution):
        return {"unit": {"part": part}, **({} if execution is None else {"execution": execution})}

    eager, compiled = {"commit": "aaa"}, {"commit": "bbb", "compile_model": True}
    report = {"records": {str(i): r for i, r in enumerate([
        record("test", compiled), record("tune", None), record("tune", eager), record("test", compiled),
        record("tune", {"commit": "bbb", "compile_layers": True})])}}
    assert executions(report) == (
        "commit `bbb` (1 validation runs, layers compiled; 2 test runs, whole model compiled), "
        "commit not recorded (1 validation runs, eager), commit `aaa` (1 validation runs, eager)")
    assert executions({"records": {}}) == ""
