"""Launchers of the StreamKL kernels: allocate the outputs, pass strides and sizes, pick the grid.

Each kernel runs through a :class:`~cl_streamkl.kernels.triton.launch_cache.KernelLauncher`
(autotuned per :mod:`cl_streamkl.kernels.triton.tuning`), which replays the compiled kernel
after the first launch of each argument signature. The grouped launchers run L problems of
one shape in one launch per kernel (:mod:`cl_streamkl.kernels.triton.launch_grouped`); their
launcher objects live here with the others, so that code which inspects or wraps launchers
finds all of them in one module.
"""

from __future__ import annotations

import contextlib

import torch
import triton.language as tl

from cl_streamkl.kernels.backward_inputs import BackwardInputs
from cl_streamkl.kernels.config import ONE_PASS_MAX_HEAD_DIM, ONE_PASS_MIN_LENGTH, get_kernel_options
from cl_streamkl.kernels.triton.backward import (
    _attention_kl_bwd_dk_kernel,
    _attention_kl_bwd_dq_kernel,
    _attention_kl_grouped_bwd_kernel,
)
from cl_streamkl.kernels.triton.common import INTERPRETING
from cl_streamkl.kernels.triton.forward import _attention_kl_fwd_kernel, _attention_kl_grouped_fwd_kernel
from cl_streamkl.kernels.triton.launch_cache import KernelLauncher
from cl_streamkl.kernels.triton.tuning import block_dim, launch_options, length_bucket, tuned
from cl_streamkl.kernels.triton.variants import exp2_constants

LOG2_E = 1.4426950408889634


def _launcher(kernel, kind: str, extra_keys: tuple[str, ...] = ()) -> KernelLauncher:
    return KernelLauncher(tuned(kernel, kind, extra_keys), replay=not INTERPRETING)


# The known-log-sum-exp forward does other work per score: its own tuning key.
FORWARD_LAUNCHER = _launcher(_attention_kl_fwd_kernel, "fwd", ("KNOWN_LSE",))
BACKWARD_DQ_LAUNCHER = _launcher(_attention_kl_bwd_dq_kernel, "bwd", ("TEACHER_GRAD",))
BACKWARD_DK_LAUNCHER = _launcher(_attention_kl_bwd_dk_kernel, "bwd", ("TEACHER_GRAD", "ONE_PASS"))
# The fused forward (gradients with the KL, launch_fused) runs the key-side kernel with ROW_TERMS:
# its own tiles (tuning kind "fused") and replay cache.
FUSED_LAUNCHER = _launcher(_attention_kl_bwd_dk_kernel, "fused", ("ROW_TERMS",))
GROUPED_FORWARD_LAUNCHER = _launcher(_attention_kl_grouped_fwd_kernel, "fwd", ("KNOWN_LSE",))
# One grouped backward kernel serves both sides (KEY_SIDE), tuned per side; each side keeps its
# own launcher and replay cache.
_GROUPED_BACKWARD = tuned(_attention_kl_grouped_bwd_kernel, "bwd", ("TEACHER_GRAD", "KEY_SIDE", "ONE_PASS"))
GROUPED_BACKWARD_DQ_LAUNCHER = KernelLauncher(_GROUPED_BACKWARD, replay=not INTERPRETING)
GROUPED_BACKWARD_DK_LAUNCHER = KernelLauncher(_GROUPED_BACKWARD, replay=not INTERPRETING)
GROUPED_FUSED_LAUNCHER = KernelLauncher(
    tuned(_attention_kl_grouped_bwd_kernel, "fused", ("KEY_SIDE", "ROW_TERMS")), replay=not INTERPRETING
)
# By name, for code that inspects the launchers (their replay caches, the autotuned tiles).
KERNEL_LAUNCHERS = {
    "forward": FORWARD_LAUNCHER,
    "backward_dq": BACKWARD_DQ_LAUNCHER,
    "backward_dk": BACKWARD_DK_LAUNCHER,
    "grouped_forward": GROUPED_FORWARD_LAUNCHER,
    "grouped_backward_dq": GROUPED_BACKWARD_DQ_LAUNCHER,
    "grouped_backward_dk": GROUPED_BACKWARD_DK_LAUNCHER,
    "fused": FUSED_LAUNCHER,
    "grouped_fused": GROUPED_FUSED_LAUNCHER,
}

TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


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


