"""Argument checking shared by every StreamKL backend.

Everything here runs before any kernel launches, so bad input fails with a
``ValueError``/``TypeError`` that names the argument instead of a Triton trace,
an out-of-bounds read or a silently wrong answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REDUCTIONS = ("none", "sum", "mean", "batchmean")
BACKENDS = ("auto", "triton", "torch")
MAX_HEAD_DIM = 256
# Scores are formed in float32 (and multiplied by log2(e) < 2 in the Triton kernels), so an
# effective scale (scale / temperature) up to 2**64 keeps every score finite for |q·k| < 2**63;
# beyond it ordinary inputs overflow to inf and whole rows come back NaN.
MAX_EFFECTIVE_SCALE = 2.0**64
_TENSOR_NAMES = ("q", "k", "q_teacher", "k_teacher")


@dataclass(frozen=True)
class AttentionKLProblem:
    """Sizes and resolved options of one ``attention_kl`` call.

    Attributes:
        batch: B.
        heads: H.
        n_q: number of query rows Nq.
        n_k: number of keys Nk.
        d_student: student head dim Ds.
        d_teacher: teacher head dim Dt.
        student_scale: softmax scale of the student divided by the temperature.
        teacher_scale: softmax scale of the teacher divided by the temperature.
        causal: whether key j > query i is masked.
    """

    batch: int
    heads: int
    n_q: int
    n_k: int
    d_student: int
    d_teacher: int
    student_scale: float
    teacher_scale: float
    causal: bool


def _check_positive_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_options(
    *,
    scale: float | None,
    teacher_scale: float | None,
    temperature: float,
    causal: bool,
    reduction: str,
    backend: str,
) -> None:
    """Validate the keyword options of ``attention_kl`` (no tensors needed).

    Raises:
        TypeError: an option has the wrong type.
        ValueError: an option has an unsupported value.
    """
    _check_positive_number("temperature", temperature)
    if scale is not None:
        _check_positive_number("scale", scale)
    if teacher_scale is not None:
        _check_positive_number("teacher_scale", teacher_scale)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    *,
    scale: float | None,
    teacher_scale: float | None,
    temperature: float,
    causal: bool,
    reduction: str,
    backend: str,
) -> AttentionKLProblem:
    """Validate the four attention inputs and the options; resolve default scales.

    Args:
        q: student queries, (B, H, Nq, Ds).
        k: student keys, (B, H, Nk, Ds).
        q_teacher: teacher queries, (B, H, Nq, Dt).
        k_teacher: teacher keys, (B, H, Nk, Dt).
        scale, teacher_scale, temperature, causal, reduction, backend: as in
            :func:`cl_streamkl.attention_kl`.

    Returns:
        The problem sizes and the effective (scale / temperature) factors.

    Raises:
        TypeError: a tensor argument is not a tensor or has an unsupported dtype.
        ValueError: shapes, devices, strides or options do not fit the contract.
    """
    check_options(
        scale=scale,
        teacher_scale=teacher_scale,
        temperature=temperature,
        causal=causal,
        reduction=reduction,
        backend=backend,
    )
    tensors = (q, k, q_teacher, k_teacher)
    for name, tensor in zip(_TENSOR_NAMES, tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (B, H, N, D), got shape {tuple(tensor.shape)}"
            )
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}"
            )
        if tensor.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(tensor.shape)}")
        if tensor.stride(-1) != 1 and tensor.size(-1) != 1:
            raise ValueError(
                f"{name} must have a unit stride in its last (head) dimension, "
                f"got strides {tensor.stride()}; call .contiguous() on it"
            )
    for name, tensor in zip(_TENSOR_NAMES[1:], tensors[1:]):
        if tensor.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but q has {q.dtype}; all four must match")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}; all four must match")
        if tensor.shape[:2] != q.shape[:2]:
            raise ValueError(
                f"{name} has (B, H) = {tuple(tensor.shape[:2])} but q has {tuple(q.shape[:2])}"
            )
    if k.size(-1) != q.size(-1):
        raise ValueError(f"k head dim {k.size(-1)} differs from q head dim {q.size(-1)}")
    if k_teacher.size(-1) != q_teacher.size(-1):
        raise ValueError(
            f"k_teacher head dim {k_teacher.size(-1)} differs from q_teacher head dim {q_teacher.size(-1)}"
        )
    if q_teacher.size(2) != q.size(2):
        raise ValueError(
            f"q_teacher has {q_teacher.size(2)} query rows but q has {q.size(2)}"
        )
    if k_teacher.size(2) != k.size(2):
        raise ValueError(f"k_teacher has {k_teacher.size(2)} keys but k has {k.size(2)}")
    for name, tensor in (("q", q), ("q_teacher", q_teacher)):
        if tensor.size(-1) > MAX_HEAD_DIM:
            raise ValueError(f"{name} head dim must be at most {MAX_HEAD_DIM}, got {tensor.size(-1)}")
    if causal and q.size(2) != k.size(2):
        raise ValueError(
            f"causal=True needs as many queries as keys, got Nq={q.size(2)} and Nk={k.size(2)}"
        )
    d_student, d_teacher = q.size(-1), q_teacher.size(-1)
    student_scale = d_student**-0.5 if scale is None else float(scale)
    teacher_scale_value = d_teacher**-0.5 if teacher_scale is None else float(teacher_scale)
    return AttentionKLProblem(
        batch=q.size(0),
        heads=q.size(1),
        n_q=q.size(2),
        n_k=k.size(2),
        d_student=d_student,
        d_teacher=d_teacher,
        student_scale=_check_effective_scale("scale", student_scale, float(temperature)),
        teacher_scale=_check_effective_scale("teacher_scale", teacher_scale_value, float(temperature)),
        causal=causal,
    )


def _check_effective_scale(name: str, scale: float, temperature: float) -> float:
    effective = scale / temperature
    if not effective <= MAX_EFFECTIVE_SCALE:
        raise ValueError(
            f"{name} / temperature = {scale:g} / {temperature:g} = {effective:g} exceeds {MAX_EFFECTIVE_SCALE:g}: "
            "the float32 attention scores would overflow and the KL rows would be NaN"
        )
    return effective


def refuse_double_backward() -> None:
    """Raise when a backward runs with ``create_graph=True`` (its result would be differentiated).

    The backward formulas run as fused kernels or chunked loops that autograd does not
    record, so a second derivative through them would silently lack every term they
    contribute.

    Raises:
        RuntimeError: grad mode is enabled inside the backward.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            "attention_kl supports no double backward: its gradient cannot be differentiated again "
            "(create_graph=True, Hessian-vector products, gradient penalties through it)"
        )


def reduce_rows(row_kl: torch.Tensor, reduction: str) -> torch.Tensor:
    """Apply ``reduction`` to per-row KL values of shape (B, H, Nq)."""
    if reduction == "none":
        return row_kl
    if reduction == "sum":
        return row_kl.sum()
    if reduction == "mean":
        return row_kl.mean()
    return row_kl.sum() / row_kl.size(0)
