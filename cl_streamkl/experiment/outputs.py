"""Files a run leaves in its output folder: config.json, results.json, results.csv, summary.csv."""

from __future__ import annotations

import csv
import io
import json
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cl_streamkl._provenance import git_commit
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.files import write_text_atomically
from cl_streamkl.experiment.summary import SCALAR_METRICS

if TYPE_CHECKING:
    from cl_streamkl.experiment.runner import RunResult

CONFIG_FILE = "config.json"
RESULTS_FILE = "results.json"
RUNS_CSV = "results.csv"
SUMMARY_CSV = "summary.csv"
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


def read_config_file(path: Path) -> ExperimentConfig:
    """A configuration saved by a run: its ``config.json``, or the ``config`` of its ``results.json``.

    Raises:
        ValueError: the file is missing, is not JSON, or does not hold a configuration.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"cannot read configuration {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if isinstance(data, dict) and isinstance(data.get("config"), dict) and "runs" in data:
        data = data["config"]
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a configuration (a JSON object of run settings)")
    try:
        return ExperimentConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None


def read_config(out_dir: Path) -> ExperimentConfig:
    """The configuration a run folder was started with.

    Raises:
        ValueError: the folder has no config.json (not a run folder), or it is damaged.
    """
    path = Path(out_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{str(out_dir)!r} is not a run folder: {CONFIG_FILE} is missing")
    return read_config_file(path)


def write_results(out_dir: Path, config: ExperimentConfig, results: Sequence[RunResult],
                  summary: dict[str, Any], env: dict[str, Any] | None = None,
                  paired: Sequence[dict[str, Any]] = ()) -> list[Path]:
    """Write results.json (config, environment, every run, summary, paired differences) and two CSV files.

    results.csv has one row per (strategy, seed); summary.csv one row per strategy
    with ``<metric>_mean`` / ``<metric>_std`` columns. ``env`` is :func:`environment`
    captured when the run started (taken now when None); ``paired`` is
    :func:`~cl_streamkl.experiment.statistics.paired_comparisons` of the runs.
    """
    out_dir = Path(out_dir)
    payload = {
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
        writer.writerow(["strategy", "seed", *SCALAR_METRICS, "mean_penalty", "wall_time_s", "peak_memory_mb",
                         *(f"average_accuracy_exp{i + 1}" for i in range(n_exp))])
        for r in results:
            m = r.metrics()
            writer.writerow([r.strategy, r.seed, *("" if m[k] is None else m[k] for k in SCALAR_METRICS),
                             "" if m["mean_penalty"] is None else m["mean_penalty"],
                             r.wall_time_s, r.peak_memory_mb, *m["average_accuracy"]])
        runs_path = write_text_atomically(out_dir / RUNS_CSV, handle.getvalue())

    scalar_keys = (*SCALAR_METRICS, "wall_time_s", "peak_memory_mb")
    with io.StringIO(newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["strategy", "n_seeds", *(f"{k}_{s}" for k in scalar_keys for s in ("mean", "std"))])
        for strategy, entry in summary.items():
            writer.writerow([strategy, len(entry["seeds"]),
                             *("" if entry[k] is None else entry[k][s]
                               for k in scalar_keys for s in ("mean", "std"))])
        summary_path = write_text_atomically(out_dir / SUMMARY_CSV, handle.getvalue())
    return [json_path, runs_path, summary_path]