def _problem_args(q, k, q_teacher, k_teacher, student_scale: float, teacher_scale: float, extra=()) -> tuple:
    """Strides of the four inputs (and of the ``extra`` tensors after them), sizes, base-2 scales."""
    batch, heads, n_q, d_s = q.shape
    n_k, d_t = k.size(2), q_teacher.size(3)
    return (
        *_strides3(q),
        *_strides3(k),
        *_strides3(q_teacher),
        *_strides3(k_teacher),
        *(stride for tensor in extra for stride in _strides3(tensor)),
        heads,
        n_q,
        n_k,
        d_s,
        d_t,
        student_scale * LOG2_E,
        teacher_scale * LOG2_E,
    )


def forward_constants(dtype: torch.dtype, d_s: int, d_t: int, causal: bool, known_lse: bool) -> dict:
    """Compile-time constants of a forward kernel."""
    return dict(
        KNOWN_LSE=known_lse,
        CAUSAL=causal,
        DOT_PRECISION=dot_precision(dtype),
        **exp2_constants(get_kernel_options(), backward=False, dtype=dtype),
        BLOCK_DS=block_dim(d_s),
        BLOCK_DT=block_dim(d_t),
    )


def one_pass_backward(n_q: int, n_k: int, head_dim: int, causal: bool) -> bool:
    """Whether the backward runs as one key-side kernel that also adds up dq (see ``kernels.config``).

    Args:
        n_q, n_k: query and key counts; head_dim: the wider of the two head dims; causal: masked.
    """
    options = get_kernel_options()
    if options.deterministic or options.backward == "split":
        return False
    if options.backward == "onepass":
        return True
    return (not causal and head_dim <= ONE_PASS_MAX_HEAD_DIM
            and min(n_q, n_k) >= ONE_PASS_MIN_LENGTH)


def backward_constants(
    dtype: torch.dtype, grad_rows: torch.Tensor, d_s: int, d_t: int, causal: bool, teacher_grad: bool, one_pass: bool,
    row_terms: bool = False,
) -> tuple[dict, dict]:
    """Compile-time constants of the dq kernel and of the dk kernel.

    With the grad-after-dot variant, the dk kernel multiplies by g after its loop only when g is
    the same along a (batch, head)'s rows: a row stride of 0, as a mean or sum hands back.
    ``row_terms``: the dk kernel also adds up the KL's row sums (the fused forward).
    """
    options = get_kernel_options()
    uniform_rows = grad_rows.stride(-1) == 0 or grad_rows.size(-1) == 1
    common = dict(CAUSAL=causal, TEACHER_GRAD=teacher_grad, DOT_PRECISION=dot_precision(dtype))
    tail = exp2_constants(options, backward=True, dtype=dtype)
    dims = dict(BLOCK_DS=block_dim(d_s), BLOCK_DT=block_dim(d_t))
    return (
        {**common, "GRAD_AFTER_DOT": options.grad_after_dot, **tail, **dims},
        {**common, "GRAD_AFTER_DOT": options.grad_after_dot and uniform_rows, **tail, "ONE_PASS": one_pass,
         "ROW_TERMS": row_terms, **dims},
    )


def unused_sum(device: torch.device) -> torch.Tensor:
    """What the backward kernels get as DQ_SUM or DQT_SUM when they never touch it.

    A one-element buffer of its own: the autotuner zeroes these arguments before the first
    launch of each tuning key (:func:`~cl_streamkl.kernels.triton.tuning.zeroed_arguments`), so
    a live tensor standing in (the log-sum-exps, say) would be zeroed before the kernel reads it.
    """
    return torch.empty(1, dtype=torch.float32, device=device)


