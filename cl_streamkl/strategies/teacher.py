"""The frozen teacher snapshot: a hook-free deep copy of a model, and its tensors.

:func:`frozen_copy` takes the snapshot, :func:`named_tensors` lists what a state dict
saves of it, :func:`restore_frozen_copy` rebuilds it from those tensors and a model
of the same structure, and :func:`check_snapshot_fits` refuses a model moved or cast since.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["check_snapshot_fits", "frozen_copy", "named_tensors", "restore_frozen_copy"]


def _hook_dict_names(module: nn.Module) -> list[str]:
    return [
        name
        for name, value in vars(module).items()
        if name.startswith(("_forward", "_backward")) and "hooks" in name and isinstance(value, dict)
    ]


@contextmanager
def _hooks_detached(model: nn.Module) -> Iterator[None]:
    """Temporarily empty every forward/backward hook table of ``model``'s modules.

    ``copy.deepcopy`` would otherwise copy the hooks, and with them whatever their
    closures reference (captures, strategies, recorded tensors).
    """
    saved: list[tuple[nn.Module, str, dict]] = []
    try:
        for module in model.modules():
            for name in _hook_dict_names(module):
                table = getattr(module, name)
                saved.append((module, name, table))
                setattr(module, name, type(table)())
        yield
    finally:
        for module, name, table in saved:
            setattr(module, name, table)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A hook-free deep copy of ``model`` in eval mode with ``requires_grad=False`` everywhere.

    The copy lives on the same device(s) as ``model``; ``model`` itself is left as it was.
    """
    with _hooks_detached(model):
        snapshot = copy.deepcopy(model)
    snapshot.eval()
    snapshot.requires_grad_(False)
    return snapshot


def named_tensors(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not), as plain detached tensors."""
    tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, param in model.named_parameters():
        tensors[name] = param.detach()
    for name, buffer in model.named_buffers():
        tensors[name] = buffer.detach()
    return tensors


def restore_frozen_copy(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """A :func:`frozen_copy` of ``model`` holding, bit for bit, saved :func:`named_tensors`.

    Args:
        model: gives the module structure (and device) of the copy.
        tensors: every parameter and buffer of the saved teacher, by name.

    Returns:
        The restored teacher.

    Raises:
        ValueError: the tensors' names, shapes or dtypes do not match ``model``.
    """
    teacher = frozen_copy(model)
    targets = named_tensors(teacher)
    if set(targets) != set(tensors):
        missing = sorted(set(targets) - set(tensors))[:5]
        unexpected = sorted(set(tensors) - set(targets))[:5]
        raise ValueError(f"the saved teacher does not fit this model: missing {missing}, unexpected {unexpected}")
    for name, target in targets.items():
        source = tensors[name]
        if source.shape != target.shape or source.dtype != target.dtype:
            raise ValueError(
                f"the saved teacher's {name} is {source.dtype}{tuple(source.shape)} but the model's is "
                f"{target.dtype}{tuple(target.shape)}"
            )
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(tensors[name])
    return teacher


def check_snapshot_fits(teacher: nn.Module, model: nn.Module) -> None:
    """Refuse a ``model`` whose first parameter has another device or dtype than its snapshot's.

    The snapshot is taken where ``model`` was; a model moved (``.to("cuda")``) or cast (``.half()``)
    after it would feed the teacher inputs it cannot take, and fail inside its forward with an
    error that names neither.

    Raises:
        ValueError: one line naming both devices and dtypes and what to do.
    """
    mine = next(model.parameters(), None)
    snapshot = next(teacher.parameters(), None)
    if mine is None or snapshot is None or (mine.device, mine.dtype) == (snapshot.device, snapshot.dtype):
        return
    raise ValueError(
        f"the model is {mine.dtype} on {mine.device} but its teacher snapshot is {snapshot.dtype} on "
        f"{snapshot.device}: the model was moved or cast after the snapshot was taken; move or cast the snapshot "
        f"the same way (distiller.teacher.to('{mine.device}', {mine.dtype})) or the model back "
        "(update_teacher(model) would make the model as it is now the teacher)"
    )
