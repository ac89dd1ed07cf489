"""Launchers of the StreamKL kernels: allocate the outputs, pass strides and sizes, pick the grid.

Each kernel runs through a :class:`~cl_streamkl.kernels.triton.launch_cache.KernelLauncher`
(autotuned per :mod:`cl_streamkl.kernels.triton.tuning`), which replays the compiled kernel
after the first launch of each argument signature. The grouped launchers run L problems of
one shape in one launch per kernel: they pass each problem's addresses, strides and scales
in an int64 table (``common.table_rows``) copied to the device once per launch.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence

import torch
import triton.language as tl

from cl_streamkl.kernels.backward_inputs import BackwardInputs
from cl_streamkl.kernels.config import get_kernel_options
from cl_streamkl.kernels.triton.backward import (
    _attention_kl_bwd_dk_kernel,
    _attention_kl_bwd_dq_kernel,
    _attention_kl_grouped_bwd_kernel,
)
from cl_streamkl.kernels.triton.common import BACKWARD_TABLE_WIDTH, FORWARD_TABLE_WIDTH, INTERPRETING
from cl_streamkl.kernels.triton.forward import _attention_kl_fwd_kernel, _attention_kl_grouped_fwd_kernel
from cl_streamkl.kernels.triton.launch_cache import KernelLauncher
from cl_streamkl.kernels.triton.tuning import block_dim, grouped_launch_options, launch_options, length_bucket, tuned
from cl_streamkl.kernels.triton.variants import exp2_constants

LOG2_E = 1.4426950408889634

def _launcher(kernel, kind: str, extra_keys: tuple[str, ...] = ()) -> KernelLauncher:
    return KernelLauncher(tuned(kernel, kind, extra_keys), replay=not INTERPRETING)


FORWARD_LAUNCHER = _launcher(_attention_kl_fwd_kernel, "fwd")
BACKWARD_DQ_LAUNCHER = _launcher(_attention_kl_bwd_dq_kernel, "bwd", ("TEACHER_GRAD",))
BACKWARD_DK_LAUNCHER = _launcher(_attention_kl_bwd_dk_kernel, "bwd", ("TEACHER_GRAD", "ONE_PASS"))
GROUPED_FORWARD_LAUNCHER = _launcher(_attention_kl_grouped_fwd_kernel, "fwd")
# One grouped backward kernel serves both sides (KEY_SIDE), tuned per side; each side keeps its
# own launcher and replay cache.
_GROUPED_BACKWARD = tuned(_attention_kl_grouped_bwd_kernel, "bwd", ("TEACHER_GRAD", "KEY_SIDE", "ONE_PASS"))
GROUPED_BACKWARD_DQ_LAUNCHER = KernelLauncher(_GROUPED_BACKWARD, replay=not INTERPRETING)
GROUPED_BACKWARD_DK_LAUNCHER = KernelLauncher(_GROUPED_BACKWARD, replay=not INTERPRETING)
# By name, for code that inspects the launchers (their replay caches, the autotuned tiles).
KERNEL_LAUNCHERS = {
    "forward": FORWARD_LAUNCHER,
    "backward_dq": BACKWARD_DQ_LAUNCHER,
    "backward_dk": BACKWARD_DK_LAUNCHER,
    "grouped_forward": GROUPED_FORWARD_LAUNCHER,
    "grouped_backward_dq": GROUPED_BACKWARD_DQ_LAUNCHER,
    "grouped_backward_dk": GROUPED_BACKWARD_DK_LAUNCHER,
}

_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_precision(dtype: torch.dtype) -> str:
    """The ``DOT_PRECISION`` constant the kernels take for inputs of ``dtype``."""
    # float32 inputs are promised float32 math, so no TF32 rounding of the scores.
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and INTERPRETING:
        return "upcast"
    return "tf32"


def _strides3(tensor: torch.Tensor) -> tuple[int, int, int]:
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def empty_gradient_for(tensor: torch.Tensor) -> torch.Tensor:
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


def device_guard(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context that makes ``tensor``'s CUDA device current (nothing on other devices)."""
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


def _forward_constants(dtype: torch.dtype, d_s: int, d_t: int, causal: bool) -> dict:
    return dict(
        CAUSAL=causal,
        DOT_PRECISION=dot_precision(dtype),
        **exp2_constants(get_kernel_options(), backward=False, dtype=dtype),
        BLOCK_DS=block_dim(d_s),
        BLOCK_DT=block_dim(d_t),
    )


