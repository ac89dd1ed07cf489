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
    When the model runs several times inside one ``with``, ``qk`` holds the last run, or
    with ``every_run`` every run.

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
            its whole forward (its Q/K arrive at the end). An int n (with ``every_run``)
            ends it once every selected block has run on n samples in all.
        every_run: record every run of the selected blocks inside the ``with`` block and
            concatenate their Q/K (and log-sum-exps) along the batch dimension, in run
            order: for a model that runs its blocks once per group of samples, as
            Avalanche's ``MultiTaskModule`` does for each task label in a batch.

    Attributes:
        block_indices: resolved absolute block indices, ascending.
        attention_modules: the attention module of each selected block.

    Raises:
        TypeError: the model has no capturable attention (see :func:`find_attention_modules`).
        ValueError: the layer selection does not fit the model.
    """

    def __init__(self, model: nn.Module, layers: LayerSpec = "all", *, stop_early: bool | int = False,
                 every_run: bool = False) -> None:
        modules = find_attention_modules(model)
        if not isinstance(stop_early, bool) and not (isinstance(stop_early, int) and stop_early > 0 and every_run):
            raise ValueError(f"stop_early must be a bool, or a positive int with every_run=True; got {stop_early!r}")
        self.stop_early = stop_early
        self.every_run = every_run
        self.model = model
        self.block_indices: list[int] = resolve_layer_indices(layers, len(modules))
        self.attention_modules: list[nn.Module] = [modules[i] for i in self.block_indices]
        # per selected block, (q, k, scale, lse or None) of each recorded run
        self._records: list[list[tuple]] = [[] for _ in self.block_indices]
        self._handles: list[Removable] = []

    def _recorder(self, slot: int) -> RecordQK:
        def record(q: torch.Tensor, k: torch.Tensor, scale: float, lse: torch.Tensor | None = None) -> None:
            entry = (q, k, scale, lse_or_none(lse))
            if self.every_run:
                self._records[slot].append(entry)
            else:
                self._records[slot] = [entry]

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
        if self.stop_early is True:
            complete = all(self._records)
        else:
            complete = all(sum(run[0].shape[0] for run in runs) >= self.stop_early for runs in self._records)
        if complete:
            raise _CaptureComplete

    def remove_hooks(self) -> None:
        """Remove every hook this capture installed (idempotent); recorded tensors are kept."""
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            handle.remove()

    def clear(self) -> None:
        """Drop the recorded tensors (and the autograd graph they keep alive)."""
        self._records = [[] for _ in self.block_indices]

    def _complete_records(self) -> list[list[tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]]]:
        missing = [self.block_indices[i] for i, runs in enumerate(self._records) if not runs]
        if missing:
            raise RuntimeError(
                f"no Q/K was captured for blocks {missing}: run the model inside the `with QKCapture(...)` block"
            )
        return self._records

    @staticmethod
    def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
        # One run: the model's own tensor, no copy.
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)

    @property
    def qk(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(q, k), ...]`` per selected block: q (B, H, Nq, D), k (B, H, Nk, D).

        Exactly the tensors the block multiplies (views with the model's strides and
        autograd graph). Raises ``RuntimeError`` if a selected block has not run.
        """
        return [(self._joined([run[0] for run in runs]), self._joined([run[1] for run in runs]))
                for runs in self._complete_records()]

    @property
    def scales(self) -> list[float]:
        """The softmax scale each selected block applies to ``q kᵀ`` (timm: ``D**-0.5``)."""
        return [runs[0][2] for runs in self._complete_records()]

    @property
    def lse(self) -> list[torch.Tensor | None]:
        """Per selected block the log-sum-exp of its score rows, (B, H, Nq) float32 natural log,
        where its attention computed one: a fused ``scaled_dot_product_attention`` on CUDA (or
        the CPU's flash backend with gradients); None elsewhere
        (:mod:`cl_streamkl.capture.attention_lse`). It belongs to ``q kᵀ · scale`` of the
        same block, as :func:`cl_streamkl.attention_kl` takes it at temperature 1.
        """
        return [None if any(run[3] is None for run in runs) else self._joined([run[3] for run in runs])
                for runs in self._complete_records()]

    def __repr__(self) -> str:
        return f"QKCapture(blocks={self.block_indices}, active={self.active})"
