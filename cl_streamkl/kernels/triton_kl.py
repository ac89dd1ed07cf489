"""Fused Triton attention KL: KL(softmax(s_t) ‖ softmax(s_s)) per query row, never materialised.

Read top to bottom: the Triton kernels (forward, backward for query-side and
key-side gradients), the launchers that pick block sizes and grids, the
``torch.library`` custom ops (so ``torch.compile(fullgraph=True)`` traces
through) with their autograd formula, and the entry point used by
:func:`cl_streamkl.attention_kl`.

Math (base 2 inside the kernels: u = s·log2(e)):
    forward  per row i:  KL_i = Σ_j p_t (s_t − s_s) − lse_t + lse_s, accumulated online
    backward dS_student = g·(P_s − P_t)·scale_s/T,
             dS_teacher = g·P_t·(log P_t − log P_s − KL_i)·scale_t/T (only when asked)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os

import torch
from torch.autograd.function import once_differentiable
import triton
import triton.language as tl
import triton.testing

from cl_streamkl.kernels.launch_cache import KernelLauncher
from cl_streamkl.kernels.validation import AttentionKLProblem

LOG2_E = 1.4426950408889634


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation; DOT_PRECISION is "ieee", "tf32" or "upcast"."""
    if DOT_PRECISION == "upcast":
        # Triton's CPU interpreter multiplies bfloat16 operands as raw uint16 bits
        # (triton 3.8); exact fp32 products of the same bf16 values sidestep it.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


# Triton picks its CPU interpreter when a kernel is defined (TRITON_INTERPRET=1 set
# before triton was imported); ask the kernel object rather than the environment.
INTERPRETING = type(_dot).__name__ == "InterpretedFunction"


@triton.jit
def _load_rows(base, index, stride, dims, limit, dim_limit):
    """Load a [len(index), len(dims)] tile of rows index (< limit), zero-padded."""
    return tl.load(
        base + index.to(tl.int64)[:, None] * stride + dims[None, :],
        mask=(index[:, None] < limit) & (dims[None, :] < dim_limit),
        other=0.0,
    )


