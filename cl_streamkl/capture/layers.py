"""Which blocks a capture reads: layer selections and each block's attention module.

A layer selection (:data:`LayerSpec`) follows timm's ``forward_intermediates(indices=...)``
rules. :func:`check_layer_spec` checks one, before or after the model is known, and
:func:`resolve_layer_indices` turns it into block indices for one model;
:func:`find_attention_modules` finds the attention module of every block, also through a
data-parallel wrapper (:func:`unwrap_data_parallel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

from torch import nn

from cl_streamkl.capture.extractors import qk_extractor_for, qualified_type_name
from cl_streamkl.capture.hf_extractors import check_faithful, encoder_blocks, is_hf_model, register_hf_attention
from cl_streamkl.distributed.data_parallel import unwrap_data_parallel

__all__ = ["LayerSpec", "check_layer_spec", "find_attention_modules", "resolve_layer_indices"]

LayerSpec = Union[str, int, Sequence[int]]
"""Which blocks to capture: ``"all"``, an int ``n`` (the last n blocks) or a list of
block indices (negative indices count from the end), as in timm's
``forward_intermediates(indices=...)``."""


def _looks_like_attention(module: nn.Module) -> bool:
    return "attention" in type(module).__name__.lower()


def _blocks(model: nn.Module) -> list[nn.Module] | None:
    """The transformer blocks of ``model``: timm's ``blocks``, a ``transformers`` encoder's layers, or None.

    A ``transformers`` model is checked first (:func:`~cl_streamkl.capture.hf_extractors.check_faithful`)
    and its attention classes registered.
    """
    if is_hf_model(model):
        check_faithful(model)
        register_hf_attention(model)
        return encoder_blocks(model)
    blocks = getattr(model, "blocks", None)
    return list(blocks.children()) if isinstance(blocks, nn.Module) else None


def find_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module of every transformer block of ``model``, in block order.

    A model with a ``blocks`` container (timm ViT, DeiT, EVA, ...) or one ``transformers``
    encoder (``encoder.layer`` / ``encoder.layers``: ViT, DeiT, DINOv2, CLIP and SigLIP
    vision) must have exactly one capturable attention module per block; any other model
    contributes every module with a registered extractor, in ``model.modules()`` order.

    Args:
        model: the vision transformer, or a ``DistributedDataParallel`` / ``DataParallel``
            wrapper around one (the wrapped module's blocks are found).

    Returns:
        One attention module per block.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, a block has no attention module
            with a registered extractor (the message names the module type found), the
            model has no capturable attention at all, or its attention adds terms to
            ``q kᵀ`` (a ``transformers`` Swin, BEiT with relative-position bias: the
            message says which).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    model = unwrap_data_parallel(model)
    blocks = _blocks(model)
    if blocks:
        found = []
        for index, block in enumerate(blocks):
            registered = [m for m in block.modules() if qk_extractor_for(m) is not None]
            if len(registered) != 1:
                if registered:
                    names = ", ".join(qualified_type_name(m) for m in registered)
                    problem = f"{len(registered)} attention modules ({names})"
                else:
                    others = [qualified_type_name(m) for m in block.modules() if _looks_like_attention(m)]
                    problem = (
                        f"attention module {', '.join(others)} which has no registered Q/K extractor"
                        if others
                        else f"no attention module (block type {qualified_type_name(block)})"
                    )
                raise TypeError(
                    f"QKCapture cannot capture block {index} of {qualified_type_name(model)}: it has {problem}. "
                    "Attention with extra score terms (e.g. relative-position bias) cannot be captured "
                    "faithfully; for a plain q·kᵀ attention class, register it with "
                    "cl_streamkl.capture.register_qk_extractor()."
                )
            found.append(registered[0])
        return found
    found = [m for m in model.modules() if qk_extractor_for(m) is not None]
    if not found:
        others = sorted({qualified_type_name(m) for m in model.modules() if _looks_like_attention(m)})
        detail = (
            f"its attention modules ({', '.join(others)}) have no registered Q/K extractor"
            if others
            else "it contains no attention module QKCapture knows"
        )
        raise TypeError(
            f"QKCapture cannot capture {qualified_type_name(model)}: {detail}. Register the attention class "
            "with cl_streamkl.capture.register_qk_extractor()."
        )
    return found


def check_layer_spec(layers: object, num_blocks: int | None = None) -> LayerSpec:
    """Check the form of a layer selection and, given ``num_blocks``, its ranges.

    Without ``num_blocks`` (no model known yet) only what holds for every model is
    checked: a count must be at least 1; indices and the count's upper bound are checked
    once the model is known.

    Args:
        layers: ``"all"``; an int ``n`` (the last n blocks); or a non-empty list/tuple of
            block indices, negative ones counting from the end.
        num_blocks: how many blocks the model has, or ``None``.

    Returns:
        ``"all"``, the int, or the indices as a new list.

    Raises:
        TypeError: ``layers`` has the wrong type.
        ValueError: the string is not ``"all"``, the list is empty, or a count or index
            is out of range.
    """
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be 'all', an int or a list of ints, got the string {layers!r}")
        return layers
    if isinstance(layers, bool):
        raise TypeError("layers must be 'all', an int or a list of ints, got a bool")
    if isinstance(layers, int):
        if num_blocks is None:
            if layers < 1:
                raise ValueError(f"layers={layers} selects the last n blocks and needs n >= 1")
        elif not 1 <= layers <= num_blocks:
            raise ValueError(f"layers={layers} selects the last n blocks and needs 1 <= n <= {num_blocks}")
        return layers
    if not isinstance(layers, (list, tuple)):
        raise TypeError(f"layers must be 'all', an int or a list of ints, got {type(layers).__name__}")
    if not layers:
        raise ValueError("layers must not be an empty list")
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"layers must contain ints, got {index!r}")
        if num_blocks is not None and not -num_blocks <= index < num_blocks:
            raise ValueError(f"layer index {index} is out of range for a model with {num_blocks} blocks")
    return list(layers)


def resolve_layer_indices(layers: LayerSpec, num_blocks: int) -> list[int]:
    """Absolute block indices selected by ``layers`` (timm's ``forward_intermediates`` rules).

    Args:
        layers: ``"all"``; an int ``n`` with ``1 <= n <= num_blocks`` selecting the last
            n blocks; or a non-empty list/tuple of distinct indices in
            ``[-num_blocks, num_blocks)``, negative ones counting from the end.
        num_blocks: how many blocks the model has.

    Returns:
        Sorted absolute indices.

    Raises:
        TypeError: ``layers`` has the wrong type.
        ValueError: an index or count is out of range, the list is empty or repeats a block.
    """
    layers = check_layer_spec(layers, num_blocks)
    if layers == "all":
        return list(range(num_blocks))
    if isinstance(layers, int):
        return list(range(num_blocks - layers, num_blocks))
    resolved = [index % num_blocks for index in layers]
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"layers {layers} select the same block more than once")
    return sorted(resolved)
