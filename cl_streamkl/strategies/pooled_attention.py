"""Pooled attention distillation (PAD; Pelosin et al. 2022), the published attention loss StreamKL is compared with.

PAD pools each attention map A = softmax(q kᵀ · scale), shape (B, H, Nq, Nk), to one vector
per sample, L2-normalises it and compares teacher and student per sample; the penalty is the
mean over the batch. Two variants, after the authors' ``olwf_asym.py``
(srvCodes/continual_learning_with_vit):

- ``symmetric`` (their ``--sym``, pooled ``spatial``): the squared maps (a softmax row
  always sums to 1, so pooling the plain map along keys would carry no information),
  pooled along queries (height) and along keys (width) PODNet-style, all heads
  concatenated; the penalty is ‖t − s‖₂, attention moving anywhere costs.
- ``asymmetric`` (their headline runs, pooled along ``height``): the maps summed over
  queries, one value per key and head, normalised; the penalty is ‖ReLU(t − s)‖₂, so
  only attention the student takes away from where the teacher looked costs, and new
  attention is free. The authors' code also offers normalising after the ReLU (its
  default): the L2 norm of a normalised vector is 1 whatever the input, so that form's
  gradient vanishes and it adds a constant; the normalise-then-ReLU form used here is
  their ``--after-norm`` path and ``olwf_asym_original.py``'s formula.

The authors record the scaled scores before the softmax; the project pools the softmax
maps (what StreamKL distils) for both variants.

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
from cl_streamkl.kernels.validation import check_pooled_inputs
from cl_streamkl.pooled_attention import pooled_attention
from cl_streamkl.strategies.distiller import AttentionDistiller

__all__ = ["PAD_VARIANTS", "STREAMING_THRESHOLD", "PooledAttentionDistiller", "pooled_attention_distance",
           "pooled_maps_distance"]

PAD_VARIANTS = ("symmetric", "asymmetric")
# Attention-map entries (B·H·Nq·Nk) above which streaming="auto" streams: 64 MiB per float32
# map. ViT-B at 197 tokens and batch 32 (14.9 M entries) stays materialised.
STREAMING_THRESHOLD = 2**24


def _check_streaming(streaming: object) -> bool | str:
    """``streaming`` if it is True, False or "auto".

    Raises:
        ValueError: anything else.
    """
    if streaming is True or streaming is False or streaming == "auto":
        return streaming
    raise ValueError(f"streaming must be True, False or 'auto', got {streaming!r}")


def _check_variant(variant: object) -> str:
    if variant not in PAD_VARIANTS:
        raise ValueError(f"variant must be one of {PAD_VARIANTS}; got {variant!r}")
    return variant  # type: ignore[return-value]


def _pool_maps(maps: torch.Tensor, variant: str) -> torch.Tensor:
    """(B, H, Nq, Nk) maps → (B, H, Nk + Nq) (symmetric) or (B, H, Nk) (asymmetric) pooled values."""
    if variant == "symmetric":
        squared = maps.square()
        return torch.cat([squared.sum(dim=-2), squared.sum(dim=-1)], dim=-1)
    return maps.sum(dim=-2)


def _distance(teacher: torch.Tensor, student: torch.Tensor, variant: str) -> torch.Tensor:
    """(B, H, P) pooled values of both → the batch mean of the per-sample distance of the normalised vectors."""
    difference = F.normalize(teacher.flatten(1), dim=1) - F.normalize(student.flatten(1), dim=1)
    if variant == "asymmetric":
        difference = torch.relu(difference)
    return difference.norm(dim=1).mean()


def pooled_maps_distance(teacher_maps: torch.Tensor, student_maps: torch.Tensor,
                         variant: str = "asymmetric") -> torch.Tensor:
    """PAD between two materialised attention maps of one block.

    Args:
        teacher_maps, student_maps: (B, H, Nq, Nk) attention maps, same shape.
        variant: ``"symmetric"`` or ``"asymmetric"`` (see the module's docstring).

    Returns:
        A 0-dim tensor in the maps' dtype: mean over the batch of ‖t̂ − ŝ‖₂
        (symmetric) or ‖ReLU(t̂ − ŝ)‖₂ (asymmetric), with t̂, ŝ the normalised pooled maps.

    Raises:
        ValueError: unknown variant, or maps that are not 4-D of the same shape.
    """
    _check_variant(variant)
    if teacher_maps.dim() != 4 or teacher_maps.shape != student_maps.shape:
        raise ValueError(f"teacher_maps {tuple(teacher_maps.shape)} and student_maps {tuple(student_maps.shape)} "
                         "must be 4-D (B, H, Nq, Nk) of the same shape")
    return _distance(_pool_maps(teacher_maps, variant), _pool_maps(student_maps, variant), variant)


def _pooled_attention(q: torch.Tensor, k: torch.Tensor, scale: float, streaming: bool | str,
                      variant: str) -> torch.Tensor:
    """(B, H, Nq, D), (B, H, Nk, D) → :func:`_pool_maps` of the float32 softmax attention."""
    if streaming == "auto":
        streaming = q.size(0) * q.size(1) * q.size(2) * k.size(2) > STREAMING_THRESHOLD
    if not streaming:
        return _pool_maps(torch.softmax(q.float() @ k.float().transpose(-2, -1) * scale, dim=-1), variant)
    per_key, per_row = pooled_attention(q, k, scale=scale, squared=variant == "symmetric")
    return torch.cat([per_key, per_row], dim=-1) if variant == "symmetric" else per_key


def pooled_attention_distance(
    q: torch.Tensor,
    k: torch.Tensor,
    q_teacher: torch.Tensor,
    k_teacher: torch.Tensor,
    *,
    scale: float | None = None,
    teacher_scale: float | None = None,
    streaming: bool | str = "auto",
    variant: str = "asymmetric",
) -> torch.Tensor:
    """PAD between the teacher's and the student's attention of one block.

    Args:
        q, k: the student's queries (B, H, Nq, D) and keys (B, H, Nk, D), as
            :func:`cl_streamkl.pooled_attention` takes them whatever ``streaming`` says
            (float32, float16 or bfloat16, one dtype, D <= 256).
        q_teacher, k_teacher: the teacher's, same B, H, Nq, Nk (head dim may differ).
        scale, teacher_scale: softmax scales (default: head dim ** -0.5 of each).
        streaming: True: pool without materialising the maps (:func:`cl_streamkl.pooled_attention`,
            Triton kernels on CUDA); False: materialise them in float32; "auto": stream when a map
            holds more than :data:`STREAMING_THRESHOLD` entries.
        variant: ``"symmetric"`` or ``"asymmetric"`` (see :func:`pooled_maps_distance`).

    Returns:
        A 0-dim float32 tensor, :func:`pooled_maps_distance` of the two softmax maps;
        differentiable w.r.t. every input that requires grad.

    Raises:
        ValueError: the inputs are not 4-D, their batch, heads or lengths differ, a pair's
            head dims differ, a tensor is empty, a scale is not a finite number > 0,
            ``streaming`` is not True, False or "auto", or the variant is unknown; and
            whatever else :func:`cl_streamkl.pooled_attention` refuses, on either path.
        TypeError: a dtype other than float32, float16 or bfloat16, or a pair's dtypes differ.
    """
    _check_streaming(streaming)
    _check_variant(variant)
    tensors = {"q": q, "k": k, "q_teacher": q_teacher, "k_teacher": k_teacher}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, N, D)")
    if q.shape[:3] != q_teacher.shape[:3] or k.shape[:3] != k_teacher.shape[:3] or q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"student q {tuple(q.shape)} / k {tuple(k.shape)} and teacher q {tuple(q_teacher.shape)} / "
            f"k {tuple(k_teacher.shape)} must share batch, heads and lengths"
        )
    # Both paths take the inputs the streamed op takes, whichever "auto" picks for these lengths.
    squared = variant == "symmetric"
    scale = check_pooled_inputs(q, k, scale, squared)
    try:
        teacher_scale = check_pooled_inputs(q_teacher, k_teacher, teacher_scale, squared)
    except (TypeError, ValueError) as err:
        raise type(err)(f"teacher (q_teacher, k_teacher): {err}") from None
    student = _pooled_attention(q, k, scale, streaming, variant)
    teacher = _pooled_attention(q_teacher, k_teacher, teacher_scale, streaming, variant)
    return _distance(teacher, student, variant)


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
        variant: ``"symmetric"`` or ``"asymmetric"`` (see :func:`pooled_maps_distance`).
    """

    state_format = "cl_streamkl.PooledAttentionDistiller/2"
    # Written before the asymmetric variant existed: symmetric.
    previous_state_format = "cl_streamkl.PooledAttentionDistiller/1"

    def __init__(self, alpha: float = 1.0, layers: LayerSpec = "all",
                 compile_teacher: bool | str | Mapping[str, Any] = "auto", streaming: bool | str = "auto",
                 variant: str = "asymmetric") -> None:
        super().__init__(alpha=alpha, layers=layers, compile_teacher=compile_teacher)
        self.streaming = _check_streaming(streaming)
        self.variant = _check_variant(variant)

    def layer_penalties(
        self, problems: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]]
    ) -> torch.Tensor:
        """One PAD value per distilled block, (L,) float32."""
        return torch.stack([
            pooled_attention_distance(q, k, q_t, k_t, scale=scale, teacher_scale=teacher_scale,
                                      streaming=self.streaming, variant=self.variant)
            for q, k, q_t, k_t, scale, teacher_scale in problems
        ])

    def _config(self) -> dict[str, Any]:
        return {"alpha": self.alpha,
                "layers": list(self.layers) if isinstance(self.layers, (list, tuple)) else self.layers,
                "variant": self.variant}

    def load_state_dict(self, state: dict[str, Any], model: torch.nn.Module | None = None) -> None:
        """As the distiller's; a state of the previous format restores into a symmetric distiller."""
        if isinstance(state, dict) and state.get("format") == self.previous_state_format:
            state = {**state, "format": self.state_format, "config": {**state["config"], "variant": "symmetric"}}
        super().load_state_dict(state, model)

    def __repr__(self) -> str:
        return (f"PooledAttentionDistiller(alpha={self.alpha}, layers={self.layers!r}, variant={self.variant!r}, "
                f"compile_teacher={self.compile_teacher!r}, streaming={self.streaming!r}, "
                f"teacher_updates={self.teacher_updates})")
