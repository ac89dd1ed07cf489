"""The per-block problems of a distillation penalty and their KL, in as few launches as the shapes allow.

:func:`block_problems` pairs the student's captured Q/K with the teacher's, block by block;
:func:`known_lse` decides whether both models' recorded log-sum-exps may stand in for the
kernels' own; :func:`kl_per_block` computes one mean KL per block, all blocks of one shape
in one grouped launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cl_streamkl.attention_kl import attention_kl, attention_kl_grouped
from cl_streamkl.capture import TeacherQK

__all__ = ["Problem", "block_problems", "kl_per_block", "known_lse"]

# Per block: (q, k, q_teacher, k_teacher, scale, teacher_scale).
Problem = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]


def block_problems(student: Any, teacher: TeacherQK, layers: object) -> list[Problem]:
    """Pair the student's Q/K and scales with the teacher's, block by block.

    Args:
        student: the :class:`~cl_streamkl.capture.QKCapture` entered around the student's
            forward (or a :class:`~cl_streamkl.capture.TeacherQK` of the student's Q/K):
            per selected block q (B, H, Nq, D) and k (B, H, Nk, D) with their graph.
        teacher: the teacher's Q/K of the same input.
        layers: the layer selection, named in errors.

    Returns:
        Per block ``(q, k, q_teacher, k_teacher, scale, teacher_scale)``; a teacher Q/K in
        another dtype than the student's (autocast) is cast to the student's.

    Raises:
        TypeError: ``student`` has no ``qk``/``scales``.
        ValueError: the block counts or the samples per block differ.
    """
    if not all(hasattr(student, name) for name in ("qk", "scales", "lse")):
        raise TypeError(
            f"capture must be the QKCapture of student_capture(model) entered around the student's forward, "
            f"got {type(student).__name__}"
        )
    student_qk, scales = student.qk, student.scales
    if len(student_qk) != len(teacher.qk):
        raise ValueError(
            f"capture has {len(student_qk)} blocks but the layer selection {layers!r} gives {len(teacher.qk)}; "
            "pass the QKCapture of student_capture()"
        )
    problems = []
    for (q, k), (q_t, k_t), scale, teacher_scale in zip(student_qk, teacher.qk, scales, teacher.scales):
        if q.shape[0] != q_t.shape[0]:
            raise ValueError(
                f"the student's captured Q/K hold {q.shape[0]} samples per block but the teacher's "
                f"{q_t.shape[0]}: run the student once on x, with the arguments the teacher gets"
            )
        # Under autocast the teacher may have run in another precision than the student did.
        if q_t.dtype != q.dtype:
            q_t, k_t = q_t.to(q.dtype), k_t.to(q.dtype)
        problems.append((q, k, q_t, k_t, scale, teacher_scale))
    return problems


def known_lse(
    temperature: float,
    problems: Sequence[Problem],
    student_lse: Sequence[torch.Tensor | None] | None,
    teacher_lse: Sequence[torch.Tensor | None] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Both models' recorded log-sum-exps where the KL may take them, else None.

    They are the log-sum-exps of ``q kᵀ · scale`` as each model's attention formed its scores,
    so they serve only where the KL's scores are those: temperature 1 and the scales the
    capture recorded (``scale`` given, not None). Every block must have both (a fused SDPA
    call without a mask records one, eager or compiled; the math backend and manual attention
    record none), and the inputs must be on CUDA, where the recorded LSE costs
    nothing; on the CPU the kernels compute both as before.

    Args:
        temperature: the distiller's.
        problems: per block ``(q, k, q_teacher, k_teacher, scale, teacher_scale)``.
        student_lse, teacher_lse: per block the recorded log-sum-exp or None; None for all.

    Returns:
        ``(student_lse, teacher_lse)``, lists of (B, H, Nq) float32 tensors, or None.
    """
    if temperature != 1.0 or student_lse is None or teacher_lse is None:
        return None
    if len(student_lse) != len(problems) or len(teacher_lse) != len(problems):
        return None
    for (q, _, _, _, scale, teacher_scale), lse_s, lse_t in zip(problems, student_lse, teacher_lse):
        if lse_s is None or lse_t is None or scale is None or teacher_scale is None or not q.is_cuda:
            return None
    return list(student_lse), list(teacher_lse)


def kl_per_block(
    problems: Sequence[Problem],
    lse: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
    temperature: float,
    backend: str,
) -> torch.Tensor:
    """One unweighted penalty per block: the mean KL(P_teacher ‖ P_student) over its query rows.

    Blocks of one shape and dtype (every block of a ViT) go to
    :func:`~cl_streamkl.attention_kl_grouped`: one kernel launch for all of them and
    one for each backward kernel. Blocks that differ are computed one by one.

    Args:
        problems: per block ``(q, k, q_teacher, k_teacher, scale, teacher_scale)``, scales
            ``None`` for ``D**-0.5``.
        lse: :func:`known_lse` of these problems, or None (the kernels compute both).
        temperature: softmax temperature of both distributions.
        backend: ``attention_kl`` backend.

    Returns:
        (L,) float32 tensor.
    """
    options = {"temperature": temperature, "reduction": "mean", "backend": backend}
    student_lse, teacher_lse = lse if lse is not None else (None, None)
    signatures = {tuple((t.shape, t.dtype, t.device) for t in problem[:4]) for problem in problems}
    if len(signatures) == 1:
        return attention_kl_grouped([problem[:4] for problem in problems],
                                    scales=[problem[4] for problem in problems],
                                    teacher_scales=[problem[5] for problem in problems],
                                    lse=student_lse, lse_teacher=teacher_lse, **options)
    given = list(zip(student_lse, teacher_lse)) if lse is not None else [(None, None)] * len(problems)
    return torch.stack([
        attention_kl(q, k, q_t, k_t, scale=scale, teacher_scale=teacher_scale, lse=lse_s, lse_teacher=lse_t,
                     **options)
        for (q, k, q_t, k_t, scale, teacher_scale), (lse_s, lse_t) in zip(problems, given)
    ])
