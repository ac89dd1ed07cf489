"""Reading a configuration file: a run's ``config.json``, a ``results.json``, or a JSON or YAML file of settings.

Keys are the flags' names (``experiences``, ``batch_size`` or ``batch-size``); values are
checked like the flags' (see :mod:`cl_streamkl.experiment.config_checks`).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import yaml

from cl_streamkl.experiment.config import RENAMED_KEYS, ExperimentConfig

CONFIG_FILE = "config.json"
YAML_SUFFIXES = (".yaml", ".yml")


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, except that ``1e-3`` (no dot) is a number, as in YAML 1.2 and JSON."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _load(path: Path) -> Any:
    text = path.read_text()
    if path.suffix.lower() in YAML_SUFFIXES:
        try:
            return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as err:
            raise ValueError(f"{path} is not valid YAML ({' '.join(str(err).split())})") from None
    try:
        return json.loads(text)
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); YAML files end in .yaml or .yml") from None


def read_config_file(path: str | Path) -> ExperimentConfig:
    """A configuration from ``path``: settings as a JSON or YAML mapping, or the ``config`` of a ``results.json``.

    Keys of earlier versions (:data:`~cl_streamkl.experiment.config.RENAMED_KEYS`) are
    read under their new names with a ``FutureWarning``.

    Raises:
        ValueError: the file is missing or unreadable, is not JSON/YAML, does not hold a
            mapping of settings, or has an unknown key (the message suggests close ones)
            or a value of the wrong type; one line starting with the file's path.
    """
    path = Path(path)
    try:
        data = _load(path)
    except OSError as err:
        raise ValueError(f"cannot read configuration {path}: {err.strerror or err}") from None
    if isinstance(data, dict) and isinstance(data.get("config"), dict) and "runs" in data:
        data = data["config"]
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a configuration (a mapping of run settings)")
    renamed = sorted(set(map(str, data)) & set(RENAMED_KEYS))
    try:
        config = ExperimentConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None
    for key in renamed:
        warnings.warn(f"{path}: key {key!r} is read as {RENAMED_KEYS[key]!r}, its name since the flags' names "
                      f"became the keys", FutureWarning, stacklevel=2)
    return config


def read_config(run_dir: str | Path) -> ExperimentConfig:
    """The configuration a run folder was started with (its ``config.json``).

    Raises:
        ValueError: the folder has no config.json (not a run folder), or it is damaged.
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} is not a run folder: {CONFIG_FILE} is missing")
    return read_config_file(path)
