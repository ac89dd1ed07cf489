"""The package's shape: the core op installs and imports alone, wings name their extra, imports go downward."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from importlinter.cli import lint_imports
from packaging.requirements import Requirement

import cl_streamkl

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
CORE_EXPORTS = {"AttentionKLDivLoss", "attention_kl", "attention_kl_grouped", "attention_kl_reference",
                "attention_kl_key_sharded", "PooledAttention", "pooled_attention", "pooled_attention_reference",
                "__version__"}
# What only the wings need: none of it may be imported by ``import cl_streamkl``.
WING_MODULES = ("avalanche", "timm", "matplotlib", "sklearn", "scipy", "mlxtend", "psutil", "tqdm")

# A fresh interpreter in which the modules named in argv[1] (comma-separated) cannot be
# imported, as if they were not installed; then argv[2] runs.
BLOCKING = """\
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked")
        return None
sys.meta_path.insert(0, Block())
exec(sys.argv[2])
"""


def run_without(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where ``blocked`` top-level modules are missing."""
    # The same cl_streamkl as this process imported, whatever is installed.
    env = {**os.environ, "PYTHONPATH": str(Path(cl_streamkl.__file__).parents[1])}
    return subprocess.run([sys.executable, "-c", BLOCKING, ",".join(blocked), code],
                          capture_output=True, text=True, env=env, timeout=300)


def test_top_level_exports_the_core_op_only() -> None:
    assert set(cl_streamkl.__all__) == CORE_EXPORTS
    assert all(hasattr(cl_streamkl, name) for name in cl_streamkl.__all__)


def test_the_op_runs_without_any_wing_dependency() -> None:
    code = (
        "import torch, cl_streamkl\n"
        "q, k, qt, kt = (torch.randn(1, 2, 5, 8) for _ in range(4))\n"
        "got = cl_streamkl.attention_kl(q, k, qt, kt)\n"
        "want = cl_streamkl.attention_kl_reference(q, k, qt, kt)\n"
        "assert torch.allclose(got, want.float(), rtol=1e-5), (got, want)\n"
        "pooled = cl_streamkl.pooled_attention(q, k).per_key\n"
        "assert torch.allclose(pooled, cl_streamkl.pooled_attention_reference(q, k).per_key.float())\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & BLOCKED))\n"
    )
    result = run_without(WING_MODULES, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(("wing", "blocked", "message"), [
    ("cl_streamkl.capture", ("timm",), 'cl_streamkl.capture needs timm: pip install "cl-streamkl[capture]"'),
    ("cl_streamkl.strategies", ("timm",), 'cl_streamkl.strategies needs timm: pip install "cl-streamkl[strategies]"'),
    ("cl_streamkl.experiment", ("matplotlib", "psutil"),
     'cl_streamkl.experiment needs matplotlib, psutil: pip install "cl-streamkl[experiment]"'),
])
def test_a_wing_without_its_extra_names_the_extra(wing: str, blocked: tuple[str, ...], message: str) -> None:
    result = run_without(blocked, f"import {wing}")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == f"ImportError: {message}"


def test_the_distillers_run_without_avalanche_and_the_plugins_name_the_extra() -> None:
    code = (
        "import timm, torch\n"
        "import cl_streamkl.strategies as strategies\n"
        "vit = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=8, num_classes=2, depth=1)\n"
        "distiller = strategies.AttentionDistiller(alpha=1.0)\n"
        "distiller.update_teacher(vit)\n"
        "with torch.no_grad():\n"
        "    vit.head.weight.add_(1.0)\n"
        "    vit.blocks[0].attn.qkv.weight.mul_(2.0)\n"
        "output, penalty = distiller.forward(vit, torch.randn(2, 3, 16, 16))\n"
        "assert output.shape == (2, 2) and penalty.item() > 0, penalty\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & BLOCKED))\n"
        "from cl_streamkl.strategies import StreamKLPlugin\n"
    )
    result = run_without(("avalanche",), code)
    assert result.stdout.strip() == "[]", result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        'ImportError: cl_streamkl.strategies.StreamKLPlugin needs avalanche-lib: pip install "cl-streamkl[strategies]"')


def test_the_strategies_import_avalanche_only_for_its_plugins() -> None:
    result = run_without((), "import cl_streamkl.strategies\nprint('avalanche' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
    # Named, a plugin comes from its module (in this process, where other tests import Avalanche anyway).
    import cl_streamkl.strategies as strategies
    from cl_streamkl.strategies.plugin import PADPlugin

    assert strategies.PADPlugin is PADPlugin
    assert set(strategies.__all__) <= set(dir(strategies))
    assert not hasattr(strategies, "NoSuchPlugin")


def test_the_command_line_help_imports_no_avalanche() -> None:
    code = (
        "from cl_streamkl.experiment.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as stop:\n"
        "    assert stop.code == 0\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'avalanche', 'timm', 'matplotlib'}))\n"
    )
    result = run_without((), code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_core_dependencies_are_torch_and_triton() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert sorted(Requirement(line).name for line in project["dependencies"]) == ["torch", "triton"]


def test_wings_import_downward_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # import-linter reads the layers contract of pyproject.toml (run from the root).
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(PYPROJECT), no_cache=True) == 0
