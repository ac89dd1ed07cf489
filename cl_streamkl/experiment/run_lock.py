"""One run per folder: an operating-system lock on ``<run folder>/.cl-streamkl.lock`` for the whole run.

Two runs writing one folder would overwrite each other's configuration, checkpoints and
results. The lock is ``filelock``'s: an ``flock``/``LockFileEx`` lock that the operating
system drops when its process ends, however it ends, so a killed run leaves no stale lock
behind and the folder can be resumed at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from cl_streamkl.experiment.files import OutputWriteError

LOCK_FILE = ".cl-streamkl.lock"


class FolderInUseError(ValueError):
    """Another process holds the run folder's lock."""


@contextmanager
def run_folder_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold ``run_dir``'s lock (creating the folder) for the duration of the block.

    Args:
        run_dir: the run folder.

    Yields:
        The lock file's path.

    Raises:
        FolderInUseError: another process is running in ``run_dir`` (refused at once, no waiting).
        OutputWriteError: the folder or its lock file cannot be created.
    """
    path = Path(run_dir) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(path, timeout=0)
        lock.acquire()
    except Timeout:
        raise FolderInUseError(f"{str(run_dir)!r} is in use by another cl-streamkl run; wait for it to end, or "
                               "choose another --out") from None
    except OSError as err:
        raise OutputWriteError(f"cannot write {path}: {err.strerror or err}") from err
    try:
        yield path
    finally:
        lock.release()
