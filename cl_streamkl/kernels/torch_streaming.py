"""Pure-PyTorch streaming attention KL: the same online math as the Triton kernels.

Keys are processed in chunks of ``chunk_size``; per query row the forward keeps
both running maxima and sums and the rescaled accumulator Σ p̃_t·(s_t − s_s),
and the backward recomputes each chunk's probabilities. Given both log-sum-exps, the
forward takes one exponential per score and renormalises the teacher's by their sum σ. Peak extra memory is
O(B·H·Nq·chunk_size) (plus a float32 copy of the inputs), never O(Nq·Nk).
Runs on any device PyTorch supports.
"""

from __future__ import annotations

import torch

from cl_streamkl.kernels.validation import AttentionKLProblem, refuse_double_backward

DEFAULT_CHUNK_SIZE = 256


def _chunk_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    problem: AttentionKLProblem,
    start: int,
    stop: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Scaled float32 scores of keys [start, stop) for student and teacher, plus the causal keep-mask."""
    scores_student = (q @ k[:, :, start:stop].float().transpose(-1, -2)) * problem.student_scale
    scores_teacher = (q_teacher @ k_teacher[:, :, start:stop].float().transpose(-1, -2)) * problem.teacher_scale
    keep = None
    if problem.causal:
        rows = torch.arange(problem.n_q, device=q.device)[:, None]
        cols = torch.arange(start, stop, device=q.device)[None, :]
        keep = cols <= rows
        scores_student = scores_student.masked_fill(~keep, float("-inf"))
        scores_teacher = scores_teacher.masked_fill(~keep, float("-inf"))
    return scores_student, scores_teacher, keep


def _known_lse_forward(
    q: torch.Tensor, k: torch.Tensor, q_teacher: torch.Tensor, k_teacher: torch.Tensor,
    problem: AttentionKLProblem, chunk_size: int, given: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`streaming_forward` with both natural log-sum-exps given: one exponential per score.

    σ = Σ_j exp(s_t − lse_t) makes the teacher's side exact even where lse_t is off; the
    returned teacher log-sum-exp is lse_t + log σ.
    """
    lse_student, lse_teacher = (tensor.float() for tensor in given)
    sigma = torch.zeros_like(lse_teacher)
    weighted_gap = torch.zeros_like(lse_teacher)
    q32, q_teacher32 = q.float(), q_teacher.float()
    for start in range(0, problem.n_k, chunk_size):
        stop = min(start + chunk_size, problem.n_k)
        scores_student, scores_teacher, keep = _chunk_scores(q32, k, q_teacher32, k_teacher, problem, start, stop)
        p_teacher = torch.exp(scores_teacher - lse_teacher[..., None])
        gap = scores_teacher - scores_student
        if keep is not None:
            gap = gap.masked_fill(~keep, 0.0)
        sigma = sigma + p_teacher.sum(dim=-1)
        weighted_gap = weighted_gap + (p_teacher * gap).sum(dim=-1)
    log_sigma = torch.log(sigma)
    row_kl = weighted_gap / sigma - log_sigma - lse_teacher + lse_student
    return row_kl, lse_student, lse_teacher + log_sigma


def streaming_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    problem: AttentionKLProblem,
    chunk_size: int,
    given: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row KL and both natural log-sum-exps over keys [0, Nk), each (B, H, Nq) float32.

    ``given``: the student's and teacher's natural log-sum-exps, if known (see
    :func:`cl_streamkl.attention_kl`). Public for :mod:`cl_streamkl.distributed`, which merges
    these statistics over key shards.
    """
    if given is not None:
        return _known_lse_forward(q, k, q_teacher, k_teacher, problem, chunk_size, given)
    shape = (problem.batch, problem.heads, problem.n_q)
    max_student = torch.full(shape, float("-inf"), device=q.device)
    max_teacher = torch.full(shape, float("-inf"), device=q.device)
    sum_student = torch.zeros(shape, device=q.device)
    sum_teacher = torch.zeros(shape, device=q.device)
    weighted_gap = torch.zeros(shape, device=q.device)
    q32, q_teacher32 = q.float(), q_teacher.float()
    for start in range(0, problem.n_k, chunk_size):
        stop = min(start + chunk_size, problem.n_k)
        scores_student, scores_teacher, keep = _chunk_scores(
            q32, k, q_teacher32, k_teacher, problem, start, stop
        )
        new_max_student = torch.maximum(max_student, scores_student.amax(dim=-1))
        new_max_teacher = torch.maximum(max_teacher, scores_teacher.amax(dim=-1))
        sum_student = sum_student * torch.exp(max_student - new_max_student) + torch.exp(
            scores_student - new_max_student[..., None]
        ).sum(dim=-1)
        teacher_rescale = torch.exp(max_teacher - new_max_teacher)
        unnormalised_teacher = torch.exp(scores_teacher - new_max_teacher[..., None])
        gap = scores_teacher - scores_student
        if keep is not None:
            gap = gap.masked_fill(~keep, 0.0)
        sum_teacher = sum_teacher * teacher_rescale + unnormalised_teacher.sum(dim=-1)
        weighted_gap = weighted_gap * teacher_rescale + (unnormalised_teacher * gap).sum(dim=-1)
        max_student, max_teacher = new_max_student, new_max_teacher
    row_kl = (
        weighted_gap / sum_teacher
        - (max_teacher - max_student)
        - torch.log(sum_teacher)
        + torch.log(sum_student)
    )
    lse_student = max_student + torch.log(sum_student)
    lse_teacher = max_teacher + torch.log(sum_teacher)
    return row_kl, lse_student, lse_teacher


def in_input_dtypes(
    grads: tuple[torch.Tensor | None, ...], inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor | None, ...]:
    """Each float32 gradient cast to its input's dtype; None (no gradient) stays None."""
    return tuple(None if grad is None else grad.to(tensor.dtype) for grad, tensor in zip(grads, inputs))


