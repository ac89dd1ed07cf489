"""The efficacy study end to end on a tiny configuration, in process: plan, tuning in parts, test, report, resume."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import time
import types

import pytest

efficacy = pytest.importorskip("efficacy")
efficacy_plan = pytest.importorskip("_harness.efficacy_plan")
efficacy_units = pytest.importorskip("_harness.efficacy_units")
efficacy_tables = pytest.importorskip("_harness.efficacy_tables")


def test_every_method_gets_the_same_number_of_settings():
    plan = efficacy_plan.make_plan("long", [100, 101], [200, 201])
    sizes = {len(family["grid"]) for part in plan["scenarios"].values() for family in part["tuning"].values()}
    assert sizes == {efficacy_plan.SETTINGS_PER_METHOD}
    assert plan["tokens"] == 1025 and efficacy_plan.make_plan("long4097", [1, 2], [3, 4])["tokens"] == 4097
    assert efficacy_plan.fingerprint(plan) == efficacy_plan.fingerprint(json.loads(json.dumps(plan)))
    assert efficacy_plan.fingerprint(efficacy_plan.make_plan("long", [100, 102], [200, 201])) != (
        efficacy_plan.fingerprint(plan))


def test_a_costly_regime_takes_the_settings_chosen_at_1025_tokens():
    chosen = {"lwf": {"lwf_alpha": 4.0, "lwf_temperature": 2.0}, "streamkl": {"alpha": 1.0}}
    report = {"plan_fingerprint": "f" * 16, "scenarios": {
        "class": {"chosen": None}, "task": {"chosen": chosen}, "domain": {"chosen": None}}}
    plan = efficacy_plan.make_plan("long4097", [100, 101], [200, 201], strategies=["lwf", "lwf+streamkl"],
                                   settings_from=report)
    assert list(plan["scenarios"]) == ["task"] and plan["scenarios"]["task"]["test"] == {"": ["lwf", "lwf+streamkl"]}
    assert efficacy_plan.tuning_units(plan, "task") == [] and efficacy_plan.tuning_units(plan, "class") == []
    tables, complete = efficacy_plan.choose(plan, "task", {})
    assert complete and {name: t["chosen"] for name, t in tables.items()} == chosen
    units = efficacy_plan.test_units(plan, "task", chosen)
    assert len(units) == 4 and dict(units[0].overrides)["lwf_alpha"] == 4.0


def test_a_costly_regime_plans_only_the_scenarios_named(tmp_path, capsys):
    chosen = {"streamkl": {"alpha": 1.0}}
    report = {"plan_fingerprint": "f" * 16, "scenarios": {
        "class": {"chosen": chosen}, "task": {"chosen": chosen}, "domain": {"chosen": None}}}
    both = efficacy_plan.make_plan("long4097", [100, 101], [200, 201], strategies=["streamkl"], settings_from=report)
    plan = efficacy_plan.make_plan("long4097", [100, 101], [200, 201], strategies=["streamkl"], settings_from=report,
                                   scenarios=["task"])
    assert list(both["scenarios"]) == ["class", "task"] and list(plan["scenarios"]) == ["task"]
    assert efficacy_plan.fingerprint(plan) != efficacy_plan.fingerprint(both)
    with pytest.raises(ValueError, match="tuning of domain is not finished"):
        efficacy_plan.make_plan("long4097", [100, 101], [200, 201], settings_from=report, scenarios=["task", "domain"])
    path = tmp_path / "long.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "runs"
    assert efficacy.main(["--regime", "long4097", "--part", "plan", "--settings-from", str(path),
                          "--plan-scenarios", "domain", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"efficacy.py: --settings-from {path}: the report's tuning of domain is not finished")
    assert not out.exists()
    assert efficacy.main(["--regime", "long4097", "--part", "plan", "--settings-from", str(path),
                          "--plan-scenarios", "task", "--strategies", "streamkl", "--out", str(out)]) == 0
    assert list(json.loads((out / "plan.json").read_text())["scenarios"]) == ["task"]


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
    assert efficacy_tables.goal_family([long]) == [
        "- The 1025-token verdict hinges on the family's breadth: with Holm over only the goal's 4 comparisons "
        "(a check chosen after the test runs), StreamKL gains in 2 of the 2 scenarios needed (met): class: "
        "replay+streamkl (mem200) − replay (mem200) forgetting -3.0 pp (p 0.012, 8 seeds); task: streamkl − naive "
        "stream acc +5.0 pp (p 0.004, 8 seeds). Smallest adjusted p elsewhere: domain: streamkl − naive forgetting "
        "-1.0 pp (p 0.2, 8 seeds)."]
    unfinished = {**long, "units": {"tune": [4, 4], "test": [200, 240]}}
    assert efficacy_tables.goal_family([unfinished]) == []


def test_the_fixed_rule_picks_the_costly_regimes_scenarios(tmp_path, capsys):
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

    path, out = tmp_path / "long.json", tmp_path / "runs"
    report["scenarios"]["domain"]["paired"][1]["p_holm"] = 0.001
    path.write_text(json.dumps(report))
    common = ["--regime", "long4097", "--part", "plan", "--settings-from", str(path), "--strategies", "streamkl",
              "--out", str(out), "--plan-scenarios"]
    assert efficacy.main([*common, "decisive"]) == 0
    assert list(json.loads((out / "plan.json").read_text())["scenarios"]) == ["domain"]
    assert f"the fixed rule picks from {path}: domain" in capsys.readouterr().out
    assert efficacy.main([*common, "decisive", "task"]) == 2
    assert capsys.readouterr().err.strip() == "efficacy.py: --plan-scenarios decisive stands alone"
    assert efficacy.main(["--regime", "long4097", "--plan-scenarios", "decisive"]) == 2
    assert capsys.readouterr().err.strip() == (
        "efficacy.py: --plan-scenarios decisive needs --settings-from (the report the rule reads)")
    report["units"]["test"] = [122, 240]
    path.write_text(json.dumps(report))
    assert efficacy.main([*common, "decisive"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"efficacy.py: --plan-scenarios decisive: --settings-from {path}: the report's test part is unfinished "
        "(122/240 units), so its Holm-adjusted p-values are not final")


def test_the_source_line_counts_units_by_commit_and_setting():
    def record(part, execution):
        return {"unit": {"part": part}, **({} if execution is None else {"execution": execution})}

    eager, compiled = {"commit": "aaa"}, {"commit": "bbb", "compile_model": True}
    report = {"records": {str(i): r for i, r in enumerate([
        record("test", compiled), record("tune", None), record("tune", eager), record("test", compiled),
        record("tune", {"commit": "bbb", "compile_layers": True})])}}
    assert efficacy_tables.executions(report) == (
        "commit `bbb` (1 tune compile-layers, 2 test compile-model), commit not recorded (1 tune eager), "
        "commit `aaa` (1 tune eager)")
    assert efficacy_tables.executions({"records": {}}) == ""


TINY_SHORT = {"dataset": "digits", "image_size": 16, "patch_size": 8, "epochs": 1, "batch_size": 64, "amp": "none",
              "model_kwargs": {"depth": 1, "embed_dim": 16, "num_heads": 2}}


def test_a_unit_longer_than_a_start_runs_over_several_starts(tmp_path, monkeypatch, capsys):
    """Units that cannot finish within one --time-limit (4097 tokens) start when their next experience
    fits and resume from their checkpoints, judged on what is left; an experience longer than a
    whole start is refused in one line. The clock is a list: each reading takes the next value."""
    monkeypatch.setitem(efficacy_plan.REGIMES, "short", TINY_SHORT)
    plan = efficacy_plan.make_plan("short", [7, 8], [0, 1], settings_per_method=1)
    unit = next(u for u in efficacy_plan.tuning_units(plan, "class") if u.strategy == "pad")
    assert efficacy_plan.experience_weights(unit, plan) == pytest.approx([0.6, 0.2, 0.2])
    readings = []
    monkeypatch.setattr(efficacy_units, "time", types.SimpleNamespace(
        time=lambda: readings.pop(0), perf_counter=time.perf_counter))
    first, later = efficacy_units.rate_key(unit, 0), efficacy_units.rate_key(unit, 1)
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {first: 50.0, later: 50.0})
    root = str(tmp_path)

    # 50 s a pass, a 40 s start: the unit needs several. Its first 30 s experience fits before 45.
    readings[:] = [0.0, 30.0, 60.0]  # start; after the first experience; after the second
    assert efficacy_units.run_unit(unit, plan, "cpu", root, 45.0, start_seconds=40.0) is None
    assert (tmp_path / "runs" / f"{unit.name}.trained").read_text() == "2\n" and not readings
    # Next start: what is left (10 s) fits, though the whole unit (50 s) would not.
    readings[:] = [100.0]
    record = efficacy_units.run_unit(unit, plan, "cpu", root, 115.0)
    assert record is not None and [number for number, _ in record["experience_s"]] == [3]
    assert not (tmp_path / "runs" / f"{unit.name}.trained").exists() and not (tmp_path / "runs" / unit.name).exists()

    # A fresh unit whose first experience (60 s) is longer than a whole start never starts, and says so.
    other = next(u for u in efficacy_plan.tuning_units(plan, "class") if u.strategy == "lwf")
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {first: 100.0})
    readings[:] = [0.0]
    assert efficacy_units.run_unit(other, plan, "cpu", root, 40.0, start_seconds=40.0) is None
    assert "its next experience needs about 60 s, more than a whole start (40 s)" in capsys.readouterr().err
    # As if no first experience had run: 100 s is a guess, from the later experiences of its scenario.
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {later: 100.0})
    readings[:] = [0.0]
    assert efficacy_units.run_unit(other, plan, "cpu", root, 40.0, start_seconds=40.0) is None
    assert "about 60 s (guessed: no unit has measured it), more than" in capsys.readouterr().err
    # Without --time-limit's length a unit that does not fit waits for a start where all of it does.
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {first: 100.0, later: 100.0})
    readings[:] = [0.0]
    assert efficacy_units.run_unit(other, plan, "cpu", root, 90.0) is None
    assert not (tmp_path / "runs" / other.name).exists()


def test_the_last_start_begins_no_unit_it_cannot_finish(tmp_path, monkeypatch, capsys):
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    units = efficacy_plan.tuning_units(plan, "task")[:1]
    starts = []
    monkeypatch.setattr(efficacy_units, "run_unit", lambda unit, *args: starts.append(args[-3:-1]))
    for last in (False, True):
        args = argparse.Namespace(out=tmp_path, device="cpu", execution={}, time_limit=10.0, last_start=last,
                                  reference={}, max_unfinished=None)
        assert efficacy_units.run_units(units, efficacy_units.InProcess(), plan, args, 1e12) == (0, 1, 0, 0)
    # A whole start's seconds, or none: every unit must finish in this one.
    assert starts == [(600.0, {}), (None, {})]
    assert efficacy.main(["--regime", "short", "--last-start"]) == 2
    assert capsys.readouterr().err.strip() == "efficacy.py: --last-start needs --time-limit"


def test_max_unfinished_bounds_the_units_begun_and_unfinished(tmp_path, monkeypatch, capsys):
    """--max-unfinished: a unit that would be left half done begins only while fewer are; one that
    finishes in the start begins anyway, and a unit begun keeps its place. The clock is a list."""
    monkeypatch.setitem(efficacy_plan.REGIMES, "short", TINY_SHORT)
    plan = efficacy_plan.make_plan("short", [7, 8], [0, 1], settings_per_method=1)
    units = efficacy_plan.tuning_units(plan, "class")[:3]
    readings = []
    monkeypatch.setattr(efficacy_units, "time", types.SimpleNamespace(
        time=lambda: readings.pop(0), perf_counter=time.perf_counter))
    first, later = efficacy_units.rate_key(units[0], 0), efficacy_units.rate_key(units[0], 1)
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {first: 50.0, later: 50.0})
    root = str(tmp_path)
    # 30 s of first experience fits before 35, not all 50 s: the unit begins and stops half done.
    readings[:] = [0.0, 0.0, 30.0]  # may it start; would it finish; after its first experience
    assert efficacy_units.run_unit(units[0], plan, "cpu", root, 35.0, start_seconds=40.0, max_unfinished=1) is None
    assert efficacy_units._unfinished(root) == 1 and not readings
    # The next would be left half done too: over the cap it does not begin, and leaves nothing.
    readings[:] = [0.0, 0.0]
    assert efficacy_units.run_unit(units[1], plan, "cpu", root, 35.0, start_seconds=40.0, max_unfinished=1) is None
    assert not (tmp_path / "runs" / units[1].name).exists() and efficacy_units._unfinished(root) == 1
    # A unit begun goes on whatever the cap; one that finishes in the start begins over it.
    assert efficacy_units._claim(root, units[0], 1, finishes=False)
    assert efficacy_units._claim(root, units[1], 1, finishes=True) and efficacy_units._unfinished(root) == 2
    assert not efficacy_units._claim(root, units[2], 2, finishes=False)
    assert efficacy_units._claim(root, units[2], 3, finishes=False) and efficacy_units._unfinished(root) == 3
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / f"{units[1].name}.json").write_text("{}")  # finished: its marker is stale
    assert efficacy_units._unfinished(root) == 2
    for argv, error in ((["--max-unfinished", "0", "--time-limit", "5"], "--max-unfinished must be >= 1"),
                        (["--max-unfinished", "4"], "--max-unfinished needs --time-limit (without it every unit "
                                                    "runs to its end)")):
        assert efficacy.main(["--regime", "short", *argv]) == 2
        assert capsys.readouterr().err.strip() == f"efficacy.py: {error}"


def test_units_with_checkpoints_start_first(tmp_path, monkeypatch):
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    units = efficacy_plan.tuning_units(plan, "task")[:4]
    for unit in (units[3], units[1]):  # checkpointed: a run folder and its progress beside it
        (tmp_path / "runs" / unit.name).mkdir(parents=True)
        efficacy_units._progress_path(str(tmp_path), unit).write_text("1\n")
    efficacy_units._progress_path(str(tmp_path), units[2]).write_text("1\n")  # its folder gone: starts afresh
    order = []
    monkeypatch.setattr(efficacy_units, "run_unit", lambda unit, *args: order.append(unit))
    args = argparse.Namespace(out=tmp_path, device="cpu", execution={}, time_limit=10.0, last_start=True,
                              reference={}, max_unfinished=None)
    efficacy_units.run_units(units, efficacy_units.InProcess(), plan, args, 1e12)
    assert order == [units[1], units[3], units[0], units[2]]


def test_seconds_left_go_by_the_finished_units_rates_and_the_checkpoints(tmp_path):
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    units = [u for u in efficacy_plan.tuning_units(plan, "task") if u.strategy in ("lwf", "streamkl")][:3]
    assert efficacy_units.seconds_left(units, plan, tmp_path) == (3, None)  # nothing finished: no rate
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / f"{units[0].name}.json").write_text(json.dumps(
        {"unit": dataclasses.asdict(units[0]), "wall_time_s": 100.0}))
    (tmp_path / "runs" / units[2].name).mkdir(parents=True)
    efficacy_units._progress_path(str(tmp_path), units[2]).write_text("1\n")  # 0.6 of its weights trained
    # 100 s per weight for every task kind (its own, or the scenario's slowest); task weights sum to 1.
    assert efficacy_units.seconds_left(units, plan, tmp_path) == (2, pytest.approx(100.0 + 0.4 * 100.0))


def test_may_start():
    later = time.time() + 100
    assert efficacy_units.may_start([50.0], later, False)  # 50 s of 100
    assert not efficacy_units.may_start([60.0, 60.0], later, False)  # 120 s in the last start
    assert efficacy_units.may_start([60.0, 60.0], later, True)  # a later start goes on from the checkpoint
    assert not efficacy_units.may_start([110.0, 10.0], later, True)  # its next experience won't end
    assert not efficacy_units.may_start([], later - 200, True)  # all trained, deadline passed


@pytest.mark.slow
def test_efficacy_study_tiny(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(efficacy_plan.REGIMES, "short", TINY_SHORT)
    # Fewer methods than the study, each with the study's machinery: tuning, choice, replay arms, pairs.
    monkeypatch.setitem(efficacy_plan.TUNED, "class", ("lwf", "pad", "replay"))
    monkeypatch.setitem(efficacy_plan.TESTED, "class", {"": ("lwf", "lwf+streamkl", "lwf+pad"),
                                                        "mem20pc": ("replay", "replay+streamkl")})
    report_path, out, archive = tmp_path / "report.json", tmp_path / "runs", tmp_path / "units.tar.gz"
    common = ["--regime", "short", "--workers", "0", "--scenarios", "class", "--val-seeds", "7", "8",
              "--seeds", "0", "1", "--settings-per-method", "2", "--json", str(report_path)]

    # A first part: three tuning units; the plan is in the report before anything ran.
    assert efficacy.main([*common, "--out", str(out), "--part", "tune", "--max-units", "3"]) == 0
    report = json.loads(report_path.read_text())
    assert report["units"] == {"tune": [3, 44], "test": [0, 42]}
    assert report["plan"]["val_seeds"] == [7, 8] and report["scenarios"]["class"]["chosen"] is None
    first = next(iter(report["records"].values()))
    execution = first["execution"]
    assert execution["compile_layers"] is False and execution["compile_model"] is False
    assert execution["commit"] == report["environment"]["commit"]
    assert [number for number, seconds in first["experience_s"] if seconds > 0] == [1, 2, 3]
    assert efficacy.main([*common, "--out", str(out), "--part", "test"]) == 2
    assert "tuning of scenario class is not finished" in capsys.readouterr().err
    # Past the time limit nothing starts; nor a unit that would pass it, judged by the finished ones.
    assert efficacy.main([*common, "--out", str(out), "--time-limit", "1e-9"]) == 0
    assert json.loads(report_path.read_text())["units"]["tune"] == [3, 44]
    records = efficacy_units.finished_records(out).values()
    plan = report["plan"]
    units = [efficacy_plan.Unit.from_record(r["unit"]) for r in records]
    rates = efficacy_units.seconds_per_weight_of(records, plan)
    # Per rate key, from the experiences' own times: every first experience alike, later ones per kind.
    assert set(rates) == {efficacy_units.rate_key(u, index) for u in units for index in range(3)}
    assert min(rates.values()) > 0 and rates[efficacy_units.rate_key(units[0], 0)] == pytest.approx(max(
        r["experience_s"][0][1] / efficacy_plan.experience_weights(u, plan)[0] for r, u in zip(records, units)))
    estimate = efficacy_units.seconds_per_weight_of
    monkeypatch.setattr(efficacy_units, "seconds_per_weight_of", lambda records, plan: {"any kind": 3600.0})
    assert efficacy.main([*common, "--out", str(out), "--time-limit", "30"]) == 0
    assert json.loads(report_path.read_text())["units"]["tune"] == [3, 44]
    monkeypatch.setattr(efficacy_units, "seconds_per_weight_of", estimate)

    monkeypatch.setattr(efficacy, "ARCHIVE_PART_BYTES", 2**12)  # so the archive comes in parts
    assert efficacy.main([*common, "--out", str(out), "--archive", str(archive)]) == 0
    assert (tmp_path / "units.tar.gz.1").is_file()
    report = json.loads(report_path.read_text())
    status = efficacy_tables.summary([report])[0]  # the class scenario's units only: the plan is not done
    assert status.startswith("Status: 5 tokens: tune 12/44 units, test 10/42 units")
    done = {**report, "units": {"tune": [44, 44], "test": [42, 42]}}
    assert efficacy_tables.summary([done])[0] == "**class-incremental**"
    part = report["scenarios"]["class"]
    assert report["units"]["tune"][0] == 12 and report["units"]["test"][0] == 10
    for family, table in part["tuning"].items():
        assert len(table["rows"]) == 2 and all(len(row["per_seed"]) == 2 for row in table["rows"])
        best = max(table["rows"], key=lambda row: row["mean"])
        assert table["chosen"] == best["setting"] == part["chosen"][family]
    assert set(part["table"]) == {"lwf", "lwf+streamkl", "lwf+pad", "replay (mem20pc)", "replay+streamkl (mem20pc)"}
    run = next(r for r in part["runs"] if r["label"] == "replay (mem20pc)")
    assert len(run["accuracy_matrix"]) == 3 and len(run["eval_sizes"]) == 3 and run["task_il_matrix"]
    last = run["accuracy_matrix"][-1]
    assert run["stream_accuracy"] == pytest.approx(
        sum(a * n for a, n in zip(last, run["eval_sizes"])) / sum(run["eval_sizes"]))
    pairs = {(e["strategy"], e["baseline"], e["metric"]): e for e in part["paired"]}
    assert ("lwf+streamkl", "lwf+pad", "forgetting") in pairs
    entry = pairs[("replay+streamkl (mem20pc)", "replay (mem20pc)", "stream_accuracy")]
    assert entry["n"] == 2 and len(entry["differences"]) == 2 and entry["p_holm"] >= entry["p_value"]
    assert pairs[("lwf+pad", "lwf", "learning_accuracy")]["p_holm"] is None  # outside Holm's family

    # The grid is fixed once the study has started.
    assert efficacy.main([*common, "--out", str(out), "--settings-per-method", "1"]) == 2
    assert "another plan" in capsys.readouterr().err
    # Another machine continues from the archive: every unit is found, nothing trains.
    before = report_path.read_text()
    assert efficacy.main([*common, "--out", str(tmp_path / "elsewhere"), "--from-archive", str(archive)]) == 0
    assert json.loads(report_path.read_text())["scenarios"] == json.loads(before)["scenarios"]
    # A new machine continues from the committed report alone: its records are the finished units,
    # less the penalty of every iteration (their mean is kept).
    stored = json.loads(before)["records"]
    assert len(stored) == 22 and not any("penalties" in record for record in stored.values())
    written = efficacy_units.finished_records(out)
    distilled = [name for name, record in written.items() if record["penalties"]]
    assert distilled and all(stored[name]["mean_penalty"] == written[name]["mean_penalty"] for name in distilled)
    assert efficacy.main([*common, "--out", str(tmp_path / "fresh"), "--from-report", str(report_path)]) == 0
    assert json.loads(report_path.read_text())["scenarios"] == json.loads(before)["scenarios"]
    assert len(list((tmp_path / "fresh" / "units").glob("*.json"))) == 22
    assert efficacy.main([*common, "--out", str(tmp_path / "other"), "--settings-per-method", "1",
                          "--from-report", str(report_path)]) == 2
    assert "--from-report holds plan" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    capsys.readouterr()
    assert efficacy.main(["--tables", str(report_path)]) == 0
    tables = capsys.readouterr().out
    assert "**class-incremental**" in tables and "| lwf+streamkl − lwf |" in tables
    assert "| method (5 tokens)" in tables


def test_a_failed_unit_is_reported_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    units = efficacy_plan.tuning_units(plan, "task")[:3]

    def run_unit(unit, *_):
        if unit == units[1]:
            raise RuntimeError("CUDA error: out of memory")
        return {"accuracy_matrix": [[0.5, 0.5]], "process_s": 1.0}

    monkeypatch.setattr(efficacy_units, "run_unit", run_unit)
    args = argparse.Namespace(out=tmp_path, device="cpu", execution={}, time_limit=None, last_start=False,
                              reference={}, max_unfinished=None)
    # The two finished units' experiences count as trained here; the broken one's do not.
    experiences = sum(len(efficacy_plan.experience_weights(unit, plan)) for unit in (units[0], units[2]))
    assert efficacy_units.run_units(units, efficacy_units.InProcess(), plan, args, None) == (2, 0, 1, experiences)
    err = capsys.readouterr().err
    assert f"unit {units[1].name} failed: RuntimeError: CUDA error: out of memory" in err


def test_a_start_counts_the_experiences_it_trained_and_kept(tmp_path, monkeypatch):
    """A start that finishes no unit may still have moved units on: the experiences it trained and
    checkpointed count, and so do a finished unit's, less those an earlier start had trained."""
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    stopped, finished = efficacy_plan.tuning_units(plan, "task")[:2]

    def checkpoint(unit, trained):
        (tmp_path / "runs" / unit.name).mkdir(parents=True, exist_ok=True)
        efficacy_units._progress_path(str(tmp_path), unit).write_text(f"{trained}\n")

    checkpoint(stopped, 1)
    checkpoint(finished, 1)

    def run_unit(unit, *_):
        if unit == stopped:
            checkpoint(unit, 2)  # one more experience, then the deadline
            return None
        return {"accuracy_matrix": [[0.5, 0.5]], "process_s": 1.0}

    monkeypatch.setattr(efficacy_units, "run_unit", run_unit)
    args = argparse.Namespace(out=tmp_path, device="cpu", execution={}, time_limit=10.0, last_start=False,
                              reference={}, max_unfinished=None)
    count = len(efficacy_plan.experience_weights(finished, plan))
    outcome = efficacy_units.run_units([stopped, finished], efficacy_units.InProcess(), plan, args, 1e12)
    assert outcome == efficacy_units.Outcome(finished=1, unfinished=1, failed=0, experiences=1 + count - 1)


