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

Each hands back a (B, H, Nq) float32 view in natural log, or None where there is none: the
math backend, a head dim the backend would pad, an op whose signature this torch spells
otherwise. None means "fall back": the KL is then computed with both log-sum-exps online.
"""

from __future__ import annotations

import torch

__all__ = ["attention_with_lse", "lse_from_node"]

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
    if backend == 1 and query.size(-1) % 8 == 0:  # SDPA pads other head dims for flash; not this path.
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
