"""Read ``nn.MultiheadAttention`` (torchvision's ``VisionTransformer``) for :class:`QKCapture`.

``nn.MultiheadAttention`` does not form its scores with a product the watcher of
:mod:`cl_streamkl.capture.extractors` can see on every path: in eval mode without
gradients it runs one fused native kernel, and with ``need_weights=True`` it folds the
scale into ``q`` before a ``bmm``. So its extractor does not watch the forward. A forward
pre-hook projects the call's ``query`` and ``key`` with the module's own input-projection
weights, exactly as :func:`torch.nn.functional.multi_head_attention_forward` does, and
records them as (B, H, N, D) with the scale ``D**-0.5``: the same q and k (to rounding)
and the same autograd graph to ``in_proj_weight`` / ``in_proj_bias``, at the cost of
projecting q and k a second time.

Calls whose scores are more than ``q kᵀ`` are refused with an error naming the module:
``attn_mask``, ``key_padding_mask``, ``is_causal=True``, and modules built with
``add_bias_kv`` or ``add_zero_attn`` (extra key tokens).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from cl_streamkl.capture.hooks import RecordQK, Removable, qualified_type_name

__all__ = ["multihead_attention_extractor", "multihead_qk"]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _fail(module: nn.Module, why: str) -> RuntimeError:
    return RuntimeError(f"QKCapture cannot read the attention scores of {qualified_type_name(module)}: {why}")


def _heads(projected: torch.Tensor, module: nn.MultiheadAttention) -> torch.Tensor:
    """(B, N, E) → (B, H, N, D), a view."""
    batch, tokens, _ = projected.shape
    return projected.view(batch, tokens, module.num_heads, module.head_dim).transpose(1, 2)


def multihead_qk(
    module: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head queries and keys ``module`` multiplies for one call.

    Args:
        module: the attention module.
        query: (B, Nq, E) with ``batch_first``, else (Nq, B, E); or unbatched (Nq, E).
        key: (B, Nk, kdim) with ``batch_first``, else (Nk, B, kdim); or unbatched (Nk, kdim).

    Returns:
        q (B, H, Nq, D) and k (B, H, Nk, D), B = 1 for unbatched inputs, before the
        softmax scale ``D**-0.5``.
    """
    if query.dim() == 2:
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    elif not module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    embed = module.embed_dim
    if module._qkv_same_embed_dim:
        w_q, w_k = module.in_proj_weight[:embed], module.in_proj_weight[embed : 2 * embed]
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    bias = module.in_proj_bias
    b_q, b_k = (None, None) if bias is None else (bias[:embed], bias[embed : 2 * embed])
    return _heads(F.linear(query, w_q, b_q), module), _heads(F.linear(key, w_k, b_k), module)


def multihead_attention_extractor(module: nn.Module, record: RecordQK) -> list[Removable]:
    """The extractor registered for ``nn.MultiheadAttention``.

    Args:
        module: an ``nn.MultiheadAttention``.
        record: called with ``(q, k, D**-0.5)`` before each forward, q (B, H, Nq, D)
            and k (B, H, Nk, D) as :func:`multihead_qk` computes them.

    Returns:
        One handle whose ``remove()`` removes the pre-hook.

    Raises:
        RuntimeError: at forward, when the call passes a mask or ``is_causal=True``, or
            when the module adds key tokens (``add_bias_kv``, ``add_zero_attn``).
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"multihead_attention_extractor reads nn.MultiheadAttention, got {qualified_type_name(module)}")

    def before(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        call = _SIGNATURE.bind(module, *args, **kwargs).arguments
        masks = [name for name in ("attn_mask", "key_padding_mask") if call.get(name) is not None]
        if masks or call.get("is_causal", False):
            raise _fail(module, f"it is called with {' and '.join(masks) or 'is_causal=True'}, "
                        "so q and k alone do not describe its scores")
        if module.bias_k is not None or module.add_zero_attn:
            raise _fail(module, "it adds key tokens (add_bias_kv or add_zero_attn) that q and k do not hold")
        q, k = multihead_qk(module, call["query"], call["key"])
        record(q, k, module.head_dim**-0.5)

    return [module.register_forward_pre_hook(before, with_kwargs=True)]