def test_experience_weights_follow_the_data_and_the_replayed_images():
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    lwf, *_ = efficacy_plan.tuning_units(plan, "task")
    assert efficacy_plan.experience_weights(lwf, plan) == pytest.approx([0.6, 0.2, 0.2])
    replay = [u for u in efficacy_plan.tuning_units(plan, "class") if dict(u.overrides).get("mem_batch_size") == 64]
    assert efficacy_plan.experience_weights(replay[0], plan) == pytest.approx([0.6, 0.6, 0.6])  # 32 + 64 a batch
    domain = efficacy_plan.tuning_units(plan, "domain")[0]
    assert efficacy_plan.experience_weights(domain, plan) == pytest.approx([0.25] * 4)


def test_the_deadline_judges_each_experience_by_its_weight(tmp_path, monkeypatch):
    """Experiences of weight 0.6, 0.2, 0.2 taking 30 s and 10 s: 50 s per weight; 45 s allow two, not three."""
    clock = {"now": 0.0}
    fake_time = types.SimpleNamespace(time=lambda: clock["now"], perf_counter=lambda: clock["now"])
    trained = []

    def run_experiment(config, out, after_experience, **_):
        for index, seconds in enumerate((30.0, 10.0, 10.0)):
            clock["now"] += seconds
            trained.append(seconds)
            after_experience(index + 1, 3)
        raise AssertionError("the deadline should have stopped the unit")

    monkeypatch.setattr(efficacy_units, "time", fake_time)
    monkeypatch.setattr(efficacy_units, "load_data", lambda *_: None)
    monkeypatch.setattr("cl_streamkl.experiment.runner.run_experiment", run_experiment)
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {})
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    unit = efficacy_plan.tuning_units(plan, "task")[0]
    # After the first experience (30 s) the second is expected to take 10 s: 40 <= 45 goes on;
    # a third would end at 50 s, past the deadline: the unit stops with two experiences done.
    assert efficacy_units.run_unit(unit, plan, "cpu", str(tmp_path), deadline=45.0) is None
    assert trained == [30.0, 10.0]
    # The next unit in this worker does not start when all of it (50 s) could not end by the deadline.
    clock["now"] = 11.0
    second = efficacy_plan.tuning_units(plan, "task")[1]
    assert efficacy_units.run_unit(second, plan, "cpu", str(tmp_path), 60.0) is None
    assert trained == [30.0, 10.0]


