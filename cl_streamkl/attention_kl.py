"""Public entry points: :func:`attention_kl`, :func:`attention_kl_grouped` and :class:`AttentionKLDivLoss`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from cl_streamkl.kernels.config import FUSED_MAX_HEAD_DIM, FUSED_MIN_LENGTH, get_kernel_options
from cl_streamkl.kernels.torch_streaming import attention_kl_rows_torch
from cl_streamkl.kernels.validation import (
    AttentionKLOptions,
    check_given_lse,
    check_grouped_inputs,
    check_grouped_lse,
    check_inputs,
    reduce_rows,
)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda":
        from cl_streamkl.kernels.triton import INTERPRETING

        if device.type != "cpu" or not INTERPRETING:
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set "
                f"before triton is imported); got tensors on {device}. Use backend='torch' instead."
            )
    return backend


def _fused_weight(
    problems: Sequence[Sequence[torch.Tensor]], reduction: str, given: bool
) -> float | None:
    """The reduction's factor if the fused forward (KL and gradients in one pass) applies to these
    problems (q, k, q_teacher, k_teacher of one shape each), else None.

    It can where the gradient with respect to q and k is g times a fixed tensor: both
    log-sum-exps given, a scalar reduction, q or k needing a gradient and no teacher; it
    does as the ``fused_gradients`` switch says (``"auto"``: where it measured faster).
    """
    q, k, q_teacher, _ = problems[0]
    options = get_kernel_options()
    if (reduction == "none" or not given or not torch.is_grad_enabled() or options.deterministic
            or options.fused_gradients == "off" or any(t.requires_grad for problem in problems for t in problem[2:])
            or not (q.requires_grad or k.requires_grad) or max(q.size(-1), q_teacher.size(-1)) > FUSED_MAX_HEAD_DIM):
        return None
    if options.fused_gradients == "auto" and min(q.size(2), k.size(2)) < FUSED_MIN_LENGTH:
        return None
    return {"sum": 1.0, "mean": 1.0 / q.shape[:3].numel(), "batchmean": 1.0 / q.size(0)}[reduction]


def attention_kl(
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
    backend: str = "auto",
    lse: torch.Tensor | None = None,
    lse_teacher: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(P_teacher ‖ P_student) between two attention distributions, never materialised.

    P_student = softmax(q kᵀ · scale / temperature) over keys and P_teacher =
    softmax(q_teacher k_teacherᵀ · teacher_scale / temperature). The value is
    computed per (b, h, query row) in float32. There is no T² factor inside:
    multiply by ``temperature**2`` yourself if you want Hinton-style scaling.

    Args:
        q: student queries, (B, H, Nq, Ds).
        k: student keys, (B, H, Nk, Ds).
        q_teacher: teacher queries, (B, H, Nq, Dt); Dt may differ from Ds.
        k_teacher: teacher keys, (B, H, Nk, Dt).
            All four share dtype (float32, float16 or bfloat16) and device. The last
            dimension must have stride 1; any other strides are read in place (timm's
            q/k views of one permuted qkv tensor need no copy). Head dims up to 256.
        scale: student softmax scale, default Ds**-0.5.
        teacher_scale: teacher softmax scale, default Dt**-0.5.
        temperature: divides both score matrices; must be > 0.
        causal: mask key j > query i (needs Nq == Nk).
        reduction: "none" → (B, H, Nq); "sum"; "mean" (over all B·H·Nq rows);
            "batchmean" (sum / B).
        backend: "triton" (fused kernels; CUDA, or CPU under TRITON_INTERPRET=1),
            "torch" (pure-PyTorch streaming over key chunks) or "auto" (triton on
            CUDA, torch otherwise).
        lse: the student's log-sum-exps, if known: (B, H, Nq) float32 on q's device, any
            strides, natural log, logsumexp over keys of q kᵀ · scale / temperature. What
            ``scaled_dot_product_attention``'s fused backends compute for the same q, k and
            scale at temperature 1 (:class:`~cl_streamkl.capture.QKCapture` records it).
            Given with ``lse_teacher``, the forward takes one exponential per score instead
            of two. Treated as a constant: the gradient with respect to q and k is complete
            without one through ``lse``. A wrong ``lse`` gives a wrong KL; nothing checks it.
        lse_teacher: the teacher's, likewise; passed together with ``lse``. The value is
            corrected for errors in it (the teacher's probabilities are renormalised by their
            sum), so an ``lse_teacher`` off by rounding (or by a constant) costs the KL nothing.
            With a scalar reduction, q or k requiring grad and a frozen teacher, the forward
            computes the gradients too, in the same pass (the ``fused_gradients`` switch of
            :mod:`cl_streamkl.kernels.config`), and these take the teacher's probabilities
            as exp(scores − lse_teacher): exact for the log-sum-exp attention computes.

    Returns:
        A float32 tensor: (B, H, Nq) for reduction="none", else a scalar. Gradients
        flow to q and k, and to q_teacher/k_teacher when they require grad (mutual
        distillation); a frozen teacher costs no teacher-gradient work.

    Raises:
        TypeError: a tensor argument is not a tensor, or dtypes are unsupported or mixed.
        ValueError: shapes, devices, strides or options do not fit the contract above.

    Example:
        >>> q, k = torch.randn(2, 4, 197, 64), torch.randn(2, 4, 197, 64)
        >>> qt, kt = torch.randn(2, 4, 197, 64), torch.randn(2, 4, 197, 64)
        >>> attention_kl(q, k, qt, kt).shape
        torch.Size([])
    """
    options = AttentionKLOptions(scale, teacher_scale, temperature, causal, reduction, backend)
    return _attention_kl(q, k, q_teacher, k_teacher, options, lse, lse_teacher)


