"""Launchers of the grouped StreamKL kernels: L problems of one shape in one launch per kernel.

The launchers pass each problem's addresses, strides and scales in an int64 table
(``common.table_rows``) copied to the device once per launch. The launcher objects are those of
:mod:`cl_streamkl.kernels.triton.launch`, looked up there at each call.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from cl_streamkl.kernels.backward_inputs import BackwardInputs
from cl_streamkl.kernels.triton import launch
from cl_streamkl.kernels.triton.common import BACKWARD_TABLE_WIDTH, FORWARD_TABLE_WIDTH
from cl_streamkl.kernels.triton.launch import (
    LOG2_E,
    TRITON_DTYPES,
    backward_constants,
    device_guard,
    dq_sums,
    empty_gradient_for,
    forward_constants,
    one_pass_backward,
    store_dq,
    unused_sum,
)
from cl_streamkl.kernels.triton.tuning import grouped_launch_options, length_bucket

__all__ = ["launch_grouped_backward", "launch_grouped_forward"]


def _float_bits(values: Sequence[float]) -> tuple[int, ...]:
    """The float32 bit patterns of ``values``, as the kernels' ``table_scale`` reads them back."""
    return struct.unpack(f"<{len(values)}i", struct.pack(f"<{len(values)}f", *values))


def _table(
    tensors: Sequence[Sequence[torch.Tensor]], scales: Sequence[Sequence[float]], width: int
) -> tuple[torch.Tensor, bool]:
    """The int64 table of the grouped kernels (``common.table_rows``) on the inputs' device.

    Args:
        tensors: per problem, the tensors whose address and strides the kernels read.
        scales: per problem, the four scales (student and teacher base 2, then natural).
        width: entries per problem; unused entries stay 0.

    Returns:
        The [L, width] table and whether every address is a multiple of 16 bytes and every
        stride a multiple of 16 elements (``ALIGNED``).
    """
    # Built on the host at every launch (8 tensors × 12 blocks for a ViT's backward), so the
    # loop stays lean: the alignment is one OR over all entries (low 4 bits zero in each).
    values: list[int] = []
    bits = 0
    for problem_tensors, problem_scales in zip(tensors, scales):
        row = list(_float_bits(problem_scales))
        for tensor in problem_tensors:
            (b, h, n), (stride_b, stride_h, stride_n) = tensor.shape[:3], tensor.stride()[:3]
            # The stride of a size-1 dimension is never multiplied by more than 0.
            entries = (tensor.data_ptr(), stride_b if b > 1 else 0, stride_h if h > 1 else 0, stride_n if n > 1 else 0)
            row += entries
            bits |= entries[0] | entries[1] | entries[2] | entries[3]
        values += row
        values += [0] * (width - len(row))
    device = tensors[0][0].device
    # A pinned host copy travels asynchronously: no host sync per launch.
    table = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda").view(len(tensors), width)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # A CUDA graph replays the copy from this host buffer (its addresses are the graph's
        # own on every replay), so it must outlive the graph: keep it for the process.
        _CAPTURED_TABLES.append(table)
    return table.to(device, non_blocking=True), bits % 16 == 0


_CAPTURED_TABLES: list[torch.Tensor] = []


def _grouped_scales(student_scales: Sequence[float], teacher_scales: Sequence[float]) -> list[tuple[float, ...]]:
    return [
        (student * LOG2_E, teacher * LOG2_E, student, teacher)
        for student, teacher in zip(student_scales, teacher_scales)
    ]