def test_each_kind_of_unit_is_judged_by_its_own_rate():
    """A slow kind's rate does not keep a cheap kind from starting; a kind never seen is guessed
    by its scenario's slowest kind, or any scenario's when its own has none."""
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    lwf, streamkl = (next(u for u in efficacy_plan.tuning_units(plan, "task") if u.strategy == name)
                     for name in ("lwf", "streamkl"))
    domain = efficacy_plan.tuning_units(plan, "domain")
    records = [{"unit": dataclasses.asdict(unit), "wall_time_s": seconds}
               for unit, seconds in ((lwf, 300.0), (streamkl, 100.0), (domain[0], 800.0))]
    rates = efficacy_units.seconds_per_weight_of(records, plan)
    key, estimate = efficacy_units.unit_kind, efficacy_units.estimate
    assert estimate(key(streamkl), rates) == pytest.approx(100.0)  # the task weights sum to 1
    assert estimate(key(lwf), rates) == pytest.approx(300.0)
    ewc = next(u for u in efficacy_plan.tuning_units(plan, "task") if u.strategy == "ewc")
    assert estimate(key(ewc), rates) == pytest.approx(300.0)  # not the domain kind's 800
    other_domain = next(u for u in domain if key(u) != key(domain[0]))
    assert estimate(key(other_domain), rates) == pytest.approx(800.0)
    class_unit = efficacy_plan.tuning_units(plan, "class")[0]
    assert estimate(key(class_unit), rates) == pytest.approx(800.0)
    assert estimate(key(ewc), {}) == 0.0
    # With another regime's rates, a guess keeps the kinds' ratio there: lwf took three times streamkl.
    only_streamkl = {key(streamkl): 50.0}
    reference = {key(lwf): 300.0, key(streamkl): 100.0}
    assert estimate(key(lwf), only_streamkl) == pytest.approx(50.0)
    assert estimate(key(lwf), only_streamkl, reference) == pytest.approx(150.0)
    assert estimate(key(ewc), only_streamkl, reference) == pytest.approx(50.0)  # not in it
    # A combination is guessed from the kinds it shares components with, scaled by the reference:
    # lwf+pad from lwf (1.2 times it there), not from naive, whose ratio carries LwF's old cost.
    lwf_pad, naive = (dataclasses.replace(lwf, strategy=name) for name in ("lwf+pad", "naive"))
    here = {key(naive): 100.0, key(lwf): 150.0}
    reference = {key(naive): 50.0, key(lwf): 400.0, key(lwf_pad): 480.0}
    assert estimate(key(lwf_pad), here, reference) == pytest.approx(180.0)
    assert estimate(key(lwf_pad), {key(naive): 100.0}, reference) == pytest.approx(960.0)


