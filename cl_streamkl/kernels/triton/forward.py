"""The forward kernels: per query row, KL(softmax(s_t) ‖ softmax(s_s)) in one pass over the keys.

An online softmax for each of the two score rows (running maximum and sum, base 2:
u = s·log2(e)) and the teacher-weighted score gap, so
    KL_i = Σ_j p_t (s_t − s_s) − lse_t + lse_s
needs no second pass. The log-sum-exps are stored for the backward kernels.

With ``KNOWN_LSE`` the caller hands both log-sum-exps in (the models' own attention computed
them): p_t = 2^(u_t − lse_t) is then the one exponential per score, with no running maximum
and no rescaling, and σ = Σ_j p_t makes the teacher's side exact even where lse_t is off by
rounding:  KL_i = ln2 · (Σ_j p_t (u_t − u_s) / σ − log2 σ − lse_t + lse_s). The stored
teacher log-sum-exp is lse_t + log2 σ, so the backward sees a normalised p_t.
``_attention_kl_fwd_kernel`` runs one problem; ``_attention_kl_grouped_fwd_kernel`` runs L
problems of one shape (the distilled blocks of a model) in one launch, reading each problem's
addresses, strides and scales from a table. Both run :func:`_fwd_rows` per query tile.
Kernel names keep Triton's leading underscore: they are the names profilers show
(benchmarks/profile_step.py sorts kernel time by them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from cl_streamkl.kernels.triton.common import (
    FORWARD_TABLE_WIDTH,
    dot,
    key_ranges,
    load_rows,
    program_coordinates,
    table_rows,
    table_scale,
    teacher_exp2,
)


@triton.jit
def _fwd_tile(
    q, qt, k, kt, rows, keys, n_k,
    scale_s_log2, scale_t_log2,
    max_s, sum_s, max_t, sum_t, gap,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
):
    """One key tile of the online forward; returns the updated running state."""
    u_s = dot(q, tl.trans(k), DOT_PRECISION) * scale_s_log2
    u_t = dot(qt, tl.trans(kt), DOT_PRECISION) * scale_t_log2
    score_gap = u_t - u_s
    if MASKED:
        # Masked entries get 2^-inf = 0 weight and a zero gap (never -inf - -inf).
        valid = keys[None, :] < n_k
        if CAUSAL:
            valid = valid & (keys[None, :] <= rows[:, None])
        score_gap = tl.where(valid, score_gap, 0.0)
        u_s = tl.where(valid, u_s, float("-inf"))
        u_t = tl.where(valid, u_t, float("-inf"))

    new_max_s = tl.maximum(max_s, tl.max(u_s, 1))
    sum_s = sum_s * tl.math.exp2(max_s - new_max_s) + tl.sum(tl.math.exp2(u_s - new_max_s[:, None]), 1)

    new_max_t = tl.maximum(max_t, tl.max(u_t, 1))
    rescale_t = tl.math.exp2(max_t - new_max_t)
    p_t = teacher_exp2(u_t - new_max_t[:, None], POLY_EXP2_DEGREE, POLY_EXP2_SPLITS)
    sum_t = sum_t * rescale_t + tl.sum(p_t, 1)
    gap = gap * rescale_t + tl.sum(p_t * score_gap, 1)
    return new_max_s, sum_s, new_max_t, sum_t, gap


@triton.jit
def _fwd_tile_known_lse(
    q, qt, k, kt, rows, keys, n_k, scale_s_log2, scale_t_log2, lse_t, sigma, gap,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
):
    """One key tile with the teacher's log-sum-exp known: one exponential per score."""
    u_s = dot(q, tl.trans(k), DOT_PRECISION) * scale_s_log2
    u_t = dot(qt, tl.trans(kt), DOT_PRECISION) * scale_t_log2
    p_t = teacher_exp2(u_t - lse_t[:, None], POLY_EXP2_DEGREE, POLY_EXP2_SPLITS)
    score_gap = u_t - u_s
    if MASKED:
        valid = keys[None, :] < n_k
        if CAUSAL:
            valid = valid & (keys[None, :] <= rows[:, None])
        p_t = tl.where(valid, p_t, 0.0)
        score_gap = tl.where(valid, score_gap, 0.0)
    return sigma + tl.sum(p_t, 1), gap + tl.sum(p_t * score_gap, 1)


