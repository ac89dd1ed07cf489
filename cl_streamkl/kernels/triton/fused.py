"""The fused forward: a scalar KL and its gradients in one pass, when both log-sum-exps are given.

With the log-sum-exps of both sides known (the models' own attention computed them) and a
scalar reduction (sum, mean or batchmean), the upstream gradient g is one number per problem,
unknown in the forward but only a factor. So the forward runs the one-pass key-side backward
kernel with g = 1 (per score tile: 2 products for the scores, 2 exponentials, 2 products for dq
and dk) and lets it add up the KL's two row sums as well, gap_i = Σ_j p̂_t·(log2 p̂_t − log2 p_s)
and σ_i = Σ_j p̂_t with p̂_t = 2^(u_t − lse_t):

    KL_i = ln 2 · (gap_i / σ_i − log2 σ_i),

the teacher's probabilities renormalised by σ as in the known-log-sum-exp forward. dq and dk
are kept, in q's and k's dtype and layout, and the backward only multiplies them by g. Their
teacher probabilities are 2^(u_t − lse_t) unrenormalised (σ comes only at the end of the pass):
exact when ``lse_teacher`` is the teacher's log-sum-exp to rounding, as attention's is.

Work per score: 4 products and 2 exponentials, against 2 + 1 for the forward and 4 + 2 for the
one-pass backward run after it. Memory kept from forward to backward: dq and dk (the size of q
and k); transient in the forward: the float32 sum of dq (4·D bytes per query row) and the row
sums (8 bytes per row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cl_streamkl.kernels.backward_inputs import BackwardInputs
from cl_streamkl.kernels.triton.launch import LOG2_E, empty_gradient_for, launch_backward
from cl_streamkl.kernels.triton.launch_grouped import launch_grouped_backward
from cl_streamkl.kernels.validation import AttentionKLProblem, refuse_double_backward

LN_2 = 0.6931471805599453


def _row_kl(row_sums: torch.Tensor) -> torch.Tensor:
    """KL_i = ln 2 · (gap_i / σ_i − log2 σ_i) from the kernel's row sums, (..., 2) → (...)."""
    gap, total = row_sums.unbind(-1)
    return (gap / total - torch.log2(total)) * LN_2


