"""The log-sum-exp of a fused ``scaled_dot_product_attention`` call, where SDPA computes one.

StreamKL's forward takes one exponential per score instead of two when it is handed both
models' log-sum-exps (:func:`cl_streamkl.attention_kl`'s ``lse`` and ``lse_teacher``). The
models' attention computes them anyway:

* With gradients (the student in training) the fused backends keep the LSE for their own
  backward: the SDPA node on the output saves it as ``_saved_logsumexp`` (cuDNN, flash, and
  flash on the CPU) or ``_saved_log_sumexp`` (efficient, its rows padded to a multiple of 32).
  :func:`lse_from_node` reads it; nothing in the model's forward or backward changes.
* Without gradients (the frozen teacher) SDPA asks no backend for it, so
  :func:`attention_with_lse` calls the backend op SDPA would pick
  (``torch._fused_sdp_choice``) with ``compute_log_sumexp=True``: the same output, plus the LSE.
* Inside a compiled forward (the compiled teacher) the backend is picked once, outside the
  traced code, by :func:`lse_backend`, and :func:`run_with_lse` runs its op in SDPA's place.

Each hands back a (B, H, Nq) float32 view in natural log, or None where there is none: the
math backend, a head dim the backend would pad, an op whose signature this torch spells
otherwise. None means "fall back": the KL is then computed with both log-sum-exps online.
"""

from __future__ import annotations

import torch

__all__ = ["attention_with_lse", "lse_backend", "lse_from_node", "run_with_lse"]

_LSE_ATTRIBUTES = ("_saved_logsumexp", "_saved_log_sumexp")


def _rows(lse: torch.Tensor, n_q: int) -> torch.Tensor | None:
    """(B, H, Nq) view of a backend's LSE: cuDNN's (B, H, Nq, 1), efficient's (B, H, ⌈Nq/32⌉·32)."""
    if lse.dim() == 4 and lse.size(-1) == 1:
        lse = lse[..., 0]
    if lse.dim() != 3 or lse.size(-1) < n_q or lse.dtype != torch.float32:
        return None
    return lse[..., :n_q]


def lse_from_node(node: object, n_q: int) -> torch.Tensor | None:
    """The LSE a fused SDPA backward node saved, as a (B, H, Nq) float32 view; None if it saved none.

    Args:
        node: an SDPA autograd node (``out.grad_fn`` of the call).
        n_q: the call's number of query rows.
    """
    for name in _LSE_ATTRIBUTES:
        lse = getattr(node, name, None)
        if isinstance(lse, torch.Tensor):
            return _rows(lse, n_q)
    return None


def _backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, scale: float | None):
    """Which fused SDPA backend a call without a mask would run on (``SDPBackend`` value), or None."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    try:
        return int(choose(query, key, value, None, dropout_p, False, scale=scale))
    except (RuntimeError, TypeError):
        return None


def _run_backend(backend: int, query, key, value, dropout_p: float, scale: float | None):
    """(output, lse) of the aten op of ``backend`` (1 flash, 2 efficient, 3 cuDNN), or None."""
    aten = torch.ops.aten
    if backend == 1 and query.device.type == "cpu":  # The CPU's flash kernel always keeps its LSE.
        result = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, False, scale=scale)
    elif backend == 1 and query.size(-1) % 8 == 0:  # SDPA pads other head dims for flash; not this path.
        result = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, False, False, scale=scale)
    elif backend == 2:
        result = aten._scaled_dot_product_efficient_attention(query, key, value, None, True, dropout_p, False,
                                                              scale=scale)
    elif backend == 3:
        result = aten._scaled_dot_product_cudnn_attention(query, key, value, None, True, dropout_p, False, False,
                                                          scale=scale)
    else:
        return None
    return result[0], result[1]


def lse_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None) -> int | None:
    """The fused backend :func:`run_with_lse` would run for these inputs without a mask, or None.

    Picked outside a compiled region (``torch._fused_sdp_choice`` is no traceable op) from
    example inputs of the call's shape, dtype and device: the backend SDPA itself would use.
    None for the math backend, a head dim flash would pad, or a probe that fails.

    Args:
        query, key, value: (B, H, N, D) example inputs of the attention call.
        scale: the call's ``scale`` argument (None: D**-0.5).
    """
    if query.dim() != 4 or query.device.type not in ("cuda", "cpu"):
        return None
    backend = _backend(query, key, value, 0.0, scale)
    if backend is None or (query.device.type == "cpu" and backend != 1):
        return None
    with torch.no_grad():
        try:  # One real call: a torch whose op takes other arguments fails here, not in compiled code.
            result = _run_backend(backend, query[:1], key[:1], value[:1], 0.0, scale)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return None
    if result is None or _rows(result[1], query.size(2)) is None:
        return None
    return backend


def run_with_lse(
    backend: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA's output for a call without a mask through ``backend``'s op, and its (B, H, Nq) LSE.

    Args:
        backend: from :func:`lse_backend` for inputs like these.
        query, key, value: (B, H, N, D).
        dropout_p, scale: the call's arguments.

    Returns:
        (output (B, H, Nq, Dv), LSE (B, H, Nq) float32 natural log, or None if its layout is unknown).

    Raises:
        ValueError: ``backend`` runs no op for these inputs.
    """
    result = _run_backend(backend, query, key, value, dropout_p, scale)
    if result is None:
        raise ValueError(f"run_with_lse: backend {backend} has no log-sum-exp op for {query.device.type} inputs "
                         f"with head dim {query.size(-1)}")
    return result[0], _rows(result[1], query.size(2))


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``F.scaled_dot_product_attention(query, key, value, dropout_p=..., scale=...)`` and its LSE.

    For gradient-free CUDA calls without a mask: the fused backend SDPA would choose, asked
    for its log-sum-exp. None (call SDPA as usual) under grad mode, off CUDA, for the math
    backend or where this torch's backend op does not take these arguments.

    Returns:
        (output as SDPA returns it, LSE (B, H, Nq) float32 natural log, or None if the op's
        LSE has a layout this module does not know), or None where the op was not run.
    """
    if torch.is_grad_enabled() or not query.is_cuda or query.dim() != 4:
        return None
    backend = _backend(query, key, value, dropout_p, scale)
    if backend is None:
        return None
    try:
        result = _run_backend(backend, query, key, value, dropout_p, scale)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        # A torch whose op takes other arguments (2.4's cuDNN op has no attn_bias), or inputs its
        # kernel refuses after all: SDPA runs as usual and this block has no LSE.
        return None
    if result is None:
        return None
    output, lse = result
    return output, _rows(lse, query.size(2))
