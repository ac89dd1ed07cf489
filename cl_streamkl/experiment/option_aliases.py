"""Earlier names of ``cl-streamkl run`` options, still accepted for a while: each sets what its
replacement sets and warns that it will go (``--alpha`` → ``--streamkl-alpha``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


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
