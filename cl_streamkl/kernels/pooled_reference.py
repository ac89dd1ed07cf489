"""The pooled attention vectors of PAD, materialised in float64: the reference the streaming ops match.

With P = softmax(q kᵀ · scale) over keys, shape (B, H, Nq, Nk), and A = P² (``squared``, the
symmetric variant of pooled attention distillation) or A = P (the asymmetric one), PAD pools A
along its two axes:

* ``per_key``, (B, H, Nk): Σ_i A_ij, the attention each key receives over all queries;
* ``per_row``, (B, H, Nq): Σ_j A_ij, each query row's total (identically 1 when A = P).

:class:`PooledAttention` holds the pair; the Triton and the PyTorch streaming ops return it too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cl_streamkl.kernels.validation import check_pooled_inputs

__all__ = ["PooledAttention", "pooled_attention_reference"]


class PooledAttention(NamedTuple):
    """The two pooled vectors of one attention map.

    Attributes:
        per_key: (B, H, Nk), the (squared) probabilities summed over query rows.
        per_row: (B, H, Nq), the (squared) probabilities summed over keys.
    """

    per_key: torch.Tensor
    per_row: torch.Tensor


def pooled_attention_reference(
    q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None, squared: bool = True
) -> PooledAttention:
    """The pooled (squared) attention of ``q`` and ``k``, computed in float64 by materialising P.

    Args:
        q: queries, (B, H, Nq, D).
        k: keys, (B, H, Nk, D).
        scale: softmax scale, default D**-0.5.
        squared: pool P² (True) or P (False).

    Returns:
        float64 ``per_key`` (B, H, Nk) and ``per_row`` (B, H, Nq), differentiable through autograd.
    """
    scale = check_pooled_inputs(q, k, scale, squared)
    attention = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, dim=-1)
    if squared:
        attention = attention.square()
    return PooledAttention(attention.sum(dim=-2), attention.sum(dim=-1))
