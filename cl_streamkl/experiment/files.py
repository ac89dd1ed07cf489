"""Writing a run's files: each one replaced atomically, or a one-line error and the old file kept."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


class OutputWriteError(Exception):
    """A file of the run could not be written (read-only folder, full disk, ...).

    The message is one line naming the file and the operating system's reason.
    """


def _os_error_in(error: BaseException) -> OSError | None:
    """The OSError that caused ``error``, if any (``torch.save`` wraps write errors in RuntimeError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def write_atomically(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Write ``path`` through ``write(handle)`` into a hidden temporary file, then rename it over ``path``.

    The rename is atomic on POSIX file systems and the data is flushed to disk first, so
    ``path`` holds either its previous content or the complete new one, never a part.
    On failure the temporary file is removed.

    Args:
        path: the file to (re)place; its folder is created if missing.
        write: writes the content to an open binary file.

    Returns:
        ``path``.

    Raises:
        OutputWriteError: the folder or file cannot be written (permissions, no space).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        cause = _os_error_in(error)
        if cause is None:
            raise
        kept = "; the previous version is kept" if path.is_file() else ""
        raise OutputWriteError(f"cannot write {path}: {cause.strerror or cause}{kept}") from error
    return path


def write_text_atomically(path: str | Path, text: str) -> Path:
    """:func:`write_atomically` for UTF-8 text."""
    return write_atomically(path, lambda handle: handle.write(text.encode("utf-8")))
