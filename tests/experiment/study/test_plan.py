"""A study's plan: plan files read strictly and checked, fingerprints, units, weights and the choice of settings."""

from __future__ import annotations

import dataclasses
import json

import pytest
from study_helpers import STUDIES, TINY, short_plan, tiny_plan, write_plan

from cl_streamkl.experiment.study.comparisons import ComparisonError
from cl_streamkl.experiment.study.files import StudyFileError, read_mapping
from cl_streamkl.experiment.study.plan import (
    PlanError,
    Unit,
    check_plan,
    choose,
    experience_weights,
    fingerprint,
    first_unit,
    first_units,
    load_plan,
    tokens,
    tuning_units,
)
from cl_streamkl.experiment.study.plan import (
    test_units as units_tested,  # not a test: pytest would collect it
)


def test_every_method_gets_the_same_number_of_settings():
    plan = load_plan(STUDIES / "efficacy-long.yaml")
    sizes = {len(family["grid"]) for part in plan["scenarios"].values() for family in part["tuning"].values()}
    assert sizes == {4}
    assert plan["tokens"] == 1025 and load_plan(STUDIES / "efficacy-short.yaml")["tokens"] == 17
    assert load_plan(STUDIES / "efficacy-long4097.yaml")["tokens"] == 4097
    assert fingerprint(plan) == fingerprint(json.loads(json.dumps(plan)))
    assert fingerprint({**plan, "val_seeds": [100, 102]}) != fingerprint(plan)
    # Without image_size a plan counts the dataset's own size, as a run resolves it.
    assert tokens({"dataset": "mnist5k", "patch_size": 8}) == 17
    assert tokens({"dataset": "cluttered-mnist", "canvas": 64, "patch_size": 8}) == 65
    assert check_plan(tiny_plan(settings={"dataset": "digits", "patch_size": 16}))["tokens"] == 5


def test_a_plan_file_reads_alike_in_yaml_toml_and_json(tmp_path):
    plan = tiny_plan()
    from_yaml = load_plan(write_plan(tmp_path / "plan.yaml", plan))
    from_json = load_plan(write_plan(tmp_path / "plan.json", plan))
    toml = tmp_path / "plan.toml"
    toml.write_text('regime = "tiny"\nval_seeds = [7, 8]\ntest_seeds = [0, 1]\n'
                    '[settings]\ndataset = "digits"\nimage_size = 16\npatch_size = 8\nepochs = 1\nbatch_size = 64\n'
                    'amp = "none"\nmodel_kwargs = {depth = 1, embed_dim = 16, num_heads = 2}\n'
                    '[arms.""]\n[arms.mem20pc]\nmem_per_class = 20\n'
                    '[scenarios.class]\noptions = {experiences = 3, first_experience_classes = 6}\n'
                    '[scenarios.class.tuning.lwf]\nstrategy = "lwf"\narm = ""\n'
                    'grid = [{lwf_alpha = 1.0}, {lwf_alpha = 4.0}]\n'
                    '[scenarios.class.tuning.replay]\nstrategy = "replay"\narm = "mem20pc"\n'
                    'grid = [{mem_batch_size = 8}, {mem_batch_size = 16}]\n'
                    '[scenarios.class.test]\n"" = ["naive", "lwf", "lwf+streamkl"]\n'
                    'mem20pc = ["replay", "replay+streamkl"]\n')
    assert fingerprint(from_yaml) == fingerprint(from_json) == fingerprint(load_plan(toml))
    # The defaults are filled in: an absent optional key leaves the fingerprint as it was before it existed.
    assert from_yaml["pad_variant"] == "asymmetric" and from_yaml["tokens"] == 5 and "comparisons" not in from_yaml


