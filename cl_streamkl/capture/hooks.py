"""What an extractor is made of: the record callback, hook handles, and the names errors use.

Shared by every extractor (:mod:`cl_streamkl.capture.extractors`,
:mod:`cl_streamkl.capture.multihead`, :mod:`cl_streamkl.capture.compiled_model`) and by
:class:`~cl_streamkl.capture.QKCapture`, so that none of them imports another for these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

__all__ = ["QKExtractor", "RecordQK", "Removable", "qualified_type_name"]

RecordQK = Callable[..., None]
"""Called by an extractor once per forward of its module with ``(q, k, scale)`` or
``(q, k, scale, lse)``: q (B, H, Nq, D), k (B, H, Nk, D), the softmax scale the module applies
to ``q kᵀ``, and, where the attention computed it, the log-sum-exp of its score rows,
(B, H, Nq) float32 natural log (:mod:`cl_streamkl.capture.attention_lse`)."""


class Removable(Protocol):
    """A hook handle: ``remove()`` undoes what was installed."""

    def remove(self) -> None: ...


QKExtractor = Callable[[nn.Module, RecordQK], Sequence[Removable]]
"""Installs whatever hooks it needs on one attention module so that every forward of
that module calls ``record(q, k, scale)`` exactly once, and returns handles whose
``remove()`` undoes everything (they are removed even when the forward raised)."""


def qualified_type_name(obj: object) -> str:
    """``module.QualName`` of ``obj``'s type, as error messages name attention classes."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def lse_or_none(lse: object) -> torch.Tensor | None:
    """``lse`` if it is a tensor, else None (an extractor that passed none)."""
    return lse if isinstance(lse, torch.Tensor) else None
