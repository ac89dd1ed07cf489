"""``cl-streamkl run`` and ``study`` call down the import floors; the few climbs back up are listed here.

A module's floor is one more than the highest floor it imports (circles share a floor). A call
from a function to one on a higher floor is a climb back up: the callee's module imports the
caller's, so the caller reaches it through an object or a function handed down. Each climb a
run makes is listed below with why it is there; a new one fails the test, so it is either
removed or listed with its reason.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

import networkx as nx
import pytest
from cli_helpers import TINY

sys.path.insert(0, str(Path(__file__).parent / "study"))
from study_helpers import tiny_plan, write_plan  # noqa: E402

from cl_streamkl.experiment import cli

PACKAGE = Path(cli.__file__).resolve().parents[1]

# (caller module, callee module, callee function) -> why the call climbs.
CLIMBS = {
    ("experiment.progress", "strategies.plugin", "last_penalty"):
        "the progress bar reads the penalty of the plugin it is given",
    ("experiment.progress", "strategies.plugin", "last_share"): "and the penalty's share of the loss",
    ("experiment.plugin_state", "strategies.plugin", "state_dict"):
        "checkpoints ask each plugin for its state (Avalanche's plugin protocol)",
    ("experiment.files", "experiment.checkpoint", "<lambda>"): "write_atomically calls the writer it is given",
    ("experiment.files", "experiment.plots", "<lambda>"): "write_atomically calls the writer it is given",
    ("experiment.runner", "experiment.cli", "warn"): "the runner warns through the callback the command gives",
    ("experiment.files", "experiment.study.units", "<lambda>"): "write_atomically calls the writer it is given",
    ("experiment.runner", "experiment.study.units", "after_experience"):
        "the runner reports each finished experience to the callback a study unit gives",
    ("strategies.distiller", "strategies.pooled_attention", "layer_penalties"):
        "PAD's distiller overrides the per-layer penalty of the distiller it extends",
    ("strategies.distiller", "strategies.pooled_attention", "_config"):
        "PAD's distiller overrides the options its state records",
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floors() -> dict[str, int]:
    """Each package module's floor in the import graph (``TYPE_CHECKING`` imports left out)."""
    modules = {_module(path): path for path in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module or ""]
            for target in targets:
                target = target.removeprefix("cl_streamkl").lstrip(".")
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    condensed = nx.condensation(graph)
    floor: dict[int, int] = {}
    for component in reversed(list(nx.topological_sort(condensed))):
        floor[component] = 1 + max((floor[d] for d in condensed.successors(component)), default=0)
    return {name: floor[condensed.graph["mapping"][name]] for name in modules}


def test_relative_imports_are_not_used_so_the_floors_see_every_import():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)), path


def _run(tmp_path: Path) -> list[str]:
    return ["run", *TINY, "--strategies", "naive", "streamkl", "replay", "lwf", "ewc", "pad", "--experiences", "2",
            "--out", str(tmp_path / "run")]


def _study(tmp_path: Path) -> list[str]:
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    return ["study", str(plan), "--workers", "0", "--part", "tune", "--max-units", "2", "--out", str(tmp_path / "study")]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("command", [_run, _study], ids=["run", "study"])
def test_a_command_climbs_back_up_only_where_listed(tmp_path, monkeypatch, command):
    floors = _floors()
    files = {str(path): _module(path) for path in PACKAGE.rglob("*.py")}
    climbs: Counter[tuple[str, str, str]] = Counter()

    def watch(frame, event, _arg):
        caller = frame.f_back
        if event != "call" or caller is None:
            return
        callee_module, caller_module = files.get(frame.f_code.co_filename), files.get(caller.f_code.co_filename)
        if callee_module and caller_module and floors[callee_module] > floors[caller_module]:
            climbs[caller_module, callee_module, frame.f_code.co_name] += 1

    monkeypatch.chdir(tmp_path)
    sys.setprofile(watch)
    try:
        status = cli.main(command(tmp_path))
    finally:
        sys.setprofile(None)
    assert status == 0
    assert set(climbs) <= set(CLIMBS), sorted(set(climbs) - set(CLIMBS))
    # The results' record sits below everything that writes, summarises and compares it.
    assert floors["experiment.run_result"] < min(floors[m] for m in ("experiment.outputs", "experiment.summary",
                                                                      "experiment.statistics"))
