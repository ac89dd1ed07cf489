"""Package attributes imported on first use, so importing a package stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, sources: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package`` that imports each name from its module.

    Args:
        package: the package's ``__name__`` (for the error message).
        sources: attribute name → the module that defines it.
    """

    def __getattr__(name: str) -> Any:
        if name in sources:
            return getattr(importlib.import_module(sources[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
