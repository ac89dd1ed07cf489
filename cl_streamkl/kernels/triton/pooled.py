"""The pooled attention vectors of PAD as Triton kernels: no (Nq, Nk) map is ever stored.

Base 2 as in the StreamKL kernels: u = s·log2(e), P_ij = 2^(u_ij − lse_i) with
lse_i = log2 Σ_j 2^u_ij, and A = P² (SQUARED) or P. Forward, two kernels:

* ``_pooled_rows_kernel``, one program per query tile: an online pass over the keys keeps the
  running maximum m, Σ 2^(u−m) and, SQUARED, Σ 2^(2(u−m)); it stores lse_i and
  per_row_i = Σ_j A_ij = Σ 2^(2(u−m)) / (Σ 2^(u−m))² (1 when A = P).
* ``_pooled_keys_kernel``, one program per key tile: over every query tile it recomputes P from
  the stored lse and adds A up per key (per_key_j = Σ_i A_ij) in registers; no atomics.

Backward (the formula is stated in :mod:`cl_streamkl.kernels.pooled_torch`), two kernels:

* ``_pooled_bwd_dq_kernel``, per query tile: a first pass over the keys for the row reduction
  D_i = Σ_j A_ij·g_key_j, which gives δ_i (stored), then a second pass for dq = scale·dS k;
* ``_pooled_bwd_dk_kernel``, per key tile: over every query tile dS from the stored lse and δ,
  dk = scale·dSᵀ q.

Masking: keys past Nk are -inf scores in the row kernels (and zero key rows, so they add nothing
to dq); query rows past Nq read lse = +inf, so their P is 0 in the key-side kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cl_streamkl.kernels.triton.common import dot, key_ranges, load_rows, program_coordinates


@triton.jit
def _rows_tile(q, k, keys, n_k, scale_log2, max_u, total, total_squared,
               MASKED: tl.constexpr, SQUARED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile of the online row pass; returns the updated (max, Σ 2^(u−m), Σ 2^(2(u−m)))."""
    u = dot(q, tl.trans(k), DOT_PRECISION) * scale_log2
    if MASKED:
        u = tl.where(keys[None, :] < n_k, u, float("-inf"))
    new_max = tl.maximum(max_u, tl.max(u, 1))
    rescale = tl.math.exp2(max_u - new_max)
    powers = tl.math.exp2(u - new_max[:, None])
    total = total * rescale + tl.sum(powers, 1)
    if SQUARED:
        total_squared = total_squared * rescale * rescale + tl.sum(powers * powers, 1)
    return new_max, total, total_squared


