"""Command-line values the scripts share, and what the library takes for them."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import torch

from _harness.report import add_json_flag

Shape = tuple[int, int, int, int]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The implementations that call attention_kl; each name is the backend it passes.
KL_IMPLEMENTATIONS = ("triton", "torch")
# --compile-teacher values: torch.compile modes.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def parse_shape(text: str) -> Shape:
    """Parse ``"BxHxNxD"`` (e.g. ``8x12x1024x64``) into four positive ints."""
    parts = text.lower().split("x")
    try:
        sizes = tuple(int(part) for part in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 4 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"shape must be BxHxNxD with four positive integers, e.g. 8x12x1024x64; got {text!r}"
        )
    return sizes  # type: ignore[return-value]


def shape_label(shape: Shape) -> str:
    """``"BxHxNxD"``, the text :func:`parse_shape` reads."""
    return "x".join(str(size) for size in shape)


def add_run_flags(parser: argparse.ArgumentParser, json_help: str = "also write the results as JSON") -> None:
    """``--device`` (read it with :func:`checked_device`), ``--json [PATH]`` and ``--commit``."""
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    add_json_flag(parser, json_help)
    parser.add_argument(
        "--commit", default=None, help="commit to print when the tree has no .git (default: git rev-parse)"
    )


def checked_device(parser: argparse.ArgumentParser, name: str, smoke_run: str = "--device cpu") -> torch.device:
    """The ``--device`` value as a device; a parser error when it is CUDA and there is none.

    Args:
        parser: reports the error.
        name: the ``--device`` value.
        smoke_run: the flags the error suggests for a run on the CPU.
    """
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda but CUDA is not available; use {smoke_run} for a smoke run")
    return device


def add_compile_teacher_flag(parser: argparse.ArgumentParser) -> None:
    """``--compile-teacher [MODE]``; :func:`compile_teacher_option` turns its value into the distiller's."""
    parser.add_argument(
        "--compile-teacher", nargs="?", const="default", default=None, choices=COMPILE_MODES, metavar="MODE",
        help="run every distilling method's frozen teacher through torch.compile (CompiledQK), optionally "
        f"in a torch.compile mode: {', '.join(COMPILE_MODES)} (default: default)",
    )


def compile_teacher_option(mode: str | None) -> bool | dict[str, str]:
    """``AttentionDistiller``'s ``compile_teacher`` for a ``--compile-teacher`` value.

    Args:
        mode: None (eager teacher), ``"default"`` or another ``torch.compile`` mode.
    """
    if mode is None:
        return False
    return True if mode == "default" else {"mode": mode}


def describe_teacher(compile_teacher: bool | Mapping[str, Any]) -> str:
    """How the teacher runs, for the report: ``eager``, ``torch.compile`` or ``torch.compile mode=...``."""
    if not compile_teacher:
        return "eager"
    if compile_teacher is True:
        return "torch.compile"
    return "torch.compile " + " ".join(f"{key}={value}" for key, value in compile_teacher.items())


def timing_batches(parser: argparse.ArgumentParser, image_sizes: list[int], batches: list[int] | None,
                   defaults: Mapping[int, int]) -> list[int]:
    """``--batches``, one per image size: as given, else each size's default (a parser error
    names the sizes without one, or a count that differs from ``--image-sizes``)."""
    if batches is None:
        missing = [size for size in image_sizes if size not in defaults]
        if missing:
            parser.error(f"--batches is needed for image sizes without a default: {missing}")
        batches = [defaults[size] for size in image_sizes]
    if len(batches) != len(image_sizes):
        parser.error(f"--batches needs one value per image size ({len(image_sizes)}), got {len(batches)}")
    return batches
