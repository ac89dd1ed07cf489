"""Every ```python block of README.md and docs/*.md runs on the CPU as written.

The blocks of one document run in order in one namespace, so a later block may use what an
earlier one defined. A block that cannot run here is preceded by
``<!-- not run: REASON -->``; README's blocks all run. README's command-line example (the
```bash block after ``<!-- run: cli example -->``) runs too.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?:<!-- not run: (?P<reason>.*?) -->\n)?```python\n(?P<code>.*?)^```$", re.DOTALL | re.MULTILINE)
CLI_EXAMPLE = re.compile(r"^<!-- run: cli example -->\n```bash\n(?P<code>.*?)^```$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[tuple[int, str | None, str]]:
    """(line number, not-run reason or None, code) of every ```python block, in order."""
    return [(text.count("\n", 0, match.start("code")) + 1, match.group("reason"), match.group("code"))
            for match in FENCE.finditer(text)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_document(path: Path, text: str) -> int:
    """Run ``text``'s runnable python blocks in order in one namespace; returns how many ran."""
    namespace: dict[str, object] = {"__name__": f"doc:{path.name}"}
    ran = 0
    for line, reason, code in python_blocks(text):
        if reason is not None:
            continue
        exec(compile(code, f"{path.relative_to(ROOT)}, block at line {line}", "exec"), namespace)
        ran += 1
    return ran


@pytest.fixture
def single_process_group(monkeypatch):
    """What torchrun sets for one process, so a block may call ``dist.init_process_group``."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(name, value)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_python_blocks_run_on_the_cpu(path, tmp_path, monkeypatch, single_process_group):
    monkeypatch.chdir(tmp_path)  # a block may write files
    text = path.read_text()
    blocks = python_blocks(text)
    if path.name == "README.md":
        assert len(blocks) >= 2 and all(reason is None for _, reason, _ in blocks)
    assert run_document(path, text) == sum(reason is None for _, reason, _ in blocks)


def test_every_skipped_block_says_why():
    for path in DOCUMENTS:
        for line, reason, _ in python_blocks(path.read_text()):
            assert reason is None or len(reason.split()) >= 3, f"{path.name}:{line}: give a reason"
    assert "```python" not in "".join(FENCE.sub("", path.read_text()) for path in DOCUMENTS), (
        "a ```python fence the extractor does not see")


@pytest.mark.slow
def test_readme_cli_example_runs(tmp_path):
    match = CLI_EXAMPLE.search((ROOT / "README.md").read_text())
    assert match, "README has a ```bash block after <!-- run: cli example -->"
    commands = [line.split("#")[0].strip() for line in match.group("code").splitlines()]
    commands = [command for command in commands if command]
    assert commands and all(command.startswith("cl-streamkl ") for command in commands)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for command in commands:
        args = [sys.executable, "-m", "cl_streamkl", *shlex.split(command)[1:]]
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
