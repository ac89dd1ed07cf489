"""Model factory: any timm ViT-family model, sized for the stream, optionally from local weights."""

from __future__ import annotations

import difflib
import logging
import re
import sys
from pathlib import Path
from typing import Any

import timm
from torch import nn

from cl_streamkl.experiment.conv_stem import ConvStem, stem_convolutions
from cl_streamkl.experiment.stems import STEMS
from cl_streamkl.experiment.task_heads import MultiHeadViT


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


# timm's ViTs use 64-wide attention heads (ViT-Ti 192 / 3, ViT-S 384 / 6, ViT-B 768 / 12).
TIMM_HEAD_DIM = 64


def file_architecture(path: str | Path) -> dict[str, int]:
    """What a ViT weights file holds, read off its tensors' shapes: depth, embed_dim, patch_size (empty if unknown).

    ``num_heads`` is not among them: the attention weights have the same shapes for any
    number of heads.
    """
    try:
        state = timm.models.load_state_dict(str(path))
    except Exception:  # noqa: BLE001 - an unreadable file tells nothing; timm's own error is reported
        return {}
    found: dict[str, int] = {}
    blocks = {int(key.split(".")[1]) for key in state if key.startswith("blocks.") and key.split(".")[1].isdigit()}
    if blocks:
        found["depth"] = max(blocks) + 1
    patch = state.get("patch_embed.proj.weight")
    if patch is not None and patch.ndim == 4:  # (embed_dim, in_chans, patch, patch)
        found["embed_dim"], found["patch_size"] = int(patch.shape[0]), int(patch.shape[-1])
    return found


def _first_line(error: BaseException) -> str:
    """``KeyError: 101``: an exception's type and the first line of its message."""
    message = str(error).strip()
    return type(error).__name__ + (f": {message.splitlines()[0]}" if message else "")