@triton.jit
def _key_ranges(pid_m, n_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges a query tile visits: [0, full_end) needs no mask, [full_end, key_end) does.

    Only the ragged tail (and, causal, the diagonal tiles) pay for the selects per score.
    """
    if CAUSAL:
        full_end = (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N
        key_end = tl.minimum((pid_m + 1) * BLOCK_M, n_k)
    else:
        full_end = (n_k // BLOCK_N) * BLOCK_N
        key_end = n_k
    return full_end, key_end


@triton.jit
def _fwd_tile(
    q, qt, k, kt, rows, keys, n_k,
    scale_s_log2, scale_t_log2,
    max_s, sum_s, max_t, sum_t, gap,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One key tile of the online forward; returns the updated running state."""
    u_s = _dot(q, tl.trans(k), DOT_PRECISION) * scale_s_log2
    u_t = _dot(qt, tl.trans(kt), DOT_PRECISION) * scale_t_log2
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
    p_t = tl.math.exp2(u_t - new_max_t[:, None])
    sum_t = sum_t * rescale_t + tl.sum(p_t, 1)
    gap = gap * rescale_t + tl.sum(p_t * score_gap, 1)
    return new_max_s, sum_s, new_max_t, sum_t, gap


@triton.jit
def _attention_kl_fwd_kernel(
    Q,  # [B, H, Nq, Ds]
    K,  # [B, H, Nk, Ds]
    QT,  # [B, H, Nq, Dt]
    KT,  # [B, H, Nk, Dt]
    ROW_KL,  # [B, H, Nq] float32, contiguous
    LSE_S,  # [B, H, Nq] float32, contiguous, base 2
    LSE_T,  # [B, H, Nq] float32, contiguous, base 2
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_qtb, stride_qth, stride_qtn,
    stride_ktb, stride_kth, stride_ktn,
    num_heads, n_q, n_k, d_s, d_t,
    scale_s_log2,  # scale_s / T · log2(e)
    scale_t_log2,  # scale_t / T · log2(e)
    N_Q_BUCKET, N_K_BUCKET,  # autotune keys only
    CAUSAL: tl.constexpr,
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
    cols = tl.arange(0, BLOCK_N)
    dims_s = tl.arange(0, BLOCK_DS)
    dims_t = tl.arange(0, BLOCK_DT)

    q = _load_rows(Q + batch * stride_qb + head * stride_qh, rows, stride_qn, dims_s, n_q, d_s)
    qt = _load_rows(QT + batch * stride_qtb + head * stride_qth, rows, stride_qtn, dims_t, n_q, d_t)
    k_base = K + batch * stride_kb + head * stride_kh
    kt_base = KT + batch * stride_ktb + head * stride_kth

    max_s = tl.full([BLOCK_M], float("-inf"), tl.float32)
    max_t = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sum_s = tl.zeros([BLOCK_M], tl.float32)
    sum_t = tl.zeros([BLOCK_M], tl.float32)
    gap = tl.zeros([BLOCK_M], tl.float32)

    full_end, key_end = _key_ranges(pid_m, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        keys = start_n + cols
        k = _load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
        kt = _load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)
        max_s, sum_s, max_t, sum_t, gap = _fwd_tile(
            q, qt, k, kt, rows, keys, n_k, scale_s_log2, scale_t_log2,
            max_s, sum_s, max_t, sum_t, gap, False, CAUSAL, DOT_PRECISION,
        )
    for start_n in range(full_end, key_end, BLOCK_N):
        keys = start_n + cols
        k = _load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
        kt = _load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)
        max_s, sum_s, max_t, sum_t, gap = _fwd_tile(
            q, qt, k, kt, rows, keys, n_k, scale_s_log2, scale_t_log2,
            max_s, sum_s, max_t, sum_t, gap, True, CAUSAL, DOT_PRECISION,
        )

    log2_sum_s = tl.math.log2(sum_s)
    log2_sum_t = tl.math.log2(sum_t)
    # Subtract the maxima first: both log-sum-exps can be large and nearly equal.
    row_kl = (gap / sum_t - (max_t - max_s) - log2_sum_t + log2_sum_s) * 0.6931471805599453
    out = pid_bh * n_q + rows.to(tl.int64)
    row_ok = rows < n_q
    tl.store(ROW_KL + out, row_kl, mask=row_ok)
    tl.store(LSE_S + out, max_s + log2_sum_s, mask=row_ok)
    tl.store(LSE_T + out, max_t + log2_sum_t, mask=row_ok)


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
    log2_p_s = _dot(q, tl.trans(k), DOT_PRECISION) * scale_s_log2 - lse_s[:, None]
    log2_p_t = _dot(qt, tl.trans(kt), DOT_PRECISION) * scale_t_log2 - lse_t[:, None]
    valid = keys[None, :] < n_k
    if CAUSAL:
        valid = valid & (keys[None, :] <= rows[:, None])
    grad_scores, grad_scores_t = _score_grads(
        log2_p_s, log2_p_t, grad[:, None], row_kl[:, None], valid, MASKED, TEACHER_GRAD
    )
    dq += _dot(grad_scores.to(k.dtype), k, DOT_PRECISION)
    if TEACHER_GRAD:
        dqt += _dot(grad_scores_t.to(kt.dtype), kt, DOT_PRECISION)
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

    q = _load_rows(Q + batch * stride_qb + head * stride_qh, rows, stride_qn, dims_s, n_q, d_s)
    qt = _load_rows(QT + batch * stride_qtb + head * stride_qth, rows, stride_qtn, dims_t, n_q, d_t)
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
    full_end, key_end = _key_ranges(pid_m, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, full_end, BLOCK_N):
        keys = start_n + cols
        k = _load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
        kt = _load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)
        dq, dqt = _bwd_dq_tile(
            q, qt, k, kt, rows, keys, n_k, lse_s, lse_t, grad, row_kl, dq, dqt,
            scale_s_log2, scale_t_log2, False, CAUSAL, TEACHER_GRAD, DOT_PRECISION,
        )
    for start_n in range(full_end, key_end, BLOCK_N):
        keys = start_n + cols
        k = _load_rows(k_base, keys, stride_kn, dims_s, n_k, d_s)
        kt = _load_rows(kt_base, keys, stride_ktn, dims_t, n_k, d_t)
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
    q = _load_rows(q_base, rows, stride_qn, dims_s, n_q, d_s)
    qt = _load_rows(qt_base, rows, stride_qtn, dims_t, n_q, d_t)
    lse_s = tl.load(LSE_S + row_base + rows64, mask=row_ok, other=0.0)
    lse_t = tl.load(LSE_T + row_base + rows64, mask=row_ok, other=0.0)
    # Padded rows: q = 0, lse = 0 and grad = 0, so every term stays finite and zero.
    grad = tl.load(grad_base + rows64 * stride_gn, mask=row_ok, other=0.0)
    if TEACHER_GRAD:
        row_kl = tl.load(ROW_KL + row_base + rows64, mask=row_ok, other=0.0)
    else:
        row_kl = grad
    log2_p_s = _dot(k, tl.trans(q), DOT_PRECISION) * scale_s_log2 - lse_s[None, :]
    log2_p_t = _dot(kt, tl.trans(qt), DOT_PRECISION) * scale_t_log2 - lse_t[None, :]
    valid = keys[:, None] <= rows[None, :]
    grad_scores, grad_scores_t = _score_grads(
        log2_p_s, log2_p_t, grad[None, :], row_kl[None, :], valid, MASKED, TEACHER_GRAD
    )
    dk += _dot(grad_scores.to(q.dtype), q, DOT_PRECISION)
    if TEACHER_GRAD:
        dkt += _dot(grad_scores_t.to(qt.dtype), qt, DOT_PRECISION)
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

    k = _load_rows(K + batch * stride_kb + head * stride_kh, keys, stride_kn, dims_s, n_k, d_s)
    kt = _load_rows(KT + batch * stride_ktb + head * stride_kth, keys, stride_ktn, dims_t, n_k, d_t)
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


