"""The kernels as ``torch.library`` custom ops and as autograd Functions, and the entry points.

The custom ops (with fake implementations) let ``torch.compile(fullgraph=True)`` trace
through; eager calls take the cheaper ``autograd.Function``. Both share one backward
formula. :func:`attention_kl_rows_triton` is what :func:`cl_streamkl.attention_kl` calls and
:func:`attention_kl_rows_triton_grouped` what :func:`cl_streamkl.attention_kl_grouped` calls:
L problems, one launch per kernel and one autograd node.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cl_streamkl.kernels.backward_inputs import BackwardInputs
from cl_streamkl.kernels.triton.launch import empty_gradient_for, launch_backward, launch_forward
from cl_streamkl.kernels.triton.launch_grouped import launch_grouped_backward, launch_grouped_forward
from cl_streamkl.kernels.validation import AttentionKLProblem, refuse_double_backward


def _forward_schema(inputs: str, scales: str, lse: str) -> str:
    """A forward op's schema (written out: its optional log-sum-exps need the same spelling on every torch)."""
    tensors = ", ".join(f"{inputs} {name}" for name in ("q", "k", "q_teacher", "k_teacher"))
    return (f"({tensors}, {scales} student_scale, {scales} teacher_scale, bool causal, {lse} lse, "
            f"{lse} lse_teacher) -> (Tensor, Tensor, Tensor)")


@torch.library.custom_op(
    "cl_streamkl::attention_kl_fwd", mutates_args=(), schema=_forward_schema("Tensor", "float", "Tensor?")
)
def attention_kl_fwd_op(q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal, lse, lse_teacher):
    """Custom op around :func:`launch_forward` (opaque to, but traceable by, torch.compile)."""
    return launch_forward(q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal, lse, lse_teacher)


