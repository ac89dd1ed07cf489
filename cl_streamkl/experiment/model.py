"""Model factory: any timm ViT-family model, sized for the stream, optionally from local weights."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import timm
from torch import nn

from cl_streamkl.experiment.conv_stem import ConvStem, stem_convolutions
from cl_streamkl.experiment.task_heads import MultiHeadViT

# How images become tokens: timm's patch projection, or early convolutions (ConvStem).
STEMS = ("patch", "conv")


def check_model_kwargs(model_kwargs: dict[str, Any]) -> None:
    """Refuse ``pretrained=True``: timm would download weights, and only ``pretrained_file`` loads any.

    Raises:
        ValueError: ``model_kwargs`` sets ``pretrained`` to anything but False/None.
    """
    if model_kwargs.get("pretrained") not in (False, None):
        raise ValueError(f"model kwarg pretrained={model_kwargs['pretrained']!r} would download weights, and "
                         "nothing is downloaded here: pass a local weights file with --pretrained-file instead")


def check_model_name(name: str) -> None:
    """Raise ValueError (with close matches) unless ``name`` is a timm model name."""
    names = timm.list_models()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown timm model {name!r}{hint}")


def check_stem(stem: str, patch_size: int, pretrained_file: str | Path | None = None) -> None:
    """Refuse a stem that cannot build: unknown, a patch size it cannot reach, or with pretrained weights.

    Raises:
        ValueError: one line naming the problem.
    """
    if stem not in STEMS:
        raise ValueError(f"stem must be one of {STEMS}; got {stem!r}")
    if stem == "conv":
        stem_convolutions(patch_size)
        if pretrained_file is not None:
            raise ValueError("--stem conv replaces the patch projection that pretrained weights were trained with; "
                             "train it from scratch (drop --pretrained-file) or use --stem patch")


def build_model(
    name: str,
    *,
    image_size: int,
    patch_size: int,
    in_chans: int,
    num_classes: int,
    model_kwargs: dict[str, Any] | None = None,
    pretrained_file: str | Path | None = None,
    head_sizes: list[int] | None = None,
    stem: str = "patch",
) -> nn.Module:
    """Create a timm vision transformer (ViT, DeiT, EVA, ...) for this stream.

    The model takes (B, in_chans, image_size, image_size) images and returns
    (B, num_classes) logits; it sees (image_size / patch_size)² patch tokens.

    Args:
        name: a timm model name, e.g. ``"vit_tiny_patch16_224"`` or ``"deit_small_patch16_224"``.
        image_size: input side length (timm ``img_size``).
        patch_size: patch side length; must divide ``image_size``.
        in_chans: image channels.
        num_classes: classifier outputs (all classes of the stream, one shared head);
            ignored when ``head_sizes`` is given.
        model_kwargs: further timm constructor arguments, e.g. ``{"depth": 4}``.
        pretrained_file: local weights (``.pth``/``.bin``/``.safetensors``) loaded through
            timm's own adaptation (position-embedding resampling, input-channel folding,
            a new classifier when ``num_classes`` differs). Nothing is downloaded.
        head_sizes: one head per task with these many outputs
            (:class:`~cl_streamkl.experiment.task_heads.MultiHeadViT`, the task scenario).
        stem: ``"patch"``, timm's patch projection; ``"conv"``, early convolutions
            (:class:`~cl_streamkl.experiment.conv_stem.ConvStem`, timm VisionTransformer
            models only, trained from scratch) giving the same token grid.

    Returns:
        The model, randomly initialised unless ``pretrained_file`` is given.

    Raises:
        ValueError: unknown name, a model without patch embedding, a size mismatch,
            a missing weights file, weights that do not fit the architecture,
            ``model_kwargs`` asking timm to download weights, or a stem the model or
            patch size cannot take.
    """
    check_model_name(name)
    check_stem(stem, patch_size, pretrained_file)
    if image_size % patch_size:
        raise ValueError(f"image size {image_size} is not divisible by patch size {patch_size}")
    kwargs: dict[str, Any] = dict(model_kwargs or {})
    check_model_kwargs(kwargs)
    kwargs.update(img_size=image_size, patch_size=patch_size, in_chans=in_chans,
                  num_classes=0 if head_sizes is not None else num_classes)
    if stem == "conv":
        kwargs["embed_layer"] = ConvStem
    if pretrained_file is not None:
        path = Path(pretrained_file).expanduser()
        if not path.is_file():
            raise ValueError(f"pretrained file {str(path)!r} does not exist")
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    try:
        model = timm.create_model(name, **kwargs)
    except TypeError as err:
        if "embed_layer" in str(err):
            raise ValueError(f"--stem conv needs a timm VisionTransformer (vit_*, deit_*); {name!r} takes no "
                             "embed_layer") from err
        raise ValueError(
            f"timm model {name!r} does not accept {sorted(kwargs)}: is it a ViT-family model? ({err})"
        ) from err
    except RuntimeError as err:
        raise ValueError(f"weights in {pretrained_file} do not fit {name!r}: {err}") from err
    if not hasattr(model, "patch_embed"):
        raise ValueError(f"timm model {name!r} has no patch embedding; use a ViT/DeiT/EVA model")
    return model if head_sizes is None else MultiHeadViT(model, head_sizes)