# Host-side helpers are plain Python: triton.next_power_of_2 is a constexpr
# function whose wrapper costs microseconds per call, and at ViT sizes
# (197 tokens) the kernels themselves run for only tens of microseconds.
def _next_power_of_2(value: int) -> int:
    return 1 << (value - 1).bit_length()


def _block_dim(head_dim: int) -> int:
    # tl.dot needs every operand dimension to be at least 16.
    return max(16, _next_power_of_2(head_dim))


def _length_bucket(length: int) -> int:
    return _next_power_of_2(length)


_TILE_SHAPES = {
    "fwd": [(128, 64), (128, 128), (64, 64), (64, 128), (128, 32), (64, 32)],
    "bwd": [(64, 64), (128, 64), (64, 128), (32, 64), (64, 32), (128, 128)],
}
# At ViT lengths (both length buckets at most 2048) only these (BLOCK_M, BLOCK_N, warps,
# stages) are tried: every tile the CUDA-graph-timed autotuner picked on the H200 at 197,
# 577 and 1025 tokens, and their neighbours, plus the fastest dq and dk tiles of a sweep of
# all 24 at 16x12x1025x64 (benchmarks/TUNING_NOTES.md, row 15). A third to 40 % of the configs
# means that much of the compiling on the first call, which there costs far more than the
# kernels themselves.
SHORT_SEQUENCE_BUCKET = 2048
_SHORT_SEQUENCE_CANDIDATES = {
    "fwd": {(128, 64, w, s) for w in (4, 8) for s in (2, 3)}
    | {(64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2)},
    "bwd": {(64, 64, w, s) for w in (4, 8) for s in (2, 3)}
    | {(128, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2), (128, 128, 8, 2), (64, 32, 4, 3), (128, 64, 4, 2)},
}