def streaming_backward(
    grad_rows: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    lse_student: torch.Tensor,
    lse_teacher: torch.Tensor,
    row_kl: torch.Tensor,
    problem: AttentionKLProblem,
    chunk_size: int,
    teacher_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of Σ grad_rows·KL_rows for student (and optionally teacher) inputs, in float32.

    ``lse_student``/``lse_teacher`` (natural log) and ``row_kl`` may come from a larger key
    set than ``k`` holds: :mod:`cl_streamkl.distributed` passes the merged statistics of all
    key shards, and the key gradients are then exact for this shard.
    """
    q32, q_teacher32 = q.float(), q_teacher.float()
    grad = grad_rows.float()[..., None]
    grad_q = torch.zeros_like(q32)
    grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    grad_q_teacher = torch.zeros_like(q_teacher32) if teacher_grad else None
    grad_k_teacher = (
        torch.zeros(k_teacher.shape, dtype=torch.float32, device=k.device) if teacher_grad else None
    )
    for start in range(0, problem.n_k, chunk_size):
        stop = min(start + chunk_size, problem.n_k)
        scores_student, scores_teacher, keep = _chunk_scores(
            q32, k, q_teacher32, k_teacher, problem, start, stop
        )
        log_p_student = scores_student - lse_student[..., None]
        log_p_teacher = scores_teacher - lse_teacher[..., None]
        p_teacher = torch.exp(log_p_teacher)
        grad_scores = grad * (torch.exp(log_p_student) - p_teacher) * problem.student_scale
        grad_q += grad_scores @ k[:, :, start:stop].float()
        grad_k[:, :, start:stop] = grad_scores.transpose(-1, -2) @ q32
        if teacher_grad:
            log_ratio = log_p_teacher - log_p_student
            if keep is not None:
                log_ratio = log_ratio.masked_fill(~keep, 0.0)
            grad_scores_teacher = (
                grad * p_teacher * (log_ratio - row_kl[..., None]) * problem.teacher_scale
            )
            grad_q_teacher += grad_scores_teacher @ k_teacher[:, :, start:stop].float()
            grad_k_teacher[:, :, start:stop] = grad_scores_teacher.transpose(-1, -2) @ q_teacher32
    return grad_q, grad_k, grad_q_teacher, grad_k_teacher


class _StreamingAttentionKL(torch.autograd.Function):
    """Autograd wrapper: forward and backward both stream over key chunks."""

    @staticmethod
    def forward(ctx, q, k, q_teacher, k_teacher, problem, chunk_size, given):
        row_kl, lse_student, lse_teacher = streaming_forward(
            q, k, q_teacher, k_teacher, problem, chunk_size, given
        )
        ctx.save_for_backward(q, k, q_teacher, k_teacher, lse_student, lse_teacher, row_kl)
        ctx.problem = problem
        ctx.chunk_size = chunk_size
        return row_kl

    @staticmethod
    def backward(ctx, grad_rows):
        refuse_double_backward()
        q, k, q_teacher, k_teacher, lse_student, lse_teacher, row_kl = ctx.saved_tensors
        teacher_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        grad_q, grad_k, grad_q_teacher, grad_k_teacher = streaming_backward(
            grad_rows,
            q,
            k,
            q_teacher,
            k_teacher,
            lse_student,
            lse_teacher,
            row_kl,
            ctx.problem,
            ctx.chunk_size,
            teacher_grad,
        )
        grads = (grad_q, grad_k, grad_q_teacher, grad_k_teacher)
        return *in_input_dtypes(grads, (q, k, q_teacher, k_teacher)), None, None, None


def attention_kl_rows_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    problem: AttentionKLProblem,
    lse: torch.Tensor | None = None,
    lse_teacher: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Per-row KL(P_teacher ‖ P_student), (B, H, Nq) float32, streaming over key chunks.

    Inputs are validated by the caller (:func:`cl_streamkl.attention_kl`); shapes are
    q (B, H, Nq, Ds), k (B, H, Nk, Ds), q_teacher (B, H, Nq, Dt), k_teacher (B, H, Nk, Dt),
    and the optional natural log-sum-exps (both or neither) (B, H, Nq) float32.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    # Under autocast the float32 chunk products would silently run in bf16/fp16;
    # the contract is float32 math, as in the Triton kernels.
    with torch.autocast(q.device.type, enabled=False):
        given = None if lse is None else (lse.detach(), lse_teacher.detach())
        return _StreamingAttentionKL.apply(q, k, q_teacher, k_teacher, problem, chunk_size, given)
