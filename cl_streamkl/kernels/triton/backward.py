"""The backward kernels: gradients of the per-row KL for the query side and the key side.

With P = softmax(s) recomputed from the forward's log-sum-exps (base 2),
    dS_student = g·(P_s − P_t)·scale_s/T,
    dS_teacher = g·P_t·(log P_t − log P_s − KL_i)·scale_t/T (only when asked);
the dq kernels stream over key tiles for one query tile, the dk kernels over query tiles
for one key tile, so none needs atomics and the gradients are deterministic. Opt-in, the dk
kernels also give dq (ONE_PASS: each score tile computed once, dq added up in float32 with
atomics, as FlashAttention-2 does); the dq kernel is then not launched. Both come as one-problem kernels; for L problems of
one shape (addresses, strides and scales from a table, see ``common.table_rows``) one grouped
kernel serves as either, by its KEY_SIDE constant. All run the same ``_dq_rows`` / ``_dk_keys``. Kernel names keep
Triton's leading underscore: they are the names profilers show (benchmarks/profile_step.py
sorts by them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from cl_streamkl.kernels.triton.common import (
    BACKWARD_TABLE_WIDTH,
    dot,
    key_ranges,
    load_rows,
    program_coordinates,
    table_rows,
    table_scale,
    teacher_exp2,
)
from cl_streamkl.kernels.triton.fused_tile import add_rows as _add_rows
from cl_streamkl.kernels.triton.fused_tile import fused_tile


@triton.jit
def _score_grads(
    log2_p_s, log2_p_t, grad, row_kl, valid,
    MASKED: tl.constexpr, TEACHER_GRAD: tl.constexpr, TIMES_GRAD: tl.constexpr,
    POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
):
    """dKL/ds_student = g·(P_s − P_t) and, if asked, dKL/ds_teacher = g·P_t·(log P_t − log P_s − KL).

    All operands are in the orientation of the caller's score tile; grad and
    row_kl are already broadcast to it. Without TIMES_GRAD the factor g is left to the
    caller. Chain-rule scales are applied by the caller.
    """
    p_s = tl.math.exp2(log2_p_s)
    p_t = teacher_exp2(log2_p_t, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS)
    if MASKED:
        p_s = tl.where(valid, p_s, 0.0)
        p_t = tl.where(valid, p_t, 0.0)
    grad_scores = p_s - p_t
    if TIMES_GRAD:
        grad_scores = grad_scores * grad
    if TEACHER_GRAD:
        log_ratio = (log2_p_t - log2_p_s) * 0.6931471805599453
        grad_scores_t = p_t * (log_ratio - row_kl)
        if TIMES_GRAD:
            grad_scores_t = grad_scores_t * grad
    else:
        grad_scores_t = grad_scores
    return grad_scores, grad_scores_t


@triton.jit
def _bwd_dq_tile(
    q, qt, k, kt, rows, keys, n_k, lse_s, lse_t, grad, row_kl, dq, dqt,
    scale_s_log2, scale_t_log2,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TEACHER_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GRAD_AFTER_DOT: tl.constexpr, POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
):
    log2_p_s = dot(q, tl.trans(k), DOT_PRECISION) * scale_s_log2 - lse_s[:, None]
    log2_p_t = dot(qt, tl.trans(kt), DOT_PRECISION) * scale_t_log2 - lse_t[:, None]
    valid = keys[None, :] < n_k
    if CAUSAL:
        valid = valid & (keys[None, :] <= rows[:, None])
    grad_scores, grad_scores_t = _score_grads(
        log2_p_s, log2_p_t, grad[:, None], row_kl[:, None], valid, MASKED, TEACHER_GRAD, not GRAD_AFTER_DOT,
        POLY_EXP2_DEGREE, POLY_EXP2_SPLITS,
    )
    dq += dot(grad_scores.to(k.dtype), k, DOT_PRECISION)
    if TEACHER_GRAD:
        dqt += dot(grad_scores_t.to(kt.dtype), kt, DOT_PRECISION)
    return dq, dqt


@triton.jit
def _dq_rows(
    q_base, k_base, qt_base, kt_base,  # row 0 of this (batch, head) in Q, K, QT, KT
    stride_qn, stride_kn, stride_qtn, stride_ktn,
    grad_base, stride_gn,  # GRAD at this (batch, head)
    ROW_KL, LSE_S, LSE_T, row_base,  # and the index of this (batch, head)'s row 0 in them
    dq_base, dqt_base, stride_on, stride_otn,  # DQ and DQT at this (batch, head)
    pid_m, n_q, n_k, d_s, d_t, scale_s_log2, scale_t_log2, scale_s, scale_t,
    CAUSAL: tl.constexpr, TEACHER_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GRAD_AFTER_DOT: tl.constexpr, POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DS: tl.constexpr, BLOCK_DT: tl.constexpr,
):
    """dq (and dq_t) of query tile ``pid_m`` of one (batch, head), streaming over its keys."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    dims_s = tl.arange(0, BLOCK_DS)
    dims_t = tl.arange(0, BLOCK_DT)
    row_ok = rows < n_q

    q = load_rows(q_base, rows, stride_qn, dims_s, n_q, d_s)
    qt = load_rows(qt_base, rows, stride_qtn, dims_t, n_q, d_t)
    row_out = row_base + rows64
    lse_s = tl.load(LSE_S + row_out, mask=row_ok, other=0.0)
    lse_t = tl.load(LSE_T + row_out, mask=row_ok, other=0.0)
    # Padded rows get grad 0, so their (finite) scores contribute nothing.
    grad = tl.load(grad_base + rows64 * stride_gn, mask=row_ok, other=0.0)
    if TEACHER_GRAD:
        row_kl = tl.load(ROW_KL + row_out, mask=row_ok, other=0.0)
    else:
        row_kl = grad

    dq = tl.zeros([BLOCK_M, BLOCK_DS], tl.float32)
    dqt = tl.zeros([BLOCK_M, BLOCK_DT], tl.float32)
    full_end, key_end = key_ranges(pid_m, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        keys = start_n + cols
        k = load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
        kt = load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)
        dq, dqt = _bwd_dq_tile(
            q, qt, k, kt, rows, keys, n_k, lse_s, lse_t, grad, row_kl, dq, dqt, scale_s_log2, scale_t_log2,
            False, CAUSAL, TEACHER_GRAD, DOT_PRECISION, GRAD_AFTER_DOT, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS,
        )
    for start_n in range(full_end, key_end, BLOCK_N):
        keys = start_n + cols
        k = load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
        kt = load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)
        dq, dqt = _bwd_dq_tile(
            q, qt, k, kt, rows, keys, n_k, lse_s, lse_t, grad, row_kl, dq, dqt, scale_s_log2, scale_t_log2,
            True, CAUSAL, TEACHER_GRAD, DOT_PRECISION, GRAD_AFTER_DOT, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS,
        )

    if GRAD_AFTER_DOT:
        # g is constant along a query row: one product per row of dq instead of one per score.
        scale_s = grad[:, None] * scale_s
        scale_t = grad[:, None] * scale_t
    tl.store(
        dq_base + rows64[:, None] * stride_on + dims_s[None, :],
        (dq * scale_s).to(dq_base.dtype.element_ty),
        mask=row_ok[:, None] & (dims_s[None, :] < d_s),
    )
    if TEACHER_GRAD:
        tl.store(
            dqt_base + rows64[:, None] * stride_otn + dims_t[None, :],
            (dqt * scale_t).to(dqt_base.dtype.element_ty),
            mask=row_ok[:, None] & (dims_t[None, :] < d_t),
        )