@triton.jit
def _pooled_rows_kernel(
    Q,  # [B, H, Nq, D]
    K,  # [B, H, Nk, D]
    PER_ROW,  # [B, H, Nq] float32, contiguous
    LSE,  # [B, H, Nq] float32, contiguous, base 2
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    num_heads, n_q, n_k, head_dim,
    scale_log2,  # scale · log2(e)
    SQUARED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m, pid_bh, batch, head = program_coordinates(n_q, BLOCK_M, num_heads)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k_base = K + batch * stride_kb + head * stride_kh
    q = load_rows(Q + batch * stride_qb + head * stride_qh, rows, stride_qn, dims, n_q, head_dim)

    max_u = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    total_squared = tl.zeros([BLOCK_M], tl.float32)
    full_end, key_end = key_ranges(pid_m, n_k, False, BLOCK_M, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        keys = start_n + cols
        k = load_rows(k_base, keys, stride_kn, dims, n_k, head_dim)
        max_u, total, total_squared = _rows_tile(
            q, k, keys, n_k, scale_log2, max_u, total, total_squared, False, SQUARED, DOT_PRECISION)
    for start_n in range(full_end, key_end, BLOCK_N):
        keys = start_n + cols
        k = load_rows(k_base, keys, stride_kn, dims, n_k, head_dim)
        max_u, total, total_squared = _rows_tile(
            q, k, keys, n_k, scale_log2, max_u, total, total_squared, True, SQUARED, DOT_PRECISION)

    if SQUARED:
        per_row = total_squared / (total * total)
    else:
        # A softmax row sums to 1; stored all the same so both variants return the same vectors.
        per_row = total / total
    out = pid_bh * n_q + rows.to(tl.int64)
    row_ok = rows < n_q
    tl.store(PER_ROW + out, per_row, mask=row_ok)
    tl.store(LSE + out, max_u + tl.math.log2(total), mask=row_ok)


@triton.jit
def _probabilities(q, k, lse, scale_log2, DOT_PRECISION: tl.constexpr):
    """P of a (rows, keys) tile from the rows' stored log-sum-exps (+inf for rows past Nq: P = 0)."""
    return tl.math.exp2(dot(q, tl.trans(k), DOT_PRECISION) * scale_log2 - lse[:, None])


@triton.jit
def _pooled_keys_kernel(
    Q,  # [B, H, Nq, D]
    K,  # [B, H, Nk, D]
    LSE,  # [B, H, Nq] float32, contiguous, base 2
    PER_KEY,  # [B, H, Nk] float32, contiguous
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    num_heads, n_q, n_k, head_dim,
    scale_log2,
    SQUARED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n, pid_bh, batch, head = program_coordinates(n_k, BLOCK_N, num_heads)
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in_tile = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_base = Q + batch * stride_qb + head * stride_qh
    k = load_rows(K + batch * stride_kb + head * stride_kh, keys, stride_kn, dims, n_k, head_dim)
    lse_base = LSE + pid_bh * n_q

    per_key = tl.zeros([BLOCK_N], tl.float32)
    for start_m in range(0, n_q, BLOCK_M):
        rows = start_m + rows_in_tile
        q = load_rows(q_base, rows, stride_qn, dims, n_q, head_dim)
        lse = tl.load(lse_base + rows, mask=rows < n_q, other=float("inf"))
        p = _probabilities(q, k, lse, scale_log2, DOT_PRECISION)
        if SQUARED:
            p = p * p
        per_key += tl.sum(p, 0)
    tl.store(PER_KEY + pid_bh * n_k + keys.to(tl.int64), per_key, mask=keys < n_k)


@triton.jit
def _score_gradient(p, grad_row, grad_key, delta, SQUARED: tl.constexpr):
    """dL/ds of a (rows, keys) tile: p·(2p·(g_row + g_key) − δ), or p·(g_key − δ) when A = P."""
    if SQUARED:
        weighted = 2.0 * p * (grad_row[:, None] + grad_key[None, :])
    else:
        weighted = tl.broadcast_to(grad_key[None, :], p.shape)
    return p * (weighted - delta[:, None])


@triton.jit
def _pooled_bwd_dq_kernel(
    Q,  # [B, H, Nq, D]
    K,  # [B, H, Nk, D]
    LSE,  # [B, H, Nq] float32, contiguous, base 2
    PER_ROW,  # [B, H, Nq] float32, contiguous
    GRAD_KEY,  # [B, H, Nk] float32, any strides (0 for an expanded gradient)
    GRAD_ROW,  # [B, H, Nq] float32, any strides
    DELTA,  # [B, H, Nq] float32, contiguous: δ, written here for the dk kernel
    DQ,  # [B, H, Nq, D]
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_gkb, stride_gkh, stride_gkn,
    stride_grb, stride_grh, stride_grn,
    stride_dqb, stride_dqh, stride_dqn,
    num_heads, n_q, n_k, head_dim,
    scale_log2, scale,
    SQUARED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m, pid_bh, batch, head = program_coordinates(n_q, BLOCK_M, num_heads)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n_q
    k_base = K + batch * stride_kb + head * stride_kh
    grad_key_base = GRAD_KEY + batch * stride_gkb + head * stride_gkh
    q = load_rows(Q + batch * stride_qb + head * stride_qh, rows, stride_qn, dims, n_q, head_dim)
    out = pid_bh * n_q + rows.to(tl.int64)
    lse = tl.load(LSE + out, mask=row_ok, other=float("inf"))
    grad_row = tl.load(GRAD_ROW + batch * stride_grb + head * stride_grh + rows.to(tl.int64) * stride_grn,
                       mask=row_ok, other=0.0)

    # The row reduction D_i = Σ_j A_ij·g_key_j (keys past Nk read g_key = 0).
    reduction = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        keys = start_n + cols
        k = load_rows(k_base, keys, stride_kn, dims, n_k, head_dim)
        grad_key = tl.load(grad_key_base + keys.to(tl.int64) * stride_gkn, mask=keys < n_k, other=0.0)
        p = _probabilities(q, k, lse, scale_log2, DOT_PRECISION)
        if SQUARED:
            p = p * p
        reduction += tl.sum(p * grad_key[None, :], 1)
    if SQUARED:
        per_row = tl.load(PER_ROW + out, mask=row_ok, other=0.0)
        delta = 2.0 * (grad_row * per_row + reduction)
    else:
        delta = reduction
    tl.store(DELTA + out, delta, mask=row_ok)

    # dq; keys past Nk have zero rows in k and add nothing.
    grad_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, n_k, BLOCK_N):
        keys = start_n + cols
        k = load_rows(k_base, keys, stride_kn, dims, n_k, head_dim)
        grad_key = tl.load(grad_key_base + keys.to(tl.int64) * stride_gkn, mask=keys < n_k, other=0.0)
        p = _probabilities(q, k, lse, scale_log2, DOT_PRECISION)
        grad_scores = _score_gradient(p, grad_row, grad_key, delta, SQUARED)
        grad_q += dot(grad_scores.to(k.dtype), k, DOT_PRECISION)
    grad_q *= scale
    dq_base = DQ + batch * stride_dqb + head * stride_dqh
    tl.store(dq_base + rows.to(tl.int64)[:, None] * stride_dqn + dims[None, :], grad_q.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (dims[None, :] < head_dim))


@triton.jit
def _pooled_bwd_dk_kernel(
    Q,  # [B, H, Nq, D]
    K,  # [B, H, Nk, D]
    LSE,  # [B, H, Nq] float32, contiguous, base 2
    GRAD_KEY,  # [B, H, Nk] float32, any strides
    GRAD_ROW,  # [B, H, Nq] float32, any strides
    DELTA,  # [B, H, Nq] float32, contiguous, from the dq kernel
    DK,  # [B, H, Nk, D]
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_gkb, stride_gkh, stride_gkn,
    stride_grb, stride_grh, stride_grn,
    stride_dkb, stride_dkh, stride_dkn,
    num_heads, n_q, n_k, head_dim,
    scale_log2, scale,
    SQUARED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_n, pid_bh, batch, head = program_coordinates(n_k, BLOCK_N, num_heads)
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in_tile = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    key_ok = keys < n_k
    q_base = Q + batch * stride_qb + head * stride_qh
    grad_row_base = GRAD_ROW + batch * stride_grb + head * stride_grh
    k = load_rows(K + batch * stride_kb + head * stride_kh, keys, stride_kn, dims, n_k, head_dim)
    grad_key = tl.load(GRAD_KEY + batch * stride_gkb + head * stride_gkh + keys.to(tl.int64) * stride_gkn,
                       mask=key_ok, other=0.0)
    row_base = pid_bh * n_q

    grad_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start_m in range(0, n_q, BLOCK_M):
        rows = start_m + rows_in_tile
        row_ok = rows < n_q
        q = load_rows(q_base, rows, stride_qn, dims, n_q, head_dim)
        lse = tl.load(LSE + row_base + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + row_base + rows, mask=row_ok, other=0.0)
        grad_row = tl.load(grad_row_base + rows.to(tl.int64) * stride_grn, mask=row_ok, other=0.0)
        p = _probabilities(q, k, lse, scale_log2, DOT_PRECISION)
        grad_scores = _score_gradient(p, grad_row, grad_key, delta, SQUARED)
        grad_k += dot(tl.trans(grad_scores.to(q.dtype)), q, DOT_PRECISION)
    grad_k *= scale
    dk_base = DK + batch * stride_dkb + head * stride_dkh
    tl.store(dk_base + keys.to(tl.int64)[:, None] * stride_dkn + dims[None, :], grad_k.to(DK.dtype.element_ty),
             mask=key_ok[:, None] & (dims[None, :] < head_dim))
