"""Lost peers: a process of a data-parallel run that died, hung past the timeout or was cut off.

torch reports a lost peer from deep inside its backend: gloo raises a ``RuntimeError`` whose
message is a source location and a socket error ("Connection reset by peer", "Timed out
waiting 600000ms for recv operation to complete"), the rendezvous store a ``DistError``.
Under torchrun a dead rank brings the job down at once; when ranks start from environment
variables (or a rank hangs), the others see only such a message, with a traceback.
:func:`peers_checked` turns it into a :class:`LostPeerError`: one line naming what the
process was doing and what happened, for the command line to print with how to resume.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["LostPeerError", "is_lost_peer", "peers_checked"]

# What gloo's and NCCL's messages say when a peer is gone; any other RuntimeError raised
# during training is a bug to show in full, not a lost peer.
_TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout", "timeout")
_CONNECTION_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Connection refused",
                       "Broken pipe", "Read error", "Write error", "Socket closed", "remote process exited")
_BACKEND_MARKERS = ("gloo", "NCCL", "ProcessGroup", "c10d")


class LostPeerError(RuntimeError):
    """Another process of the run died, hung past the process group's timeout, or lost its connection."""


def is_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a process group's report of a peer that is gone or silent.

    Args:
        error: an exception raised by a collective or by a ``DistributedDataParallel`` step.
    """
    if isinstance(error, LostPeerError | dist.DistError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    message = str(error)
    return any(marker in message for marker in _BACKEND_MARKERS) and any(
        marker in message for marker in (*_TIMEOUT_MARKERS, *_CONNECTION_MARKERS))


def _cause(error: BaseException, timeout_s: float | None) -> str:
    message = str(error)
    if any(marker in message for marker in _CONNECTION_MARKERS):
        return "another process closed its connection (it stopped or died)"
    if any(marker in message for marker in _TIMEOUT_MARKERS):
        within = f" within the {timeout_s:g} s timeout (--dist-timeout)" if timeout_s is not None else ""
        return f"another process did not answer{within} (it hangs, died or is unreachable)"
    first_line = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    return first_line[:200]


@contextmanager
def peers_checked(doing: str, timeout_s: float | None = None) -> Iterator[None]:
    """Raise a one-line :class:`LostPeerError` for a lost peer reported inside the block.

    Other errors pass through unchanged, and so does a :class:`LostPeerError` raised by a
    nested block (it already names what was being done).

    Args:
        doing: what the block does, as it completes "lost contact with the other processes
            while ...", e.g. ``"broadcasting rank 0's object"``.
        timeout_s: the process group's timeout, named when a peer did not answer.

    Raises:
        LostPeerError: a collective in the block reported a lost or silent peer.
    """
    try:
        yield
    except LostPeerError:
        raise
    except RuntimeError as error:
        if not is_lost_peer(error):
            raise
        raise LostPeerError(f"lost contact with the other processes while {doing}: "
                            f"{_cause(error, timeout_s)}") from error