def test_first_experiences_are_timed_apart_from_the_later_ones():
    """A first experience has no earlier model (no teacher, no penalty): it is timed with every first
    experience of its scenario and arm, the later ones per kind; a kind's later experiences are
    guessed from later ones, first experiences from first ones."""
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    lwf = next(u for u in efficacy_plan.tuning_units(plan, "task") if u.strategy == "lwf")
    naive = dataclasses.replace(lwf, strategy="naive")
    first = efficacy_units.rate_key(naive, 0)
    assert first == efficacy_units.rate_key(lwf, 0) != efficacy_units.rate_key(lwf, 1) == efficacy_units.unit_kind(lwf)
    # Weights 0.6, 0.2, 0.2: LwF's first experience 60 s (100 s a weight), the others 100 s each (500).
    records = [{"unit": dataclasses.asdict(lwf), "wall_time_s": 260.0, "experience_s": [[1, 60.0], [2, 100.0], [3, 100.0]]},
               {"unit": dataclasses.asdict(naive), "wall_time_s": 100.0}]  # no times: one rate, 100 s a weight
    rates = efficacy_units.seconds_per_weight_of(records, plan)
    assert rates == pytest.approx({first: 100.0, efficacy_units.unit_kind(lwf): 500.0,
                                   efficacy_units.unit_kind(naive): 100.0})
    # Only naive measured here; at another length LwF's later experiences took five times naive's.
    reference = {first: 50.0, efficacy_units.unit_kind(naive): 50.0, efficacy_units.unit_kind(lwf): 250.0}
    here = {first: 200.0, efficacy_units.unit_kind(naive): 200.0}
    assert efficacy_units.estimate(efficacy_units.rate_key(lwf, 1), here, reference) == pytest.approx(1000.0)
    # A first experience is guessed from first experiences (another arm's), not from a slower later kind.
    class_rates = {("class", "", efficacy_units.FIRST): 30.0, ("class", "mem200", "replay"): 900.0}
    assert efficacy_units.estimate(("class", "mem200", efficacy_units.FIRST), class_rates) == pytest.approx(30.0)