def _weights_file(pretrained_file: str | Path) -> Path:
    """The weights file's path, refused in one line if it is missing or empty."""
    path = Path(pretrained_file).expanduser()
    if not path.exists():
        raise ValueError(f"pretrained file {str(path)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"pretrained file {str(path)!r} is not a file")
    if path.stat().st_size == 0:
        raise ValueError(f"pretrained file {str(path)!r} is empty")
    return path


def _unreadable_weights(path: Path) -> str | None:
    """Why timm cannot read ``path`` as a state dict (``EOFError``, ...), or None if it can."""
    try:
        timm.models.load_state_dict(str(path))
    except Exception as err:  # noqa: BLE001 - whatever the reader raises, the file is unusable
        return _first_line(err)
    return None


# What build_model passes every model besides --model-kwargs.
BUILT_WITH = ("img_size", "patch_size", "in_chans", "num_classes")
# The constructor defaults whose type a --model-kwargs value is checked against, and their names.
_KINDS = {bool: "true or false", int: "an int", float: "a number", str: "a string"}


def _fits(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _refused_key(name: str, model_kwargs: dict[str, Any], err: TypeError) -> str:
    """Which keyword a timm model's constructor refused, named as the user gave it: a
    ``--model-kwargs`` key, or one the run sets itself (then the model is no ViT)."""
    found = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    if found is None:
        return f"timm model {name!r} refused its arguments: is it a ViT-family model? ({err})"
    key = found.group(1)
    if key in model_kwargs:
        return f"--model-kwargs {key}: timm model {name!r} takes no argument {key!r}"
    return (f"timm model {name!r} takes no {key!r}: cl-streamkl runs ViT-family models (vit_*, deit_*), which "
            "take img_size, patch_size, in_chans and num_classes")


def _wrong_value(name: str, model_kwargs: dict[str, Any]) -> str | None:
    """Why a timm model refused ``model_kwargs``, when a value is of another type than its argument's
    default (``depth: 'abc' is not an int``); None when no value is to blame or the class is unknown.

    The model's class is the ``nn.Module`` of its timm module whose constructor takes the most
    of the given keys and :data:`BUILT_WITH` (``VisionTransformer`` for ``vit_*``).
    """
    import inspect
    import sys

    try:
        module = sys.modules[timm.models.model_entrypoint(name).__module__]
    except (AttributeError, KeyError, RuntimeError):
        return None
    signatures = {}
    for candidate in vars(module).values():
        if isinstance(candidate, type) and issubclass(candidate, nn.Module):
            try:
                signatures[candidate] = inspect.signature(candidate).parameters
            except (TypeError, ValueError):
                continue
    if not signatures:
        return None
    keys = {*model_kwargs, *BUILT_WITH}
    model_class = max(signatures, key=lambda c: sum(key in signatures[c] for key in keys))
    for key, value in model_kwargs.items():
        parameter = signatures[model_class].get(key)
        kind = None if parameter is None else type(parameter.default)
        if kind in _KINDS and not _fits(value, kind):
            return (f"--model-kwargs {key}: {value!r} is not {_KINDS[kind]} ({model_class.__name__} takes "
                    f"{key}={parameter.default!r})")
    return None


def _mismatch(name: str, path: Path, model_kwargs: dict[str, Any], patch_size: int, detail: str,
              model: nn.Module | None = None) -> str:
    """One line for weights that do not fit: the architecture the file holds and the options that build it.

    ``detail`` says what did not fit; it is the line when the file's shapes name no ViT, or the
    depth and width the model was built with (``model``'s, else ``model_kwargs``'), which other
    ``--model-kwargs`` would not change.
    """
    held = file_architecture(path)
    built_size = ((model_kwargs.get("depth"), model_kwargs.get("embed_dim")) if model is None
                  else (len(getattr(model, "blocks", ())), getattr(model, "embed_dim", None)))
    if "depth" not in held or "embed_dim" not in held or built_size == (held["depth"], held["embed_dim"]):
        return f"weights in {path} do not fit {name!r}: {detail}"
    built = " ".join(f"{k}={v}" for k, v in model_kwargs.items()) or "none"
    heads = held["embed_dim"] // TIMM_HEAD_DIM if held["embed_dim"] % TIMM_HEAD_DIM == 0 else None
    heads_hint = (f"num_heads={heads} (64-wide heads, as in timm's ViTs; shapes do not show the heads)" if heads
                  else "num_heads=<the file's heads; shapes do not show them>")
    patch = f" --patch-size {held['patch_size']}" if held.get("patch_size", patch_size) != patch_size else ""
    return (f"weights in {path} do not fit {name!r} with --model-kwargs {built}: the file holds a "
            f"{held['depth']}-block, {held['embed_dim']}-wide ViT; pass --model-kwargs depth={held['depth']} "
            f"embed_dim={held['embed_dim']} {heads_hint}{patch}")


def _first_of(keys: set[str]) -> str:
    """``blocks.2.attn.qkv.weight (and 25 more)``: the first of sorted names and how many follow."""
    first = sorted(keys)
    return first[0] + (f" (and {len(first) - 1} more)" if len(first) > 1 else "")


def _unmatched_tensors(model: nn.Module, path: Path) -> str | None:
    """What timm's lenient load of ``path`` into ``model`` left out, or None when every tensor matched.

    timm loads non-strictly whenever the classifier is replaced, so a file missing some of the
    model's tensors (fewer blocks, another architecture) would leave them at random init, and the
    file's extra tensors would be dropped, without an error. The classifier, which timm replaces
    on purpose, is left out of the comparison.
    """
    state = timm.models.load_state_dict(str(path))
    filter_fn = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:  # the renaming and resampling timm applied while loading
        state = filter_fn(state, model)
    classifiers = model.pretrained_cfg.get("classifier") or ()
    prefixes = tuple(f"{c}." for c in ((classifiers,) if isinstance(classifiers, str) else classifiers))
    wanted = {key for key in model.state_dict() if not key.startswith(prefixes)}
    held = {key for key in state if not key.startswith(prefixes)}
    missing, extra = wanted - held, held - wanted
    parts = ([f"the model's {_first_of(missing)} not in the file"] if missing else []) + (
        [f"the file's {_first_of(extra)} not in the model"] if extra else [])
    return "; ".join(parts) or None


class _UnexpectedKeysFilter(logging.Filter):
    """Drops timm's log line listing a file's unexpected tensors: build_model refuses such files in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unexpected keys (")


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
            a missing, empty or unreadable weights file, weights that do not fit the
            architecture, sizes too large to allocate, values the model's own checks refuse,
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
    path = None if pretrained_file is None else _weights_file(pretrained_file)
    if path is not None:
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    timm_builder_log, quiet = logging.getLogger("timm.models._builder"), _UnexpectedKeysFilter()
    timm_builder_log.addFilter(quiet)
    try:
        model = timm.create_model(name, **kwargs)
    except TypeError as err:
        if "embed_layer" in str(err):
            raise ValueError(f"--stem conv needs a timm VisionTransformer (vit_*, deit_*); {name!r} takes no "
                             "embed_layer") from err
        raise ValueError(_wrong_value(name, model_kwargs or {}) or _refused_key(name, model_kwargs or {}, err)
                         ) from err
    except Exception as err:  # noqa: BLE001 - said in one line below, or raised again
        unreadable = None if path is None else _unreadable_weights(path)
        if unreadable is not None:
            raise ValueError(f"pretrained file {str(path)!r} cannot be read as weights ({unreadable})") from None
        wrong = _wrong_value(name, model_kwargs or {})
        if wrong is not None:
            raise ValueError(wrong) from None
        if isinstance(err, RuntimeError) and path is not None:  # timm lists every mismatched tensor
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            detail = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines[0]
            raise ValueError(_mismatch(name, path, model_kwargs or {}, patch_size, detail)) from None
        # Sizes too large to allocate, or values the model's own checks refuse (timm asserts that
        # embed_dim divides by num_heads).
        if isinstance(err, (RuntimeError, MemoryError, OverflowError, AssertionError)):
            built = " ".join(f"{k}={v}" for k, v in (model_kwargs or {}).items()) or "none"
            raise ValueError(f"timm model {name!r} cannot be built with --model-kwargs {built}: "
                             f"{_first_line(err)}") from None
        raise
    finally:
        timm_builder_log.removeFilter(quiet)
    unmatched = None if path is None else _unmatched_tensors(model, path)
    if unmatched is not None:
        raise ValueError(_mismatch(name, path, model_kwargs or {}, patch_size, unmatched, model))
    if not hasattr(model, "patch_embed"):
        raise ValueError(f"timm model {name!r} has no patch embedding; use a ViT/DeiT/EVA model")
    return model if head_sizes is None else MultiHeadViT(model, head_sizes)
