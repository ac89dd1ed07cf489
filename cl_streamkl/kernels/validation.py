"""Argument checking shared by every StreamKL backend.

Everything here runs before any kernel launches, so bad input fails with a
``ValueError``/``TypeError`` that names the argument instead of a Triton trace,
an out-of-bounds read or a silently wrong answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


@dataclass(frozen=True)
class AttentionKLOptions:
    """The keyword options of ``attention_kl``, checked once, when made.

    Attributes: as the keyword arguments of :func:`cl_streamkl.attention_kl`.

    Raises:
        TypeError: an option has the wrong type.
        ValueError: an option has an unsupported value.
    """

    scale: float | None = None
    teacher_scale: float | None = None
    temperature: float = 1.0
    causal: bool = False
    reduction: str = "mean"
    backend: str = "auto"

    def __post_init__(self) -> None:
        # Stored as a float: every later use divides by it.
        object.__setattr__(self, "temperature", _check_positive_number("temperature", self.temperature))
        if self.scale is not None:
            _check_positive_number("scale", self.scale)
        if self.teacher_scale is not None:
            _check_positive_number("teacher_scale", self.teacher_scale)
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    options: AttentionKLOptions,
    scales: tuple[float | None, float | None] | None = None,
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES,
) -> AttentionKLProblem:
    """Validate the four attention inputs against checked options; resolve default scales.

    Args:
        q: student queries, (B, H, Nq, Ds).
        k: student keys, (B, H, Nk, Ds).
        q_teacher: teacher queries, (B, H, Nq, Dt).
        k_teacher: teacher keys, (B, H, Nk, Dt).
        options: the call's options, already checked.
        scales: (scale, teacher_scale) in place of the options' (one problem of a grouped call).
        dtypes: the dtypes the caller takes (the float64 reference adds float64).

    Returns:
        The problem sizes and the effective (scale / temperature) factors.

    Raises:
        TypeError: a tensor argument is not a tensor or has an unsupported dtype, or a scale
            is not a number.
        ValueError: shapes, devices, strides or scales do not fit the contract.
    """
    scale, teacher_scale = (options.scale, options.teacher_scale) if scales is None else scales
    for name, value in (("scale", scale), ("teacher_scale", teacher_scale)):
        if scales is not None and value is not None:
            _check_positive_number(name, value)
    temperature, causal = options.temperature, options.causal
    tensors = (q, k, q_teacher, k_teacher)
    for name, tensor in zip(_TENSOR_NAMES, tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (B, H, N, D), got shape {tuple(tensor.shape)}"
            )
        if tensor.dtype not in dtypes:
            names = [str(dtype).removeprefix("torch.") for dtype in dtypes]
            raise TypeError(f"{name} must be {', '.join(names[:-1])} or {names[-1]}, got {tensor.dtype}")
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
        student_scale=_check_effective_scale("scale", student_scale, temperature),
        teacher_scale=_check_effective_scale("teacher_scale", teacher_scale_value, temperature),
        causal=causal,
    )


def check_given_lse(
    lse: torch.Tensor | None, lse_teacher: torch.Tensor | None, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate the optional log-sum-exps of :func:`cl_streamkl.attention_kl` against its ``q``.

    Args:
        lse, lse_teacher: both None, or both (B, H, Nq) float32 tensors on ``q``'s device (any strides).
        q: the student queries, (B, H, Nq, Ds), already checked.

    Returns:
        ``(lse, lse_teacher)``, or None when neither is given.

    Raises:
        TypeError: one is given without the other, is not a tensor or not float32.
        ValueError: a shape other than (B, H, Nq) or another device than ``q``'s.
    """
    if lse is None and lse_teacher is None:
        return None
    if lse is None or lse_teacher is None:
        raise TypeError("lse and lse_teacher go together: pass both log-sum-exps or neither")
    expected = tuple(q.shape[:3])
    for name, tensor in (("lse", lse), ("lse_teacher", lse_teacher)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, as attention returns its log-sum-exp, got {tensor.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}")
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must have shape (B, H, Nq) = {expected}, got {tuple(tensor.shape)}")
    return lse, lse_teacher


def check_grouped_lse(
    lse: Sequence[torch.Tensor] | None, lse_teacher: Sequence[torch.Tensor] | None, problems: Sequence[Sequence]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`check_given_lse` for each problem of ``attention_kl_grouped``; each side stacked.

    Returns:
        ``(lse, lse_teacher)``, each (L, B, H, Nq) float32 contiguous (one copy of a few bytes per
        row, so the kernels need no per-problem addresses), or None when neither is given.

    Raises:
        TypeError / ValueError: as :func:`check_given_lse`, prefixed with ``problems[l]``, or lists
            whose lengths differ from the number of problems.
    """
    if lse is None and lse_teacher is None:
        return None
    if lse is None or lse_teacher is None:
        raise TypeError("lse and lse_teacher go together: pass both log-sum-exps or neither")
    for name, values in (("lse", lse), ("lse_teacher", lse_teacher)):
        if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a sequence of one tensor per problem, got {type(values).__name__}")
        if len(values) != len(problems):
            raise ValueError(f"{name} has {len(values)} entries but there are {len(problems)} problems")
    q = problems[0][0]
    expected = (len(problems), *q.shape[:3])
    stacked = []
    for values in (lse, lse_teacher):
        try:
            tensor = torch.stack(list(values))
        except (TypeError, RuntimeError):
            tensor = None
        if tensor is None or tensor.dtype != torch.float32 or tensor.device != q.device or tensor.shape != expected:
            break
        stacked.append(tensor)
    else:
        return stacked[0], stacked[1]
    # Something is off: find the problem and say what, one problem at a time.
    for index, (student, teacher, problem) in enumerate(zip(lse, lse_teacher, problems)):
        if student is None or teacher is None:
            raise TypeError(f"problems[{index}]: lse and lse_teacher must hold a tensor for every problem")
        try:
            check_given_lse(student, teacher, problem[0])
        except (TypeError, ValueError) as error:
            raise type(error)(f"problems[{index}]: {error}") from None
    raise ValueError("lse and lse_teacher must hold one (B, H, Nq) float32 tensor per problem")


def check_pooled_inputs(q: torch.Tensor, k: torch.Tensor, scale: float | None, squared: object) -> float:
    """Validate the inputs of the pooled attention vectors; return the softmax scale.

    Args:
        q: queries, (B, H, Nq, D).
        k: keys, (B, H, Nk, D), same dtype (float32, float16 or bfloat16) and device as ``q``.
        scale: softmax scale, > 0; None for D**-0.5.
        squared: whether the probabilities are squared before pooling (a bool).

    Returns:
        The scale to use.

    Raises:
        TypeError: a tensor argument is not a tensor or has an unsupported or differing
            dtype, ``scale`` is not a number or ``squared`` not a bool.
        ValueError: shapes, devices, strides or the scale do not fit.
    """
    for name, tensor in (("q", q), ("k", k)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (B, H, N, D), got shape {tuple(tensor.shape)}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}")
        if tensor.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(tensor.shape)}")
        if tensor.stride(-1) != 1 and tensor.size(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last (head) dimension, got strides "
                             f"{tensor.stride()}; call .contiguous() on it")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; both must match")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device} but q is on {q.device}; both must match")
    if k.shape[:2] != q.shape[:2] or k.size(-1) != q.size(-1):
        raise ValueError(f"k has shape {tuple(k.shape)} but q has {tuple(q.shape)}: B, H and D must match")
    if q.size(-1) > MAX_HEAD_DIM:
        raise ValueError(f"q head dim must be at most {MAX_HEAD_DIM}, got {q.size(-1)}")
    if not isinstance(squared, bool):
        raise TypeError(f"squared must be a bool, got {type(squared).__name__}")
    value = q.size(-1) ** -0.5 if scale is None else _check_positive_number("scale", scale)
    return _check_effective_scale("scale", value, 1.0)


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


def _per_problem_scales(name: str, value: object, count: int) -> list[float | None]:
    """``scales`` / ``teacher_scales`` of :func:`check_grouped_inputs` as one entry per problem."""
    if value is None or (isinstance(value, Real) and not isinstance(value, bool)):
        return [value] * count
    if isinstance(value, (torch.Tensor, str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be None, a number or a sequence of {count} numbers or None, "
                        f"got {type(value).__name__}")
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries but there are {count} problems")
    return list(value)


def check_grouped_inputs(
    problems: Sequence[Sequence[torch.Tensor]],
    *,
    scales: float | Sequence[float | None] | None,
    teacher_scales: float | Sequence[float | None] | None,
    options: AttentionKLOptions,
) -> list[AttentionKLProblem]:
    """Validate the L problems of ``attention_kl_grouped``: each as :func:`check_inputs` does,
    and all of one shape, dtype and device.

    Args:
        problems: L tuples (q, k, q_teacher, k_teacher).
        scales, teacher_scales: None, one number for every problem, or L numbers or None.
        options: the call's temperature, causal, reduction and backend, already checked.

    Returns:
        Each problem's sizes and effective scales.

    Raises:
        TypeError: a problem is not a sequence, a tensor is not one or its dtype is unsupported
            or differs between problems, or a scale argument has the wrong type.
        ValueError: no problems, a problem without four tensors, shapes or devices that differ
            between problems, as many scales as problems, or as :func:`check_inputs`.
    """
    if isinstance(problems, torch.Tensor) or not isinstance(problems, Sequence):
        raise TypeError(
            f"problems must be a sequence of (q, k, q_teacher, k_teacher) tuples, got {type(problems).__name__}"
        )
    if len(problems) == 0:
        raise ValueError("problems must hold at least one (q, k, q_teacher, k_teacher) tuple")
    student_scales = _per_problem_scales("scales", scales, len(problems))
    teacher_scale_values = _per_problem_scales("teacher_scales", teacher_scales, len(problems))
    checked = []
    for index, problem in enumerate(problems):
        if isinstance(problem, torch.Tensor) or not isinstance(problem, Sequence):
            raise TypeError(
                f"problems[{index}] must be a (q, k, q_teacher, k_teacher) tuple, got {type(problem).__name__}"
            )
        if len(problem) != 4:
            raise ValueError(
                f"problems[{index}] must hold 4 tensors (q, k, q_teacher, k_teacher), got {len(problem)}"
            )
        try:
            checked.append(
                check_inputs(*problem, options, scales=(student_scales[index], teacher_scale_values[index]))
            )
        except (TypeError, ValueError) as error:
            raise type(error)(f"problems[{index}]: {error}") from None
        for name, tensor, first in zip(_TENSOR_NAMES, problem, problems[0]):
            if tensor.shape != first.shape:
                raise ValueError(
                    f"problems[{index}]: {name} has shape {tuple(tensor.shape)} but problems[0]'s has "
                    f"{tuple(first.shape)}; all problems must share their shapes"
                )
            if tensor.dtype != first.dtype:
                raise TypeError(f"problems[{index}]: {name} has dtype {tensor.dtype} but problems[0]'s has {first.dtype}")
            if tensor.device != first.device:
                raise ValueError(f"problems[{index}]: {name} is on {tensor.device} but problems[0]'s is on {first.device}")
    return checked


def reduce_rows(row_kl: torch.Tensor, reduction: str, grouped: bool = False) -> torch.Tensor:
    """Apply ``reduction`` to per-row KL values of shape (B, H, Nq).

    With ``grouped`` the values are (L, B, H, Nq) and each problem is reduced on its own:
    (L,) for every reduction but "none".

    Every reduction is a sum, then a division: the backward then hands the kernels an
    expanded (row stride 0) gradient instead of materialising a (B, H, Nq) one as mean()'s
    does, which saves 4 bytes per query row and lets the dk kernel multiply by the
    gradient after its dot products (see the grad_after_dot switch of kernels.config).
    """
    if reduction == "none":
        return row_kl
    rows = row_kl.flatten(1) if grouped else row_kl.flatten()
    total = rows.sum(-1)
    divisor = {"sum": 1, "mean": rows.size(-1), "batchmean": row_kl.size(1 if grouped else 0)}[reduction]
    return total if divisor == 1 else total / divisor
