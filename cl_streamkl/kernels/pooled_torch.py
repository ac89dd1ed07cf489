"""The pooled attention vectors of PAD, streamed in PyTorch over chunks of query rows.

For the CPU and devices without Triton; the Triton kernels (:mod:`cl_streamkl.kernels.triton.pooled`)
compute the same. Per chunk of ``chunk_size`` query rows the forward forms the float32 scores
against every key, their log-sum-exp and P = exp(s − lse), and adds A = P² (or P) up per row and
per key. The backward recomputes each chunk. With G_ij = g_row_i + g_key_j the upstream gradient
of A_ij, the chain rule through A = P^p (p = 2 or 1) and the softmax gives

    dS_ij = p·A_ij·G_ij − P_ij·δ_i,   δ_i = Σ_j p·A_ij·G_ij = p·(g_row_i·per_row_i + Σ_j A_ij·g_key_j),

one row reduction per query row. For p = 1 the row term cancels (a softmax row always sums
to 1) and dS_ij = P_ij·(g_key_j − Σ_l P_il·g_key_l). Then dq = scale·dS k and dk = scale·dSᵀ q.
Peak extra memory is O(B·H·chunk_size·Nk) plus float32 copies of the inputs, never O(Nq·Nk).
"""

from __future__ import annotations

import torch

from cl_streamkl.kernels.pooled_reference import PooledAttention
from cl_streamkl.kernels.torch_streaming import in_input_dtypes
from cl_streamkl.kernels.validation import refuse_double_backward

__all__ = ["DEFAULT_ROW_CHUNK", "pooled_attention_torch", "score_gradient"]

DEFAULT_ROW_CHUNK = 128


def score_gradient(
    probabilities: torch.Tensor,
    grad_row: torch.Tensor,
    grad_key: torch.Tensor,
    per_row: torch.Tensor,
    squared: bool,
) -> torch.Tensor:
    """dL/ds of a chunk of rows (the formula of the module docstring), float32.

    Args:
        probabilities: P of the chunk, (B, H, rows, Nk).
        grad_row: upstream gradient of ``per_row``, (B, H, rows).
        grad_key: upstream gradient of ``per_key``, (B, H, Nk).
        per_row: the forward's ``per_row`` of the chunk, (B, H, rows).
        squared: whether A = P².
    """
    grad_key = grad_key[..., None, :]
    if not squared:
        row_term = (probabilities * grad_key).sum(dim=-1, keepdim=True)
        return probabilities * (grad_key - row_term)
    pooled = probabilities.square()
    weighted = 2.0 * pooled * (grad_row[..., None] + grad_key)
    row_term = 2.0 * (grad_row * per_row + (pooled * grad_key).sum(dim=-1))
    return weighted - probabilities * row_term[..., None]


def _chunks(n_q: int, chunk_size: int):
    return ((start, min(start + chunk_size, n_q)) for start in range(0, n_q, chunk_size))


def _forward(q: torch.Tensor, k32: torch.Tensor, scale: float, squared: bool, chunk_size: int):
    """per_key (B, H, Nk), per_row and the natural log-sum-exps (B, H, Nq), float32."""
    per_key = torch.zeros(k32.shape[:3], dtype=torch.float32, device=q.device)
    per_row = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    lse = torch.empty_like(per_row)
    for start, stop in _chunks(q.size(2), chunk_size):
        scores = q[:, :, start:stop].float() @ k32.transpose(-1, -2) * scale
        # logsumexp gives +inf for a row holding a +inf score, and exp(s - lse) would then be 0 for its
        # finite scores; the softmax of such a row is NaN (inf - inf), as in the reference and the kernels.
        chunk_lse = torch.logsumexp(scores, dim=-1)
        lse[:, :, start:stop] = chunk_lse.masked_fill(chunk_lse == float("inf"), float("nan"))
        pooled = torch.exp(scores - lse[:, :, start:stop, None])
        if squared:
            pooled = pooled.square()
        per_row[:, :, start:stop] = pooled.sum(dim=-1)
        per_key += pooled.sum(dim=-2)
    return per_key, per_row, lse


class _StreamingPooledAttention(torch.autograd.Function):
    """Forward and backward both stream over chunks of query rows."""

    @staticmethod
    def forward(ctx, q, k, scale, squared, chunk_size):
        per_key, per_row, lse = _forward(q, k.float(), scale, squared, chunk_size)
        ctx.save_for_backward(q, k, per_row, lse)
        ctx.options = (scale, squared, chunk_size)
        return per_key, per_row

    @staticmethod
    def backward(ctx, grad_key, grad_row):
        refuse_double_backward()
        q, k, per_row, lse = ctx.saved_tensors
        scale, squared, chunk_size = ctx.options
        k32 = k.float()
        grad_key, grad_row = grad_key.float(), grad_row.float()
        grad_q = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        grad_k = torch.zeros_like(k32)
        for start, stop in _chunks(q.size(2), chunk_size):
            q_chunk = q[:, :, start:stop].float()
            probabilities = torch.exp(q_chunk @ k32.transpose(-1, -2) * scale - lse[:, :, start:stop, None])
            grad_scores = score_gradient(
                probabilities, grad_row[:, :, start:stop], grad_key, per_row[:, :, start:stop], squared
            ) * scale
            grad_q[:, :, start:stop] = grad_scores @ k32
            grad_k += grad_scores.transpose(-1, -2) @ q_chunk
        return *in_input_dtypes((grad_q, grad_k), (q, k)), None, None, None


def pooled_attention_torch(
    q: torch.Tensor, k: torch.Tensor, scale: float, squared: bool, chunk_size: int = DEFAULT_ROW_CHUNK
) -> PooledAttention:
    """``per_key`` (B, H, Nk) and ``per_row`` (B, H, Nq), float32, streaming over query chunks.

    Inputs are validated by the caller (:func:`cl_streamkl.pooled_attention`): q (B, H, Nq, D),
    k (B, H, Nk, D), ``scale`` resolved.

    Args:
        chunk_size: query rows per chunk, >= 1.

    Raises:
        ValueError: ``chunk_size`` is not a positive int.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    # Under autocast the float32 chunk products would run in bf16/fp16; the contract is float32 math.
    with torch.autocast(q.device.type, enabled=False):
        return PooledAttention(*_StreamingPooledAttention.apply(q, k, scale, squared, chunk_size))