@triton.jit
def _attention_kl_bwd_dq_kernel(
    Q,  # [B, H, Nq, Ds]
    K,  # [B, H, Nk, Ds]
    QT,  # [B, H, Nq, Dt]
    KT,  # [B, H, Nk, Dt]
    GRAD,  # [B, H, Nq] float32, any strides (an expanded scalar from mean())
    ROW_KL,  # [B, H, Nq] float32, contiguous; read only when TEACHER_GRAD
    LSE_S,  # [B, H, Nq] float32, contiguous, base 2
    LSE_T,  # [B, H, Nq] float32, contiguous, base 2
    DQ,  # [B, H, Nq, Ds], unit stride in Ds
    DQT,  # [B, H, Nq, Dt], unit stride in Dt; unused unless TEACHER_GRAD
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_qtb, stride_qth, stride_qtn,
    stride_ktb, stride_kth, stride_ktn,
    stride_gb, stride_gh, stride_gn,
    stride_ob, stride_oh, stride_on,  # of DQ (DK)
    stride_otb, stride_oth, stride_otn,  # of DQT (DKT)
    num_heads, n_q, n_k, d_s, d_t,
    scale_s_log2, scale_t_log2,
    scale_s, scale_t,  # natural-unit chain-rule factors scale / T
    N_Q_BUCKET, N_K_BUCKET,
    CAUSAL: tl.constexpr,
    TEACHER_GRAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GRAD_AFTER_DOT: tl.constexpr,  # multiply by g per row after the key loop, not per score
    POLY_EXP2_DEGREE: tl.constexpr,  # 0: every exponential on the MUFU; see common.teacher_exp2
    POLY_EXP2_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DS: tl.constexpr,
    BLOCK_DT: tl.constexpr,
):
    pid_m, pid_bh, batch, head = program_coordinates(n_q, BLOCK_M, num_heads)
    _dq_rows(
        Q + batch * stride_qb + head * stride_qh, K + batch * stride_kb + head * stride_kh,
        QT + batch * stride_qtb + head * stride_qth, KT + batch * stride_ktb + head * stride_kth,
        stride_qn, stride_kn, stride_qtn, stride_ktn, GRAD + batch * stride_gb + head * stride_gh, stride_gn,
        ROW_KL, LSE_S, LSE_T, pid_bh * n_q, DQ + batch * stride_ob + head * stride_oh,
        DQT + batch * stride_otb + head * stride_oth, stride_on, stride_otn, pid_m, n_q, n_k, d_s, d_t,
        scale_s_log2, scale_t_log2, scale_s, scale_t, CAUSAL, TEACHER_GRAD, DOT_PRECISION, GRAD_AFTER_DOT,
        POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, BLOCK_M, BLOCK_N, BLOCK_DS, BLOCK_DT,
    )


