"""Float64 materialising reference for the attention KL.

It builds both (Nq, Nk) attention matrices, so it is only for tests,
benchmarks' correctness checks and debugging at small sizes. It is
differentiable through ordinary autograd.
"""

from __future__ import annotations

import torch

from cl_streamkl.kernels.validation import check_inputs, reduce_rows


def attention_kl_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    *,
    scale: float | None = None,
    teacher_scale: float | None = None,
    temperature: float = 1.0,
    causal: bool = False,
    reduction: str = "mean",
) -> torch.Tensor:
    """KL(P_teacher ‖ P_student) per query row, computed in float64 by materialising.

    Args:
        q: student queries, (B, H, Nq, Ds).
        k: student keys, (B, H, Nk, Ds).
        q_teacher: teacher queries, (B, H, Nq, Dt).
        k_teacher: teacher keys, (B, H, Nk, Dt).
        scale: student softmax scale, default Ds**-0.5.
        teacher_scale: teacher softmax scale, default Dt**-0.5.
        temperature: both score matrices are divided by it.
        causal: mask key j > query i.
        reduction: "none" → (B, H, Nq); "sum"; "mean" over B·H·Nq rows; "batchmean" → sum / B.

    Returns:
        A float64 tensor, reduced as asked.
    """
    problem = check_inputs(
        q,
        k,
        q_teacher,
        k_teacher,
        scale=scale,
        teacher_scale=teacher_scale,
        temperature=temperature,
        causal=causal,
        reduction=reduction,
        backend="torch",
    )
    scores_student = (q.double() @ k.double().transpose(-1, -2)) * problem.student_scale
    scores_teacher = (q_teacher.double() @ k_teacher.double().transpose(-1, -2)) * problem.teacher_scale
    if causal:
        keep = torch.ones(problem.n_q, problem.n_k, dtype=torch.bool, device=q.device).tril()
        scores_student = scores_student.masked_fill(~keep, float("-inf"))
        scores_teacher = scores_teacher.masked_fill(~keep, float("-inf"))
    log_p_student = torch.log_softmax(scores_student, dim=-1)
    log_p_teacher = torch.log_softmax(scores_teacher, dim=-1)
    if causal:
        # Masked entries hold −inf; zero them before the product so that neither the
        # value nor the gradient sees 0 · (−inf − −inf) = NaN.
        zero = torch.zeros((), dtype=log_p_student.dtype, device=q.device)
        log_p_student = torch.where(keep, log_p_student, zero)
        log_p_teacher = torch.where(keep, log_p_teacher, zero)
        p_teacher = torch.where(keep, log_p_teacher.exp(), zero)
    else:
        p_teacher = log_p_teacher.exp()
    terms = p_teacher * (log_p_teacher - log_p_student)
    return reduce_rows(terms.sum(dim=-1), reduction)