@attention_kl_fwd_op.register_fake
def _attention_kl_fwd_fake(q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal, lse, lse_teacher):
    rows = q.new_empty(q.shape[:3], dtype=torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(rows)


def _backward_schema(inputs: str, scales: str) -> str:
    """The backward op's schema: torch.library needs the :class:`BackwardInputs` fields flat.

    Args:
        inputs: the schema type of q, k, q_teacher and k_teacher ("Tensor" or "Tensor[]").
        scales: that of the two scales ("float" or "float[]").
    """
    types = dict.fromkeys(BackwardInputs._fields, "Tensor")
    types.update(q=inputs, k=inputs, q_teacher=inputs, k_teacher=inputs, student_scale=scales, teacher_scale=scales,
                 causal="bool", teacher_grad="bool")
    fields = ", ".join(f"{types[name]} {name}" for name in BackwardInputs._fields)
    return f"(Tensor grad_rows, {fields}) -> Tensor[]"


def _differentiated_roles(fields: tuple) -> tuple:
    """Of the backward's :class:`BackwardInputs` fields, the roles that get gradients, in the
    backward's output order: q, k, and with the teacher's gradient q_teacher, k_teacher."""
    saved = BackwardInputs(*fields)
    return (saved.q, saved.k, saved.q_teacher, saved.k_teacher) if saved.teacher_grad else (saved.q, saved.k)


@torch.library.custom_op("cl_streamkl::attention_kl_bwd", mutates_args=(), schema=_backward_schema("Tensor", "float"))
def attention_kl_bwd_op(grad_rows: torch.Tensor, *fields) -> list[torch.Tensor]:
    """Custom op around :func:`launch_backward`; ``fields`` are those of :class:`BackwardInputs`."""
    return launch_backward(grad_rows, BackwardInputs(*fields))


@attention_kl_bwd_op.register_fake
def _attention_kl_bwd_fake(grad_rows, *fields):
    return [empty_gradient_for(tensor) for tensor in _differentiated_roles(fields)]


@torch.library.custom_op(
    "cl_streamkl::attention_kl_grouped_fwd", mutates_args=(), schema=_forward_schema("Tensor[]", "float[]", "Tensor?")
)
def attention_kl_grouped_fwd_op(q, k, q_teacher, k_teacher, student_scales, teacher_scales, causal, lse, lse_teacher):
    """Custom op around :func:`launch_grouped_forward`; ``lse`` and ``lse_teacher`` stacked, (L, B, H, Nq)."""
    return launch_grouped_forward(q, k, q_teacher, k_teacher, student_scales, teacher_scales, causal, lse, lse_teacher)


@attention_kl_grouped_fwd_op.register_fake
def _attention_kl_grouped_fwd_fake(q, k, q_teacher, k_teacher, student_scales, teacher_scales, causal, lse,
                                   lse_teacher):
    rows = q[0].new_empty((len(q), *q[0].shape[:3]), dtype=torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(rows)


@torch.library.custom_op(
    "cl_streamkl::attention_kl_grouped_bwd", mutates_args=(), schema=_backward_schema("Tensor[]", "float[]")
)
def attention_kl_grouped_bwd_op(grad_rows: torch.Tensor, *fields) -> list[torch.Tensor]:
    """Custom op around :func:`launch_grouped_backward`; ``fields`` as in :func:`attention_kl_bwd_op`, per problem."""
    return launch_grouped_backward(grad_rows, BackwardInputs(*fields))


@attention_kl_grouped_bwd_op.register_fake
def _attention_kl_grouped_bwd_fake(grad_rows, *fields):
    return [empty_gradient_for(tensor) for role in _differentiated_roles(fields) for tensor in role]


def _save_for_backward(ctx, inputs: Sequence[torch.Tensor], outputs, options: tuple) -> None:
    """Keep what the backward needs.

    Args:
        inputs: q, k, q_teacher, k_teacher of every problem, problem after problem.
        outputs: row_kl, lse_student, lse_teacher of the forward.
        options: the launchers' trailing arguments (scales, causal).
    """
    row_kl, lse_student, lse_teacher = outputs
    teacher_grad = any(tensor.requires_grad for index, tensor in enumerate(inputs) if index % 4 >= 2)
    # The per-row KL is needed only for the teacher's gradient; not keeping it
    # otherwise leaves 8 bytes per row (the two log-sum-exps) alive until backward.
    ctx.save_for_backward(*inputs, lse_student, lse_teacher, row_kl if teacher_grad else None)
    ctx.options = options
    ctx.teacher_grad = teacher_grad


def _gradients(ctx, grad_rows: torch.Tensor | None, backward_fn, grouped: bool) -> tuple:
    """(dq, dk, dq_teacher, dk_teacher), each a tensor or, ``grouped``, a list over problems.

    ``backward_fn(grad_rows, saved)`` runs the backward on a :class:`BackwardInputs`.

    The teacher's are None for a frozen teacher; all four are None without an upstream gradient.
    """
    *inputs, lse_student, lse_teacher, row_kl = ctx.saved_tensors
    if grad_rows is None:
        return (None,) * 4
    roles = [list(inputs[index::4]) for index in range(4)] if grouped else inputs
    # A frozen teacher costs no teacher-gradient work: the kernels skip it entirely
    # and never read ROW_KL, so any float32 tensor of the rows' shape stands in for it.
    saved = BackwardInputs(
        *roles, lse_student if row_kl is None else row_kl, lse_student, lse_teacher, *ctx.options, ctx.teacher_grad,
    )
    grads = backward_fn(grad_rows, saved)
    if grouped:  # dq of every problem, then dk (then the teacher's): one list per role
        count = len(inputs) // 4
        grads = [grads[start:start + count] for start in range(0, len(grads), count)]
    return grads[0], grads[1], *(grads[2:] if ctx.teacher_grad else (None, None))


def _flat(backward_op):
    """``backward_op`` (a custom op, flat arguments) called as ``backward_fn(grad_rows, saved)``."""
    return lambda grad_rows, saved: backward_op(grad_rows, *saved)


def _setup_context(ctx, inputs, output):
    q, k, q_teacher, k_teacher, *options, _lse, _lse_teacher = inputs
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1], output[2])
    _save_for_backward(ctx, (q, k, q_teacher, k_teacher), output, tuple(options))


# The given log-sum-exps get no gradient: the backward's g·(p_s − p_t) is already the whole
# derivative of the KL with respect to (q, k), their dependence on q and k included.
def _op_backward(ctx, grad_rows, _grad_lse_student, _grad_lse_teacher):
    return *_gradients(ctx, grad_rows, _flat(attention_kl_bwd_op), grouped=False), *(None,) * 5


attention_kl_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def _grouped_setup_context(ctx, inputs, output):
    q, k, q_teacher, k_teacher, *options, _lse, _lse_teacher = inputs
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1], output[2])
    interleaved = [tensor for problem in zip(q, k, q_teacher, k_teacher) for tensor in problem]
    _save_for_backward(ctx, interleaved, output, tuple(options))


