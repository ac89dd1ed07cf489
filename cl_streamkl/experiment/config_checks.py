"""Checks of a configuration's values against its fields' declarations: type, choices, range.

A value may come from a flag, a configuration file (JSON or YAML, whose ``null``, lists and
numbers arrive as they are) or Python; whatever its source, a wrong one is refused with one
line naming the field, before anything is written.

The checks take any dataclass whose fields carry a ``flag`` in their metadata (an
:class:`~cl_streamkl.experiment.config.ExperimentConfig`); they import nothing from the
configuration module, which imports them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# Seeds feed torch.manual_seed, which takes unsigned 64-bit integers.
SEED_LIMIT = 2**64
# Every other integer setting (sizes, counts, epochs) is at most the largest 32-bit signed integer:
# larger ones fit no dataset or buffer a run can hold, and fail deep in Python or torch
# (islice, tensor sizes) after the run folder is written.
MAX_INTEGER = 2**31 - 1
# Larger inputs are refused before anything is built: at 4096 px a batch of 16 RGB images
# is already 3 GiB of float32, and 65,536 tokens (a 256 × 256 patch grid) is far past the
# sequence lengths the kernels are benchmarked at.
MAX_IMAGE_SIZE = 4096
MAX_TOKENS = 65536


def suggest(word: str, candidates: Iterable[str], cutoff: float = 0.6) -> str:
    """``" (did you mean 'lr'?)"`` for the close matches of ``word`` among ``candidates`` (empty if none).

    ``cutoff`` is difflib's similarity ratio a candidate needs (0 to 1).
    """
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=cutoff)
    return _did_you_mean(close)


def suggest_option(word: str, options: Iterable[str]) -> str:
    """``" (did you mean '--strategies'?)"`` for an unknown command-line option ``word`` (empty if none).

    The options that begin with ``word`` (the parsers take no abbreviations: a prefix would
    silently mean whichever option it begins), else the close ones.
    """
    options = list(options)
    begun = [option for option in options if option.startswith(word)] if len(word) > 2 else []
    # Flags share their "--", which lifts every ratio: closer matches are asked for.
    return _did_you_mean(begun[:3]) if begun else suggest(word, options, cutoff=0.75)


def _did_you_mean(words: list[str]) -> str:
    return f" (did you mean {' or '.join(repr(w) for w in words)}?)" if words else ""


def _describe(hint: Any) -> str:
    """``int | None`` → ``"an integer or null"``, in the words of a configuration file."""
    if hint is type(None):
        return "null"
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if hint is Any:
        return "any value"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('an ').removeprefix('a ')}s"
    if origin is dict:
        return "a mapping of names to values"
    return str(hint)


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the type ``hint`` (a field's annotation); ``bool`` is no number here."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_matches(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1])
                                               for k, v in value.items())
    raise TypeError(f"no check for the annotation {hint!r}")


def check_types(config: DataclassInstance, label: Callable[[str], str] = str) -> None:
    """Raise ValueError naming the first field of ``config`` (a dataclass) whose value is not of its declared type.

    ``label`` names a field in the error (``alpha`` → ``alpha (--streamkl-alpha)``).
    """
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not _matches(value, hints[f.name]):
            raise ValueError(f"{label(f.name)} must be {_describe(hints[f.name])}; got {value!r}")


def _check_number(name: str, value: float, bound: str | None) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value}")
    if bound == "positive" and value <= 0:
        raise ValueError(f"{name} must be > 0; got {value}")
    if bound == "non-negative" and value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    if bound == "seed" and not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{name} must be an integer from 0 to 2**64 - 1; got {value}")
    if bound != "seed" and isinstance(value, int) and value > MAX_INTEGER:
        raise ValueError(f"{name} must be at most 2**31 - 1 ({MAX_INTEGER:,}); got {value}")


def check_ranges(config: DataclassInstance, label: Callable[[str], str] = str) -> None:
    """Raise ValueError for a value outside its field's choices or bound, or a number that is not finite.

    ``config`` is a dataclass whose fields carry their :class:`~cl_streamkl.experiment.config.Flag`
    as ``metadata["flag"]``; ``label`` names a field in the error. Call after :func:`check_types`.
    """
    for f in dataclasses.fields(config):
        flag, value = f.metadata["flag"], getattr(config, f.name)
        if value is None:
            continue
        if flag.choices is not None and value not in flag.choices:
            hint = suggest(str(value), [str(c) for c in flag.choices])
            raise ValueError(f"{label(f.name)} must be one of {', '.join(map(str, flag.choices))}; got {value!r}{hint}")
        for number in value if isinstance(value, list) else [value]:
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                _check_number(label(f.name), number, flag.bound)


def check_input_size(image_size: int, patch_size: int) -> None:
    """Refuse inputs too large to build: more than :data:`MAX_IMAGE_SIZE` pixels a side or :data:`MAX_TOKENS`."""
    if image_size > MAX_IMAGE_SIZE:
        raise ValueError(f"image_size {image_size} is above the largest supported, {MAX_IMAGE_SIZE} px")
    tokens = (image_size // patch_size) ** 2
    if tokens > MAX_TOKENS:
        raise ValueError(f"image_size {image_size} with patch_size {patch_size} gives {tokens:,} tokens per image, "
                         f"above the largest supported, {MAX_TOKENS:,} (a 256 × 256 patch grid): raise "
                         f"--patch-size or lower --image-size")
