"""SIGTERM ends ``cl-streamkl run`` as Ctrl-C does: one message, the ``--resume`` command, a known status.

Schedulers and container runtimes stop a job with SIGTERM (Slurm at its time limit or on
preemption, ``docker stop``, torchrun stopping its workers). Python's default for SIGTERM ends
the process at once, silently; within :func:`sigterm_raises` it raises :class:`Terminated`, a
``KeyboardInterrupt``, so the run stops where Ctrl-C would stop it and says how to continue.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

# Exit statuses: 128 + the signal's number, as shells report a process the signal ended.
INTERRUPTED_STATUS = 128 + signal.SIGINT
TERMINATED_STATUS = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM (raised in the main thread within :func:`sigterm_raises`)."""


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """143 for :class:`Terminated` (SIGTERM), 130 for Ctrl-C."""
    return TERMINATED_STATUS if isinstance(interrupt, Terminated) else INTERRUPTED_STATUS


def stopped_by(interrupt: KeyboardInterrupt) -> str:
    """``"terminated (SIGTERM)"`` or ``"interrupted"``, the word a message starts with."""
    return "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted"


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    # A second SIGTERM while the first is handled ends the process, as it would have at first.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread; the previous handler after it.

    Signal handlers can only be set from the main thread: elsewhere the block runs with
    SIGTERM's handling unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