@triton.jit
def _fwd_key_range(
    q, qt, k_base, kt_base, stride_kn, stride_ktn, rows, cols, dims_s, dims_t, key_start, key_end, n_k, d_s, d_t,
    scale_s_log2, scale_t_log2, max_s, sum_s, max_t, sum_t, gap,
    MASKED: tl.constexpr, KNOWN_LSE: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Key tiles [key_start, key_end) of a query tile; returns the updated running state.

    With KNOWN_LSE, max_s and max_t hold the given log-sum-exps, sum_t accumulates σ and
    sum_s stays untouched.
    """
    for start_n in range(key_start, key_end, BLOCK_N):
        keys = start_n + cols
        k = load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
        kt = load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)
        if KNOWN_LSE:
            sum_t, gap = _fwd_tile_known_lse(
                q, qt, k, kt, rows, keys, n_k, scale_s_log2, scale_t_log2, max_t, sum_t, gap,
                MASKED, CAUSAL, DOT_PRECISION, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS,
            )
        else:
            max_s, sum_s, max_t, sum_t, gap = _fwd_tile(
                q, qt, k, kt, rows, keys, n_k, scale_s_log2, scale_t_log2,
                max_s, sum_s, max_t, sum_t, gap, MASKED, CAUSAL, DOT_PRECISION, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS,
            )
    return max_s, sum_s, max_t, sum_t, gap


@triton.jit
def _fwd_rows(
    q_base, k_base, qt_base, kt_base,  # row 0 of this (batch, head) in Q, K, QT, KT
    stride_qn, stride_kn, stride_qtn, stride_ktn,
    lse_s_in, lse_t_in, stride_lse_s, stride_lse_t,  # row 0 of the given natural log-sum-exps (KNOWN_LSE)
    ROW_KL, LSE_S, LSE_T, out_base,  # outputs, and the index of this (batch, head)'s row 0 in them
    pid_m, n_q, n_k, d_s, d_t, scale_s_log2, scale_t_log2,
    KNOWN_LSE: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DS: tl.constexpr, BLOCK_DT: tl.constexpr,
):
    """Query tile ``pid_m`` of one (batch, head): stream over its keys, store KL and both lse."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims_s = tl.arange(0, BLOCK_DS)
    dims_t = tl.arange(0, BLOCK_DT)
    row_ok = rows < n_q

    q = load_rows(q_base, rows, stride_qn, dims_s, n_q, d_s)
    qt = load_rows(qt_base, rows, stride_qtn, dims_t, n_q, d_t)

    max_s = tl.full([BLOCK_M], float("-inf"), tl.float32)
    max_t = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sum_s = tl.zeros([BLOCK_M], tl.float32)
    sum_t = tl.zeros([BLOCK_M], tl.float32)
    gap = tl.zeros([BLOCK_M], tl.float32)
    if KNOWN_LSE:
        # Natural log in, base 2 inside; padded rows get 0 and are never stored.
        rows64 = rows.to(tl.int64)
        max_s = tl.load(lse_s_in + rows64 * stride_lse_s, mask=row_ok, other=0.0) * 1.4426950408889634
        max_t = tl.load(lse_t_in + rows64 * stride_lse_t, mask=row_ok, other=0.0) * 1.4426950408889634

    full_end, key_end = key_ranges(pid_m, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    max_s, sum_s, max_t, sum_t, gap = _fwd_key_range(
        q, qt, k_base, kt_base, stride_kn, stride_ktn, rows, cols, dims_s, dims_t, 0, full_end, n_k, d_s, d_t,
        scale_s_log2, scale_t_log2, max_s, sum_s, max_t, sum_t, gap,
        False, KNOWN_LSE, CAUSAL, DOT_PRECISION, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, BLOCK_N,
    )
    max_s, sum_s, max_t, sum_t, gap = _fwd_key_range(
        q, qt, k_base, kt_base, stride_kn, stride_ktn, rows, cols, dims_s, dims_t, full_end, key_end, n_k, d_s, d_t,
        scale_s_log2, scale_t_log2, max_s, sum_s, max_t, sum_t, gap,
        True, KNOWN_LSE, CAUSAL, DOT_PRECISION, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, BLOCK_N,
    )

    # Known: max_s, max_t are the given log-sum-exps and sum_t is σ; the student's sum stays 1.
    if KNOWN_LSE:
        log2_sum_s = tl.zeros([BLOCK_M], tl.float32)
    else:
        log2_sum_s = tl.math.log2(sum_s)
    log2_sum_t = tl.math.log2(sum_t)
    # Subtract the maxima first: both log-sum-exps can be large and nearly equal.
    row_kl = (gap / sum_t - (max_t - max_s) - log2_sum_t + log2_sum_s) * 0.6931471805599453
    out = out_base + rows.to(tl.int64)
    tl.store(ROW_KL + out, row_kl, mask=row_ok)
    tl.store(LSE_S + out, max_s + log2_sum_s, mask=row_ok)
    tl.store(LSE_T + out, max_t + log2_sum_t, mask=row_ok)


@triton.jit
def _attention_kl_fwd_kernel(
    Q,  # [B, H, Nq, Ds]
    K,  # [B, H, Nk, Ds]
    QT,  # [B, H, Nq, Dt]
    KT,  # [B, H, Nk, Dt]
    LSE_S_IN,  # [B, H, Nq] float32, natural log, any strides; read only with KNOWN_LSE
    LSE_T_IN,  # [B, H, Nq] float32, likewise
    ROW_KL,  # [B, H, Nq] float32, contiguous
    LSE_S,  # [B, H, Nq] float32, contiguous, base 2
    LSE_T,  # [B, H, Nq] float32, contiguous, base 2
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_qtb, stride_qth, stride_qtn,
    stride_ktb, stride_kth, stride_ktn,
    stride_lsb, stride_lsh, stride_lsn,
    stride_ltb, stride_lth, stride_ltn,
    num_heads, n_q, n_k, d_s, d_t,
    scale_s_log2,  # scale_s / T · log2(e)
    scale_t_log2,  # scale_t / T · log2(e)
    N_Q_BUCKET, N_K_BUCKET,  # autotune keys only
    KNOWN_LSE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POLY_EXP2_DEGREE: tl.constexpr,  # 0: every exponential on the MUFU; see common.teacher_exp2
    POLY_EXP2_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DS: tl.constexpr,
    BLOCK_DT: tl.constexpr,
):
    pid_m, pid_bh, batch, head = program_coordinates(n_q, BLOCK_M, num_heads)
    _fwd_rows(
        Q + batch * stride_qb + head * stride_qh, K + batch * stride_kb + head * stride_kh,
        QT + batch * stride_qtb + head * stride_qth, KT + batch * stride_ktb + head * stride_kth,
        stride_qn, stride_kn, stride_qtn, stride_ktn,
        LSE_S_IN + batch * stride_lsb + head * stride_lsh, LSE_T_IN + batch * stride_ltb + head * stride_lth,
        stride_lsn, stride_ltn, ROW_KL, LSE_S, LSE_T, pid_bh * n_q,
        pid_m, n_q, n_k, d_s, d_t, scale_s_log2, scale_t_log2, KNOWN_LSE, CAUSAL, DOT_PRECISION,
        POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, BLOCK_M, BLOCK_N, BLOCK_DS, BLOCK_DT,
    )


@triton.jit
def _attention_kl_grouped_fwd_kernel(
    TABLE,  # [L, FORWARD_TABLE_WIDTH] int64: per problem both base-2 scales, q, k, q_t, k_t (common.table_rows)
    LSE_S_IN, LSE_T_IN,  # [L, B, H, Nq] float32, contiguous, natural log; read only with KNOWN_LSE
    ROW_KL, LSE_S, LSE_T,  # [L, B, H, Nq] float32, contiguous; the lse in base 2
    batch_size, num_heads, n_q, n_k, d_s, d_t,  # shared by all L problems
    N_Q_BUCKET, N_K_BUCKET,  # autotune keys only
    ELEMENT: tl.constexpr, ALIGNED: tl.constexpr,  # the inputs' dtype; see common.table_rows
    KNOWN_LSE: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DS: tl.constexpr, BLOCK_DT: tl.constexpr,
):
    pid_m, pid_bh, batch, head = program_coordinates(n_q, BLOCK_M, num_heads)
    entry = TABLE + (batch // batch_size) * FORWARD_TABLE_WIDTH
    batch = batch % batch_size
    q_base, stride_qn = table_rows(entry, 0, batch, head, ELEMENT, ALIGNED)
    k_base, stride_kn = table_rows(entry, 1, batch, head, ELEMENT, ALIGNED)
    qt_base, stride_qtn = table_rows(entry, 2, batch, head, ELEMENT, ALIGNED)
    kt_base, stride_ktn = table_rows(entry, 3, batch, head, ELEMENT, ALIGNED)
    _fwd_rows(
        q_base, k_base, qt_base, kt_base, stride_qn, stride_kn, stride_qtn, stride_ktn,
        LSE_S_IN + pid_bh * n_q, LSE_T_IN + pid_bh * n_q, 1, 1,
        ROW_KL, LSE_S, LSE_T, pid_bh * n_q, pid_m, n_q, n_k, d_s, d_t,
        table_scale(entry, 0), table_scale(entry, 1), KNOWN_LSE, CAUSAL, DOT_PRECISION,
        POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, BLOCK_M, BLOCK_N, BLOCK_DS, BLOCK_DT,
    )
