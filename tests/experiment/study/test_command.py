"""``cl-streamkl study PLAN`` end to end on the CPU, in process: tuning in parts, test, report, time
limits, archives, resuming from an archive or a committed report, a user's ImageFolder plan."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest
from study_helpers import tiny_plan, write_plan

from cl_streamkl.experiment import cli
from cl_streamkl.experiment.study import files as study_files
from cl_streamkl.experiment.study import rates as study_rates
from cl_streamkl.experiment.study.command import main
from cl_streamkl.experiment.study.plan import Unit, experience_weights, load_plan
from cl_streamkl.experiment.study.rates import (
    finished_records,
    rate_key,
    seconds_per_weight_of,
)


def _plan(tmp_path, name="plan.yaml", **changes):
    """The tiny plan with PAD tuned too: lwf, pad and replay, two settings each."""
    plan = tiny_plan(**changes)
    part = plan["scenarios"]["class"]
    part["tuning"]["pad"] = {"strategy": "pad", "arm": "", "grid": [{"pad_alpha": 0.1}, {"pad_alpha": 1.0}]}
    part["test"][""] = ["lwf", "lwf+streamkl", "lwf+pad"]
    return write_plan(tmp_path / name, plan)


@pytest.mark.slow
def test_a_small_study_tunes_tests_and_reports(tmp_path, monkeypatch, capsys):
    path = _plan(tmp_path)
    report_path, out, archive = tmp_path / "report.json", tmp_path / "runs", tmp_path / "units.tar.gz"
    common = [str(path), "--workers", "0", "--json", str(report_path)]

    # A first part: three tuning units; the plan is in the report before anything ran.
    assert main([*common, "--out", str(out), "--part", "tune", "--max-units", "3"]) == 0
    report = json.loads(report_path.read_text())
    assert report["units"] == {"tune": [3, 12], "test": [0, 10]}
    assert report["plan"] == load_plan(path) and report["scenarios"]["class"]["chosen"] is None
    assert json.loads((out / "plan.json").read_text()) == report["plan"]
    first = next(iter(report["records"].values()))
    execution = first["execution"]
    assert execution["compile_layers"] is False and execution["compile_model"] is False
    assert execution["commit"] == report["environment"]["commit"] and execution["workers"] == 0
    assert [number for number, seconds in first["experience_s"] if seconds > 0] == [1, 2, 3]
    capsys.readouterr()
    assert main([*common, "--out", str(out), "--part", "test"]) == 2
    assert capsys.readouterr().err == ("cl-streamkl study: error: the tuning of scenario class is not finished; "
                                       "run --part tune first\n")
    # Past the time limit nothing starts; nor a unit that would pass it, judged by the finished ones.
    assert main([*common, "--out", str(out), "--time-limit", "1e-9"]) == 0
    assert json.loads(report_path.read_text())["units"]["tune"] == [3, 12]
    records = finished_records(out).values()
    plan = report["plan"]
    units = [Unit.from_record(r["unit"]) for r in records]
    rates = seconds_per_weight_of(records, plan)
    # Per rate key, from the experiences' own times: every first experience alike, later ones per kind.
    assert set(rates) == {rate_key(u, index) for u in units for index in range(3)}
    assert min(rates.values()) > 0 and rates[rate_key(units[0], 0)] == pytest.approx(max(
        r["experience_s"][0][1] / experience_weights(u, plan)[0] for r, u in zip(records, units)))
    with monkeypatch.context() as patched:
        patched.setattr(study_rates, "seconds_per_weight_of", lambda records, plan: {"any kind": 3600.0})
        assert main([*common, "--out", str(out), "--time-limit", "30"]) == 0
    assert json.loads(report_path.read_text())["units"]["tune"] == [3, 12]

    monkeypatch.setattr(study_files, "ARCHIVE_PART_BYTES", 2**12)  # so the archive comes in parts
    capsys.readouterr()
    assert main([*common, "--out", str(out), "--archive", str(archive)]) == 0
    printed = capsys.readouterr().out
    assert "**class-incremental**" in printed and "| lwf+streamkl − lwf |" in printed
    assert "tune 12/12 units; test 10/10 units" in printed
    assert (tmp_path / "units.tar.gz.1").is_file()
    assert all((out / name).is_file() for name in ("report.json", "report.md", "paired.png", "plan.json"))
    report = json.loads(report_path.read_text())
    assert json.loads((out / "report.json").read_text()) == report
    part = report["scenarios"]["class"]
    assert report["units"] == {"tune": [12, 12], "test": [10, 10]}
    for family, table in part["tuning"].items():
        assert len(table["rows"]) == 2 and all(len(row["per_seed"]) == 2 for row in table["rows"])
        best = max(table["rows"], key=lambda row: row["mean"])  # the first of equals
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

    # The grid is fixed once the study has started: another plan in the same folder is refused.
    other = _plan(tmp_path, "other.yaml", val_seeds=[7, 9])
    assert main([str(other), "--workers", "0", "--out", str(out)]) == 2
    assert "holds another plan" in capsys.readouterr().err
    # Another machine continues from the archive: every unit is found, nothing trains.
    before = report_path.read_text()
    assert main([*common, "--out", str(tmp_path / "elsewhere"), "--from-archive", str(archive)]) == 0
    assert json.loads(report_path.read_text())["scenarios"] == json.loads(before)["scenarios"]
    assert "[1/" not in capsys.readouterr().out
    # A new machine continues from the committed report alone: its records are the finished units,
    # less the penalty of every iteration (their mean is kept).
    stored = json.loads(before)["records"]
    assert len(stored) == 22 and not any("penalties" in record for record in stored.values())
    written = finished_records(out)
    distilled = [name for name, record in written.items() if record["penalties"]]
    assert distilled and all(stored[name]["mean_penalty"] == written[name]["mean_penalty"] for name in distilled)
    assert main([*common, "--out", str(tmp_path / "fresh"), "--from-report", str(report_path)]) == 0
    assert json.loads(report_path.read_text())["scenarios"] == json.loads(before)["scenarios"]
    assert len(list((tmp_path / "fresh" / "units").glob("*.json"))) == 22
    assert main([str(other), "--workers", "0", "--out", str(tmp_path / "o"), "--from-report", str(report_path)]) == 2
    assert "--from-report holds plan" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert cli.main(["study", "--tables", str(report_path)]) == 0  # also as cl-streamkl's sub-command
    tables = capsys.readouterr().out
    assert "**class-incremental**" in tables and "| lwf+streamkl − lwf |" in tables and "| method (5 tokens)" in tables
    # A later plan takes the settings this study chose.
    later = write_plan(tmp_path / "later.yaml", {**tiny_plan(val_seeds=[]), "settings_from": "report.json",
                                                 "scenarios": {"class": {"options": plan["scenarios"]["class"]["options"],
                                                                         "test": {"": ["lwf", "lwf+streamkl"]}}}})
    chosen = load_plan(later)["scenarios"]["class"]["chosen_from"]
    assert chosen == {"plan": report["plan_fingerprint"], "chosen": part["chosen"]}


def test_the_hard_limit_kills_the_workers_and_still_writes_the_report(tmp_path, capsys):
    """--hard-limit: the workers still training at it are killed and their units counted as stopped,
    and the report and archive are written all the same (a machine ending the call would lose them)."""
    path = write_plan(tmp_path / "plan.yaml", tiny_plan())
    report, archive = tmp_path / "report.json", tmp_path / "units.tar.gz"
    began = time.time()
    # 1.2 s: the worker is still importing torch, let alone training.
    assert main([str(path), "--workers", "1", "--part", "tune", "--max-units", "2", "--time-limit", "0.02",
                 "--hard-limit", "0.02", "--out", str(tmp_path / "runs"), "--json", str(report),
                 "--archive", str(archive)]) == 0
    assert time.time() - began < 60
    out = capsys.readouterr()
    assert "cl-streamkl study: --hard-limit reached: 2 units stopped or never started" in out.err
    assert "; 2 unfinished (they resume from their checkpoints)" in out.out
    assert json.loads(report.read_text())["units"]["tune"][0] == 0 and archive.is_file()
    assert not multiprocessing.active_children()


def _image_folder(root, classes=4, images=12):
    """``classes`` folders of ``images`` 16 px PNGs each, every class its own shade and stripe."""
    from PIL import Image

    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for k in range(images):
            pixels = bytes((60 * c + 3 * k + (40 if (x + c) % 4 == 0 else 0)) % 256 for y in range(16) for x in range(16))
            Image.frombytes("L", (16, 16), pixels).convert("RGB").save(root / f"class{c}" / f"{k}.png")
    return root


def test_a_users_imagefolder_plan_runs(tmp_path, capsys):
    data = _image_folder(tmp_path / "images")
    settings = {"dataset": "imagefolder", "data_root": str(data), "image_size": 16, "patch_size": 8, "epochs": 1,
                "batch_size": 16, "amp": "none", "model_kwargs": {"depth": 1, "embed_dim": 16, "num_heads": 2}}
    scenario = {"options": {"experiences": 2}, "tuning": {}, "test": {"": ["naive", "streamkl"]}}
    path = write_plan(tmp_path / "plan.yaml", tiny_plan(settings=settings, val_seeds=[], arms={"": {}},
                                                        scenarios={"class": scenario}))
    out = tmp_path / "out"
    assert main([str(path), "--workers", "0", "--part", "test", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["units"] == {"tune": [0, 0], "test": [4, 4]} and report["settings"]["tokens"] == 5
    runs = report["scenarios"]["class"]["runs"]
    assert {(r["strategy"], r["seed"]) for r in runs} == {(s, seed) for s in ("naive", "streamkl") for seed in (0, 1)}
    assert all(len(r["accuracy_matrix"]) == 2 and sorted(r["class_order"]) == [0, 1, 2, 3] for r in runs)
    assert "| streamkl − naive |" in capsys.readouterr().out


@pytest.mark.slow
def test_a_plan_that_only_tunes_reports_its_choice_for_a_later_plan(tmp_path, capsys):
    plan = tiny_plan(test_seeds=[])
    plan["scenarios"]["class"]["tuning"] = {"lwf": {"strategy": "replay+lwf", "arm": "mem20pc",
                                                    "grid": [{"lwf_alpha": 1.0}, {"lwf_alpha": 4.0}]}}
    plan["scenarios"]["class"]["test"] = {}
    path = write_plan(tmp_path / "tune.yaml", plan)
    report_path = tmp_path / "tune.json"
    assert main([str(path), "--part", "tune", "--workers", "0", "--out", str(tmp_path / "runs"),
                 "--json", str(report_path)]) == 0
    assert "tune 4/4 units; test 0/0 units" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    chosen = report["scenarios"]["class"]["chosen"]
    assert list(chosen) == ["lwf"] and chosen["lwf"]["lwf_alpha"] in (1.0, 4.0)
    # A later plan takes that choice after an earlier report's (here: the same report twice).
    scenario = {"options": plan["scenarios"]["class"]["options"], "test": {"mem20pc": ["replay+lwf"]}}
    later = write_plan(tmp_path / "later.yaml", {**tiny_plan(val_seeds=[]), "settings_from": ["tune.json", "tune.json"],
                                                 "scenarios": {"class": scenario}})
    assert load_plan(later)["scenarios"]["class"]["chosen_from"]["chosen"] == chosen
