"""The project's own views of its efficacy study (benchmarks/_harness/efficacy_tables.py): naive's learning
accuracy, each distilling unit's penalty, the conclusion, the goal and its family check, the rule that picked
the 4097-token scenarios, and README's summary (the generic tables are cl_streamkl.experiment.study.tables)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

efficacy_tables = pytest.importorskip("_harness.efficacy_tables")

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_findings_of_an_unfinished_regime_are_marked_interim():
    entry = {"strategy": "streamkl", "baseline": "naive", "metric": "stream_accuracy", "mean_diff": 9.8,
             "p_holm": 0.046}
    not_significant = {**entry, "strategy": "lwf+streamkl", "baseline": "lwf", "p_holm": 0.2}

    def report(tokens, done, total):
        return {"settings": {"tokens": tokens}, "units": {"tune": [4, 4], "test": [done, total]},
                "scenarios": {"task": {"paired": [entry, not_significant], "runs": [{}]}}}

    lines = efficacy_tables.conclusion([report(17, 8, 8), report(1025, 52, 240)])
    assert lines[1] == ("- task-incremental: streamkl − naive stream acc +9.8 pp (p 0.046, 17 tok.); "
                        "streamkl − naive stream acc +9.8 pp (p 0.046, 1025 tok., interim: 52/240 test units).")
    assert lines[0] == "- class-incremental: not run yet."


def test_the_learning_table_reads_each_experience_off_the_diagonal():
    def run(label, diagonal):
        return {"label": label, "accuracy_matrix": [[d if i == j else 0.0 for j in range(len(diagonal))]
                                                    for i, d in enumerate(diagonal)]}

    long = {"settings": {"tokens": 1025}, "scenarios": {
        "task": {"runs": [run("naive", [0.7, 0.9, 0.8]), run("naive", [0.5, 0.95, 0.9]), run("lwf", [0.1, 0.1, 0.1])]},
        "domain": {"runs": [run("naive", [0.3, 0.4, 0.5, 0.6])]}}}
    short = {"settings": {"tokens": 17}, "scenarios": {"task": {"runs": [run("lwf", [0.9, 0.9, 0.9])]}}}
    assert efficacy_tables.learning_table([short, long]) == [
        "| scenario | tokens | seeds | experience 1 | experience 2 | experience 3 | experience 4 |",
        "|---|---:|---:|---:|---:|---:|---:|",
        "| task | 1025 | 2 | 60.0 (lowest 50.0) | 92.5 (lowest 90.0) | 85.0 (lowest 80.0) | – |",
        "| domain | 1025 | 1 | 30.0 (lowest 30.0) | 40.0 (lowest 40.0) | 50.0 (lowest 50.0) | 60.0 (lowest 60.0) |"]
    assert efficacy_tables.learning_table([short]) == ["No test runs of naive yet."]


def test_the_goal_is_judged_from_the_long_token_reports():
    def entry(strategy, baseline, metric, diff, p_holm=0.01, n=8):
        return {"strategy": strategy, "baseline": baseline, "metric": metric, "mean_diff": diff, "p_holm": p_holm,
                "n": n, "ci95": [diff - 1.0, diff + 1.0]}

    def report(regime, done, scenarios):
        return {"regime": regime, "settings": {"tokens": 1025 if regime == "long" else 4097},
                "units": {"tune": [4, 4], "test": [done, 240]},
                "scenarios": {name: {"paired": paired, "runs": [{}]} for name, paired in scenarios.items()}}

    long = report("long", 240, {
        "task": [entry("streamkl", "naive", "stream_accuracy", 9.8),
                 entry("lwf+streamkl", "lwf", "forgetting", 2.0),  # StreamKL more forgetful: no gain
                 entry("pad", "naive", "stream_accuracy", 12.0),  # no StreamKL in it
                 entry("ewc+streamkl", "ewc", "stream_accuracy", 8.0),  # not one of the goal's bases
                 entry("lwf+streamkl", "lwf+pad", "stream_accuracy", -5.0)],  # worse than PAD
        "class": [entry("replay+streamkl (mem200)", "replay (mem200)", "forgetting", -4.0),
                  entry("streamkl", "naive", "learning_accuracy", 3.0)],  # not a goal metric
        "domain": [entry("streamkl", "naive", "stream_accuracy", 3.0, n=5),  # too few seeds
                   entry("streamkl", "naive", "forgetting", -3.0, p_holm=0.06)]})
    lines = efficacy_tables.goal([long])
    assert lines == [
        ("- 1025 tokens: StreamKL gains (2 of the 2 scenarios needed, met): class: replay+streamkl (mem200) − "
         "replay (mem200) forgetting -4.0 pp (p 0.01, 8 seeds); task: streamkl − naive stream acc +9.8 pp "
         "(p 0.01, 8 seeds). Nearest to a gain where none is significant: domain: streamkl − naive: stream acc "
         "+3.0 pp [+2.0, +4.0] (p 0.01), forgetting -3.0 pp [-4.0, -2.0] (p 0.06), 5 seeds. Significantly worse "
         "than PAD: task: lwf+streamkl − lwf+pad stream acc -5.0 pp (p 0.01, 8 seeds). Against StreamKL, with a "
         "95 % interval excluding 0: task: lwf+streamkl − lwf: forgetting +2.0 pp [+1.0, +3.0] (p 0.01), 8 seeds; "
         "task: lwf+streamkl − lwf+pad: stream acc -5.0 pp [-6.0, -4.0] (p 0.01), 8 seeds."),
        "- 4097 tokens: not run yet."]
    # 4097 tokens runs no replay: class's replay gain at 1025 is not counted as one that failed to hold.
    long4097 = report("long4097", 25, {"task": [entry("streamkl", "naive", "stream_accuracy", 4.0, p_holm=0.2, n=5)],
                                       "class": [entry("streamkl", "naive", "forgetting", -1.0, p_holm=0.3, n=5)]})
    assert efficacy_tables.goal([long, long4097])[1] == (
        "- 4097 tokens (interim: 25/240 test units): StreamKL gains (0 of the 1 gains seen at 1025 tokens that it "
        "tests hold): none. Nearest to a gain where none is significant: class: streamkl − naive: forgetting -1.0 pp "
        "[-2.0, +0.0] (p 0.3), 5 seeds; task: streamkl − naive: stream acc +4.0 pp [+3.0, +5.0] (p 0.2), 5 seeds. "
        "Nowhere significantly worse than PAD.")
    # With no gain at 1025 tokens there is nothing to hold: the line says so rather than "0 of the 0".
    none = report("long", 240, {"task": [entry("streamkl", "naive", "stream_accuracy", 9.8, p_holm=0.26)]})
    assert "StreamKL gains (no gain seen at 1025 tokens among the comparisons it makes): none." in (
        efficacy_tables.goal([none, long4097])[1])
    half = report("long", 52, {"task": long["scenarios"]["task"]["paired"][:1]})
    assert "(1 of the 2 scenarios needed, so far)" in efficacy_tables.goal([half])[0]


def test_the_goal_family_check_narrows_holm_to_the_goal_comparisons():
    def entry(strategy, baseline, metric, diff, p_value, p_holm):
        return {"strategy": strategy, "baseline": baseline, "metric": metric, "mean_diff": diff, "n": 8,
                "p_value": p_value, "p_holm": p_holm, "ci95": [diff - 1.0, diff + 1.0]}

    long = {"regime": "long", "units": {"tune": [4, 4], "test": [240, 240]}, "scenarios": {
        "task": {"paired": [entry("streamkl", "naive", "stream_accuracy", 5.0, 0.001, 0.2),
                            entry("ewc+streamkl", "ewc", "forgetting", -9.0, 0.0001, 0.01),  # not the goal's
                            entry("streamkl", "naive", "mean_experience_accuracy", 4.0, 0.0001, 0.01)]},  # nor this
        "class": {"paired": [entry("replay+streamkl (mem200)", "replay (mem200)", "forgetting", -3.0, 0.004, 0.3)]},
        "domain": {"paired": [entry("lwf+streamkl", "lwf", "stream_accuracy", -2.0, 0.01, 0.4),  # against StreamKL
                              entry("streamkl", "naive", "forgetting", -1.0, 0.2, 1.0)]}}}
    # Family of four: p 0.001, 0.004, 0.01, 0.2 become 0.004, 0.012, 0.02, 0.2.
    assert efficacy_tables.goal_family([long]) == [(
        "- The 1025-token verdict hinges on the family's breadth: with Holm over only the goal's 4 comparisons "
        "(a check chosen after the test runs), StreamKL gains in 2 of the 2 scenarios needed (met): class: "
        "replay+streamkl (mem200) − replay (mem200) forgetting -3.0 pp (p 0.012, 8 seeds); task: streamkl − naive "
        "stream acc +5.0 pp (p 0.004, 8 seeds). Smallest adjusted p elsewhere: domain: streamkl − naive forgetting "
        "-1.0 pp (p 0.2, 8 seeds).")]
    unfinished = {**long, "units": {"tune": [4, 4], "test": [200, 240]}}
    assert efficacy_tables.goal_family([unfinished]) == []


def test_the_fixed_rule_picks_the_costly_regimes_scenarios():
    def entry(strategy, baseline, metric, diff, p_holm=0.01, n=8):
        return {"strategy": strategy, "baseline": baseline, "metric": metric, "mean_diff": diff, "p_holm": p_holm,
                "n": n, "ci95": [diff - 1.0, diff + 1.0]}

    chosen = {"streamkl": {"alpha": 1.0}, "lwf": {"lwf_alpha": 1.0}}
    report = {"regime": "long", "plan_fingerprint": "f" * 16, "units": {"tune": [4, 4], "test": [240, 240]},
              "scenarios": {
                  "class": {"chosen": chosen, "paired": [
                      entry("replay+streamkl (mem200)", "replay (mem200)", "forgetting", -4.0),  # not decisive
                      entry("streamkl", "naive", "stream_accuracy", 2.0, n=5)]},  # too few seeds
                  "task": {"chosen": chosen, "paired": [entry("lwf+streamkl", "lwf", "forgetting", -2.0)]},
                  "domain": {"chosen": chosen, "paired": [
                      entry("streamkl", "naive", "forgetting", 3.0),  # StreamKL forgets more: against it
                      entry("streamkl", "naive", "stream_accuracy", 1.0, p_holm=0.2)]}}}
    assert efficacy_tables.decisive_scenarios(report) == ["task"]
    report["scenarios"]["domain"]["paired"][1]["p_holm"] = 0.04
    assert efficacy_tables.decisive_scenarios(report) == ["task", "domain"]
    report["scenarios"]["task"]["paired"][0]["p_holm"] = report["scenarios"]["domain"]["paired"][1]["p_holm"] = 0.5
    assert efficacy_tables.decisive_scenarios(report) == ["task"]  # none: the fallback


def test_the_penalty_table_lists_each_distilling_unit_per_seed():
    def record(strategy, seed, penalty, part="test", scenario="task", arm=""):
        return {"unit": {"part": part, "scenario": scenario, "arm": arm, "strategy": strategy, "seed": seed},
                "seed": seed, "mean_penalty": penalty}

    records = [record("streamkl", 201, 77.7), record("streamkl", 200, 10.2), record("streamkl", 202, 1.18),
               record("naive", 200, None),  # no penalty: not listed
               record("streamkl", 100, 5.0, part="tune"), record("streamkl", 200, 3.0, scenario="class"),
               record("replay+pad", 200, 0.5, arm="mem200")]
    report = {"settings": {"tokens": 4097}, "records": {str(i): r for i, r in enumerate(records)}}
    assert efficacy_tables.penalty_table([report]) == [
        "| tokens | strategy | seeds | mean penalty per seed (seed order) | median |",
        "|---:|---|---:|---|---:|",
        "| 4097 | replay+pad (mem200) | 1 | 0.5 | 0.5 |",
        "| 4097 | streamkl | 3 | 10.2, 77.7, 1.18 | 10.2 |"]
    assert efficacy_tables.penalty_table([report], "domain") == ["No distilling test units in domain yet."]



def test_the_summary_says_how_far_each_regime_is_then_the_conclusion_and_the_goal():
    reports = [json.loads((RESULTS / f"efficacy-{regime}.json").read_text()) for regime in ("short", "long", "long4097")]
    lines = efficacy_tables.summary(reports)
    assert all(done == total for report in reports for done, total in report["units"].values())
    assert lines[0] == "**class-incremental**" and efficacy_tables.GOAL in lines  # finished: no status line
    assert lines[lines.index(efficacy_tables.GOAL) + 2].startswith("- 1025 tokens")
    assert any(line.startswith("- task-incremental: ") for line in lines)
    unfinished = copy.deepcopy(reports[2])
    unfinished["units"]["test"][0] -= 1
    assert efficacy_tables.summary([reports[1], unfinished])[0].startswith("Status: 1025 tokens: tune ")
    empty = {**unfinished, "scenarios": {name: {**part, "runs": []} for name, part in unfinished["scenarios"].items()}}
    assert efficacy_tables.summary([empty])[0].startswith("The study has not been run at these settings yet (4097 tokens")
    assert efficacy_tables.decisive_scenarios(reports[1]) == list(reports[2]["plan"]["scenarios"])