def launch_fused(
    q: torch.Tensor, k: torch.Tensor, q_teacher: torch.Tensor, k_teacher: torch.Tensor,
    student_scale: float, teacher_scale: float, causal: bool, lse: torch.Tensor, lse_teacher: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row KL and the gradients of its sum, in one launch.

    Args:
        q, k, q_teacher, k_teacher: as :func:`~cl_streamkl.kernels.triton.launch.launch_forward` takes them.
        student_scale, teacher_scale: scale / T of each side, natural units.
        causal: mask key j > query i.
        lse, lse_teacher: the natural log-sum-exps of both sides' score rows, (B, H, Nq) float32.

    Returns:
        row_kl (B, H, Nq) float32; dq and dk, the gradients of Σ row_kl with respect to q and
        k, in their dtype and layout (:func:`~cl_streamkl.kernels.triton.launch.empty_gradient_for`).
    """
    row_sums = torch.zeros((*q.shape[:3], 2), dtype=torch.float32, device=q.device)
    base2 = (lse * LOG2_E).contiguous(), (lse_teacher * LOG2_E).contiguous()
    # g = 1 for every row: a stride-0 gradient, which the kernel multiplies once after its loop.
    ones = torch.ones((), dtype=torch.float32, device=q.device).expand(q.shape[:3])
    saved = BackwardInputs(q, k, q_teacher, k_teacher, base2[0], *base2, student_scale, teacher_scale, causal, False)
    grad_q, grad_k = launch_backward(ones, saved, row_sums)
    return _row_kl(row_sums), grad_q, grad_k


def launch_grouped_fused(
    q: Sequence[torch.Tensor], k: Sequence[torch.Tensor], q_teacher: Sequence[torch.Tensor],
    k_teacher: Sequence[torch.Tensor], student_scales: Sequence[float], teacher_scales: Sequence[float],
    causal: bool, lse: torch.Tensor, lse_teacher: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """:func:`launch_fused` of L problems of one shape in one launch.

    Args:
        lse, lse_teacher: every problem's natural log-sum-exps, stacked: (L, B, H, Nq) float32.

    Returns:
        row_kl (L, B, H, Nq) float32, then dq and dk of every problem (lists of L).
    """
    row_sums = torch.zeros((len(q), *q[0].shape[:3], 2), dtype=torch.float32, device=q[0].device)
    base2 = (lse * LOG2_E).contiguous(), (lse_teacher * LOG2_E).contiguous()
    ones = torch.ones((), dtype=torch.float32, device=q[0].device).expand(row_sums.shape[:-1])
    saved = BackwardInputs(
        list(q), list(k), list(q_teacher), list(k_teacher), base2[0], *base2, list(student_scales),
        list(teacher_scales), causal, False,
    )
    grads = launch_grouped_backward(ones, saved, row_sums)
    return _row_kl(row_sums), grads[: len(q)], grads[len(q):]


def _fused_schema(inputs: str, scales: str, gradients: str) -> str:
    """A fused op's schema: the forward's arguments and the reduction's weight, the scalar KL and the gradients."""
    arguments = [*(f"{inputs} {name}" for name in ("q", "k", "q_teacher", "k_teacher")), f"{scales} student_scale",
                 f"{scales} teacher_scale", "bool causal", "Tensor lse", "Tensor lse_teacher", "float weight"]
    return f"({', '.join(arguments)}) -> (Tensor, {gradients}, {gradients})"


def _fused(q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal, lse, lse_teacher, weight):
    """weight · Σ_rows KL and the unweighted gradients of Σ_rows KL (:func:`launch_fused`): the custom op
    and its eager twin."""
    row_kl, grad_q, grad_k = launch_fused(q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal, lse,
                                          lse_teacher)
    return row_kl.sum() * weight, grad_q, grad_k


attention_kl_fused_op = torch.library.custom_op(
    "cl_streamkl::attention_kl_fused", mutates_args=(), schema=_fused_schema("Tensor", "float", "Tensor")
)(_fused)


@attention_kl_fused_op.register_fake
def _attention_kl_fused_fake(q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal, lse, lse_teacher,
                             weight):
    return q.new_empty((), dtype=torch.float32), empty_gradient_for(q), empty_gradient_for(k)


def _grouped_fused(q, k, q_teacher, k_teacher, student_scales, teacher_scales, causal, lse, lse_teacher, weight):
    """Per problem weight · Σ_rows KL, (L,), and every problem's gradients (:func:`launch_grouped_fused`): the
    custom op and its eager twin."""
    row_kl, grad_q, grad_k = launch_grouped_fused(q, k, q_teacher, k_teacher, student_scales, teacher_scales, causal,
                                                  lse, lse_teacher)
    return row_kl.flatten(1).sum(-1) * weight, grad_q, grad_k


attention_kl_grouped_fused_op = torch.library.custom_op(
    "cl_streamkl::attention_kl_grouped_fused", mutates_args=(), schema=_fused_schema("Tensor[]", "float[]", "Tensor[]")
)(_grouped_fused)


@attention_kl_grouped_fused_op.register_fake
def _attention_kl_grouped_fused_fake(q, k, q_teacher, k_teacher, student_scales, teacher_scales, causal, lse,
                                     lse_teacher, weight):
    return (q[0].new_empty((len(q),), dtype=torch.float32), [empty_gradient_for(t) for t in q],
            [empty_gradient_for(t) for t in k])


def _scaled(grads: Sequence[torch.Tensor], factors: torch.Tensor) -> list[torch.Tensor]:
    """grads[l] · factors[l], new tensors in each gradient's dtype and layout (the saved ones stay
    as they are: a backward run again under ``retain_graph`` scales them again from scratch)."""
    return list(torch._foreach_mul(list(grads), list(factors.unbind(0))))


def _setup_fused(ctx, inputs, output):
    ctx.weight = inputs[-1]
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(output[1], output[2])


def _fused_backward(ctx, grad_loss, _grad_q, _grad_k):
    grad_q, grad_k = ctx.saved_tensors
    factor = grad_loss * ctx.weight
    return grad_q * factor, grad_k * factor, *(None,) * 8


attention_kl_fused_op.register_autograd(_fused_backward, setup_context=_setup_fused)


def _setup_grouped_fused(ctx, inputs, output):
    ctx.weight = inputs[-1]
    ctx.problems = len(output[1])
    ctx.mark_non_differentiable(*output[1], *output[2])
    ctx.save_for_backward(*output[1], *output[2])


def _grouped_fused_backward(ctx, grad_loss, _grad_q, _grad_k):
    saved, factors, frozen = ctx.saved_tensors, grad_loss * ctx.weight, [None] * ctx.problems
    # A list input takes a list of gradients, one (or None) per tensor.
    return _scaled(saved[:ctx.problems], factors), _scaled(saved[ctx.problems:], factors), frozen, frozen, *(None,) * 6


attention_kl_grouped_fused_op.register_autograd(_grouped_fused_backward, setup_context=_setup_grouped_fused)


class _FusedFunction(torch.autograd.Function):
    """Eager twin of :func:`attention_kl_fused_op` (a fraction of the dispatch cost)."""

    @staticmethod
    def forward(ctx, *inputs):
        value, grad_q, grad_k = _fused(*inputs)
        ctx.weight = inputs[-1]
        ctx.save_for_backward(grad_q, grad_k)
        return value

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward()
        return _fused_backward(ctx, grad_loss, None, None)


class _GroupedFusedFunction(torch.autograd.Function):
    """Eager twin of :func:`attention_kl_grouped_fused_op`; inputs are q, k, q_t, k_t of each problem in turn."""

    @staticmethod
    def forward(ctx, student_scales, teacher_scales, causal, lse, lse_teacher, weight, *inputs):
        roles = [inputs[index::4] for index in range(4)]
        value, grad_q, grad_k = _grouped_fused(*roles, student_scales, teacher_scales, causal, lse, lse_teacher, weight)
        ctx.weight = weight
        ctx.problems = len(grad_q)
        ctx.save_for_backward(*grad_q, *grad_k)
        return value

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward()
        saved, factors = ctx.saved_tensors, grad_loss * ctx.weight
        grad_q, grad_k = _scaled(saved[:ctx.problems], factors), _scaled(saved[ctx.problems:], factors)
        return (None,) * 6 + tuple(grad for pair in zip(grad_q, grad_k) for grad in (*pair, None, None))


def attention_kl_fused_triton(
    q: torch.Tensor, k: torch.Tensor, q_teacher: torch.Tensor, k_teacher: torch.Tensor,
    problem: AttentionKLProblem, lse: torch.Tensor, lse_teacher: torch.Tensor, weight: float,
) -> torch.Tensor:
    """weight · Σ_rows KL(P_teacher ‖ P_student), a float32 scalar whose gradients come from the forward pass.

    Inputs are validated by the caller (:func:`cl_streamkl.attention_kl`), the log-sum-exps too.
    """
    args = (q, k, q_teacher, k_teacher, problem.student_scale, problem.teacher_scale, problem.causal, lse,
            lse_teacher, weight)
    if torch.compiler.is_compiling():
        return attention_kl_fused_op(*args)[0]
    return _FusedFunction.apply(*args)


def attention_kl_fused_triton_grouped(
    inputs: Sequence[Sequence[torch.Tensor]], problems: Sequence[AttentionKLProblem],
    lse: torch.Tensor, lse_teacher: torch.Tensor, weight: float,
) -> torch.Tensor:
    """Per problem weight · Σ_rows KL, (L,) float32, of L problems of one shape in one launch.

    Args:
        inputs: per problem (q, k, q_teacher, k_teacher), validated by the caller.
        problems: per problem its sizes and scales; ``causal`` is the same in all.
        lse, lse_teacher: every problem's natural log-sum-exps, (L, B, H, Nq) float32.
        weight: the reduction's factor (1 for a sum, 1 / rows for a mean, 1 / B for batchmean).
    """
    student_scales = [problem.student_scale for problem in problems]
    teacher_scales = [problem.teacher_scale for problem in problems]
    options = (student_scales, teacher_scales, problems[0].causal, lse, lse_teacher, weight)
    if torch.compiler.is_compiling():
        roles = [[problem[index] for problem in inputs] for index in range(4)]
        return attention_kl_grouped_fused_op(*roles, *options)[0]
    return _GroupedFusedFunction.apply(*options, *(tensor for problem in inputs for tensor in problem))
