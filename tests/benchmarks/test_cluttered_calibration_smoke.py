"""The cluttered-MNIST calibration on a tiny configuration, in process: the table file, and a resumed start."""

from __future__ import annotations

import json

import pytest

calibration = pytest.importorskip("cluttered_calibration")


@pytest.mark.slow
def test_cluttered_calibration_tiny(tmp_path, monkeypatch):
    report_path = tmp_path / "report.json"
    args = ["--tiny", "--device", "cpu", "--workers", "0", "--clutter", "1", "--schedules", "cosine",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "units"), "--json", str(report_path)]
    assert calibration.main(args) == 0
    report = json.loads(report_path.read_text())
    assert {"title", "gpu", "torch", "triton", "timm", "avalanche", "commit", "date", "command"} <= set(report)
    assert [column["name"] for column in report["columns"]][2:4] == ["joint acc., 65 tok.", "joint acc., 5 tok."]
    [row] = report["rows"]
    assert row[:2] == [1, "cosine"] and len(row[5].split(" / ")) == 5
    assert all(0.0 <= value <= 1.0 for value in (row[2], row[3], row[6], row[7]))
    assert {unit["kind"] for unit in report["units"]} == {"joint", "control", "learning"}

    def no_training(*args, **kwargs):
        raise AssertionError("a finished training ran again")

    monkeypatch.setattr(calibration, "run_unit", no_training)
    assert calibration.main(args) == 0
    assert json.loads(report_path.read_text())["rows"] == [row]
