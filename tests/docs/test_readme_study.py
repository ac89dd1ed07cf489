"""README's study example: its plan is a valid plan file, and the command after it runs it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAN = re.compile(r"^<!-- run: study plan -->\n```yaml\n(?P<plan>.*?)^```\n\n```bash\n(?P<command>.*?)^```$",
                  re.DOTALL | re.MULTILINE)


def _example() -> tuple[str, list[str]]:
    match = PLAN.search((ROOT / "README.md").read_text())
    assert match, "README has a ```yaml plan after <!-- run: study plan --> and its ```bash command"
    command = shlex.split(match.group("command").split("#")[0])
    assert command[:3] == ["cl-streamkl", "study", "plan.yaml"]
    return match.group("plan"), command[3:]


def test_readme_plan_is_a_valid_plan(tmp_path):
    from cl_streamkl.experiment.study.plan import load_plan

    plan_text, _ = _example()
    (tmp_path / "plan.yaml").write_text(plan_text)
    plan = load_plan(tmp_path / "plan.yaml")
    assert plan["test_seeds"] and plan["scenarios"]["task"]["tuning"]


@pytest.mark.slow
def test_readme_study_runs(tmp_path, monkeypatch, capsys):
    from cl_streamkl.experiment.study.command import main

    plan_text, options = _example()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.yaml").write_text(plan_text)
    # In this process (the example's two worker processes would each import torch again).
    options = [option for option in options if option not in ("--workers", "2")] + ["--workers", "0"]
    assert main(["plan.yaml", *options]) == 0
    out = tmp_path / "runs" / "demo-study"
    assert {"report.json", "report.md", "paired.png"} <= {path.name for path in out.iterdir()}
    assert "lwf+streamkl − lwf" in (out / "report.md").read_text()
