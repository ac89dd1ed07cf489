"""The API reference (mkdocs.yml, docs/api/*.md) builds with ``mkdocs build --strict``.

A ``::: name`` that names nothing, or a cross-reference mkdocstrings cannot resolve, fails the
build; links from the guide pages to files outside docs/ only inform (mkdocs.yml, ``validation``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason='mkdocs and mkdocstrings are not installed (pip install -e ".[docs]")')


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_api_reference_builds_strictly(tmp_path):
    start = time.monotonic()
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-4000:]
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        assert (tmp_path / "site" / "api" / page.stem).exists() or page.stem == "index", page.name
    assert (tmp_path / "site" / "api" / "op" / "index.html").read_text().count('id="cl_streamkl.attention_kl.') >= 3
    assert time.monotonic() - start < 120, "the API reference takes too long to build"


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = {page for section in config["nav"] for entries in section.values() for entry in entries
              for page in entry.values()}
    pages = {path.relative_to(ROOT / "docs").as_posix() for path in (ROOT / "docs").glob("**/*.md")}
    assert pages - listed == set()
    assert listed - pages == set()


@pytest.mark.parametrize(("page", "builds"), [
    ("::: cl_streamkl.kernels.config\n\nSee [kernel_options][cl_streamkl.kernels.config.kernel_options].\n", True),
    ("::: cl_streamkl.kernels.no_such_module\n", False),
    ("::: cl_streamkl.kernels.config\n\nSee [kernel_options][cl_streamkl.kernels.config.no_such_name].\n", False),
], ids=["resolved", "unknown identifier", "unresolved cross-reference"])
def test_a_broken_reference_fails_the_build(tmp_path, page, builds):
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(f"# One page\n\n{page}")
    config.update(docs_dir=str(tmp_path / "docs"), nav=["index.md"])
    config["plugins"][1]["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert (done.returncode == 0) == builds, done.stderr[-2000:]
