"""The fused forward's score tile, and the atomic row sums the one-pass kernels add into.

The fused forward (:mod:`cl_streamkl.kernels.triton.fused`) runs the key-side backward kernel
with g = 1 and ``ROW_TERMS``: for each query tile it streams past its key tile, :func:`fused_tile`
computes the scores in query-major orientation [queries, keys], so that the KL's two row sums
are reductions along a row (within a warp, as attention's row sums) rather than across the
warps that hold a key-major tile's rows. Per score: 2 products for the scores, 2 exponentials,
2 products for the dk and dq shares; the dq share and the row sums are added with atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cl_streamkl.kernels.triton.common import dot, teacher_exp2


@triton.jit
def add_rows(base, rows64, row_ok, dims, dim_limit, values):
    """Atomically add a [rows, dims] float32 tile into rows of a contiguous [N, dim_limit] float32 sum."""
    tl.atomic_add(
        base + rows64[:, None] * dim_limit + dims[None, :], values,
        mask=row_ok[:, None] & (dims[None, :] < dim_limit), sem="relaxed",
    )


@triton.jit
def fused_tile(
    q, qt, k, kt, keys, rows, rows64, row_ok, n_k, lse_s, lse_t, dk, dq_sum_base, row_sums_base, dims_s, d_s,
    scale_s_log2, scale_t_log2,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, POLY_EXP2_DEGREE: tl.constexpr,
    POLY_EXP2_SPLITS: tl.constexpr,
):
    """One (query tile, key tile) of the fused forward: dk += dSᵀ·q, returned; dq += dS·k and the
    row sums Σ p̂_t·(log2 p̂_t − log2 p_s), Σ p̂_t added atomically (base 2, lse in base 2).

    Padded query rows load q = 0 and lse = 0, so p_s = p_t = 1 and dS = 0 there; padded keys (zero
    rows of K) add nothing to dq and their dk rows are never stored, but their p̂_t must not reach
    the row sums. MASKED: the causal mask (key j > query i) applies in this tile.
    """
    log2_p_s = dot(q, tl.trans(k), DOT_PRECISION) * scale_s_log2 - lse_s[:, None]
    log2_p_t = dot(qt, tl.trans(kt), DOT_PRECISION) * scale_t_log2 - lse_t[:, None]
    p_s = tl.math.exp2(log2_p_s)
    p_t = teacher_exp2(log2_p_t, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS)
    valid = (keys < n_k)[None, :]
    if MASKED:
        valid = valid & (keys[None, :] <= rows[:, None])
        p_s = tl.where(valid, p_s, 0.0)
    p_t = tl.where(valid, p_t, 0.0)
    gap = tl.sum(p_t * (log2_p_t - log2_p_s), 1)
    tl.atomic_add(row_sums_base + rows64 * 2, gap, mask=row_ok, sem="relaxed")
    tl.atomic_add(row_sums_base + rows64 * 2 + 1, tl.sum(p_t, 1), mask=row_ok, sem="relaxed")
    grad_scores = (p_s - p_t).to(q.dtype)
    dk += dot(tl.trans(grad_scores), q, DOT_PRECISION)
    add_rows(dq_sum_base, rows64, row_ok, dims_s, d_s, dot(grad_scores, k, DOT_PRECISION))
    return dk
