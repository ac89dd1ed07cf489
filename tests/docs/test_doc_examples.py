"""Every ```python block of README.md and docs/*.md runs alone, as a reader pastes it, on the CPU.

Each block runs by itself in a fresh interpreter (a subprocess, no GPU, an empty working
folder): it must hold its own imports, device and model. A block that cannot run so (one
that needs several GPUs or a compiler) is a fragment, preceded by ``<!-- fragment: HOW IT
RUNS -->`` (or ``<!-- not run: REASON -->``), the marker saying how it is run. README's blocks
are never fragments. README's command-line example (the ```bash block after
``<!-- run: cli example -->``) runs too.

The blocks' interpreters are started as many at a time as the machine has CPU cores (each
one alone in its own process and folder, as before): a block spends most of its seconds
importing torch, timm and avalanche on one core.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?:<!-- (?:fragment|not run): (?P<reason>.*?) -->\n)?```python\n(?P<code>.*?)^```$",
                   re.DOTALL | re.MULTILINE)
CLI_EXAMPLE = re.compile(r"^<!-- run: cli example -->\n```bash\n(?P<code>.*?)^```$", re.DOTALL | re.MULTILINE)
BLOCK_TIMEOUT_S = 600
MOST_AT_ONCE = 4  # interpreters at once on a machine of many cores: each holds 1 to 2 GiB


def python_blocks(text: str) -> list[tuple[int, str | None, str]]:
    """(line number, fragment marker's text or None, code) of every ```python block, in order."""
    return [(text.count("\n", 0, match.start("code")) + 1, match.group("reason"), match.group("code"))
            for match in FENCE.finditer(text)]


def _runnable_blocks() -> list[tuple[Path, int, str]]:
    return [(path, line, code) for path in DOCUMENTS
            for line, reason, code in python_blocks(path.read_text()) if reason is None]


def _clean_env() -> dict[str, str]:
    """The environment of a reader's fresh shell on a CPU machine, with this checkout importable."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def run_alone(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, in ``cwd``."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)


def _cli_commands() -> list[str]:
    """The commands of README's command-line example, comments dropped; none when README has no example."""
    match = CLI_EXAMPLE.search((ROOT / "README.md").read_text())
    commands = [line.split("#")[0].strip() for line in match.group("code").splitlines()] if match else []
    return [command for command in commands if command]


def run_cli_example(commands: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    """README's ``cl-streamkl`` commands one after the other in ``cwd``, up to the first that fails."""
    done = []
    for command in commands:
        args = [sys.executable, "-m", "cl_streamkl", *shlex.split(command)[1:]]
        done.append(subprocess.run(args, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=900))
        if done[-1].returncode:
            break
    return done


@pytest.fixture(scope="module")
def example_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[object, Future]:
    """Every example this pytest run selected, started at once on one worker per CPU core (at most MOST_AT_ONCE).

    By (page, line) for a Python block, ``"cli"`` for README's command-line example (queued first,
    as the longest).
    """
    names = {getattr(item, "originalname", None) for item in request.session.items}
    blocks = [item.callspec.params for item in request.session.items
              if getattr(item, "originalname", None) == "test_python_block_runs_alone"]
    pool = ThreadPoolExecutor(max_workers=min(len(os.sched_getaffinity(0)), MOST_AT_ONCE))
    runs = {}
    if "test_readme_cli_example_runs" in names:
        runs["cli"] = pool.submit(run_cli_example, _cli_commands(), tmp_path_factory.mktemp("cli"))
    for params in blocks:
        runs[params["path"], params["line"]] = pool.submit(run_alone, params["code"], tmp_path_factory.mktemp("block"))
    yield runs
    pool.shutdown(cancel_futures=True)  # after -x or an interrupt, the blocks not started yet never start


@pytest.mark.slow
@pytest.mark.parametrize(("path", "line", "code"), _runnable_blocks(),
                         ids=[f"{path.relative_to(ROOT).as_posix()}:{line}" for path, line, _ in _runnable_blocks()])
def test_python_block_runs_alone(path, line, code, example_runs):
    done = example_runs[path, line].result()
    assert done.returncode == 0, f"{path.name}, block at line {line}:\n{done.stderr[-3000:]}"


def test_a_block_that_needs_what_it_does_not_import_fails():
    """The check is real: a block leaning on an earlier block's names fails alone."""
    done = run_alone("loss = attention_kl(q, k, q, k)", Path.cwd())
    assert done.returncode != 0 and "NameError" in done.stderr


def test_every_fragment_says_how_it_runs():
    for path in DOCUMENTS:
        for line, reason, _ in python_blocks(path.read_text()):
            assert reason is None or len(reason.split()) >= 3, f"{path.name}:{line}: say how the fragment runs"
            assert reason is None or path.name != "README.md", f"README.md:{line}: README's blocks all run"
    assert "```python" not in "".join(FENCE.sub("", path.read_text()) for path in DOCUMENTS), (
        "a ```python fence the extractor does not see")


@pytest.mark.slow
def test_readme_cli_example_runs(example_runs):
    assert CLI_EXAMPLE.search((ROOT / "README.md").read_text()), (
        "README has a ```bash block after <!-- run: cli example -->")
    commands = _cli_commands()
    assert commands and all(command.startswith("cl-streamkl ") for command in commands)
    done = example_runs["cli"].result()
    assert len(done) == len(commands) and all(run.returncode == 0 for run in done), done[-1].stderr[-2000:]