def _autotune_configs(kind: str) -> list[triton.Config]:
    """Candidate tile shapes for the GPU; the interpreter uses one fixed small config."""
    return [
        triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
        for block_m, block_n in _TILE_SHAPES[kind]
        for warps in (4, 8)
        for stages in (2, 3)
    ]


def _config_tuple(config: triton.Config) -> tuple[int, int, int, int]:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def _prune_configs(configs, named_args, kind: str, **kwargs):
    """Drop tile shapes that cannot run well for these inputs before autotuning compiles them."""
    widest = max(named_args["d_s"], named_args["d_t"])
    four_byte = named_args["Q"].element_size() == 4
    kept = configs
    if max(named_args["N_Q_BUCKET"], named_args["N_K_BUCKET"]) <= SHORT_SEQUENCE_BUCKET:
        kept = [c for c in kept if _config_tuple(c) in _SHORT_SEQUENCE_CANDIDATES[kind]]
    if widest > 128 or four_byte:
        # Wide heads and float32 operands need small tiles: larger ones exceed the
        # register file and shared memory, spill, and take minutes each to compile
        # (an fp32 autotuning pass over every config did not finish in 4 minutes on an H200).
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
    if four_byte:
        kept = [c for c in kept if c.num_stages <= 2]
    return kept or configs[:1]


_AUTOTUNE_KEY = ["N_Q_BUCKET", "N_K_BUCKET", "d_s", "d_t", "CAUSAL"]
# Autotuning costs seconds to a minute of compiling per new (dtype, head dims, causal,
# length bucket) combination; CL_STREAMKL_AUTOTUNE=0 uses the heuristic tiles below instead
# (correctness runs, short jobs). The interpreter never autotunes: timing it is meaningless.
AUTOTUNE = not INTERPRETING and os.environ.get("CL_STREAMKL_AUTOTUNE", "1") != "0"


def _heuristic_options(kind: str, widest_head_dim: int, element_size: int) -> dict:
    if INTERPRETING:
        return {"BLOCK_M": 16, "BLOCK_N": 16}
    # Shared memory holds the pipelined K tiles: 4-byte inputs and wide heads need smaller tiles.
    if widest_head_dim > 128 or element_size == 4:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if kind == "fwd":
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def _bench_in_cuda_graph(kernel_call, quantiles):
    """GPU time of one autotuning candidate, replayed from a CUDA graph.

    Triton's default benchmarker launches every call from Python. A kernel that runs
    for tens of microseconds (ViT lengths) finishes before the next launch arrives, so
    every candidate measures the same host latency and the pick is arbitrary: on the
    H200 it chose backward tiles 1.6x slower than the heuristic ones at 16x12x577x64.
    """
    return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)


_AUTOTUNE_PARAMETERS = inspect.signature(triton.autotune).parameters
_AUTOTUNE_OPTIONS = {
    # Triton keeps autotuning results on disk (keyed by GPU, Triton version, kernel source and
    # tuning key), so only the first process on a machine pays the benchmarking; every later
    # one compiles just the chosen tiles. Tritons before 3.4 lack the option and tune every process.
    **({"cache_results": True} if "cache_results" in _AUTOTUNE_PARAMETERS else {}),
    **({"do_bench": _bench_in_cuda_graph} if "do_bench" in _AUTOTUNE_PARAMETERS else {}),
}


def _tuned(kernel, kind: str, extra_keys: tuple[str, ...] = ()):
    if not AUTOTUNE:
        return kernel
    key = _AUTOTUNE_KEY + list(extra_keys)
    return triton.autotune(
        configs=_autotune_configs(kind),
        key=key,
        prune_configs_by={"early_config_prune": functools.partial(_prune_configs, kind=kind)},
        **_AUTOTUNE_OPTIONS,
    )(kernel)


