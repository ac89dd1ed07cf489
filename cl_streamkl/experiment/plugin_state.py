"""State dicts for the plugins Avalanche cannot checkpoint itself (plain tensors, weights_only-safe)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from avalanche.training.plugins import EWCPlugin, LwFPlugin, ReplayPlugin, SupervisedPlugin
from avalanche.training.plugins.clock import Clock
from avalanche.training.utils import ParamData
from torch import nn

_CLOCK_FIELDS = ("train_iterations", "train_exp_counter", "train_exp_epochs",
                 "train_exp_iterations", "train_epoch_iterations", "total_iterations")


def plugin_state(plugin: SupervisedPlugin, parameter_prefix: str = "") -> dict[str, Any]:
    """Everything a plugin learned so far, as tensors and plain Python values.

    Supports LwF (teacher weights, seen classes, experience count), EWC (anchor
    parameters and importances per experience), replay (buffer indices), the
    Avalanche clock, and any plugin with its own ``state_dict`` (StreamKL).

    Args:
        plugin: the plugin.
        parameter_prefix: what the strategy's model puts before its parameters' names
            (``"module."`` for a ``DistributedDataParallel`` wrapper); EWC's names are
            saved without it, so the state fits a run of any number of processes.

    Raises:
        TypeError: a plugin type this module does not know how to save.
    """
    if isinstance(plugin, LwFPlugin):
        lwf = plugin.lwf
        return {
            "prev_model": None if lwf.prev_model is None else lwf.prev_model.state_dict(),
            "prev_classes_by_task": {int(t): sorted(int(c) for c in cs)
                                     for t, cs in lwf.prev_classes_by_task.items()},
            "expcount": lwf.expcount,
        }
    if isinstance(plugin, EWCPlugin):
        return {
            "saved_params": {int(t): {k.removeprefix(parameter_prefix): p.data.clone() for k, p in ps.items()}
                             for t, ps in plugin.saved_params.items()},
            "importances": {int(t): {k.removeprefix(parameter_prefix): p.data.clone() for k, p in ps.items()}
                            for t, ps in plugin.importances.items()},
        }
    if isinstance(plugin, ReplayPlugin):
        return plugin.storage_policy.state_dict()
    if isinstance(plugin, Clock):
        return {name: getattr(plugin, name) for name in _CLOCK_FIELDS}
    if hasattr(plugin, "state_dict"):
        return plugin.state_dict()
    raise TypeError(f"cannot checkpoint plugin of type {type(plugin).__name__}")


def load_plugin_state(
    plugin: SupervisedPlugin, state: dict[str, Any], model_factory: Callable[[], nn.Module],
    parameter_prefix: str = "", device: torch.device | str = "cpu",
) -> None:
    """Inverse of :func:`plugin_state`.

    Args:
        plugin: a freshly built plugin of the same type.
        state: what :func:`plugin_state` returned.
        model_factory: builds a fresh model of the run's architecture (LwF's teacher
            is rebuilt this way rather than deep-copied, so it carries no hooks).
        parameter_prefix: as for :func:`plugin_state`, put back before EWC's names.
        device: where the run computes (EWC's anchors and importances go there).
    """
    if isinstance(plugin, LwFPlugin):
        lwf = plugin.lwf
        lwf.prev_model = None
        if state["prev_model"] is not None:
            teacher = model_factory()
            teacher.load_state_dict(state["prev_model"])
            lwf.prev_model = teacher
        lwf.prev_classes_by_task.clear()
        lwf.prev_classes_by_task.update(
            {int(t): set(cs) for t, cs in state["prev_classes_by_task"].items()})
        lwf.expcount = int(state["expcount"])
    elif isinstance(plugin, EWCPlugin):
        for field in ("saved_params", "importances"):
            target = getattr(plugin, field)
            target.clear()
            for t, params in state[field].items():
                target[int(t)] = {
                    parameter_prefix + k: ParamData(parameter_prefix + k, init_tensor=v.to(device, copy=True),
                                                    device=device)
                    for k, v in params.items()}
    elif isinstance(plugin, ReplayPlugin):
        plugin.storage_policy.load_state_dict(state)
    elif isinstance(plugin, Clock):
        for name in _CLOCK_FIELDS:
            setattr(plugin, name, int(state[name]))
    elif hasattr(plugin, "load_state_dict"):
        plugin.load_state_dict(state)
    else:
        raise TypeError(f"cannot restore plugin of type {type(plugin).__name__}")