@triton.jit
def _bwd_dk_tile(
    q_base, qt_base, grad_base, row_base, LSE_S, LSE_T, ROW_KL,
    stride_qn, stride_qtn, stride_gn,
    k, kt, keys, rows, n_q, n_k, d_s, d_t, dims_s, dims_t, dk, dkt, dq_sum_base, dqt_sum_base, row_sums_base,
    scale_s_log2, scale_t_log2,
    MASKED: tl.constexpr, TEACHER_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GRAD_AFTER_DOT: tl.constexpr, POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
    ONE_PASS: tl.constexpr, ROW_TERMS: tl.constexpr,
):
    rows64 = rows.to(tl.int64)
    row_ok = rows < n_q
    q = load_rows(q_base, rows, stride_qn, dims_s, n_q, d_s)
    qt = load_rows(qt_base, rows, stride_qtn, dims_t, n_q, d_t)
    lse_s = tl.load(LSE_S + row_base + rows64, mask=row_ok, other=0.0)
    lse_t = tl.load(LSE_T + row_base + rows64, mask=row_ok, other=0.0)
    # Padded rows: q = 0, lse = 0 and grad = 0, so every term stays finite and zero.
    grad = tl.load(grad_base + rows64 * stride_gn, mask=row_ok, other=0.0)
    if TEACHER_GRAD:
        row_kl = tl.load(ROW_KL + row_base + rows64, mask=row_ok, other=0.0)
    else:
        row_kl = grad
    if ROW_TERMS:
        dk = fused_tile(q, qt, k, kt, keys, rows, rows64, row_ok, n_k, lse_s, lse_t, dk, dq_sum_base, row_sums_base,
                        dims_s, d_s, scale_s_log2, scale_t_log2, MASKED, DOT_PRECISION, POLY_EXP2_DEGREE,
                        POLY_EXP2_SPLITS)
    else:
        dk, dkt = _dk_tile_scores(q, qt, k, kt, keys, rows, rows64, row_ok, grad, row_kl, lse_s, lse_t, dk, dkt,
                                  dq_sum_base, dqt_sum_base, dims_s, dims_t, d_s, d_t, scale_s_log2, scale_t_log2,
                                  MASKED, TEACHER_GRAD, DOT_PRECISION, GRAD_AFTER_DOT, POLY_EXP2_DEGREE,
                                  POLY_EXP2_SPLITS, ONE_PASS)
    return dk, dkt


@triton.jit
def _dk_tile_scores(
    q, qt, k, kt, keys, rows, rows64, row_ok, grad, row_kl, lse_s, lse_t, dk, dkt, dq_sum_base, dqt_sum_base,
    dims_s, dims_t, d_s, d_t, scale_s_log2, scale_t_log2,
    MASKED: tl.constexpr, TEACHER_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr, GRAD_AFTER_DOT: tl.constexpr,
    POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """The key-side tile's scores in the transposed orientation [keys, queries], their dk and dq shares."""
    log2_p_s = dot(k, tl.trans(q), DOT_PRECISION) * scale_s_log2 - lse_s[None, :]
    log2_p_t = dot(kt, tl.trans(qt), DOT_PRECISION) * scale_t_log2 - lse_t[None, :]
    valid = keys[:, None] <= rows[None, :]
    grad_scores, grad_scores_t = _score_grads(
        log2_p_s, log2_p_t, grad[None, :], row_kl[None, :], valid, MASKED, TEACHER_GRAD, not GRAD_AFTER_DOT,
        POLY_EXP2_DEGREE, POLY_EXP2_SPLITS,
    )
    grad_scores = grad_scores.to(q.dtype)
    dk += dot(grad_scores, q, DOT_PRECISION)
    if ONE_PASS:
        # This key tile's share of dq: added into float32 sums that other key tiles share.
        _add_rows(dq_sum_base, rows64, row_ok, dims_s, d_s, dot(tl.trans(grad_scores), k, DOT_PRECISION))
    if TEACHER_GRAD:
        grad_scores_t = grad_scores_t.to(qt.dtype)
        dkt += dot(grad_scores_t, qt, DOT_PRECISION)
        if ONE_PASS:
            _add_rows(dqt_sum_base, rows64, row_ok, dims_t, d_t, dot(tl.trans(grad_scores_t), kt, DOT_PRECISION))
    return dk, dkt


@triton.jit
def _dk_keys(
    q_base, k_base, qt_base, kt_base,  # row 0 of this (batch, head) in Q, K, QT, KT
    stride_qn, stride_kn, stride_qtn, stride_ktn,
    grad_base, stride_gn,  # GRAD at this (batch, head)
    ROW_KL, LSE_S, LSE_T, row_base,  # and the index of this (batch, head)'s row 0 in them
    dk_base, dkt_base, stride_on, stride_otn,  # DK and DKT at this (batch, head)
    dq_sum_base, dqt_sum_base,  # ONE_PASS: row 0 of this (batch, head) in DQ_SUM, DQT_SUM
    row_sums_base,  # ROW_TERMS: row 0 of this (batch, head) in ROW_SUMS
    pid_n, n_q, n_k, d_s, d_t, scale_s_log2, scale_t_log2, scale_s, scale_t,
    CAUSAL: tl.constexpr, TEACHER_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GRAD_AFTER_DOT: tl.constexpr, POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
    ONE_PASS: tl.constexpr, ROW_TERMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DS: tl.constexpr, BLOCK_DT: tl.constexpr,
):
    """dk (and dk_t) of key tile ``pid_n`` of one (batch, head), streaming over its queries.

    Transposed orientation: keys past Nk need no mask, their rows of dk are never stored
    (and their K rows load as zeros, so they add nothing to dq).
    GRAD_AFTER_DOT is only set when g is the same for every query row of this (batch, head)
    (GRAD's row stride is 0, as after a mean or sum): then g multiplies dk once at the end.
    With ONE_PASS the same score tiles also give dq: each query tile's dSᵀ·K is added into the
    float32 sums DQ_SUM (and DQT_SUM) with atomics, which the launcher scales (by g too under
    GRAD_AFTER_DOT) and casts. With ROW_TERMS (the fused forward, g = 1) the same tiles also add
    up the KL's two row sums into ROW_SUMS, from which the launcher computes the KL.
    """
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keys64 = keys.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    dims_s = tl.arange(0, BLOCK_DS)
    dims_t = tl.arange(0, BLOCK_DT)
    key_ok = keys < n_k

    k = load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
    kt = load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)

    dk = tl.zeros([BLOCK_N, BLOCK_DS], tl.float32)
    dkt = tl.zeros([BLOCK_N, BLOCK_DT], tl.float32)
    if CAUSAL:
        # Query tiles that straddle this key block need the causal mask; from the
        # first tile starting at or after the block's end, every entry is valid.
        query_start = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
        unmasked_start = tl.cdiv((pid_n + 1) * BLOCK_N, BLOCK_M) * BLOCK_M
        for start_m in range(query_start, tl.minimum(unmasked_start, n_q), BLOCK_M):
            dk, dkt = _bwd_dk_tile(
                q_base, qt_base, grad_base, row_base, LSE_S, LSE_T, ROW_KL,
                stride_qn, stride_qtn, stride_gn,
                k, kt, keys, start_m + offs_m, n_q, n_k, d_s, d_t, dims_s, dims_t, dk, dkt, dq_sum_base, dqt_sum_base,
                row_sums_base,
                scale_s_log2, scale_t_log2, True, TEACHER_GRAD, DOT_PRECISION, GRAD_AFTER_DOT,
                POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, ONE_PASS, ROW_TERMS,
            )
    else:
        unmasked_start = 0
    for start_m in range(unmasked_start, n_q, BLOCK_M):
        dk, dkt = _bwd_dk_tile(
            q_base, qt_base, grad_base, row_base, LSE_S, LSE_T, ROW_KL,
            stride_qn, stride_qtn, stride_gn,
            k, kt, keys, start_m + offs_m, n_q, n_k, d_s, d_t, dims_s, dims_t, dk, dkt, dq_sum_base, dqt_sum_base,
                row_sums_base,
            scale_s_log2, scale_t_log2, False, TEACHER_GRAD, DOT_PRECISION, GRAD_AFTER_DOT,
            POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, ONE_PASS, ROW_TERMS,
        )

    if GRAD_AFTER_DOT:
        grad = tl.load(grad_base)
        scale_s = grad * scale_s
        scale_t = grad * scale_t
    tl.store(
        dk_base + keys64[:, None] * stride_on + dims_s[None, :],
        (dk * scale_s).to(dk_base.dtype.element_ty),
        mask=key_ok[:, None] & (dims_s[None, :] < d_s),
    )
    if TEACHER_GRAD:
        tl.store(
            dkt_base + keys64[:, None] * stride_otn + dims_t[None, :],
            (dkt * scale_t).to(dkt_base.dtype.element_ty),
            mask=key_ok[:, None] & (dims_t[None, :] < d_t),
        )


