"""Pooled attention distillation (PAD; Pelosin et al. 2022), the published attention loss StreamKL is compared with.

PAD materialises both attention maps, A = softmax(q kᵀ · scale), shape (B, H, Nq, Nk);
squares them (the authors' symmetric variant: a softmax row always sums to 1, so pooling
the plain map along keys would carry no information); pools each map along queries
(height) and along keys (width), PODNet-style; concatenates the pooled vectors of all
heads per sample; L2-normalises them; and takes the Euclidean (Frobenius) distance
between teacher and student per sample, averaged over the batch.

Materialised, its memory is O(B·H·Nq·Nk), which suits short token counts only. Streamed
(``streaming=True``, or ``"auto"`` when a map would hold more than :data:`STREAMING_THRESHOLD`
entries) the pooled vectors come from :func:`cl_streamkl.pooled_attention`, which never forms
the map: O(B·H·(Nq + Nk)) memory, the same value up to rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from cl_streamkl.capture import LayerSpec
from cl_streamkl.pooled_attention import pooled_attention
from cl_streamkl.strategies.distiller import AttentionDistiller

__all__ = ["STREAMING_THRESHOLD", "PooledAttentionDistiller", "pooled_attention_distance"]

# Attention-map entries (B·H·Nq·Nk) above which streaming="auto" streams: 64 MiB per float32
# map. ViT-B at 197 tokens and batch 32 (14.9 M) stays materialised.
STREAMING_THRESHOLD = 2**24


def _check_streaming(streaming: object) -> bool | str:
    """``streaming`` if it is True, False or "auto".

    Raises:
        ValueError: anything else.
    """
    if streaming is True or streaming is False or streaming == "auto":
        return streaming
    raise ValueError(f"streaming must be True, False or 'auto', got {streaming!r}")


def _pooled_attention(q: torch.Tensor, k: torch.Tensor, scale: float, streaming: bool | str) -> torch.Tensor:
    """(B, H, Nq, D), (B, H, Nk, D) → (B, H·(Nk + Nq)) L2-normalised pooled squared attention."""
    if streaming == "auto":
        streaming = q.size(0) * q.size(1) * q.size(2) * k.size(2) > STREAMING_THRESHOLD
    if streaming:
        pooled = torch.cat(pooled_attention(q, k, scale=scale), dim=-1)
    else:
        attention = torch.softmax(q.float() @ k.float().transpose(-2, -1) * scale, dim=-1).square()
        pooled = torch.cat([attention.sum(dim=-2), attention.sum(dim=-1)], dim=-1)
    return F.normalize(pooled.flatten(1), dim=1)


def pooled_attention_distance(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    *,
    scale: float | None = None,
    teacher_scale: float | None = None,
    streaming: bool | str = "auto",
) -> torch.Tensor:
    """PAD between the teacher's and the student's attention of one block.

    Args:
        q, k: the student's queries (B, H, Nq, D) and keys (B, H, Nk, D).
        q_teacher, k_teacher: the teacher's, same B, H, Nq, Nk (head dim may differ).
        scale, teacher_scale: softmax scales (default: head dim ** -0.5 of each).
        streaming: True: pool without materialising the maps (:func:`cl_streamkl.pooled_attention`,
            Triton kernels on CUDA); False: materialise them in float32; "auto": stream when a map
            holds more than :data:`STREAMING_THRESHOLD` entries.

    Returns:
        A 0-dim float32 tensor: mean over the batch of ‖â_teacher − â_student‖₂, with â
        the normalised pooled maps; differentiable w.r.t. every input that requires grad.

    Raises:
        ValueError: the inputs are not 4-D or their batch, heads or lengths differ, or
            ``streaming`` is not True, False or "auto".
    """
    _check_streaming(streaming)
    tensors = {"q": q, "k": k, "q_teacher": q_teacher, "k_teacher": k_teacher}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, N, D)")
    if q.shape[:3] != q_teacher.shape[:3] or k.shape[:3] != k_teacher.shape[:3] or q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"student q {tuple(q.shape)} / k {tuple(k.shape)} and teacher q {tuple(q_teacher.shape)} / "
            f"k {tuple(k_teacher.shape)} must share batch, heads and lengths"
        )
    student = _pooled_attention(q, k, q.shape[-1] ** -0.5 if scale is None else scale, streaming)
    teacher = _pooled_attention(q_teacher, k_teacher,
                                q_teacher.shape[-1] ** -0.5 if teacher_scale is None else teacher_scale, streaming)
    return (teacher - student).norm(dim=1).mean()


class PooledAttentionDistiller(AttentionDistiller):
    """:class:`~cl_streamkl.strategies.distiller.AttentionDistiller` with PAD as the per-block penalty.

    The teacher snapshot, the Q/K capture and the state handling are the distiller's;
    only the loss differs: ``alpha`` × the mean over the selected blocks of
    :func:`pooled_attention_distance`.

    Args:
        alpha: weight of the penalty, >= 0.
        layers: blocks to distil (``"all"``, an int n for the last n, or a list of indices).
        compile_teacher: as for the distiller.
        streaming: as for :func:`pooled_attention_distance`. An execution choice (the value
            is the same up to rounding): not part of :meth:`state_dict`.
    """

    state_format = "cl_streamkl.PooledAttentionDistiller/1"

    def __init__(self, alpha: float = 1.0, layers: LayerSpec = "all",
                 compile_teacher: bool | Mapping[str, Any] = False, streaming: bool | str = "auto") -> None:
        super().__init__(alpha=alpha, layers=layers, compile_teacher=compile_teacher)
        self.streaming = _check_streaming(streaming)

    def layer_penalties(
        self, problems: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]]
    ) -> torch.Tensor:
        """One PAD value per distilled block, (L,) float32."""
        return torch.stack([
            pooled_attention_distance(q, k, q_t, k_t, scale=scale, teacher_scale=teacher_scale,
                                      streaming=self.streaming)
            for q, k, q_t, k_t, scale, teacher_scale in problems
        ])

    def _config(self) -> dict[str, Any]:
        return {"alpha": self.alpha,
                "layers": list(self.layers) if isinstance(self.layers, (list, tuple)) else self.layers}

    def __repr__(self) -> str:
        return (f"PooledAttentionDistiller(alpha={self.alpha}, layers={self.layers!r}, "
                f"compile_teacher={self.compile_options is not None}, streaming={self.streaming!r}, "
                f"teacher_updates={self.teacher_updates})")
