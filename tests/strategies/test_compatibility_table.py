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
    if not available(kind):
        return f"not run (needs {MODEL_KINDS[kind][1]})"
    results = []
    for plugin in sorted(PLUGINS, reverse=True):
        first, second = run(kind, strategy, plugin)
        distilled = all(value == 0.0 for value in first) and max(second, default=0.0) > 0.0
        results.append(f"{SHORT[plugin]} {'✓' if distilled else '✗'}")
    return ", ".join(results)


def table() -> str:
    """The Markdown table of every model kind and strategy."""
    lines = ["| model | " + " | ".join(STRATEGIES) + " |", "|---|" + "---|" * len(STRATEGIES)]
    lines += [f"| {kind} | " + " | ".join(cell(kind, strategy) for strategy in STRATEGIES) + " |"
              for kind in MODEL_KINDS]
    return "\n".join(lines) + "\n"


def test_the_compatibility_table_is_the_runs_table() -> None:
    match = MARKED.search(PAGE.read_text())
    assert match, f"{PAGE.name} has no <!-- compatibility --> ... <!-- /compatibility --> markers"
    assert match.group(2) == table(), (
        f"the compatibility table in {PAGE.name} is stale: python tests/strategies/test_compatibility_table.py")


if __name__ == "__main__":
    text = PAGE.read_text()
    if not MARKED.search(text):
        sys.exit(f"{PAGE} has no <!-- compatibility --> markers")
    PAGE.write_text(MARKED.sub(lambda m: m.group(1) + table() + m.group(3), text))