def _attention_kl(
    q: torch.Tensor, k: torch.Tensor, q_teacher: torch.Tensor, k_teacher: torch.Tensor, options: AttentionKLOptions,
    lse: torch.Tensor | None = None, lse_teacher: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attention_kl` with its options checked already."""
    problem = check_inputs(q, k, q_teacher, k_teacher, options)
    # None, or (lse, lse_teacher); tested with ``is not None``, which torch.compile traces.
    given = check_given_lse(lse, lse_teacher, q)
    if _resolve_backend(options.backend, q.device) == "triton":
        from cl_streamkl.kernels.triton import attention_kl_fused_triton, attention_kl_rows_triton

        weight = _fused_weight([(q, k, q_teacher, k_teacher)], options.reduction, given is not None)
        if weight is not None:
            return attention_kl_fused_triton(q, k, q_teacher, k_teacher, problem, *given, weight)

        row_kl = attention_kl_rows_triton(q, k, q_teacher, k_teacher, problem, *(given or ()))
    else:
        row_kl = attention_kl_rows_torch(q, k, q_teacher, k_teacher, problem, *(given or ()))
    return reduce_rows(row_kl, options.reduction)


def attention_kl_grouped(
    problems: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    scales: float | Sequence[float | None] | None = None,
    teacher_scales: float | Sequence[float | None] | None = None,
    temperature: float = 1.0,
    causal: bool = False,
    reduction: str = "mean",
    backend: str = "auto",
    lse: Sequence[torch.Tensor] | None = None,
    lse_teacher: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`attention_kl` of L problems of one shape at once: the distilled blocks of a model.

    Entry l equals ``attention_kl(*problems[l], scale=scales[l], teacher_scale=teacher_scales[l],
    temperature=temperature, causal=causal, reduction=reduction)``. On the triton backend the
    forward is one kernel launch for all L problems, the backward one launch per backward
    kernel (dq, dk), and the result has one autograd node; the torch backend computes the
    problems one after another.

    Args:
        problems: L tuples (q, k, q_teacher, k_teacher), each as in :func:`attention_kl`:
            q (B, H, Nq, Ds), k (B, H, Nk, Ds), q_teacher (B, H, Nq, Dt), k_teacher (B, H, Nk, Dt).
            Every problem has the same shapes, dtype and device; strides may differ from
            problem to problem (each is read in place, unit stride in the last dimension).
        scales: student softmax scales: None (Ds**-0.5 for all), one number for all, or L
            numbers or None.
        teacher_scales: teacher softmax scales, likewise (default Dt**-0.5).
        temperature: divides every score matrix; must be > 0.
        causal: mask key j > query i in every problem (needs Nq == Nk).
        reduction: "none" → (L, B, H, Nq); "sum", "mean" or "batchmean" → (L,), each
            problem reduced as :func:`attention_kl` reduces it.
        backend: "triton", "torch" or "auto", as in :func:`attention_kl`.
        lse, lse_teacher: None, or L log-sum-exps each, problem l's as :func:`attention_kl`
            takes them: both or neither.

    Returns:
        A float32 tensor, (L, B, H, Nq) or (L,). Gradients flow to every problem's q and k,
        and to q_teacher/k_teacher where they require grad, each in its input's layout.

    Raises:
        TypeError: a problem is not a tuple of tensors, dtypes are unsupported or differ.
        ValueError: no problems, a tuple without four tensors, shapes or devices that differ
            within or between problems, as many scales as problems, or a bad option.

    Example:
        >>> blocks = [tuple(torch.randn(2, 4, 197, 64) for _ in range(4)) for _ in range(12)]
        >>> attention_kl_grouped(blocks).shape
        torch.Size([12])
    """
    options = AttentionKLOptions(temperature=temperature, causal=causal, reduction=reduction, backend=backend)
    checked = check_grouped_inputs(problems, scales=scales, teacher_scales=teacher_scales, options=options)
    given = check_grouped_lse(lse, lse_teacher, problems)
    if _resolve_backend(backend, problems[0][0].device) == "triton":
        from cl_streamkl.kernels.triton import attention_kl_fused_triton_grouped, attention_kl_rows_triton_grouped

        weight = _fused_weight(problems, reduction, given is not None)
        if weight is not None:
            return attention_kl_fused_triton_grouped(problems, checked, *given, weight)

        row_kl = attention_kl_rows_triton_grouped(problems, checked, *(given or ()))
    else:
        given = list(zip(*given)) if given is not None else [()] * len(problems)
        row_kl = torch.stack([
            attention_kl_rows_torch(*tensors, problem, *known)
            for tensors, problem, known in zip(problems, checked, given)
        ])
    return reduce_rows(row_kl, reduction, grouped=True)


class AttentionKLDivLoss(nn.Module):
    """Module form of :func:`attention_kl`; the keyword options are fixed at construction.

    Example:
        >>> loss_fn = AttentionKLDivLoss(temperature=2.0, reduction="batchmean")
        >>> loss = loss_fn(q, k, q_teacher, k_teacher)
    """

    def __init__(
        self,
        *,
        scale: float | None = None,
        teacher_scale: float | None = None,
        temperature: float = 1.0,
        causal: bool = False,
        reduction: str = "mean",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        # Checked once here; every forward reuses them.
        self.options = AttentionKLOptions(scale, teacher_scale, temperature, causal, reduction, backend)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_teacher: torch.Tensor,
        k_teacher: torch.Tensor,
        lse: torch.Tensor | None = None,
        lse_teacher: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See :func:`attention_kl` for shapes, the log-sum-exps and the returned value."""
        return _attention_kl(q, k, q_teacher, k_teacher, self.options, lse, lse_teacher)

    def extra_repr(self) -> str:
        options = self.options
        return (
            f"temperature={options.temperature}, causal={options.causal}, "
            f"reduction={options.reduction!r}, backend={options.backend!r}"
        )
