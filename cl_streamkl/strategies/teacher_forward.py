"""How a distiller runs its frozen teacher: called as the student is, eager or compiled.

The teacher is called with the student's input and the student's extra forward arguments
(an Avalanche ``MultiTaskModule`` takes task labels): :func:`check_forward_call` refuses a
call the model's forward cannot take, in one line and before anything runs;
:func:`eager_teacher_qk` runs the call gradient-free and stops once every selected block
has seen every sample; :func:`auto_compiles` decides ``compile_teacher="auto"``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from cl_streamkl.capture import LayerSpec, QKCapture, TeacherQK
from cl_streamkl.capture.compiled_model import is_compiled
from cl_streamkl.capture.hooks import qualified_type_name
from cl_streamkl.capture.layers import find_attention_modules

__all__ = ["attention_heads", "auto_compiles", "check_forward_call", "eager_teacher_qk", "on_cuda"]


def attention_heads(model: nn.Module) -> list[int | None]:
    """Heads of each block's attention module (``None`` where it has neither ``num_heads`` nor, as
    Hugging Face's have, ``num_attention_heads``).

    Q/K projections of the same shape split into another number of heads give other
    attention maps, so a saved teacher is only restored into a model with these counts.
    """
    heads = [getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
             for module in find_attention_modules(model)]
    return [head if isinstance(head, int) and not isinstance(head, bool) else None for head in heads]


def on_cuda(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters lives on a CUDA device."""
    return any(tensor.is_cuda for tensor in module.parameters())


def auto_compiles(teacher: nn.Module) -> bool:
    """Whether ``compile_teacher="auto"`` compiles ``teacher``.

    Only on CUDA, where the compiled teacher measured faster at 197–4097 tokens; not a
    snapshot of a :func:`~cl_streamkl.capture.compile_model` student, which runs compiled
    already (and :class:`~cl_streamkl.capture.CompiledQK` refuses it), nor a model with
    ``nn.MultiheadAttention``, whose fused eval path makes no SDPA call for the compiled
    capture to collect (its first call would only fail and fall back).
    """
    if not on_cuda(teacher) or is_compiled(teacher):
        return False
    return not any(isinstance(module, nn.MultiheadAttention) for module in find_attention_modules(teacher))


def check_forward_call(model: nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> None:
    """Raise unless ``model(x, *args, **kwargs)`` fits the signature of ``model``'s forward.

    Only the signature is checked (nothing runs), so this is cheap enough for every call.

    Raises:
        TypeError: one line naming the model and what its forward does not take.
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return  # a forward without an inspectable signature is called and left to fail on its own
    try:
        signature.bind(None, *args, **dict(kwargs or {}))
    except TypeError as error:
        extra = len(args) + len(kwargs or {})
        raise TypeError(
            f"the teacher cannot be called as the student is: {qualified_type_name(model)}.forward{signature} "
            f"cannot be called with the input and {extra} more argument(s): {error}; pass it the arguments the "
            "student's forward gets"
        ) from None


def eager_teacher_qk(model: nn.Module, layers: LayerSpec, x: Any, args: tuple = (),
                     kwargs: Mapping[str, Any] | None = None) -> TeacherQK:
    """The selected blocks' Q/K, scales and LSEs of an eager, gradient-free ``model(x, *args, **kwargs)``.

    Every run of the blocks is recorded (a ``MultiTaskModule`` runs them once per task in
    the batch, in the order the student's capture records them), and the forward stops
    once every selected block has run on all of ``x``'s samples: a multi-head teacher
    never reaches a head it lacks (a task that came after its snapshot).
    """
    rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() > 0 else True
    capture = QKCapture(model, layers, stop_early=rows, every_run=True)
    with torch.no_grad(), capture:
        model(x, *args, **dict(kwargs or {}))
    return TeacherQK(qk=capture.qk, scales=capture.scales, lse=capture.lse)