def launch_grouped_forward(
    q: Sequence[torch.Tensor],
    k: Sequence[torch.Tensor],
    q_teacher: Sequence[torch.Tensor],
    k_teacher: Sequence[torch.Tensor],
    student_scales: Sequence[float],
    teacher_scales: Sequence[float],
    causal: bool,
    lse: torch.Tensor | None = None,
    lse_teacher: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the forward kernel once for L problems of one shape and dtype.

    Args:
        q, k, q_teacher, k_teacher: L tensors each, problem l being (q[l], k[l], ...) with the
            shapes of :func:`~cl_streamkl.kernels.triton.launch.launch_forward`; strides may
            differ from problem to problem.
        student_scales, teacher_scales: L scales each (scale / T, natural units).
        lse, lse_teacher: both or neither: the natural log-sum-exps of every problem's score
            rows, (L, B, H, Nq) float32 contiguous (one stacked tensor each: the kernel reads
            them at the outputs' offsets, with no table entries to build per launch).

    Returns:
        row_kl, lse_student, lse_teacher: each (L, B, H, Nq) float32 contiguous, the
        log-sum-exps in base 2.
    """
    batch, heads, n_q, d_s = q[0].shape
    n_k, d_t = k[0].size(2), q_teacher[0].size(3)
    rows = torch.empty((len(q), batch, heads, n_q), dtype=torch.float32, device=q[0].device)
    lse_student = torch.empty_like(rows)
    lse_teacher_out = torch.empty_like(rows)
    known_lse = lse is not None
    given = (lse, lse_teacher) if known_lse else (rows, rows)  # never read without KNOWN_LSE
    table, aligned = _table(
        list(zip(q, k, q_teacher, k_teacher)), _grouped_scales(student_scales, teacher_scales),
        FORWARD_TABLE_WIDTH.value,
    )
    with device_guard(q[0]):
        launch.GROUPED_FORWARD_LAUNCHER(
            (table, *given, rows, lse_student, lse_teacher_out, batch, heads, n_q, n_k, d_s, d_t,
             length_bucket(n_q), length_bucket(n_k)),
            dict(ELEMENT=TRITON_DTYPES[q[0].dtype], ALIGNED=aligned,
                 **forward_constants(q[0].dtype, d_s, d_t, causal, known_lse)),
            grouped_launch_options("fwd", n_q, n_k, d_s, d_t, q[0].dtype),
            length=n_q,
            batch_heads=len(q) * batch * heads,
            block="BLOCK_M",
        )
    return rows, lse_student, lse_teacher_out


def launch_grouped_backward(
    grad_rows: torch.Tensor, saved: BackwardInputs, row_sums: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Run the grouped backward: one dq launch and one dk launch for all L problems.

    With the one-pass backward (:func:`~cl_streamkl.kernels.triton.launch.launch_backward`), the dk launch alone.

    Args:
        grad_rows: upstream gradient of the per-row KL, (L, B, H, Nq), any strides.
        saved: the grouped forward's inputs and scales (a list over problems each), its
            outputs (L, B, H, Nq) and its options.
        row_sums: for the fused forward only: zeros, (L, B, H, Nq, 2) float32, as
            :func:`~cl_streamkl.kernels.triton.launch.launch_backward` takes them.

    Returns:
        dq of every problem, then dk of every problem (2L tensors) and, with
        ``teacher_grad``, dq_teacher and dk_teacher of every problem (4L), each in its
        input's dtype and layout (:func:`empty_gradient_for`).
    """
    (q, k, q_teacher, k_teacher, row_kl, lse_student, lse_teacher,
     student_scales, teacher_scales, causal, teacher_grad) = saved
    batch, heads, n_q, d_s = q[0].shape
    n_k, d_t = k[0].size(2), q_teacher[0].size(3)
    grad_rows = grad_rows.float()
    fused = row_sums is not None
    one_pass = fused or one_pass_backward(n_q, n_k, max(d_s, d_t), causal)
    grad_q = [empty_gradient_for(tensor) for tensor in q]
    grad_k = [empty_gradient_for(tensor) for tensor in k]
    if teacher_grad:
        grad_q_teacher = [empty_gradient_for(tensor) for tensor in q_teacher]
        grad_k_teacher = [empty_gradient_for(tensor) for tensor in k_teacher]
    else:
        # Never written: TEACHER_GRAD=False compiles the teacher stores away.
        grad_q_teacher, grad_k_teacher = grad_q, grad_k
    if one_pass:
        dq_sum, dq_teacher_sum = dq_sums((q[0].shape, q_teacher[0].shape), len(q), q[0].device, teacher_grad)
    else:
        dq_sum = dq_teacher_sum = unused_sum(q[0].device)
    table, aligned = _table(
        list(zip(q, k, q_teacher, k_teacher, grad_q, grad_q_teacher, grad_k, grad_k_teacher)),
        _grouped_scales(student_scales, teacher_scales),
        BACKWARD_TABLE_WIDTH.value,
    )
    arguments = (
        table, grad_rows, row_kl, lse_student, lse_teacher, dq_sum, dq_teacher_sum,
        row_sums if fused else unused_sum(q[0].device), *grad_rows.stride(),
        batch, heads, n_q, n_k, d_s, d_t, length_bucket(n_q), length_bucket(n_k),
    )
    table_constants = dict(ELEMENT=TRITON_DTYPES[q[0].dtype], ALIGNED=aligned)
    dq_constants, dk_constants = backward_constants(
        q[0].dtype, grad_rows, d_s, d_t, causal, teacher_grad, one_pass, row_terms=fused
    )
    dq_options, dk_options = (
        grouped_launch_options(kind, n_q, n_k, d_s, d_t, q[0].dtype) for kind in ("dq", "fused" if fused else "dk")
    )
    programs = len(q) * batch * heads
    with device_guard(q[0]):
        if not one_pass:
            launch.GROUPED_BACKWARD_DQ_LAUNCHER(
                arguments, {**table_constants, "KEY_SIDE": False, **dq_constants, "ONE_PASS": False,
                            "ROW_TERMS": False}, dq_options,
                length=n_q, batch_heads=programs, block="BLOCK_M",
            )
        (launch.GROUPED_FUSED_LAUNCHER if fused else launch.GROUPED_BACKWARD_DK_LAUNCHER)(
            arguments, {**table_constants, "KEY_SIDE": True, **dk_constants}, dk_options,
            length=n_k, batch_heads=programs, block="BLOCK_N",
        )
    if one_pass:
        times_grad = dk_constants["GRAD_AFTER_DOT"]
        for problem in range(len(q)):
            store_dq(dq_sum[problem], grad_q[problem], student_scales[problem], grad_rows[problem], times_grad)
            if teacher_grad:
                store_dq(dq_teacher_sum[problem], grad_q_teacher[problem], teacher_scales[problem],
                          grad_rows[problem], times_grad)
    grads = grad_q + grad_k
    if teacher_grad:
        grads += grad_q_teacher + grad_k_teacher
    return grads
