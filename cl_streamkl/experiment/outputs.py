"""Files a run leaves in its output folder: config.json, results.json, results.csv, summary.csv, summary.md.

Units: results.json and the CSV files hold fractions (an accuracy of 0.5, not 50 %), paired
differences included; summary.md shows percent. Each file says so: results.json in its
``units`` entry, the CSV files in their column names (``..._fraction``).
"""

from __future__ import annotations

import csv
import io
import json
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from cl_streamkl._provenance import git_commit
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.config_file import CONFIG_FILE
from cl_streamkl.experiment.files import write_text_atomically
from cl_streamkl.experiment.run_result import RunResult
from cl_streamkl.experiment.summary import SCALAR_METRICS, summary_markdown

RESULTS_FILE = "results.json"
RUNS_CSV = "results.csv"
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
RESULTS_UNITS = ("fractions: accuracies, forgetting, backward transfer and the paired differences (mean_diff, "
                 "ci95) are in [0, 1] (times 100 for percent); wall_time_s in seconds; peak_memory_mb in MiB")
# Column suffix of the CSV files' values that are fractions.
FRACTION = "_fraction"
_PACKAGES = ("cl-streamkl", "torch", "triton", "timm", "avalanche-lib", "torchvision", "numpy",
             "scikit-learn", "matplotlib")


def environment(world_size: int = 1) -> dict[str, Any]:
    """Library versions, Python, platform, device, processes and git commit (when run from a checkout).

    Args:
        world_size: processes of a data-parallel run (1 for one process).
    """
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "versions": versions, "python": platform.python_version(), "platform": platform.platform(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(), "world_size": world_size, "git_commit": git_commit(),
    }


def write_config(out_dir: Path, config: ExperimentConfig) -> Path:
    """Write the resolved configuration, which ``--resume`` reads back (atomically).

    Raises:
        OutputWriteError: the folder cannot be written.
    """
    return write_text_atomically(Path(out_dir) / CONFIG_FILE, json.dumps(config.to_dict(), indent=2) + "\n")


def write_results(out_dir: Path, config: ExperimentConfig, results: Sequence[RunResult],
                  summary: dict[str, Any], env: dict[str, Any] | None = None,
                  paired: Sequence[dict[str, Any]] = (), title: str = "results") -> list[Path]:
    """Write results.json (config, environment, every run, summary, paired differences), two CSV files and summary.md.

    results.csv has one row per (strategy, seed); summary.csv one row per strategy
    with ``<metric>_mean`` / ``<metric>_std`` columns; summary.md the printed table and
    paired differences under ``title``. ``env`` is :func:`environment` captured when the
    run started (taken now when None); ``paired`` is
    :func:`~cl_streamkl.experiment.statistics.paired_comparisons` of the runs (fractions).
    """
    out_dir = Path(out_dir)
    payload = {
        "units": RESULTS_UNITS,
        "config": config.to_dict(),
        "environment": environment() if env is None else env,
        "runs": [r.to_dict() for r in results],
        "summary": summary,
        "paired": list(paired),
    }
    json_path = write_text_atomically(out_dir / RESULTS_FILE, json.dumps(payload, indent=2) + "\n")

    n_exp = len(results[0].accuracy_matrix) if results else 0
    with io.StringIO(newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["strategy", "seed", *(k + FRACTION for k in SCALAR_METRICS), "mean_penalty", "wall_time_s",
                         "peak_memory_mb", *(f"average_accuracy_exp{i + 1}{FRACTION}" for i in range(n_exp))])
        for r in results:
            m = r.metrics()
            writer.writerow([r.strategy, r.seed, *("" if m[k] is None else m[k] for k in SCALAR_METRICS),
                             "" if m["mean_penalty"] is None else m["mean_penalty"],
                             r.wall_time_s, r.peak_memory_mb, *m["average_accuracy"]])
        runs_path = write_text_atomically(out_dir / RUNS_CSV, handle.getvalue())

    scalar_keys = (*SCALAR_METRICS, "wall_time_s", "peak_memory_mb")
    with io.StringIO(newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["strategy", "n_seeds", *(f"{k}{FRACTION if k in SCALAR_METRICS else ''}_{s}"
                                                  for k in scalar_keys for s in ("mean", "std"))])
        for strategy, entry in summary.items():
            writer.writerow([strategy, len(entry["seeds"]),
                             *("" if entry[k] is None else entry[k][s]
                               for k in scalar_keys for s in ("mean", "std"))])
        summary_path = write_text_atomically(out_dir / SUMMARY_CSV, handle.getvalue())
    markdown_path = write_text_atomically(out_dir / SUMMARY_MD, summary_markdown(title, summary, paired, config.scenario))
    return [json_path, runs_path, summary_path, markdown_path]
