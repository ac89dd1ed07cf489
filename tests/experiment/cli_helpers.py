"""What the command-line tests share: a tiny run's options and one-line error checks."""

from __future__ import annotations

from pathlib import Path

from cl_streamkl.experiment import cli

# A 1-block, 16-wide ViT on 8 px digits, one seed of the class scenario: a run of two experiences
# takes seconds on a CPU.
TINY = ["--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "--image-size", "8",
        "--patch-size", "4", "--epochs", "1", "--batch-size", "64", "--no-progress", "--scenario", "class",
        "--seeds", "0"]
# The smallest useful run: one strategy, two experiences.
SMALL = [*TINY, "--strategies", "naive", "--experiences", "2"]


def run_cli(tmp_path: Path, name: str, *extra: str) -> tuple[int, Path]:
    """``cl-streamkl run`` with :data:`TINY` options into ``tmp_path/name``; (exit status, folder)."""
    out = tmp_path / name
    return cli.main(["run", *TINY, "--out", str(out), *extra]), out


def one_line_error(capsys) -> str:
    """The captured stderr's error, checked to be one ``cl-streamkl: error:`` line without a traceback.

    Warnings of the run before it (an experience not learned, say) are left out.
    """
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("cl-streamkl: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("cl-streamkl: error: ") and "Traceback" not in err, err
    return lines[0] + "\n"