_forward_kernel = KernelLauncher(_tuned(_attention_kl_fwd_kernel, "fwd"), replay=not INTERPRETING)
_backward_dq_kernel = KernelLauncher(
    _tuned(_attention_kl_bwd_dq_kernel, "bwd", ("TEACHER_GRAD",)), replay=not INTERPRETING
)
_backward_dk_kernel = KernelLauncher(
    _tuned(_attention_kl_bwd_dk_kernel, "bwd", ("TEACHER_GRAD",)), replay=not INTERPRETING
)


def _launch_options(kind: str, d_s: int, d_t: int, dtype: torch.dtype) -> dict:
    return {} if AUTOTUNE else _heuristic_options(kind, max(d_s, d_t), dtype.itemsize)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs are promised float32 math, so no TF32 rounding of the scores.
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and INTERPRETING:
        return "upcast"
    return "tf32"


def _strides3(tensor: torch.Tensor) -> tuple[int, int, int]:
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def _empty_gradient_for(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised gradient buffer for ``tensor``: same shape and dtype, same layout.

    Dense, in the stride order of ``tensor`` (``torch.empty_like``). When the penalty's
    input is a view the model also hands to ``F.scaled_dot_product_attention`` (timm:
    q/k of a permuted qkv projection), SDPA's backward returns its gradient in this
    layout, and the autograd engine adds the two; same layouts make that add one
    contiguous pass instead of a strided one. The kernels need a unit stride in the head
    dimension, so a layout without one (only possible with size-1 dimensions) falls back
    to contiguous.
    """
    gradient = torch.empty_like(tensor, memory_format=torch.preserve_format)
    if gradient.size(-1) > 1 and gradient.stride(-1) != 1:
        gradient = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return gradient


def _device_guard(tensor: torch.Tensor):
    # Triton launches on the current CUDA device, which need not be the inputs'.
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _problem_args(q, k, q_teacher, k_teacher, student_scale: float, teacher_scale: float) -> tuple:
    batch, heads, n_q, d_s = q.shape
    n_k, d_t = k.size(2), q_teacher.size(3)
    return (
        *_strides3(q),
        *_strides3(k),
        *_strides3(q_teacher),
        *_strides3(k_teacher),
        heads,
        n_q,
        n_k,
        d_s,
        d_t,
        student_scale * LOG2_E,
        teacher_scale * LOG2_E,
    )


def launch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    student_scale: float,
    teacher_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the forward kernel.

    Returns:
        row_kl, lse_student, lse_teacher: each (B, H, Nq) float32 contiguous; the
        log-sum-exps are in base 2 (log2 Σ 2^u with u = s·log2 e).
    """
    batch, heads, n_q, d_s = q.shape
    n_k, d_t = k.size(2), q_teacher.size(3)
    rows = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    lse_student = torch.empty_like(rows)
    lse_teacher = torch.empty_like(rows)
    with _device_guard(q):
        # Tiles and (batch, head) pairs share grid axis 0, tiles fastest, so B·H is
        # not capped by the 65535 limit of grid axes 1 and 2.
        _forward_kernel(
            (
                q,
                k,
                q_teacher,
                k_teacher,
                rows,
                lse_student,
                lse_teacher,
                *_problem_args(q, k, q_teacher, k_teacher, student_scale, teacher_scale),
                _length_bucket(n_q),
                _length_bucket(n_k),
            ),
            dict(
                CAUSAL=causal,
                DOT_PRECISION=_dot_precision(q.dtype),
                BLOCK_DS=_block_dim(d_s),
                BLOCK_DT=_block_dim(d_t),
            ),
            _launch_options("fwd", d_s, d_t, q.dtype),
            length=n_q,
            batch_heads=batch * heads,
            block="BLOCK_M",
        )
    return rows, lse_student, lse_teacher


def launch_backward(
    grad_rows: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    row_kl: torch.Tensor,
    lse_student: torch.Tensor,
    lse_teacher: torch.Tensor,
    student_scale: float,
    teacher_scale: float,
    causal: bool,
    teacher_grad: bool,
) -> list[torch.Tensor]:
    """Run the backward: the query-side kernel, then the key-side kernel.

    Each recomputes both probability tiles; neither uses atomics, so the gradients
    are deterministic (a single kernel adding dq up with atomics measured slower on
    the H200, see benchmarks/TUNING_NOTES.md).

    Args:
        grad_rows: upstream gradient of the per-row KL, (B, H, Nq), any strides.

    Returns:
        [dq, dk] or, with ``teacher_grad``, [dq, dk, dq_teacher, dk_teacher], each
        in its input's dtype and layout (:func:`_empty_gradient_for`).
    """
    batch, heads, n_q, d_s = q.shape
    n_k, d_t = k.size(2), q_teacher.size(3)
    grad_rows = grad_rows.float()
    grad_q = _empty_gradient_for(q)
    grad_k = _empty_gradient_for(k)
    if teacher_grad:
        grad_q_teacher = _empty_gradient_for(q_teacher)
        grad_k_teacher = _empty_gradient_for(k_teacher)
    else:
        # Never written: TEACHER_GRAD=False compiles the teacher stores away.
        grad_q_teacher = grad_k_teacher = grad_q
    common = (
        q,
        k,
        q_teacher,
        k_teacher,
        grad_rows,
        row_kl,
        lse_student,
        lse_teacher,
    )
    problem_args = _problem_args(q, k, q_teacher, k_teacher, student_scale, teacher_scale)
    input_strides, sizes_and_scales = problem_args[:12], problem_args[12:]

    def arguments(output: torch.Tensor, output_teacher: torch.Tensor) -> tuple:
        return (
            *common,
            output,
            output_teacher,
            *input_strides,
            *_strides3(grad_rows),
            *_strides3(output),
            *_strides3(output_teacher),
            *sizes_and_scales,
            student_scale,
            teacher_scale,
            _length_bucket(n_q),
            _length_bucket(n_k),
        )

    constants = dict(
        CAUSAL=causal,
        TEACHER_GRAD=teacher_grad,
        DOT_PRECISION=_dot_precision(q.dtype),
        BLOCK_DS=_block_dim(d_s),
        BLOCK_DT=_block_dim(d_t),
    )
    options = _launch_options("bwd", d_s, d_t, q.dtype)
    with _device_guard(q):
        _backward_dq_kernel(
            arguments(grad_q, grad_q_teacher), constants, options,
            length=n_q, batch_heads=batch * heads, block="BLOCK_M",
        )
        _backward_dk_kernel(
            arguments(grad_k, grad_k_teacher), constants, options,
            length=n_k, batch_heads=batch * heads, block="BLOCK_N",
        )
    if teacher_grad:
        return [grad_q, grad_k, grad_q_teacher, grad_k_teacher]
    return [grad_q, grad_k]


@torch.library.custom_op("cl_streamkl::attention_kl_fwd", mutates_args=())
def attention_kl_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    student_scale: float,
    teacher_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Custom op around :func:`launch_forward` (opaque to, but traceable by, torch.compile)."""
    return launch_forward(q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal)


@attention_kl_fwd_op.register_fake
def _attention_kl_fwd_fake(q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal):
    rows = q.new_empty(q.shape[:3], dtype=torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(rows)


@torch.library.custom_op("cl_streamkl::attention_kl_bwd", mutates_args=())
def attention_kl_bwd_op(
    grad_rows: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    row_kl: torch.Tensor,
    lse_student: torch.Tensor,
    lse_teacher: torch.Tensor,
    student_scale: float,
    teacher_scale: float,
    causal: bool,
    teacher_grad: bool,
) -> list[torch.Tensor]:
    """Custom op around :func:`launch_backward`."""
    return launch_backward(
        grad_rows,
        q,
        k,
        q_teacher,
        k_teacher,
        row_kl,
        lse_student,
        lse_teacher,
        student_scale,
        teacher_scale,
        causal,
        teacher_grad,
    )


@attention_kl_bwd_op.register_fake
def _attention_kl_bwd_fake(
    grad_rows, q, k, q_teacher, k_teacher, row_kl, lse_student, lse_teacher,
    student_scale, teacher_scale, causal, teacher_grad,
):
    grads = [_empty_gradient_for(q), _empty_gradient_for(k)]
    if teacher_grad:
        grads += [_empty_gradient_for(q_teacher), _empty_gradient_for(k_teacher)]
    return grads


def _save_for_backward(ctx, q, k, q_teacher, k_teacher, row_kl, lse_student, lse_teacher, options) -> None:
    teacher_grad = bool(q_teacher.requires_grad or k_teacher.requires_grad)
    # The per-row KL is needed only for the teacher's gradient; not keeping it
    # otherwise leaves 8 bytes per row (the two log-sum-exps) alive until backward.
    ctx.save_for_backward(q, k, q_teacher, k_teacher, lse_student, lse_teacher, row_kl if teacher_grad else None)
    ctx.options = options
    ctx.teacher_grad = teacher_grad


def _gradients(ctx, grad_rows: torch.Tensor | None, backward_fn) -> tuple:
    q, k, q_teacher, k_teacher, lse_student, lse_teacher, row_kl = ctx.saved_tensors
    if grad_rows is None:
        return (None,) * 7
    student_scale, teacher_scale, causal = ctx.options
    # A frozen teacher costs no teacher-gradient work: the kernels skip it entirely
    # and never read ROW_KL, so any float32 (B, H, Nq) tensor stands in for it.
    grads = backward_fn(
        grad_rows,
        q,
        k,
        q_teacher,
        k_teacher,
        lse_student if row_kl is None else row_kl,
        lse_student,
        lse_teacher,
        student_scale,
        teacher_scale,
        causal,
        ctx.teacher_grad,
    )
    grad_q_teacher, grad_k_teacher = (grads[2], grads[3]) if ctx.teacher_grad else (None, None)
    return grads[0], grads[1], grad_q_teacher, grad_k_teacher, None, None, None


def _setup_context(ctx, inputs, output):
    q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal = inputs
    row_kl, lse_student, lse_teacher = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse_student, lse_teacher)
    _save_for_backward(
        ctx, q, k, q_teacher, k_teacher, row_kl, lse_student, lse_teacher, (student_scale, teacher_scale, causal)
    )


def _op_backward(ctx, grad_rows, _grad_lse_student, _grad_lse_teacher):
    return _gradients(ctx, grad_rows, attention_kl_bwd_op)


attention_kl_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


class _AttentionKLFunction(torch.autograd.Function):
    """Eager-mode twin of the custom op: same launchers, a fraction of the dispatch cost.

    At ViT sizes (197 tokens) one kernel runs for tens of microseconds, so the
    custom-op dispatcher's overhead would dominate; torch.compile uses the op.
    """

    @staticmethod
    def forward(ctx, q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal):
        row_kl, lse_student, lse_teacher = launch_forward(
            q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal
        )
        ctx.set_materialize_grads(False)
        _save_for_backward(
            ctx, q, k, q_teacher, k_teacher, row_kl, lse_student, lse_teacher, (student_scale, teacher_scale, causal)
        )
        return row_kl

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_rows):
        return _gradients(ctx, grad_rows, launch_backward)


def attention_kl_rows_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    problem: AttentionKLProblem,
) -> torch.Tensor:
    """Per-row KL(P_teacher ‖ P_student), (B, H, Nq) float32, through the fused kernels.

    Inputs are validated by the caller (:func:`cl_streamkl.attention_kl`).
    """
    args = (q, k, q_teacher, k_teacher, problem.student_scale, problem.teacher_scale, problem.causal)
    if torch.compiler.is_compiling():
        return attention_kl_fwd_op(*args)[0]
    return _AttentionKLFunction.apply(*args)
