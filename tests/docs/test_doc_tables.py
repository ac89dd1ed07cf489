"""Every table of README.md and docs/ is what benchmarks/tables.py renders from benchmarks/results/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tables

ROOT = Path(__file__).resolve().parents[2]


def test_every_document_table_matches_its_result_file():
    done = subprocess.run([sys.executable, "benchmarks/tables.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_check_fails_on_an_edited_table(tmp_path):
    (tmp_path / "docs").mkdir()
    document = tmp_path / "docs" / "page.md"
    document.write_text("<!-- table:kernel-long-bf16/headline -->\n<!-- /table -->\n")
    document.write_text(tables.regenerate(document))
    assert tables.regenerate(document) == document.read_text()
    document.write_text(document.read_text().replace("| 1.84 |", "| 1.48 |"))
    assert tables.regenerate(document) != document.read_text()


def test_every_result_table_names_gpu_versions_commit_and_date():
    for path in sorted(tables.RESULTS.glob("*.json")):
        table = json.loads(path.read_text())
        if path.name.startswith("efficacy-") or "plan_fingerprint" in table:  # a study's report
            assert {"device", "torch", "triton", "commit"} <= table["environment"].keys() and table["date"]
            continue
        if path.name.startswith("power-"):  # a plan's power calculation (CPU arithmetic on committed results)
            assert {"date", "commit", "command", "plan_file"} <= table.keys(), path.name
            continue
        names = [column["name"] for column in table["columns"]]
        assert {"gpu", "torch", "triton", "date"} <= table.keys(), path.name
        assert "commit" in table or "measured at" in names, path.name
        assert all(len(row) == len(names) for row in table["rows"]), path.name


def test_every_marker_names_a_table_and_every_table_is_shown():
    shown = {match.group("name").split("/")[0] for document in tables.documents()
             for match in tables.MARKED.finditer(document.read_text())}
    files = {path.stem for path in tables.RESULTS.glob("*.json") if not path.name.startswith(("efficacy-", "power-"))}
    assert files <= shown, f"result files no document shows: {sorted(files - shown)}"


def test_unknown_table_is_refused(tmp_path):
    document = tmp_path / "page.md"
    document.write_text("<!-- table:no-such-table -->\n<!-- /table -->\n")
    with pytest.raises(ValueError, match="no-such-table"):
        tables.regenerate(document)


def test_missing_values_show_as_a_dash():
    columns = [{"name": "a"}, {"name": "b", "align": "right", "format": ".1f"}]
    assert tables.markdown_table(columns, [[None, 2.0], ["x", None]])[2:] == ["| – | 2.0 |", "| x | – |"]
