"""The names of ``cl-streamkl run``'s options: a field's option, the options not named after their
field, and earlier names still accepted for a while, each setting what its replacement sets and
warning that it will go (``--alpha`` → ``--streamkl-alpha``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

# Fields whose option is not named after them: StreamKL's own, named like the baselines' (--lwf-alpha).
# Configuration files and study plans take either name as a key.
OPTION_NAMES = {"alpha": "streamkl_alpha", "temperature": "streamkl_temperature", "layers": "streamkl_layers"}
# The options' earlier names, still accepted with a warning: old option → field.
DEPRECATED_OPTIONS = {"--alpha": "alpha", "--temperature": "temperature", "--layers": "layers"}


def flag_name(field_name: str) -> str:
    """A field's option: ``experiences`` → ``--experiences``; ``batch_size`` → ``--batch-size``;
    ``alpha`` → ``--streamkl-alpha``."""
    return "--" + OPTION_NAMES.get(field_name, field_name).replace("_", "-")


def field_label(field_name: str) -> str:
    """How an error names a field: ``alpha`` → ``alpha (--streamkl-alpha)``, ``epochs`` → ``epochs``.

    A field whose option has another name is named both ways, so that whoever gave it, by flag or
    by a configuration file's key, recognises it.
    """
    return f"{field_name} ({flag_name(field_name)})" if field_name in OPTION_NAMES else field_name


class DeprecatedOption(argparse.Action):
    """An option's earlier name, hidden from the help: sets its replacement's value and warns once used.

    Args:
        replacement: the option's current name, which the warning names.
        warn: prints the one-line warning (the command's own, so that only rank 0 prints).
    """

    def __init__(self, option_strings: list[str], dest: str, replacement: str, warn: Callable[[str], None],
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.replacement = replacement
        self.warn = warn

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        self.warn(f"{option_string} is deprecated and will be removed; use {self.replacement}")
        setattr(namespace, self.dest, values)
