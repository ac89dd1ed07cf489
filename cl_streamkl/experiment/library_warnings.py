"""The warnings of cl_streamkl's own modules, printed as the command's one-line warnings."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

# The installed package: a warning raised from a file under it is the library's own.
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _is_own(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(PACKAGE_DIR)
    except (OSError, ValueError):  # "<string>" and the like
        return False


@contextlib.contextmanager
def own_warnings_through(warn: Callable[[str], None] | None) -> Iterator[None]:
    """Pass the message of every warning cl_streamkl's modules raise inside the block to ``warn``.

    Python would print such a warning with its file path, line number, category and source
    line (``.../plugin.py:177: RuntimeWarning: StreamKLPlugin: ...`` and the code under it),
    unlike the command's own warnings; ``warn`` prints it as one of them. Warnings of other
    libraries keep Python's form, and the filters and ``warnings.showwarning`` are restored on
    leaving the block.

    Args:
        warn: called with a warning's message; None leaves every warning as it is (ranks of a
            data-parallel run other than 0).
    """
    if warn is None:
        yield
        return
    with warnings.catch_warnings():
        python_show = warnings.showwarning

        def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
            if _is_own(filename):
                warn(str(message))
            else:
                python_show(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield
