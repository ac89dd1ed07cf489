"""The backward kernels: gradients of the per-row KL for the query side and the key side.

With P = softmax(s) recomputed from the forward's log-sum-exps (base 2),
    dS_student = g·(P_s − P_t)·scale_s/T,
    dS_teacher = g·P_t·(log P_t − log P_s − KL_i)·scale_t/T (only when asked);
the dq kernel streams over key tiles for one query tile, the dk kernel over query tiles
for one key tile, so neither needs atomics. Kernel names keep Triton's leading
underscore: they are the names profilers show (benchmarks/profile_step.py sorts by them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from cl_streamkl.kernels.triton.common import dot, key_ranges, load_rows


@triton.jit
def _score_grads(
    log2_p_s, log2_p_t, grad, row_kl, valid,
    MASKED: tl.constexpr, TEACHER_GRAD: tl.constexpr,
):
    """dKL/ds_student = g·(P_s − P_t) and, if asked, dKL/ds_teacher = g·P_t·(log P_t − log P_s − KL).

    All operands are in the orientation of the caller's score tile; grad and
    row_kl are already broadcast to it. Chain-rule scales are applied by the caller.
    """
    p_s = tl.math.exp2(log2_p_s)
    p_t = tl.math.exp2(log2_p_t)
    if MASKED:
        p_s = tl.where(valid, p_s, 0.0)
        p_t = tl.where(valid, p_t, 0.0)
    grad_scores = (p_s - p_t) * grad
    if TEACHER_GRAD:
        log_ratio = (log2_p_t - log2_p_s) * 0.6931471805599453
        grad_scores_t = p_t * (log_ratio - row_kl) * grad
    else:
        grad_scores_t = grad_scores
    return grad_scores, grad_scores_t


@triton.jit
def _bwd_dq_tile(
    q, qt, k, kt, rows, keys, n_k, lse_s, lse_t, grad, row_kl, dq, dqt,
    scale_s_log2, scale_t_log2,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TEACHER_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    log2_p_s = dot(q, tl.trans(k), DOT_PRECISION) * scale_s_log2 - lse_s[:, None]
    log2_p_t = dot(qt, tl.trans(kt), DOT_PRECISION) * scale_t_log2 - lse_t[:, None]
    valid = keys[None, :] < n_k
    if CAUSAL:
        valid = valid & (keys[None, :] <= rows[:, None])
    grad_scores, grad_scores_t = _score_grads(
        log2_p_s, log2_p_t, grad[:, None], row_kl[:, None], valid, MASKED, TEACHER_GRAD
    )
    dq += dot(grad_scores.to(k.dtype), k, DOT_PRECISION)
    if TEACHER_GRAD:
        dqt += dot(grad_scores_t.to(kt.dtype), kt, DOT_PRECISION)
    return dq, dqt


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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DS: tl.constexpr,
    BLOCK_DT: tl.constexpr,
):
    query_tiles = tl.cdiv(n_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % query_tiles
    pid_bh = (pid // query_tiles).to(tl.int64)
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    dims_s = tl.arange(0, BLOCK_DS)
    dims_t = tl.arange(0, BLOCK_DT)
    row_ok = rows < n_q

    q = load_rows(Q + batch * stride_qb + head * stride_qh, rows, stride_qn, dims_s, n_q, d_s)
    qt = load_rows(QT + batch * stride_qtb + head * stride_qth, rows, stride_qtn, dims_t, n_q, d_t)
    row_out = pid_bh * n_q + rows64
    lse_s = tl.load(LSE_S + row_out, mask=row_ok, other=0.0)
    lse_t = tl.load(LSE_T + row_out, mask=row_ok, other=0.0)
    # Padded rows get grad 0, so their (finite) scores contribute nothing.
    grad = tl.load(GRAD + batch * stride_gb + head * stride_gh + rows64 * stride_gn, mask=row_ok, other=0.0)
    if TEACHER_GRAD:
        row_kl = tl.load(ROW_KL + row_out, mask=row_ok, other=0.0)
    else:
        row_kl = grad
    k_base = K + batch * stride_kb + head * stride_kh
    kt_base = KT + batch * stride_ktb + head * stride_kth

    dq = tl.zeros([BLOCK_M, BLOCK_DS], tl.float32)
    dqt = tl.zeros([BLOCK_M, BLOCK_DT], tl.float32)
    full_end, key_end = key_ranges(pid_m, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        keys = start_n + cols
        k = load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
        kt = load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)
        dq, dqt = _bwd_dq_tile(
            q, qt, k, kt, rows, keys, n_k, lse_s, lse_t, grad, row_kl, dq, dqt,
            scale_s_log2, scale_t_log2, False, CAUSAL, TEACHER_GRAD, DOT_PRECISION,
        )
    for start_n in range(full_end, key_end, BLOCK_N):
        keys = start_n + cols
        k = load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
        kt = load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)
        dq, dqt = _bwd_dq_tile(
            q, qt, k, kt, rows, keys, n_k, lse_s, lse_t, grad, row_kl, dq, dqt,
            scale_s_log2, scale_t_log2, True, CAUSAL, TEACHER_GRAD, DOT_PRECISION,
        )

    tl.store(
        DQ + batch * stride_ob + head * stride_oh + rows64[:, None] * stride_on + dims_s[None, :],
        (dq * scale_s).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (dims_s[None, :] < d_s),
    )
    if TEACHER_GRAD:
        tl.store(
            DQT + batch * stride_otb + head * stride_oth + rows64[:, None] * stride_otn + dims_t[None, :],
            (dqt * scale_t).to(DQT.dtype.element_ty),
            mask=row_ok[:, None] & (dims_t[None, :] < d_t),
        )


@triton.jit
def _bwd_dk_tile(
    q_base, qt_base, grad_base, row_base, LSE_S, LSE_T, ROW_KL,
    stride_qn, stride_qtn, stride_gn,
    k, kt, keys, rows, n_q, d_s, d_t, dims_s, dims_t, dk, dkt,
    scale_s_log2, scale_t_log2,
    MASKED: tl.constexpr, TEACHER_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
    log2_p_s = dot(k, tl.trans(q), DOT_PRECISION) * scale_s_log2 - lse_s[None, :]
    log2_p_t = dot(kt, tl.trans(qt), DOT_PRECISION) * scale_t_log2 - lse_t[None, :]
    valid = keys[:, None] <= rows[None, :]
    grad_scores, grad_scores_t = _score_grads(
        log2_p_s, log2_p_t, grad[None, :], row_kl[None, :], valid, MASKED, TEACHER_GRAD
    )
    dk += dot(grad_scores.to(q.dtype), q, DOT_PRECISION)
    if TEACHER_GRAD:
        dkt += dot(grad_scores_t.to(qt.dtype), qt, DOT_PRECISION)
    return dk, dkt


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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DS: tl.constexpr,
    BLOCK_DT: tl.constexpr,
):
    # Transposed orientation: this program owns BLOCK_N keys and streams over
    # query tiles. Keys past Nk need no mask: their rows of dk are never stored.
    key_tiles = tl.cdiv(n_k, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % key_tiles
    pid_bh = (pid // key_tiles).to(tl.int64)
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keys64 = keys.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    dims_s = tl.arange(0, BLOCK_DS)
    dims_t = tl.arange(0, BLOCK_DT)
    key_ok = keys < n_k

    k = load_rows(K + batch * stride_kb + head * stride_kh, keys, stride_kn, dims_s, n_k, d_s)
    kt = load_rows(KT + batch * stride_ktb + head * stride_kth, keys, stride_ktn, dims_t, n_k, d_t)
    q_base = Q + batch * stride_qb + head * stride_qh
    qt_base = QT + batch * stride_qtb + head * stride_qth
    grad_base = GRAD + batch * stride_gb + head * stride_gh
    row_base = pid_bh * n_q

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
                k, kt, keys, start_m + offs_m, n_q, d_s, d_t, dims_s, dims_t, dk, dkt,
                scale_s_log2, scale_t_log2, True, TEACHER_GRAD, DOT_PRECISION,
            )
    else:
        unmasked_start = 0
    for start_m in range(unmasked_start, n_q, BLOCK_M):
        dk, dkt = _bwd_dk_tile(
            q_base, qt_base, grad_base, row_base, LSE_S, LSE_T, ROW_KL,
            stride_qn, stride_qtn, stride_gn,
            k, kt, keys, start_m + offs_m, n_q, d_s, d_t, dims_s, dims_t, dk, dkt,
            scale_s_log2, scale_t_log2, False, TEACHER_GRAD, DOT_PRECISION,
        )

    tl.store(
        DK + batch * stride_ob + head * stride_oh + keys64[:, None] * stride_on + dims_s[None, :],
        (dk * scale_s).to(DK.dtype.element_ty),
        mask=key_ok[:, None] & (dims_s[None, :] < d_s),
    )
    if TEACHER_GRAD:
        tl.store(
            DKT + batch * stride_otb + head * stride_oth + keys64[:, None] * stride_otn + dims_t[None, :],
            (dkt * scale_t).to(DKT.dtype.element_ty),
            mask=key_ok[:, None] & (dims_t[None, :] < d_t),
        )
