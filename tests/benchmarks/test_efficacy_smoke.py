"""The efficacy study end to end on a tiny configuration, in process: sweep, choice, test, report."""

from __future__ import annotations

import json

import pytest

efficacy = pytest.importorskip("efficacy")


@pytest.mark.slow
def test_efficacy_study_tiny(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(efficacy.REGIMES, "short", {
        "dataset": "digits", "image_size": 8, "patch_size": 4, "epochs": 1, "batch_size": 64, "amp": "none",
        "model_kwargs": {"depth": 1, "embed_dim": 16, "num_heads": 2}})
    monkeypatch.setitem(efficacy.SWEEP_GRIDS, "short", ((10.0, "all", 0.5), (1.0, 1, 1.0)))
    monkeypatch.setitem(efficacy.SCENARIO_OPTIONS, "domain", {"experiences": 2, "rotation_step": 90.0})
    report_path = tmp_path / "report.json"
    assert efficacy.main(["--regime", "short", "--workers", "0", "--scenarios", "domain", "--seeds", "0", "1",
                          "--sweep-seeds", "7", "--strategies", "naive", "streamkl", "pad",
                          "--out", str(tmp_path / "runs"), "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    part = report["scenarios"]["domain"]
    assert [row["alpha"] for row in part["sweep"]] == [10.0, 1.0]
    best = max(part["sweep"], key=lambda row: row["objective"])
    assert part["chosen"] == {k: best[k] for k in ("alpha", "layers", "temperature")}
    assert set(part["table"]) == {"naive", "streamkl", "pad"}
    assert part["table"]["naive"]["seeds"] == [0, 1] and "task_il_acc" not in part["table"]["naive"]
    assert {(e["strategy"], e["baseline"]) for e in part["paired"]} == {
        ("streamkl", "naive"), ("streamkl", "pad"), ("pad", "naive")}
    assert all(e["n"] == 2 for e in part["paired"])
    printed = capsys.readouterr().out
    assert "### domain-incremental (5 tokens" in printed and "| streamkl − naive |" in printed
    assert efficacy.main(["--tables", str(report_path), str(report_path)]) == 0
    tables = capsys.readouterr().out
    assert "**domain-incremental**" in tables and "| strategy | acc, 5 tok. |" in tables
    assert tables.count("| streamkl − naive |") == 1 and "forgetting, 5 tok." in tables
    # a second start finds every unit done and trains nothing
    units = sorted((tmp_path / "runs" / "units").iterdir())
    stamps = [u.stat().st_mtime_ns for u in units]
    assert efficacy.main(["--regime", "short", "--workers", "0", "--scenarios", "domain", "--seeds", "0", "1",
                          "--sweep-seeds", "7", "--strategies", "naive", "streamkl", "pad",
                          "--out", str(tmp_path / "runs")]) == 0
    assert [u.stat().st_mtime_ns for u in units] == stamps