@triton.jit
def _attention_kl_bwd_dk_kernel(
    Q,  # [B, H, Nq, Ds]
    K,  # [B, H, Nk, Ds]
    QT,  # [B, H, Nq, Dt]
    KT,  # [B, H, Nk, Dt]
    GRAD,  # [B, H, Nq] float32, any strides
    ROW_KL,  # [B, H, Nq] float32, contiguous; read only when TEACHER_GRAD
    LSE_S,  # [B, H, Nq] float32, contiguous, base 2
    LSE_T,  # [B, H, Nq] float32, contiguous, base 2
    DK,  # [B, H, Nk, Ds], unit stride in Ds
    DKT,  # [B, H, Nk, Dt], unit stride in Dt; unused unless TEACHER_GRAD
    DQ_SUM,  # [B, H, Nq, Ds] float32, contiguous, zeros; used only when ONE_PASS
    DQT_SUM,  # [B, H, Nq, Dt] float32, contiguous, zeros; used only when ONE_PASS and TEACHER_GRAD
    ROW_SUMS,  # [B, H, Nq, 2] float32, contiguous, zeros; used only when ROW_TERMS
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_qtb, stride_qth, stride_qtn,
    stride_ktb, stride_kth, stride_ktn,
    stride_gb, stride_gh, stride_gn,
    stride_ob, stride_oh, stride_on,  # of DQ (DK)
    stride_otb, stride_oth, stride_otn,  # of DQT (DKT)
    num_heads, n_q, n_k, d_s, d_t,
    scale_s_log2, scale_t_log2,
    scale_s, scale_t,
    N_Q_BUCKET, N_K_BUCKET,
    CAUSAL: tl.constexpr,
    TEACHER_GRAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GRAD_AFTER_DOT: tl.constexpr,  # only when GRAD's row stride is 0 (see _dk_keys)
    POLY_EXP2_DEGREE: tl.constexpr,
    POLY_EXP2_SPLITS: tl.constexpr,
    ONE_PASS: tl.constexpr,  # also add up dq (see _dk_keys)
    ROW_TERMS: tl.constexpr,  # also add up the KL's row sums (the fused forward; see _dk_keys)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DS: tl.constexpr,
    BLOCK_DT: tl.constexpr,
):
    pid_n, pid_bh, batch, head = program_coordinates(n_k, BLOCK_N, num_heads)
    _dk_keys(
        Q + batch * stride_qb + head * stride_qh, K + batch * stride_kb + head * stride_kh,
        QT + batch * stride_qtb + head * stride_qth, KT + batch * stride_ktb + head * stride_kth,
        stride_qn, stride_kn, stride_qtn, stride_ktn, GRAD + batch * stride_gb + head * stride_gh, stride_gn,
        ROW_KL, LSE_S, LSE_T, pid_bh * n_q, DK + batch * stride_ob + head * stride_oh,
        DKT + batch * stride_otb + head * stride_oth, stride_on, stride_otn,
        DQ_SUM + pid_bh * n_q * d_s, DQT_SUM + pid_bh * n_q * d_t, ROW_SUMS + pid_bh * n_q * 2, pid_n, n_q, n_k,
        d_s, d_t, scale_s_log2, scale_t_log2, scale_s, scale_t, CAUSAL, TEACHER_GRAD, DOT_PRECISION, GRAD_AFTER_DOT,
        POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, ONE_PASS, ROW_TERMS, BLOCK_M, BLOCK_N, BLOCK_DS, BLOCK_DT,
    )


