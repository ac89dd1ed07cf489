"""The top-level package: what it exports, and that importing it needs no Avalanche."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cl_streamkl
from cl_streamkl.capture import CompiledQK
from cl_streamkl.strategies import AttentionDistiller


def test_top_level_exports() -> None:
    assert cl_streamkl.AttentionDistiller is AttentionDistiller
    assert cl_streamkl.CompiledQK is CompiledQK
    assert all(hasattr(cl_streamkl, name) for name in cl_streamkl.__all__)


def test_importing_the_package_and_the_distiller_leaves_avalanche_unimported() -> None:
    # A fresh interpreter: this test process has Avalanche loaded by other tests already.
    code = (
        "import sys, cl_streamkl\n"
        "cl_streamkl.AttentionDistiller(layers='all')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'avalanche'))\n"
    )
    # The same cl_streamkl as this process imported, whatever is installed.
    env = {**os.environ, "PYTHONPATH": str(Path(cl_streamkl.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.strip() == "[]"