def dq_sums(
    shapes: tuple[torch.Size, torch.Size], problems: int, device: torch.device, teacher_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-pass backward's float32 sums of dq and dq_teacher: zeros, [problems, B, H, Nq, D] each.

    Without teacher gradients the kernels never touch the second: :func:`unused_sum` stands in.
    """
    q_shape, q_teacher_shape = shapes
    dq_sum = torch.zeros((problems, *q_shape), dtype=torch.float32, device=device)
    if not teacher_grad:
        return dq_sum, unused_sum(device)
    return dq_sum, torch.zeros((problems, *q_teacher_shape), dtype=torch.float32, device=device)


def store_dq(sums: torch.Tensor, out: torch.Tensor, scale: float, grad_rows: torch.Tensor, times_grad: bool) -> None:
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
    lse: torch.Tensor | None = None,
    lse_teacher: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the forward kernel.

    Args:
        lse, lse_teacher: both or neither: the natural log-sum-exps of the student's and the
            teacher's score rows, (B, H, Nq) float32, any strides (``KNOWN_LSE``: one
            exponential per score).

    Returns:
        row_kl, lse_student, lse_teacher: each (B, H, Nq) float32 contiguous; the
        log-sum-exps are in base 2 (log2 Σ 2^u with u = s·log2 e).
    """
    batch, heads, n_q, d_s = q.shape
    n_k, d_t = k.size(2), q_teacher.size(3)
    rows = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    lse_student = torch.empty_like(rows)
    lse_teacher_out = torch.empty_like(rows)
    known_lse = lse is not None
    # Without given log-sum-exps the kernel never reads these pointers.
    given = (lse, lse_teacher) if known_lse else (rows, rows)
    with device_guard(q):
        FORWARD_LAUNCHER(
            (
                q,
                k,
                q_teacher,
                k_teacher,
                *given,
                rows,
                lse_student,
                lse_teacher_out,
                *_problem_args(q, k, q_teacher, k_teacher, student_scale, teacher_scale, given),
                length_bucket(n_q),
                length_bucket(n_k),
            ),
            forward_constants(q.dtype, d_s, d_t, causal, known_lse),
            launch_options("fwd", d_s, d_t, q.dtype),
            length=n_q,
            batch_heads=batch * heads,
            block="BLOCK_M",
        )
    return rows, lse_student, lse_teacher_out


def launch_backward(
    grad_rows: torch.Tensor, saved: BackwardInputs, row_sums: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Run the backward: the query-side kernel, then the key-side kernel.

    Each recomputes both probability tiles; neither uses atomics, so the gradients are
    deterministic. With ``kernel_options(backward="onepass")`` (and not ``deterministic``) the
    key-side kernel alone runs and also adds dq up in float32 with atomics (docs/tuning-log.md
    has its timings): 4·D bytes per query row more memory, a summation order that varies.

    Args:
        grad_rows: upstream gradient of the per-row KL, (B, H, Nq), any strides.
        saved: the forward's inputs, outputs and options, one tensor or scale each.
        row_sums: for the fused forward (:mod:`~cl_streamkl.kernels.triton.fused`) only: zeros,
            (B, H, Nq, 2) float32, into which the one-pass key-side kernel also adds the KL's row
            sums; it then runs on the fused launcher's tiles.

    Returns:
        [dq, dk] or, with ``teacher_grad``, [dq, dk, dq_teacher, dk_teacher], each
        in its input's dtype and layout (:func:`empty_gradient_for`).
    """
    (q, k, q_teacher, k_teacher, row_kl, lse_student, lse_teacher,
     student_scale, teacher_scale, causal, teacher_grad) = saved
    batch, heads, n_q, d_s = q.shape
    n_k, d_t = k.size(2), q_teacher.size(3)
    grad_rows = grad_rows.float()
    one_pass = row_sums is not None or one_pass_backward(n_q, n_k, max(d_s, d_t), causal)
    grad_q = empty_gradient_for(q)
    grad_k = empty_gradient_for(k)
    if teacher_grad:
        grad_q_teacher = empty_gradient_for(q_teacher)
        grad_k_teacher = empty_gradient_for(k_teacher)
    else:
        # Never written: TEACHER_GRAD=False compiles the teacher stores away.
        grad_q_teacher = grad_k_teacher = grad_q
    if one_pass:
        dq_sum, dq_teacher_sum = dq_sums((q.shape, q_teacher.shape), 1, q.device, teacher_grad)
    else:
        dq_sum = dq_teacher_sum = unused_sum(q.device)
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

    fused = row_sums is not None
    dq_constants, dk_constants = backward_constants(
        q.dtype, grad_rows, d_s, d_t, causal, teacher_grad, one_pass, row_terms=fused
    )
    options = launch_options("bwd", d_s, d_t, q.dtype)
    with device_guard(q):
        if not one_pass:
            BACKWARD_DQ_LAUNCHER(
                arguments(grad_q, grad_q_teacher), dq_constants, options,
                length=n_q, batch_heads=batch * heads, block="BLOCK_M",
            )
        (FUSED_LAUNCHER if fused else BACKWARD_DK_LAUNCHER)(
            arguments(grad_k, grad_k_teacher, dq_sum, dq_teacher_sum, row_sums if fused else unused_sum(q.device)),
            dk_constants, launch_options("fused", d_s, d_t, q.dtype) if fused else options,
            length=n_k, batch_heads=batch * heads, block="BLOCK_N",
        )
    if one_pass:
        times_grad = dk_constants["GRAD_AFTER_DOT"]
        store_dq(dq_sum[0], grad_q, student_scale, grad_rows, times_grad)
        if teacher_grad:
            store_dq(dq_teacher_sum[0], grad_q_teacher, teacher_scale, grad_rows, times_grad)
    if teacher_grad:
        return [grad_q, grad_k, grad_q_teacher, grad_k_teacher]
    return [grad_q, grad_k]