@triton.jit
def _attention_kl_grouped_bwd_kernel(
    TABLE,  # [L, BACKWARD_TABLE_WIDTH] int64: scales, q, k, q_t, k_t, dq, dq_t, dk, dk_t (common.table_rows)
    GRAD,  # [L, B, H, Nq] float32, any strides
    ROW_KL, LSE_S, LSE_T,  # [L, B, H, Nq] float32, contiguous; ROW_KL read only when TEACHER_GRAD
    DQ_SUM, DQT_SUM,  # [L, B, H, Nq, Ds] and [..., Dt] float32, contiguous, zeros; only KEY_SIDE with ONE_PASS
    ROW_SUMS,  # [L, B, H, Nq, 2] float32, contiguous, zeros; only KEY_SIDE with ROW_TERMS
    stride_gl, stride_gb, stride_gh, stride_gn,
    batch_size, num_heads, n_q, n_k, d_s, d_t,  # shared by all L problems
    N_Q_BUCKET, N_K_BUCKET,
    ELEMENT: tl.constexpr, ALIGNED: tl.constexpr,  # the inputs' dtype; see common.table_rows
    KEY_SIDE: tl.constexpr,  # False: the dq kernel (query tiles); True: the dk kernel (key tiles)
    CAUSAL: tl.constexpr, TEACHER_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GRAD_AFTER_DOT: tl.constexpr,  # see _dq_rows and _dk_keys
    POLY_EXP2_DEGREE: tl.constexpr, POLY_EXP2_SPLITS: tl.constexpr,
    ONE_PASS: tl.constexpr,  # KEY_SIDE also adds up dq (see _dk_keys); the dq launch is skipped
    ROW_TERMS: tl.constexpr,  # KEY_SIDE also adds up the KL's row sums (the fused forward)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DS: tl.constexpr, BLOCK_DT: tl.constexpr,
):
    # One kernel for both sides (the launcher launches it twice, KEY_SIDE False then True):
    # the table lookups are shared, the work is _dq_rows' or _dk_keys'.
    if KEY_SIDE:
        tile, pid_bh, batch, head = program_coordinates(n_k, BLOCK_N, num_heads)
    else:
        tile, pid_bh, batch, head = program_coordinates(n_q, BLOCK_M, num_heads)
    problem = batch // batch_size
    entry = TABLE + problem * BACKWARD_TABLE_WIDTH
    batch = batch % batch_size
    q_base, stride_qn = table_rows(entry, 0, batch, head, ELEMENT, ALIGNED)
    k_base, stride_kn = table_rows(entry, 1, batch, head, ELEMENT, ALIGNED)
    qt_base, stride_qtn = table_rows(entry, 2, batch, head, ELEMENT, ALIGNED)
    kt_base, stride_ktn = table_rows(entry, 3, batch, head, ELEMENT, ALIGNED)
    out_base, stride_on = table_rows(entry, 6 if KEY_SIDE else 4, batch, head, ELEMENT, ALIGNED)
    out_t_base, stride_otn = table_rows(entry, 7 if KEY_SIDE else 5, batch, head, ELEMENT, ALIGNED)
    grad_base = GRAD + problem * stride_gl + batch * stride_gb + head * stride_gh
    scale_s_log2, scale_t_log2 = table_scale(entry, 0), table_scale(entry, 1)
    scale_s, scale_t = table_scale(entry, 2), table_scale(entry, 3)
    if KEY_SIDE:
        _dk_keys(q_base, k_base, qt_base, kt_base, stride_qn, stride_kn, stride_qtn, stride_ktn, grad_base, stride_gn,
                 ROW_KL, LSE_S, LSE_T, pid_bh * n_q, out_base, out_t_base, stride_on, stride_otn,
                 DQ_SUM + pid_bh * n_q * d_s, DQT_SUM + pid_bh * n_q * d_t, ROW_SUMS + pid_bh * n_q * 2, tile, n_q,
                 n_k, d_s, d_t, scale_s_log2, scale_t_log2, scale_s, scale_t, CAUSAL, TEACHER_GRAD, DOT_PRECISION,
                 GRAD_AFTER_DOT, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, ONE_PASS, ROW_TERMS, BLOCK_M, BLOCK_N, BLOCK_DS, BLOCK_DT)
    else:
        _dq_rows(q_base, k_base, qt_base, kt_base, stride_qn, stride_kn, stride_qtn, stride_ktn, grad_base, stride_gn,
                 ROW_KL, LSE_S, LSE_T, pid_bh * n_q, out_base, out_t_base, stride_on, stride_otn, tile, n_q, n_k,
                 d_s, d_t, scale_s_log2, scale_t_log2, scale_s, scale_t, CAUSAL, TEACHER_GRAD, DOT_PRECISION,
                 GRAD_AFTER_DOT, POLY_EXP2_DEGREE, POLY_EXP2_SPLITS, BLOCK_M, BLOCK_N, BLOCK_DS, BLOCK_DT)