def test_a_unit_is_judged_by_what_other_workers_finished_since_the_start(tmp_path, monkeypatch):
    """The rates a start began with are stale once any worker finishes a unit: a unit starting reads
    the finished records on disk, so a kind measured slow meanwhile does not start past the deadline."""
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {})
    monkeypatch.setattr(efficacy_units, "load_data", lambda *_: pytest.fail("the unit should not start"))
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    unit, *others = efficacy_plan.tuning_units(plan, "task")
    finished = next(u for u in others if efficacy_units.unit_kind(u) == efficacy_units.unit_kind(unit))
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / f"{finished.name}.json").write_text(json.dumps(
        {"unit": dataclasses.asdict(finished), "wall_time_s": 1000.0}))  # task weights sum to 1
    assert efficacy_units.run_unit(unit, plan, "cpu", str(tmp_path), time.time() + 500.0, start_seconds=600.0) is None


def test_the_hard_limit_kills_the_workers_and_still_writes_the_report(tmp_path, monkeypatch, capsys):
    """--hard-limit: the workers still training at it are killed and their units counted as stopped,
    and the report and archive are written all the same (a machine ending the call would lose them)."""
    monkeypatch.setitem(efficacy_plan.REGIMES, "short", TINY_SHORT)
    report, archive = tmp_path / "report.json", tmp_path / "units.tar.gz"
    began = time.time()
    # 1.2 s: the worker is still importing torch, let alone training.
    assert efficacy.main(["--regime", "short", "--workers", "1", "--scenarios", "task", "--part", "tune",
                          "--val-seeds", "7", "8", "--settings-per-method", "1", "--max-units", "2",
                          "--time-limit", "0.02", "--hard-limit", "0.02", "--out", str(tmp_path / "runs"),
                          "--json", str(report), "--archive", str(archive)]) == 0
    assert time.time() - began < 60
    out = capsys.readouterr()
    assert "efficacy.py: --hard-limit reached: 2 units stopped or never started" in out.err
    assert "2 unfinished, not started or stopped by the time limit" in out.out
    assert "; 0 experiences trained and kept;" in out.out
    assert json.loads(report.read_text())["units"]["tune"][0] == 0 and archive.is_file()
    assert not multiprocessing.active_children()
    for argv, error in ((["--workers", "0", "--hard-limit", "5"], "--hard-limit needs worker processes (--workers >= 1)"),
                        (["--time-limit", "9", "--hard-limit", "8"], "--hard-limit must be > 0 and not below --time-limit")):
        assert efficacy.main(["--regime", "short", *argv]) == 2
        assert capsys.readouterr().err.strip() == f"efficacy.py: {error}"


