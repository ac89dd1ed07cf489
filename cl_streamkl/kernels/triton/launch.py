"""Launchers of the StreamKL kernels: allocate the outputs, pass strides and sizes, pick the grid.

Each kernel runs through a :class:`~cl_streamkl.kernels.triton.launch_cache.KernelLauncher`
(autotuned per :mod:`cl_streamkl.kernels.triton.tuning`), which replays the compiled kernel
after the first launch of each argument signature.
"""

from __future__ import annotations

import contextlib

import torch

from cl_streamkl.kernels.triton.backward import _attention_kl_bwd_dk_kernel, _attention_kl_bwd_dq_kernel
from cl_streamkl.kernels.triton.common import INTERPRETING
from cl_streamkl.kernels.triton.forward import _attention_kl_fwd_kernel
from cl_streamkl.kernels.triton.launch_cache import KernelLauncher
from cl_streamkl.kernels.triton.tuning import block_dim, launch_options, length_bucket, tuned

LOG2_E = 1.4426950408889634


FORWARD_LAUNCHER = KernelLauncher(tuned(_attention_kl_fwd_kernel, "fwd"), replay=not INTERPRETING)
BACKWARD_DQ_LAUNCHER = KernelLauncher(
    tuned(_attention_kl_bwd_dq_kernel, "bwd", ("TEACHER_GRAD",)), replay=not INTERPRETING
)
BACKWARD_DK_LAUNCHER = KernelLauncher(
    tuned(_attention_kl_bwd_dk_kernel, "bwd", ("TEACHER_GRAD",)), replay=not INTERPRETING
)
# By name, for code that inspects the launchers (their replay caches, the autotuned tiles).
KERNEL_LAUNCHERS = {
    "forward": FORWARD_LAUNCHER,
    "backward_dq": BACKWARD_DQ_LAUNCHER,
    "backward_dk": BACKWARD_DK_LAUNCHER,
}


def _dot_precision(dtype: torch.dtype) -> str:
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
            dict(
                CAUSAL=causal,
                DOT_PRECISION=_dot_precision(q.dtype),
                BLOCK_DS=block_dim(d_s),
                BLOCK_DT=block_dim(d_t),
            ),
            launch_options("fwd", d_s, d_t, q.dtype),
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
        in its input's dtype and layout (:func:`empty_gradient_for`).
    """
    batch, heads, n_q, d_s = q.shape
    n_k, d_t = k.size(2), q_teacher.size(3)
    grad_rows = grad_rows.float()
    grad_q = empty_gradient_for(q)
    grad_k = empty_gradient_for(k)
    if teacher_grad:
        grad_q_teacher = empty_gradient_for(q_teacher)
        grad_k_teacher = empty_gradient_for(k_teacher)
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
            length_bucket(n_q),
            length_bucket(n_k),
        )

    constants = dict(
        CAUSAL=causal,
        TEACHER_GRAD=teacher_grad,
        DOT_PRECISION=_dot_precision(q.dtype),
        BLOCK_DS=block_dim(d_s),
        BLOCK_DT=block_dim(d_t),
    )
    options = launch_options("bwd", d_s, d_t, q.dtype)
    with _device_guard(q):
        BACKWARD_DQ_LAUNCHER(
            arguments(grad_q, grad_q_teacher), constants, options,
            length=n_q, batch_heads=batch * heads, block="BLOCK_M",
        )
        BACKWARD_DK_LAUNCHER(
            arguments(grad_k, grad_k_teacher), constants, options,
            length=n_k, batch_heads=batch * heads, block="BLOCK_N",
        )
    if teacher_grad:
        return [grad_q, grad_k, grad_q_teacher, grad_k_teacher]
    return [grad_q, grad_k]

