"""Every relative link of README.md, CHANGELOG.md, docs/*.md and docs/api/*.md reaches a file, and
its #anchor a heading there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "api").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```$", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_anchor_rules_follow_github():
    assert anchors("## bf16, D = 64 and 128, against SDPA's default backend\n") == {
        "bf16-d--64-and-128-against-sdpas-default-backend"}
    assert anchors("### `StreamKLPlugin` in an Avalanche strategy\n") == {"streamklplugin-in-an-avalanche-strategy"}


def test_every_relative_link_resolves():
    broken = []
    for document in DOCUMENTS:
        text = document.read_text()
        for target in LINK.findall(CODE_SPAN.sub("", FENCE.sub("", text))):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (document.parent / path).resolve() if path else document
            if not resolved.exists():
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
