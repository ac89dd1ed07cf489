"""What the compiled captures share: recording the attention calls of a traced forward, and the check.

:class:`SdpaRecorder` is entered inside a function that ``torch.compile`` traces; Dynamo
inlines its ``__torch_function__`` into the graph, so the recorded tensors become graph
outputs (:mod:`cl_streamkl.capture.compiled`, :mod:`cl_streamkl.capture.compiled_model`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cl_streamkl.capture.attention_lse import run_with_lse

__all__ = ["MATCH_RTOL", "Record", "SdpaRecorder", "input_signature", "qk_error", "relative_error"]

# A wrong tensor (another block's, q for k, no rotary/qk-norm) is O(1) away in relative
# terms; compiled and eager low-precision arithmetic differ by rounding, far below this.
MATCH_RTOL = 0.1

_SDPA_ARGUMENT_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")

Record = tuple[torch.Tensor, torch.Tensor, float, bool, "torch.Tensor | None"]
"""``(query, key, scale, plain, lse)`` of one call; ``plain``: no mask and not causal, so the
scores are just ``scale · q kᵀ``; ``lse``: their (B, H, Nq) log-sum-exp where the recorder
was asked for it, else None."""


class SdpaRecorder(TorchFunctionMode):
    """Appends a :data:`Record` of every ``F.scaled_dot_product_attention`` call to a list.

    Kept minimal on purpose: Dynamo inlines ``__torch_function__`` for every torch call of
    the forward, so anything here becomes part of the traced program.

    Args:
        records: the list to append to.
        lse_backend: None, or the fused backend (:func:`~cl_streamkl.capture.attention_lse.lse_backend`)
            whose op runs each plain call in SDPA's place and records its log-sum-exp.
    """

    def __init__(self, records: list[Record], lse_backend: int | None = None) -> None:
        super().__init__()
        self.records = records
        self.lse_backend = lse_backend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = {**dict(zip(_SDPA_ARGUMENT_NAMES, args)), **kwargs}
            q, k, scale = bound["query"], bound["key"], bound.get("scale")
            plain = bound.get("attn_mask") is None and not bound.get("is_causal", False)
            lse = None
            if self.lse_backend is not None and plain and not bound.get("enable_gqa", False):
                out, lse = run_with_lse(self.lse_backend, q, k, bound["value"], bound.get("dropout_p", 0.0), scale)
            else:
                out = func(*args, **kwargs)
            self.records.append((q, k, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, plain, lse))
            return out
        return func(*args, **kwargs)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (the plain difference when expected is 0)."""
    difference = torch.linalg.vector_norm((actual - expected).double())
    size = torch.linalg.vector_norm(expected.double())
    return float(difference / size) if size > 0 else float(difference)


def qk_error(q: torch.Tensor, k: torch.Tensor, q_reference: torch.Tensor, k_reference: torch.Tensor) -> float:
    """The larger relative difference of ``q`` and ``k`` from their references (no autograd graph)."""
    return max(relative_error(q.detach(), q_reference.detach()), relative_error(k.detach(), k_reference.detach()))


def input_signature(x: torch.Tensor, *, batch: bool = True) -> tuple:
    """What a compiled forward's first-call check is keyed by for input ``x``: its shape (without
    the batch size when ``batch`` is False), dtype, device and its device's autocast state."""
    autocast = torch.is_autocast_enabled(x.device.type)
    autocast_dtype = torch.get_autocast_dtype(x.device.type) if autocast else None
    return (tuple(x.shape if batch else x.shape[1:]), x.dtype, x.device, autocast, autocast_dtype)