def test_a_guessed_rate_gives_way_to_the_first_measured_experience(tmp_path, monkeypatch):
    """A rate key never measured starts on a guess; its first measured experience, not the guess,
    then judges the next one of that key."""
    clock = {"now": 0.0}
    monkeypatch.setattr(efficacy_units, "time", types.SimpleNamespace(time=lambda: clock["now"],
                                                                      perf_counter=lambda: clock["now"]))
    trained = []

    def run_experiment(config, out, after_experience, **_):
        for index in range(4):
            clock["now"] += 2.5  # weights 0.25 each: 10 s per weight
            trained.append(index + 1)
            after_experience(index + 1, 4)
        raise AssertionError("the deadline should have stopped the unit")

    monkeypatch.setattr(efficacy_units, "load_data", lambda *_: None)
    monkeypatch.setattr("cl_streamkl.experiment.runner.run_experiment", run_experiment)
    plan = efficacy_plan.make_plan("short", [100, 101], [200, 201])
    unit, *others = efficacy_plan.tuning_units(plan, "domain")
    seen = next(u for u in others if efficacy_units.unit_kind(u) != efficacy_units.unit_kind(unit))
    first, later = efficacy_units.rate_key(unit, 0), efficacy_units.unit_kind(unit)
    # The first experience is measured (10 s per weight); the later ones are guessed at the other
    # kind's 14: the second ends at 5 s (by the guess 6, within the 8 s deadline); measured at 10 s per
    # weight it replaces the guess, so the third (ending at 7.5 s; by the guess 8.5) starts too.
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {first: 10.0, efficacy_units.unit_kind(seen): 14.0})
    assert efficacy_units.run_unit(unit, plan, "cpu", str(tmp_path), 8.0, start_seconds=8.0) is None
    assert trained == [1, 2, 3]
    assert efficacy_units._seconds_per_weight[later] == pytest.approx(10.0)
    # Had the guess been a measurement, it would have stopped the unit after its second experience.
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {first: 10.0, later: 14.0})
    same = next(u for u in others if efficacy_units.unit_kind(u) == later)
    clock["now"], trained[:] = 0.0, []
    assert efficacy_units.run_unit(same, plan, "cpu", str(tmp_path), 8.0, start_seconds=8.0) is None
    assert trained == [1, 2]


