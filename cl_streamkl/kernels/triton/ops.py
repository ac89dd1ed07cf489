"""The kernels as ``torch.library`` custom ops and as an autograd Function, and the entry point.

The custom ops (with fake implementations) let ``torch.compile(fullgraph=True)`` trace
through; eager calls take the cheaper ``autograd.Function``. Both share one backward
formula. :func:`attention_kl_rows_triton` is what :func:`cl_streamkl.attention_kl` calls.
"""

from __future__ import annotations

import torch

from cl_streamkl.kernels.triton.launch import empty_gradient_for, launch_backward, launch_forward
from cl_streamkl.kernels.validation import AttentionKLProblem, refuse_double_backward


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
    grads = [empty_gradient_for(q), empty_gradient_for(k)]
    if teacher_grad:
        grads += [empty_gradient_for(q_teacher), empty_gradient_for(k_teacher)]
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
    def backward(ctx, grad_rows):
        refuse_double_backward()
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
