"""What the command-line tests share: a tiny run's options and one-line error checks."""

from __future__ import annotations

from pathlib import Path

from cl_streamkl.experiment import cli

# A 1-block, 16-wide ViT on 8 px digits: a run of two experiences takes seconds on a CPU.
TINY = ["--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "--image-size", "8",
        "--patch-size", "4", "--epochs", "1", "--batch-size", "64", "--no-progress"]
# The smallest useful run: one strategy, two experiences.
SMALL = [*TINY, "--strategies", "naive", "--experiences", "2"]


def run_cli(tmp_path: Path, name: str, *extra: str) -> tuple[int, Path]:
    """``cl-streamkl run`` with :data:`TINY` options into ``tmp_path/name``; (exit status, folder)."""
    out = tmp_path / name
    return cli.main(["run", *TINY, "--out", str(out), *extra]), out


def one_line_error(capsys) -> str:
    """The captured stderr, checked to be one ``cl-streamkl: error:`` line without a traceback."""
    err = capsys.readouterr().err
    assert err.startswith("cl-streamkl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err
