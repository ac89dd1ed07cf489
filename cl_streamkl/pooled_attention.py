"""Public entry point: :func:`pooled_attention`, the pooled attention vectors of PAD without the map."""

from __future__ import annotations

import torch

from cl_streamkl.attention_kl import _resolve_backend
from cl_streamkl.kernels.pooled_reference import PooledAttention
from cl_streamkl.kernels.pooled_torch import pooled_attention_torch
from cl_streamkl.kernels.validation import BACKENDS, check_pooled_inputs

__all__ = ["PooledAttention", "pooled_attention"]


def pooled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    squared: bool = True,
    backend: str = "auto",
) -> PooledAttention:
    """The attention map's (squared) probabilities summed per key and per query row, never materialised.

    With P = softmax(q kᵀ · scale) over keys and A = P² (``squared``: the symmetric variant of
    pooled attention distillation) or A = P (the asymmetric variant), returns
    ``per_key_j = Σ_i A_ij`` and ``per_row_i = Σ_j A_ij``: PAD's two pooled vectors. A first
    pass over the keys finds each row's log-sum-exp; a second adds the probabilities up, tile
    by tile (triton) or chunk of query rows by chunk (torch). The backward recomputes them
    likewise. Extra memory: 8 bytes per query row on the triton backend. Non-finite inputs give
    NaN where :func:`~cl_streamkl.pooled_attention_reference` does: a score of +inf makes its
    softmax row NaN, and so every ``per_key`` entry of that head.

    Args:
        q: queries, (B, H, Nq, D).
        k: keys, (B, H, Nk, D). Both float32, float16 or bfloat16, one dtype and device, unit
            stride in D (any other strides are read in place), D <= 256.
        scale: softmax scale, > 0; default D**-0.5.
        squared: pool P² (True) or P (False; ``per_row`` is then 1 everywhere).
        backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (PyTorch, streaming
            over chunks of query rows, any device) or "auto" (triton on CUDA, torch otherwise).

    Returns:
        ``PooledAttention(per_key, per_row)``: float32 (B, H, Nk) and (B, H, Nq). Gradients flow
        to q and k.

    Raises:
        TypeError: a tensor is not one, dtypes are unsupported or differ, ``squared`` is not a bool.
        ValueError: shapes, devices, strides, the scale or the backend do not fit.

    Example:
        >>> q, k = torch.randn(2, 4, 197, 64), torch.randn(2, 4, 197, 64)
        >>> pooled = pooled_attention(q, k)
        >>> pooled.per_key.shape, pooled.per_row.shape
        (torch.Size([2, 4, 197]), torch.Size([2, 4, 197]))
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    scale = check_pooled_inputs(q, k, scale, squared)
    if _resolve_backend(backend, q.device) == "triton":
        from cl_streamkl.kernels.triton.pooled_ops import pooled_attention_triton

        return pooled_attention_triton(q, k, scale, squared)
    return pooled_attention_torch(q, k, scale, squared)
