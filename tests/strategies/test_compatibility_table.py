"""The compatibility table of docs/plugins.md: every model kind under every strategy, with each plugin.

The table lies between ``<!-- compatibility -->`` and ``<!-- /compatibility -->``; this test runs
every combination (tests/strategies/compatibility.py) and fails when the page's table differs from
what the runs give. Rewrite it with ``python tests/strategies/test_compatibility_table.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from compatibility import MODEL_KINDS, PLUGINS, STRATEGIES, available, run

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
MARKED = re.compile(r"(<!-- compatibility -->\n)(.*?)(<!-- /compatibility -->)", re.DOTALL)
SHORT = {"StreamKLPlugin": "StreamKL", "PADPlugin": "PAD"}


def cell(kind: str, strategy: str) -> str:
    """Which plugins distilled ``kind`` under ``strategy``: a penalty above 0 in the second experience."""
    results = []
    for plugin in sorted(PLUGINS, reverse=True):
        first, second = run(kind, strategy, plugin)
        distilled = all(value == 0.0 for value in first) and max(second, default=0.0) > 0.0
        results.append(f"{SHORT[plugin]} {'✓' if distilled else '✗'}")
    return ", ".join(results)


def table(written: str = "") -> str:
    """The Markdown table of every model kind and strategy.

    A kind whose extra is not installed here keeps its row of ``written`` (the page's table), or
    says what it needs when the page has none.
    """
    kept = {line.split(" | ")[0].removeprefix("| "): line for line in written.splitlines()}
    lines = ["| model | " + " | ".join(STRATEGIES) + " |", "|---|" + "---|" * len(STRATEGIES)]
    for kind in MODEL_KINDS:
        if available(kind):
            lines.append(f"| {kind} | " + " | ".join(cell(kind, strategy) for strategy in STRATEGIES) + " |")
        else:
            lines.append(kept.get(kind, f"| {kind} | " + " | ".join(
                [f"not run (needs {MODEL_KINDS[kind][1]})"] * len(STRATEGIES)) + " |"))
    return "\n".join(lines) + "\n"


def test_the_compatibility_table_is_the_runs_table() -> None:
    match = MARKED.search(PAGE.read_text())
    assert match, f"{PAGE.name} has no <!-- compatibility --> ... <!-- /compatibility --> markers"
    assert match.group(2) == table(match.group(2)), (
        f"the compatibility table in {PAGE.name} is stale: python tests/strategies/test_compatibility_table.py")


def test_a_kind_whose_extra_is_missing_keeps_its_written_row(monkeypatch) -> None:
    import test_compatibility_table as module

    monkeypatch.setattr(module, "available", lambda kind: False)
    first = next(iter(MODEL_KINDS))
    written = f"| {first} | as the page has it |\n"
    rows = table(written).splitlines()[2:]
    assert rows[0] == written.strip()
    assert all("not run (needs" in row for row in rows[1:]) and len(rows) == len(MODEL_KINDS)


if __name__ == "__main__":
    text = PAGE.read_text()
    if not MARKED.search(text):
        sys.exit(f"{PAGE} has no <!-- compatibility --> markers")
    PAGE.write_text(MARKED.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(3), text))
