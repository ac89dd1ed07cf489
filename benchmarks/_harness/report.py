"""What a run prints and writes: the environment header, aligned table cells, the JSON file.

Every script takes ``--json [PATH]`` (:func:`add_json_flag`): without a path it writes
``benchmarks/results/<script>-<date>.json``, the folder from which ``benchmarks/tables.py``
renders the documents' tables.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from _harness import sentences
from cl_streamkl._provenance import git_commit


def describe_environment(device: torch.device, commit: str | None = None) -> dict[str, str]:
    """Device name, library versions and commit, for the header line and the JSON file.

    Args:
        device: the device measured.
        commit: what to report as the commit (``--commit``, for a tree without .git);
            None: the short hash of the checkout, ``+dirty`` if edited, else "unknown".
    """
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        name = f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB)"
    else:
        name = f"{device.type} ({platform.processor() or platform.machine()})"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": commit or git_commit(short=True, mark_dirty=True) or "unknown",
    }


def table_header(environment: dict[str, str]) -> dict[str, str]:
    """A result table's header fields from :func:`describe_environment`: the device named ``gpu``
    as ``benchmarks/tables.py`` reads it, the versions and the commit."""
    return {"gpu": environment["device"], "torch": environment["torch"], "triton": environment["triton"],
            "python": environment["python"], "commit": environment["commit"]}


def environment_line(environment: dict[str, str]) -> str:
    """The header line: ``device ... | torch ... | triton ... | python ... | commit ...``."""
    return " | ".join(f"{key} {value}" for key, value in environment.items())


def cell(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``; ``-`` when missing or not finite."""
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def aligned(cells: Sequence[str], columns: Sequence[tuple[str, int]]) -> str:
    """One table line: each cell right-aligned to its column's width, two spaces apart.

    Args:
        cells: the line's text, one per column.
        columns: (title, width) per column.
    """
    return "  ".join(text.rjust(width) for text, (_, width) in zip(cells, columns))


def header_line(columns: Sequence[tuple[str, int]]) -> str:
    """The column titles, aligned like :func:`aligned` lines."""
    return aligned([title for title, _ in columns], columns)


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed arguments as JSON values (paths and devices as text)."""
    return {key: str(value) if isinstance(value, (Path, torch.device)) else value for key, value in vars(args).items()}


RESULTS = Path(__file__).resolve().parent.parent / "results"


def add_json_flag(parser: argparse.ArgumentParser, help: str = "also write the results as JSON") -> None:
    """``--json [PATH]``: None when absent; without PATH, ``benchmarks/results/<script>-<date>.json``."""
    default = RESULTS / f"{Path(parser.prog).stem}-{time.strftime('%Y-%m-%d')}.json"
    parser.add_argument(
        "--json", nargs="?", type=Path, const=default, default=None, metavar="PATH",
        help=f"{help}; without PATH: benchmarks/results/{default.name}",
    )


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` as indented JSON, with the date and the command line.

    The folder is created if missing; ``date`` and ``command`` already in ``payload`` are kept, and
    so are the sentence views of a result file it replaces (``sentences.keep_sentence_views``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    stamped = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]), **payload}
    path.write_text(json.dumps(sentences.keep_sentence_views(path, stamped), indent=1))
