"""The error of data that cannot be used: a file that is missing, unreadable or not an image."""

from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be used; the message is one line naming the file.

    Found before anything is written when the check can see it (a dangling link, a missing
    file); an image that fails to decode is found when it is first read, which may be
    mid-run: the command line then says how to continue once the file is replaced.
    """
