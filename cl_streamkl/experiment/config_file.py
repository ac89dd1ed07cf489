"""Reading a configuration file: a run's ``config.json``, a ``results.json``, or a JSON or YAML file of settings.

Keys are the flags' names (``experiences``, ``batch_size`` or ``batch-size``); values are
checked like the flags' (see :mod:`cl_streamkl.experiment.config_checks`).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from cl_streamkl.experiment.config import RENAMED_KEYS, ExperimentConfig

CONFIG_FILE = "config.json"
YAML_SUFFIXES = (".yaml", ".yml")


class _RefusedContent(ValueError):
    """Valid YAML or JSON that a configuration file may not hold: a key given twice, a YAML alias."""


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, with three differences for configuration files.

    ``1e-3`` (no dot) is a number, as in YAML 1.2 and JSON. A key given twice in one mapping
    is refused, not read as its last value. Aliases (``*name``) are refused: a few nested
    ones expand to billions of values (a "billion laughs"), and settings never need them.
    """

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _RefusedContent(f"aliases (*{event.anchor}, line {event.start_mark.line + 1}) are not read in "
                                  "configuration files; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<": merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):  # SafeLoader refuses it in a moment
                continue
            if key in seen:
                raise _RefusedContent(f"key {key!r} is given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict (``json``'s ``object_pairs_hook``), a key given twice refused."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _RefusedContent(f"key {key!r} is given twice")
        data[key] = value
    return data


def read_data(path: Path) -> Any:
    """The data of a YAML (by its suffix) or JSON file, read strictly (also what study plans are read with).

    Raises:
        ValueError: not UTF-8 text, not valid YAML or JSON, a key given twice, a YAML alias, or
            values nested too deeply (one line starting with the path).
        OSError: the file cannot be read.
    """
    is_yaml = path.suffix.lower() in YAML_SUFFIXES
    try:
        text = path.read_text(encoding="utf-8")
        return yaml.load(text, Loader=_YamlLoader) if is_yaml else json.loads(text, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except _RefusedContent as err:
        raise ValueError(f"{path}: {err}") from None
    except RecursionError:
        raise ValueError(f"{path}: values nested too deeply for a configuration") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML ({' '.join(str(err).split())})") from None
    except ValueError as err:  # json.JSONDecodeError
        raise ValueError(f"{path} is not valid JSON ({err}); YAML files end in .yaml or .yml") from None


def read_config_file(path: str | Path) -> ExperimentConfig:
    """A configuration from ``path``: settings as a JSON or YAML mapping, or the ``config`` of a ``results.json``.

    Keys of earlier versions (:data:`~cl_streamkl.experiment.config.RENAMED_KEYS`) are
    read under their new names with a ``FutureWarning``.

    Raises:
        ValueError: the file is missing or unreadable, is not JSON/YAML, gives a key twice
            (in any mapping), holds a YAML alias (``*name``), does not hold a
            mapping of settings, or has an unknown key (the message suggests close ones)
            or a value of the wrong type, outside its choices or range; one line starting
            with the file's path.
    """
    path = Path(path)
    try:
        data = read_data(path)
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