def one_pass_backward() -> bool:
    """Whether the backward runs as one key-side kernel that also adds up dq (see ``kernels.config``)."""
    options = get_kernel_options()
    return options.backward == "onepass" and not options.deterministic


def _backward_constants(
    dtype: torch.dtype, grad_rows: torch.Tensor, d_s: int, d_t: int, causal: bool, teacher_grad: bool, one_pass: bool
) -> tuple[dict, dict]:
    """Compile-time constants of the dq kernel and of the dk kernel.

    With the grad-after-dot variant, the dk kernel multiplies by g after its loop only when g is
    the same along a (batch, head)'s rows: a row stride of 0, as a mean or sum hands back.
    """
    options = get_kernel_options()
    uniform_rows = grad_rows.stride(-1) == 0 or grad_rows.size(-1) == 1
    common = dict(CAUSAL=causal, TEACHER_GRAD=teacher_grad, DOT_PRECISION=dot_precision(dtype))
    tail = exp2_constants(options, backward=True, dtype=dtype)
    dims = dict(BLOCK_DS=block_dim(d_s), BLOCK_DT=block_dim(d_t))
    return (
        {**common, "GRAD_AFTER_DOT": options.grad_after_dot, **tail, **dims},
        {**common, "GRAD_AFTER_DOT": options.grad_after_dot and uniform_rows, **tail, "ONE_PASS": one_pass, **dims},
    )


def _unused_sum(device: torch.device) -> torch.Tensor:
    """What the backward kernels get as DQ_SUM or DQT_SUM when they never touch it.

    A one-element buffer of its own: the autotuner zeroes these arguments before the first
    launch of each tuning key (:func:`~cl_streamkl.kernels.triton.tuning.zeroed_arguments`), so
    a live tensor standing in (the log-sum-exps, say) would be zeroed before the kernel reads it.
    """
    return torch.empty(1, dtype=torch.float32, device=device)