def test_yaml_plans_are_read_strictly(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("regime: a\nregime: b\n")
    with pytest.raises(StudyFileError, match=r"key 'regime' is given twice \(line 2\)"):
        read_mapping(path)
    path.write_text("a: &x [1, 2]\nb: *x\n")
    with pytest.raises(StudyFileError, match=r"aliases \(\*x, line 2\) are not read"):
        read_mapping(path)
    path.write_text("lr: 1e-3\nother: 2.5E+2\nname: 1e3x\n")  # YAML 1.2 numbers, as a user means them
    assert read_mapping(path) == {"lr": 0.001, "other": 250.0, "name": "1e3x"}
    path.write_text("- a list\n")
    with pytest.raises(StudyFileError, match="does not hold a mapping"):
        read_mapping(path)
    (tmp_path / "plan.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(StudyFileError, match="key 'a' is given twice"):
        read_mapping(tmp_path / "plan.json")
    (tmp_path / "plan.toml").write_text("a = 1\na = 2\n")
    with pytest.raises(StudyFileError, match="is not valid TOML"):
        read_mapping(tmp_path / "plan.toml")
    with pytest.raises(StudyFileError, match="cannot read"):
        read_mapping(tmp_path / "missing.yaml")


def _scenario(plan):
    return plan["scenarios"]["class"]


@pytest.mark.parametrize("change, message", [
    (lambda p: p.pop("test_seeds"), "missing key 'test_seeds'"),
    (lambda p: p.update(seeds=[1]), "unknown key 'seeds'"),
    (lambda p: p.update(regime=""), "regime must be a name"),
    (lambda p: p.update(test_seeds=[0, 0, 1]), r"test_seeds repeats a seed: \[0\]"),
    (lambda p: p.update(test_seeds=[-1, 1]), "seeds are integers from 0 to 2\\*\\*32 - 1"),
    (lambda p: p.update(test_seeds=[0, True]), "test_seeds must be a list of integer seeds"),
    (lambda p: p.update(test_seeds=[0]), "test_seeds needs at least 2 distinct seeds"),
    (lambda p: p.update(val_seeds=[0, 7]), r"test_seeds and val_seeds share \[0\]"),
    (lambda p: p["settings"].update(seeds=[3]), "settings: seeds is set per unit by the study"),
    (lambda p: p["settings"].update(no_such_field=1), "settings: "),
    (lambda p: p["arms"].update(big={"mem_size": "big"}), "arms.big: "),
    (lambda p: p["scenarios"].update(joint=_scenario(p)), "'joint' is not a scenario"),
    (lambda p: _scenario(p).pop("test"), "scenarios.class needs exactly the keys options, tuning, test"),
    (lambda p: _scenario(p)["test"].update(mem5={"replay": []}), "arm 'mem5' is not in arms"),
    (lambda p: _scenario(p)["test"].update({"": ["no-such-method"]}), r"scenarios.class.test.<no arm>: "),
    (lambda p: _scenario(p)["tuning"]["lwf"].pop("arm"), "tuning.lwf needs exactly the keys arm, grid, strategy"),
    (lambda p: _scenario(p)["tuning"]["lwf"].update(grid=[]), "grid must be a non-empty list"),
    (lambda p: _scenario(p)["tuning"]["lwf"]["grid"].append({"lwf_alpha": 9.0}),
     r"every family needs the same number of settings \(equal tuning effort\); the grids have \[2, 3\]"),
    (lambda p: p.update(first_experience="never"), "first_experience must be one of own, shared"),
    (lambda p: _scenario(p)["options"].update(experiences=4, first_experience_classes=None),
     r"scenarios.class: .*: experiences must divide the 10 classes; got 4"),
])
def test_a_bad_plan_is_refused_naming_its_key(change, message):
    plan = tiny_plan()
    change(plan)
    with pytest.raises(PlanError, match=message):
        check_plan(plan)


@pytest.mark.parametrize("entry, message", [
    ({"scenario": "task", "strategy": "lwf", "baseline": "naive"}, "scenario 'task' is not in the plan"),
    ({"scenario": "class", "strategy": "ewc", "baseline": "naive"}, "'ewc' is not tested in scenario class"),
    ({"scenario": "class", "arm": "mem5", "strategy": "lwf", "baseline": "naive"}, "arm 'mem5' is not tested"),
    ({"scenario": "class", "strategy": "lwf", "baseline": "naive", "metrics": ["speed"]}, "unknown metric 'speed'"),
    ({"strategy": "lwf", "baseline": "naive"}, "needs scenario, strategy, baseline"),
])
def test_a_comparison_the_plan_cannot_answer_is_refused(entry, message):
    with pytest.raises(ComparisonError, match=message):
        check_plan(tiny_plan(comparisons=[entry]))


def test_hypotheses_are_checked():
    good = {"id": "H1", "scenario": "class", "arm": "", "strategy": "lwf+streamkl", "baseline": "lwf",
            "metric": "forgetting", "direction": "lower", "role": "primary"}
    assert check_plan(tiny_plan(hypotheses=[good]))["hypotheses"] == [good]
    for bad, message in (({**good, "metric": "learning_accuracy"}, "cannot be a hypothesis"),
                         ({**good, "direction": "up"}, "direction is lower or higher"),
                         ({k: v for k, v in good.items() if k != "role"}, "needs exactly")):
        with pytest.raises(ComparisonError, match=message):
            check_plan(tiny_plan(hypotheses=[bad]))
    with pytest.raises(ComparisonError, match="every id must be distinct"):
        check_plan(tiny_plan(hypotheses=[good, good]))


def test_a_costly_regime_takes_the_settings_chosen_by_another_report(tmp_path):
    chosen = {"lwf": {"lwf_alpha": 4.0, "lwf_temperature": 2.0}, "streamkl": {"alpha": 1.0}}
    report = {"plan_fingerprint": "f" * 16, "scenarios": {"task": {"chosen": chosen}, "domain": {"chosen": None}}}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "long.json").write_text(json.dumps(report))
    scenario = {"options": {"experiences": 3, "first_experience_classes": 6},
                "test": {"": ["lwf", "lwf+streamkl"]}}
    path = write_plan(tmp_path / "studies" / "plan.yaml", {
        **{k: v for k, v in tiny_plan().items() if k != "scenarios"}, "settings_from": "../results/long.json",
        "scenarios": {"task": scenario}})
    plan = load_plan(path)
    assert plan["scenarios"]["task"]["chosen_from"] == {"plan": "f" * 16, "chosen": chosen}
    assert tuning_units(plan, "task") == [] and tuning_units(plan, "class") == []
    tables, complete = choose(plan, "task", {})
    assert complete and {name: t["chosen"] for name, t in tables.items()} == chosen
    units = units_tested(plan, "task", chosen)
    assert len(units) == 4 and dict(units[0].overrides)["lwf_alpha"] == 4.0
    # A scenario whose tuning the report has not finished cannot take its settings.
    write_plan(path, {**tiny_plan(), "settings_from": "../results/long.json",
                      "scenarios": {"domain": {"options": {"experiences": 4}, "test": {"": ["lwf"]}}}})
    with pytest.raises(PlanError, match=f"{path}: settings_from ../results/long.json: the report's tuning of domain "
                                        "is not finished"):
        load_plan(path)
    (tmp_path / "results" / "long.json").write_text("{}")
    with pytest.raises(PlanError, match="is not a study report"):
        load_plan(path)
    (tmp_path / "results" / "long.json").unlink()
    with pytest.raises(PlanError, match="cannot read a JSON report"):
        load_plan(path)


def test_units_are_named_uniquely_and_read_back_from_their_records():
    plan = short_plan()
    units = [u for s in plan["scenarios"] for u in tuning_units(plan, s)]
    assert len(units) == 3 * 4 * 4 * 2 + 4 * 2 and len({u.name for u in units}) == len(units)
    unit = units[0]
    assert Unit.from_record(json.loads(json.dumps(dataclasses.asdict(unit)))) == unit
    fields = unit.config_fields(plan)
    assert fields["eval_split"] == "val" and fields["seeds"] == [unit.seed] and fields["strategies"] == [unit.strategy]
    tested = units_tested(plan, "class", {"replay": {"mem_batch_size": 8}})
    replay = next(u for u in tested if u.arm == "mem200" and u.strategy == "replay")
    assert replay.label == "replay (mem200)" and dict(replay.overrides) == {
        "mem_batch_size": 8, "mem_per_class": 0, "mem_size": 200}
    assert replay.config_fields(plan)["eval_split"] == "test"


def test_experience_weights_follow_the_data_and_the_replayed_images():
    plan = short_plan()
    lwf, *_ = tuning_units(plan, "task")
    assert experience_weights(lwf, plan) == pytest.approx([0.6, 0.2, 0.2])
    replay = [u for u in tuning_units(plan, "class") if dict(u.overrides).get("mem_batch_size") == 64]
    assert experience_weights(replay[0], plan) == pytest.approx([0.6, 0.6, 0.6])  # 32 + 64 a batch
    domain = tuning_units(plan, "domain")[0]
    assert experience_weights(domain, plan) == pytest.approx([0.25] * 4)
    assert experience_weights(first_unit(lwf), plan) == pytest.approx([0.6])  # a shared first experience
    # A dataset whose classes are only known once loaded: every experience weighs alike.
    folder = check_plan(tiny_plan(settings={**TINY, "dataset": "imagefolder", "data_root": "x"}))
    assert experience_weights(tuning_units(folder, "class")[0], folder) == pytest.approx([1 / 3] * 3)


def test_a_shared_first_experience_is_one_unit_per_scenario_and_seed():
    plan = check_plan(tiny_plan(first_experience="shared"))
    tested = units_tested(plan, "class", {"lwf": {"lwf_alpha": 1.0}, "replay": {"mem_batch_size": 8}})
    firsts = first_units(plan, tested)
    assert [(u.part, u.strategy, u.arm, u.seed, u.overrides) for u in firsts] == [
        ("first", "naive", "", 0, ()), ("first", "naive", "", 1, ())]
    assert first_units(check_plan(tiny_plan()), tested) == []


def test_the_choice_is_the_best_mean_and_waits_for_every_seed():
    plan = check_plan(tiny_plan())
    units = tuning_units(plan, "class")
    scores = {u: 50.0 + (10.0 if dict(u.overrides).get("lwf_alpha") == 4.0 else 0.0) for u in units}
    tables, complete = choose(plan, "class", scores)
    assert complete and tables["lwf"]["chosen"] == {"lwf_alpha": 4.0}
    assert tables["replay"]["chosen"] == {"mem_batch_size": 8}  # a tie: the first in grid order
    assert tables["lwf"]["rows"][1]["per_seed"] == {"7": 60.0, "8": 60.0}
    del scores[units[-1]]
    tables, complete = choose(plan, "class", scores)
    assert not complete and tables["replay"]["chosen"] is None and tables["lwf"]["chosen"] == {"lwf_alpha": 4.0}


def test_several_reports_give_their_settings_in_order_a_later_family_replacing_an_earlier(tmp_path):
    first = {"plan_fingerprint": "a" * 16, "scenarios": {
        "task": {"chosen": {"streamkl": {"alpha": 100.0}}},
        "class": {"chosen": {"lwf": {"lwf_alpha": 16.0, "lwf_temperature": 2.0}, "replay": {"mem_batch_size": 16}}}}}
    again = {"plan_fingerprint": "b" * 16, "scenarios": {"class": {"chosen": {"lwf": {"lwf_alpha": 4.0,
                                                                                      "lwf_temperature": 1.0}}}}}
    (tmp_path / "results").mkdir()
    for name, report in (("first", first), ("again", again)):
        (tmp_path / "results" / f"{name}.json").write_text(json.dumps(report))
    plan = tiny_plan(val_seeds=[], settings_from=["../results/first.json", "../results/again.json"])
    plan["scenarios"] = {"task": {"options": {"experiences": 3, "first_experience_classes": 6},
                                  "test": {"": ["naive", "streamkl"]}},
                         "class": {"options": {"experiences": 3, "first_experience_classes": 6},
                                   "test": {"mem20pc": ["replay+lwf", "replay+lwf+streamkl"]}}}
    path = write_plan(tmp_path / "studies" / "plan.yaml", plan)
    loaded = load_plan(path)
    assert loaded["scenarios"]["class"]["chosen_from"] == {"plan": ["a" * 16, "b" * 16], "chosen": {
        "lwf": {"lwf_alpha": 4.0, "lwf_temperature": 1.0}, "replay": {"mem_batch_size": 16}}}
    assert loaded["scenarios"]["task"]["chosen_from"] == {"plan": ["a" * 16, "b" * 16],
                                                          "chosen": {"streamkl": {"alpha": 100.0}}}
    units = units_tested(loaded, "class", loaded["scenarios"]["class"]["chosen_from"]["chosen"])
    assert {dict(u.overrides)["lwf_alpha"] for u in units} == {4.0}
    # Another family setting the same field would make the choice depend on the families' order.
    again["scenarios"]["class"]["chosen"] = {"lwf_on_replay": {"lwf_alpha": 4.0}}
    (tmp_path / "results" / "again.json").write_text(json.dumps(again))
    with pytest.raises(PlanError, match="families lwf and lwf_on_replay of scenario class both set lwf_alpha"):
        load_plan(path)
    write_plan(path, {**plan, "settings_from": ["../results/again.json"]})
    with pytest.raises(PlanError, match="settings_from: no report has scenario task"):
        load_plan(path)
    write_plan(path, {**plan, "settings_from": []})
    with pytest.raises(PlanError, match="settings_from must be the path of a study report, or a list of them"):
        load_plan(path)


def test_a_plan_that_only_tunes_needs_no_test_seeds():
    plan = tiny_plan(test_seeds=[])
    plan["scenarios"]["class"]["test"] = {}
    checked = check_plan(plan)
    assert len(tuning_units(checked, "class")) == 2 * 2 * 2 and units_tested(checked, "class", {}) == []
    with pytest.raises(PlanError, match="scenarios.class runs nothing: its test and tuning are both empty"):
        check_plan({**plan, "scenarios": {"class": {**plan["scenarios"]["class"], "tuning": {}}}})
    with pytest.raises(PlanError, match="test_seeds needs at least 2 distinct seeds"):
        check_plan(tiny_plan(test_seeds=[]))
