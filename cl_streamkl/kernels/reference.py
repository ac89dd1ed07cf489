"""Materialising attention KL: the float64 reference and the eager baseline.

Both build the (Nq, Nk) attention matrices and are differentiable through ordinary
autograd. :func:`attention_kl_reference` computes in float64, for tests, benchmarks'
correctness checks and debugging at small sizes. :func:`eager_attention_kl` is the code
distillation usually runs, the baseline the benchmarks time StreamKL against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cl_streamkl.kernels.validation import (
    SUPPORTED_DTYPES,
    AttentionKLOptions,
    check_given_lse,
    check_inputs,
    reduce_rows,
)


def attention_kl_reference(
    q: torch.Tensor, k: torch.Tensor, q_teacher: torch.Tensor, k_teacher: torch.Tensor, **options: Any
) -> torch.Tensor:
    """KL(P_teacher ‖ P_student) per query row, computed in float64 by materialising.

    Takes what :func:`cl_streamkl.attention_kl` takes, and float64 inputs too (for
    ``torch.autograd.gradcheck`` and float64 gradients to compare with).

    Args:
        q: student queries, (B, H, Nq, Ds).
        k: student keys, (B, H, Nk, Ds).
        q_teacher: teacher queries, (B, H, Nq, Dt).
        k_teacher: teacher keys, (B, H, Nk, Dt).
        options: the keyword arguments of :func:`cl_streamkl.attention_kl`, checked as it
            checks them: ``scale``, ``teacher_scale``, ``temperature``, ``causal``,
            ``reduction``; ``backend`` is ignored, and given ``lse`` / ``lse_teacher`` are
            validated but not used: the reference computes both log-sum-exps in float64.

    Returns:
        A float64 tensor, reduced as asked.
    """
    given = options.pop("lse", None), options.pop("lse_teacher", None)
    options = AttentionKLOptions(**{"backend": "torch", **options})
    problem = check_inputs(q, k, q_teacher, k_teacher, options, dtypes=(*SUPPORTED_DTYPES, torch.float64))
    check_given_lse(*given, q)
    causal, reduction = options.causal, options.reduction
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


def eager_attention_kl(
    q: torch.Tensor, k: torch.Tensor, q_teacher: torch.Tensor, k_teacher: torch.Tensor, *,
    scale: float | None = None, teacher_scale: float | None = None, causal: bool = False, reduction: str = "mean",
) -> torch.Tensor:
    """KL(P_teacher ‖ P_student) per query row, the way distillation code usually computes it.

    Both score matrices are materialised in the inputs' dtype and again in float32, each
    gets a float32 ``log_softmax``, and ``F.kl_div(log_p_student, log_p_teacher,
    log_target=True)`` is summed over keys. Nothing is validated: this is the baseline
    whose time and memory the benchmarks compare StreamKL with.

    Args:
        q, k, q_teacher, k_teacher, scale, teacher_scale, causal, reduction: as in
            :func:`attention_kl_reference` (which adds ``temperature``).

    Returns:
        A float32 tensor, reduced as asked.
    """
    scale = q.size(-1) ** -0.5 if scale is None else scale
    teacher_scale = q_teacher.size(-1) ** -0.5 if teacher_scale is None else teacher_scale
    student = (q @ k.transpose(-2, -1)).float() * scale
    teacher = (q_teacher @ k_teacher.transpose(-2, -1)).float() * teacher_scale
    if causal:
        future = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).triu(1)
        # The dtype's minimum rather than −inf: exp gives 0 and the log-ratio of two masked
        # entries stays finite, so kl_div sees no 0·(−inf − −inf).
        lowest = torch.finfo(torch.float32).min
        student = student.masked_fill(future, lowest)
        teacher = teacher.masked_fill(future, lowest)
    log_p_student = student.log_softmax(dim=-1)
    log_p_teacher = teacher.log_softmax(dim=-1)
    per_entry = F.kl_div(log_p_student, log_p_teacher, reduction="none", log_target=True)
    return reduce_rows(per_entry.sum(dim=-1), reduction)