def _dq_sums(
    shapes: tuple[torch.Size, torch.Size], problems: int, device: torch.device, teacher_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-pass backward's float32 sums of dq and dq_teacher: zeros, [problems, B, H, Nq, D] each.

    Without teacher gradients the kernels never touch the second: :func:`_unused_sum` stands in.
    """
    q_shape, q_teacher_shape = shapes
    dq_sum = torch.zeros((problems, *q_shape), dtype=torch.float32, device=device)
    if not teacher_grad:
        return dq_sum, _unused_sum(device)
    return dq_sum, torch.zeros((problems, *q_teacher_shape), dtype=torch.float32, device=device)


def _store_dq(sums: torch.Tensor, out: torch.Tensor, scale: float, grad_rows: torch.Tensor, times_grad: bool) -> None:
    """out = sums · scale (· g per row when the key-side kernel left g out), in out's dtype and layout."""
    factor = grad_rows[..., None] * scale if times_grad else scale
    out.copy_(sums.mul_(factor))


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
    with device_guard(q):
        FORWARD_LAUNCHER(
            (
                q,
                k,
                q_teacher,
                k_teacher,
                rows,
                lse_student,
                lse_teacher,
                *_problem_args(q, k, q_teacher, k_teacher, student_scale, teacher_scale),
                length_bucket(n_q),
                length_bucket(n_k),
            ),
            _forward_constants(q.dtype, d_s, d_t, causal),
            launch_options("fwd", d_s, d_t, q.dtype),
            length=n_q,
            batch_heads=batch * heads,
            block="BLOCK_M",
        )
    return rows, lse_student, lse_teacher


def launch_backward(grad_rows: torch.Tensor, saved: BackwardInputs) -> list[torch.Tensor]:
    """Run the backward: the query-side kernel, then the key-side kernel.

    Each recomputes both probability tiles; neither uses atomics, so the gradients are
    deterministic. With ``kernel_options(backward="onepass")`` (and not ``deterministic``) the
    key-side kernel alone runs and also adds dq up in float32 with atomics (docs/tuning-log.md
    has its timings): 4·D bytes per query row more memory, a summation order that varies.

    Args:
        grad_rows: upstream gradient of the per-row KL, (B, H, Nq), any strides.
        saved: the forward's inputs, outputs and options, one tensor or scale each.

    Returns:
        [dq, dk] or, with ``teacher_grad``, [dq, dk, dq_teacher, dk_teacher], each
        in its input's dtype and layout (:func:`empty_gradient_for`).
    """
    (q, k, q_teacher, k_teacher, row_kl, lse_student, lse_teacher,
     student_scale, teacher_scale, causal, teacher_grad) = saved
    batch, heads, n_q, d_s = q.shape
    n_k, d_t = k.size(2), q_teacher.size(3)
    grad_rows = grad_rows.float()
    one_pass = one_pass_backward()
    grad_q = empty_gradient_for(q)
    grad_k = empty_gradient_for(k)
    if teacher_grad:
        grad_q_teacher = empty_gradient_for(q_teacher)
        grad_k_teacher = empty_gradient_for(k_teacher)
    else:
        # Never written: TEACHER_GRAD=False compiles the teacher stores away.
        grad_q_teacher = grad_k_teacher = grad_q
    if one_pass:
        dq_sum, dq_teacher_sum = _dq_sums((q.shape, q_teacher.shape), 1, q.device, teacher_grad)
    else:
        dq_sum = dq_teacher_sum = _unused_sum(q.device)
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

    def arguments(output: torch.Tensor, output_teacher: torch.Tensor, *sums: torch.Tensor) -> tuple:
        return (
            *common,
            output,
            output_teacher,
            *sums,
            *input_strides,
            *_strides3(grad_rows),
            *_strides3(output),
            *_strides3(output_teacher),
            *sizes_and_scales,
            student_scale,
            teacher_scale,
            length_bucket(n_q),
            length_bucket(n_k),
        )

    dq_constants, dk_constants = _backward_constants(q.dtype, grad_rows, d_s, d_t, causal, teacher_grad, one_pass)
    options = launch_options("bwd", d_s, d_t, q.dtype)
    with device_guard(q):
        if not one_pass:
            BACKWARD_DQ_LAUNCHER(
                arguments(grad_q, grad_q_teacher), dq_constants, options,
                length=n_q, batch_heads=batch * heads, block="BLOCK_M",
            )
        BACKWARD_DK_LAUNCHER(
            arguments(grad_k, grad_k_teacher, dq_sum, dq_teacher_sum), dk_constants, options,
            length=n_k, batch_heads=batch * heads, block="BLOCK_N",
        )
    if one_pass:
        times_grad = dk_constants["GRAD_AFTER_DOT"]
        _store_dq(dq_sum[0], grad_q, student_scale, grad_rows, times_grad)
        if teacher_grad:
            _store_dq(dq_teacher_sum[0], grad_q_teacher, teacher_scale, grad_rows, times_grad)
    if teacher_grad:
        return [grad_q, grad_k, grad_q_teacher, grad_k_teacher]
    return [grad_q, grad_k]


def _float_bits(value: float) -> int:
    """The float32 bit pattern of ``value``, as the kernels' ``table_scale`` reads it back."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


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
    values: list[int] = []
    aligned = True
    for problem_tensors, problem_scales in zip(tensors, scales):
        row = [_float_bits(scale) for scale in problem_scales]
        for tensor in problem_tensors:
            # The stride of a size-1 dimension is never multiplied by more than 0.
            strides = [stride if size > 1 else 0 for size, stride in zip(tensor.shape[:3], tensor.stride()[:3])]
            row += [tensor.data_ptr(), *strides]
            aligned = aligned and tensor.data_ptr() % 16 == 0 and all(stride % 16 == 0 for stride in strides)
        values += row + [0] * (width - len(row))
    device = tensors[0][0].device
    # A pinned host copy travels asynchronously: no host sync per launch.
    table = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda").view(len(tensors), width)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # A CUDA graph replays the copy from this host buffer (its addresses are the graph's
        # own on every replay), so it must outlive the graph: keep it for the process.
        _CAPTURED_TABLES.append(table)
    return table.to(device, non_blocking=True), aligned


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the forward kernel once for L problems of one shape and dtype.

    Args:
        q, k, q_teacher, k_teacher: L tensors each, problem l being (q[l], k[l], ...) with the
            shapes of :func:`launch_forward`; strides may differ from problem to problem.
        student_scales, teacher_scales: L scales each (scale / T, natural units).

    Returns:
        row_kl, lse_student, lse_teacher: each (L, B, H, Nq) float32 contiguous, the
        log-sum-exps in base 2.
    """
    batch, heads, n_q, d_s = q[0].shape
    n_k, d_t = k[0].size(2), q_teacher[0].size(3)
    rows = torch.empty((len(q), batch, heads, n_q), dtype=torch.float32, device=q[0].device)
    lse_student = torch.empty_like(rows)
    lse_teacher = torch.empty_like(rows)
    table, aligned = _table(
        list(zip(q, k, q_teacher, k_teacher)), _grouped_scales(student_scales, teacher_scales),
        FORWARD_TABLE_WIDTH.value,
    )
    with device_guard(q[0]):
        GROUPED_FORWARD_LAUNCHER(
            (table, rows, lse_student, lse_teacher, batch, heads, n_q, n_k, d_s, d_t,
             length_bucket(n_q), length_bucket(n_k)),
            dict(ELEMENT=_TRITON_DTYPES[q[0].dtype], ALIGNED=aligned, **_forward_constants(q[0].dtype, d_s, d_t, causal)),
            grouped_launch_options("fwd", n_q, n_k, d_s, d_t, q[0].dtype),
            length=n_q,
            batch_heads=len(q) * batch * heads,
            block="BLOCK_M",
        )
    return rows, lse_student, lse_teacher


def launch_grouped_backward(grad_rows: torch.Tensor, saved: BackwardInputs) -> list[torch.Tensor]:
    """Run the grouped backward: one dq launch and one dk launch for all L problems.

    With the one-pass backward (:func:`launch_backward`), the dk launch alone.

    Args:
        grad_rows: upstream gradient of the per-row KL, (L, B, H, Nq), any strides.
        saved: the grouped forward's inputs and scales (a list over problems each), its
            outputs (L, B, H, Nq) and its options.

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
    one_pass = one_pass_backward()
    grad_q = [empty_gradient_for(tensor) for tensor in q]
    grad_k = [empty_gradient_for(tensor) for tensor in k]
    if teacher_grad:
        grad_q_teacher = [empty_gradient_for(tensor) for tensor in q_teacher]
        grad_k_teacher = [empty_gradient_for(tensor) for tensor in k_teacher]
    else:
        # Never written: TEACHER_GRAD=False compiles the teacher stores away.
        grad_q_teacher, grad_k_teacher = grad_q, grad_k
    if one_pass:
        dq_sum, dq_teacher_sum = _dq_sums((q[0].shape, q_teacher[0].shape), len(q), q[0].device, teacher_grad)
    else:
        dq_sum = dq_teacher_sum = _unused_sum(q[0].device)
    table, aligned = _table(
        list(zip(q, k, q_teacher, k_teacher, grad_q, grad_q_teacher, grad_k, grad_k_teacher)),
        _grouped_scales(student_scales, teacher_scales),
        BACKWARD_TABLE_WIDTH.value,
    )
    arguments = (
        table, grad_rows, row_kl, lse_student, lse_teacher, dq_sum, dq_teacher_sum, *grad_rows.stride(),
        batch, heads, n_q, n_k, d_s, d_t, length_bucket(n_q), length_bucket(n_k),
    )
    table_constants = dict(ELEMENT=_TRITON_DTYPES[q[0].dtype], ALIGNED=aligned)
    dq_constants, dk_constants = _backward_constants(q[0].dtype, grad_rows, d_s, d_t, causal, teacher_grad, one_pass)
    dq_options, dk_options = (grouped_launch_options(kind, n_q, n_k, d_s, d_t, q[0].dtype) for kind in ("dq", "dk"))
    programs = len(q) * batch * heads
    with device_guard(q[0]):
        if not one_pass:
            GROUPED_BACKWARD_DQ_LAUNCHER(
                arguments, {**table_constants, "KEY_SIDE": False, **dq_constants, "ONE_PASS": False}, dq_options,
                length=n_q, batch_heads=programs, block="BLOCK_M",
            )
        GROUPED_BACKWARD_DK_LAUNCHER(
            arguments, {**table_constants, "KEY_SIDE": True, **dk_constants}, dk_options,
            length=n_k, batch_heads=programs, block="BLOCK_N",
        )
    if one_pass:
        times_grad = dk_constants["GRAD_AFTER_DOT"]
        for problem in range(len(q)):
            _store_dq(dq_sum[problem], grad_q[problem], student_scales[problem], grad_rows[problem], times_grad)
            if teacher_grad:
                _store_dq(dq_teacher_sum[problem], grad_q_teacher[problem], teacher_scales[problem],
                          grad_rows[problem], times_grad)
    grads = grad_q + grad_k
    if teacher_grad:
        grads += grad_q_teacher + grad_k_teacher
    return grads
