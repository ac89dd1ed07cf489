"""Each wing of the package needs third-party modules the core does not: say which extra brings them."""

from __future__ import annotations

import importlib.util


def require_extra(wing: str, extra: str, modules: dict[str, str]) -> None:
    """Raise if any of ``modules`` cannot be imported, naming the pip extra that installs it.

    Only looks the modules up (``importlib.util.find_spec``), so a wing's ``__init__``
    stays cheap to import.

    Args:
        wing: the importing package, e.g. ``"cl_streamkl.strategies"``.
        extra: the pip extra that installs the modules, e.g. ``"strategies"``.
        modules: module name → the distribution that provides it, e.g.
            ``{"avalanche": "avalanche-lib"}``.

    Raises:
        ImportError: ``cl_streamkl.strategies needs avalanche-lib: pip install "cl-streamkl[strategies]"``.
    """
    missing = [distribution for module, distribution in modules.items() if not _importable(module)]
    if missing:
        raise ImportError(f'{wing} needs {", ".join(missing)}: pip install "cl-streamkl[{extra}]"')


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        # A finder that refuses the name, or a module left in sys.modules without a spec.
        return False
