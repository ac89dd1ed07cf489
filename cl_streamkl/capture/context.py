"""Record the queries and keys that a vision transformer's selected attention blocks multiply.

:class:`QKCapture` hooks the attention module of selected blocks and records, for every
forward, the exact ``q`` and ``k`` tensors whose product becomes that block's attention
scores: after qk-norm, after rotary embeddings, before the softmax scale. The tensors are
the ones the model itself uses, so they keep their autograd graph and their strides
(timm's ``q``/``k`` are strided views of one permuted ``qkv`` tensor); nothing is copied.
How each block is read is up to the extractor registered for its attention class (see
:mod:`cl_streamkl.capture.extractors`).

Example:
    >>> with QKCapture(model, layers=[-2, -1]) as cap:
    ...     logits = model(x)
    >>> q, k = cap.qk[0]          # block len(blocks) - 2, each (B, H, N, D)
"""

from __future__ import annotations

import torch
from torch import nn

from cl_streamkl.capture.extractors import qk_extractor_for
from cl_streamkl.capture.hooks import RecordQK, Removable, lse_or_none, qualified_type_name
from cl_streamkl.capture.layers import LayerSpec, find_attention_modules, resolve_layer_indices

__all__ = ["QKCapture"]


class _CaptureComplete(Exception):
    """Raised by a ``stop_early`` capture to end the forward; its ``with`` block swallows it."""


class QKCapture:
    """Context manager recording the Q/K each selected block's attention multiplies.

    The model and the layer selection are checked at construction; hooks exist only
    inside the ``with`` block and are removed on exit, also when the forward raises.
    When the model runs several times inside one ``with``, ``qk`` holds the last run.

    Args:
        model: a vision transformer whose blocks' attention classes have extractors
            (timm ViT/DeiT/DeiT-3/EVA/EVA-02, torchvision ViT, and transformers' ViT,
            DeiT, DINOv2, CLIP and SigLIP vision models out of the box).
        layers: ``"all"``, an int n (the last n blocks) or a list of block indices
            (negative allowed).
        stop_early: end the model's forward as soon as every selected block's attention
            has run, skipping the rest (later blocks, the MLP of the last one, the head),
            and leave the ``with`` block at once: for a teacher whose output is not
            needed. Statements after the forward inside the ``with`` do not run. A model
            compiled by :func:`~cl_streamkl.capture.compiled_model.compile_model` runs
            its whole forward (its Q/K arrive at the end).

    Attributes:
        block_indices: resolved absolute block indices, ascending.
        attention_modules: the attention module of each selected block.

    Raises:
        TypeError: the model has no capturable attention (see :func:`find_attention_modules`).
        ValueError: the layer selection does not fit the model.
    """

    def __init__(self, model: nn.Module, layers: LayerSpec = "all", *, stop_early: bool = False) -> None:
        modules = find_attention_modules(model)
        self.stop_early = stop_early
        self.model = model
        self.block_indices: list[int] = resolve_layer_indices(layers, len(modules))
        self.attention_modules: list[nn.Module] = [modules[i] for i in self.block_indices]
        # (q, k, scale, lse or None) per selected block
        self._records: list[tuple | None] = [None] * len(self.block_indices)
        self._handles: list[Removable] = []

    def _recorder(self, slot: int) -> RecordQK:
        def record(q: torch.Tensor, k: torch.Tensor, scale: float, lse: torch.Tensor | None = None) -> None:
            self._records[slot] = (q, k, scale, lse_or_none(lse))

        return record

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._handles)

    def __enter__(self) -> QKCapture:
        if self._handles:
            raise RuntimeError("this QKCapture is already active; it cannot be entered twice")
        self.clear()
        try:
            for slot, module in enumerate(self.attention_modules):
                extractor = qk_extractor_for(module)
                if extractor is None:
                    raise TypeError(f"no Q/K extractor is registered for {qualified_type_name(module)} any more")
                self._handles.extend(extractor(module, self._recorder(slot)))
            if self.stop_early:
                # Registered after the extractors' hooks, so it runs once they have recorded. Not on
                # the attention of a compiled model (capture.compiled_model): a hook inside it would
                # make Dynamo recompile, and its Q/K arrive only after the whole forward anyway.
                self._handles.extend(
                    module.register_forward_hook(self._stop_if_complete) for module in self.attention_modules
                    if not getattr(module, "replays_compiled_forward", False)
                )
        except BaseException:
            self.remove_hooks()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> bool:
        self.remove_hooks()
        return exc_type is _CaptureComplete

    def _stop_if_complete(self, _module: nn.Module, _args: tuple, _output: object) -> None:
        if all(record is not None for record in self._records):
            raise _CaptureComplete

    def remove_hooks(self) -> None:
        """Remove every hook this capture installed (idempotent); recorded tensors are kept."""
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            handle.remove()

    def clear(self) -> None:
        """Drop the recorded tensors (and the autograd graph they keep alive)."""
        self._records = [None] * len(self.block_indices)

    def _complete_records(self) -> list[tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]]:
        missing = [self.block_indices[i] for i, rec in enumerate(self._records) if rec is None]
        if missing:
            raise RuntimeError(
                f"no Q/K was captured for blocks {missing}: run the model inside the `with QKCapture(...)` block"
            )
        return self._records  # type: ignore[return-value]

    @property
    def qk(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(q, k), ...]`` per selected block: q (B, H, Nq, D), k (B, H, Nk, D).

        Exactly the tensors the block multiplies (views with the model's strides and
        autograd graph). Raises ``RuntimeError`` if a selected block has not run.
        """
        return [(q, k) for q, k, _, _ in self._complete_records()]

    @property
    def scales(self) -> list[float]:
        """The softmax scale each selected block applies to ``q kᵀ`` (timm: ``D**-0.5``)."""
        return [scale for _, _, scale, _ in self._complete_records()]

    @property
    def lse(self) -> list[torch.Tensor | None]:
        """Per selected block the log-sum-exp of its score rows, (B, H, Nq) float32 natural log,
        where its attention computed one: a fused ``scaled_dot_product_attention`` on CUDA (or
        the CPU's flash backend with gradients); None elsewhere
        (:mod:`cl_streamkl.capture.attention_lse`). It belongs to ``q kᵀ · scale`` of the
        same block, as :func:`cl_streamkl.attention_kl` takes it at temperature 1.
        """
        return [lse for _, _, _, lse in self._complete_records()]

    def __repr__(self) -> str:
        return f"QKCapture(blocks={self.block_indices}, active={self.active})"