def test_a_stopped_unit_goes_on_from_the_archive_on_another_machine(tmp_path, monkeypatch):
    """A unit stopped between experiences travels in --archive (its checkpoint and progress) and
    a fresh folder unpacked from it trains only the experiences left, to the same result as a
    unit trained in one go: how a unit outlives the machine it began on."""
    monkeypatch.setitem(efficacy_plan.REGIMES, "short", TINY_SHORT)
    plan = efficacy_plan.make_plan("short", [7, 8], [0, 1], settings_per_method=1)
    unit = next(u for u in efficacy_plan.tuning_units(plan, "class") if u.strategy == "streamkl")
    readings = []
    monkeypatch.setattr(efficacy_units, "time", types.SimpleNamespace(
        time=lambda: readings.pop(0), perf_counter=time.perf_counter))
    monkeypatch.setattr(efficacy_units, "_seconds_per_weight", {efficacy_units.unit_kind(unit): 50.0})
    first, second, whole = tmp_path / "first", tmp_path / "second", tmp_path / "whole"

    readings[:] = [0.0, 30.0]  # the first experience fits before 35 s; then the next would not
    assert efficacy_units.run_unit(unit, plan, "cpu", str(first), 35.0, start_seconds=40.0) is None
    efficacy.write_archive(first, tmp_path / "units.tar.gz")
    efficacy.read_archive(tmp_path / "units.tar.gz", second)
    assert (second / "runs" / f"{unit.name}.trained").read_text() == "1\n"
    readings[:] = [100.0]
    resumed = efficacy_units.run_unit(unit, plan, "cpu", str(second), None)
    assert [number for number, _ in resumed["experience_s"]] == [2, 3]
    once = efficacy_units.run_unit(unit, plan, "cpu", str(whole), None)
    assert [number for number, _ in once["experience_s"]] == [1, 2, 3]
    assert resumed["accuracy_matrix"] == once["accuracy_matrix"] and resumed["penalties"] == once["penalties"]


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