def _per_problem(ctx, grads: tuple) -> list[list[torch.Tensor | None]]:
    """The four roles' gradients as lists over problems, None where a role gets none."""
    problems = len(ctx.options[0])
    return [[None] * problems if role is None else role for role in grads]


def _grouped_op_backward(ctx, grad_rows, _grad_lse_student, _grad_lse_teacher):
    # A list input takes a list of gradients, one (or None) per tensor.
    grads = _gradients(ctx, grad_rows, _flat(attention_kl_grouped_bwd_op), grouped=True)
    return *_per_problem(ctx, grads), *(None,) * 5


attention_kl_grouped_fwd_op.register_autograd(_grouped_op_backward, setup_context=_grouped_setup_context)


class _AttentionKLFunction(torch.autograd.Function):
    """Eager-mode twin of the custom op: same launchers, a fraction of the dispatch cost.

    At ViT sizes (197 tokens) one kernel runs for tens of microseconds, so the
    custom-op dispatcher's overhead would dominate; torch.compile uses the op.
    """

    @staticmethod
    def forward(ctx, q, k, q_teacher, k_teacher, student_scale, teacher_scale, causal, lse, lse_teacher):
        options = (student_scale, teacher_scale, causal)
        outputs = launch_forward(q, k, q_teacher, k_teacher, *options, lse, lse_teacher)
        ctx.set_materialize_grads(False)
        _save_for_backward(ctx, (q, k, q_teacher, k_teacher), outputs, options)
        return outputs[0]

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward()
        return *_gradients(ctx, grad_rows, launch_backward, grouped=False), *(None,) * 5


class _GroupedAttentionKLFunction(torch.autograd.Function):
    """Eager twin of the grouped custom op; its inputs are q, k, q_t, k_t of each problem in turn."""

    @staticmethod
    def forward(ctx, student_scales, teacher_scales, causal, lse, lse_teacher, *inputs):
        roles = [inputs[index::4] for index in range(4)]
        options = (student_scales, teacher_scales, causal)
        outputs = launch_grouped_forward(*roles, *options, lse, lse_teacher)
        ctx.set_materialize_grads(False)
        _save_for_backward(ctx, inputs, outputs, options)
        return outputs[0]

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward()
        grads = _per_problem(ctx, _gradients(ctx, grad_rows, launch_grouped_backward, grouped=True))
        return None, None, None, None, None, *(grad for problem in zip(*grads) for grad in problem)


def attention_kl_rows_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    problem: AttentionKLProblem,
    lse: torch.Tensor | None = None,
    lse_teacher: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row KL(P_teacher ‖ P_student), (B, H, Nq) float32, through the fused kernels.

    Inputs are validated by the caller (:func:`cl_streamkl.attention_kl`), the log-sum-exps
    too: both (B, H, Nq) float32, natural log, or neither.
    """
    args = (q, k, q_teacher, k_teacher, problem.student_scale, problem.teacher_scale, problem.causal, lse, lse_teacher)
    if torch.compiler.is_compiling():
        return attention_kl_fwd_op(*args)[0]
    return _AttentionKLFunction.apply(*args)


def attention_kl_rows_triton_grouped(
    inputs: Sequence[Sequence[torch.Tensor]],
    problems: Sequence[AttentionKLProblem],
    lse: torch.Tensor | None = None,
    lse_teacher: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row KL of L problems of one shape, (L, B, H, Nq) float32: one launch per kernel.

    Args:
        inputs: per problem (q, k, q_teacher, k_teacher), validated by the caller
            (:func:`cl_streamkl.attention_kl_grouped`): one shape, dtype and device for all.
        problems: per problem its sizes and scales; ``causal`` is the same in all.
        lse, lse_teacher: every problem's natural log-sum-exps, (L, B, H, Nq) float32 contiguous, or None.
    """
    student_scales = [problem.student_scale for problem in problems]
    teacher_scales = [problem.teacher_scale for problem in problems]
    causal = problems[0].causal
    if torch.compiler.is_compiling():
        roles = [[problem[index] for problem in inputs] for index in range(4)]
        return attention_kl_grouped_fwd_op(*roles, student_scales, teacher_scales, causal, lse, lse_teacher)[0]
    flat = [tensor for problem in inputs for tensor in problem]
    return _GroupedAttentionKLFunction.apply(student_scales, teacher_scales, causal, lse, lse_teacher, *flat)
