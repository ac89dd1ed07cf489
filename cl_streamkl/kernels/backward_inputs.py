"""What the backward of StreamKL reads besides the upstream gradient, as one bundle.

The Triton launchers, the eager autograd Functions and the context-parallel op pass it
whole; only the ``torch.library`` custom ops, which need flat arguments, spell it out.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["BackwardInputs"]


class BackwardInputs(NamedTuple):
    """What the backward kernels read besides the upstream gradient: the forward's inputs,
    its outputs and its options. In the grouped launchers each tensor and scale is a list
    over the L problems.

    Attributes:
        q, k, q_teacher, k_teacher: the forward's inputs, (B, H, N, D) each.
        row_kl: the forward's per-row KL, (B, H, Nq) float32; read only for ``teacher_grad``
            (any float32 tensor of that shape stands in otherwise).
        lse_student, lse_teacher: the forward's log-sum-exps (base 2), (B, H, Nq) float32.
        student_scale, teacher_scale: scale / temperature of each side, natural units.
        causal: whether key j > query i was masked.
        teacher_grad: whether the teacher's inputs get gradients too.
    """

    q: Any
    k: Any
    q_teacher: Any
    k_teacher: Any
    row_kl: torch.Tensor
    lse_student: torch.Tensor
    lse_teacher: torch.Tensor
    student_scale: Any
    teacher_scale: Any
    causal: bool
    teacher_grad: bool
