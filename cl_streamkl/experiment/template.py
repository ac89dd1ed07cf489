"""The Avalanche training template every strategy runs on: SupervisedTemplate plus mixed precision."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from avalanche.training.plugins import EvaluationPlugin
from avalanche.training.templates import SupervisedTemplate

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``amp`` in {"bf16", "fp16"}; a no-op context for ``"none"``."""
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp must be one of {tuple(AMP_DTYPES)}; got {amp!r}")
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class AmpSupervisedTemplate(SupervisedTemplate):
    """Avalanche's supervised template with the forward pass under autocast.

    The plugins' ``before_forward`` callbacks run under the same autocast, so a teacher
    that a plugin runs there (the StreamKL plugin's) computes in the student's precision.

    Plugins see the same callbacks as with ``avalanche.training.Naive``; the
    strategies differ only in their plugin lists. With ``amp="fp16"`` a gradient
    scaler wraps backward and the optimizer step. Avalanche's metric evaluator is
    replaced by an empty one: the experiment runner computes its own metrics and
    prints its own progress.

    Args:
        amp: "none", "bf16" or "fp16".
        **kwargs: ``SupervisedTemplate`` arguments (model, optimizer, plugins, ...).
    """

    def __init__(self, *, amp: str = "none", **kwargs: Any) -> None:
        if "evaluator" not in kwargs:
            with warnings.catch_warnings():
                # An evaluator without loggers is the point here, not a mistake to warn about.
                warnings.filterwarnings("ignore", message="No loggers specified")
                kwargs["evaluator"] = EvaluationPlugin(loggers=[])
        super().__init__(**kwargs)
        self.amp = amp
        autocast(self.device, amp)  # validates amp early
        self.scaler = torch.amp.GradScaler(self.device.type) if amp == "fp16" else None

    def _before_forward(self, **kwargs: Any) -> None:
        # Plugins that run a model here (StreamKLPlugin's teacher) get the forward's precision.
        with autocast(self.device, self.amp):
            super()._before_forward(**kwargs)

    def forward(self) -> torch.Tensor:
        with autocast(self.device, self.amp):
            return super().forward()

    def backward(self) -> None:
        if self.scaler is None:
            super().backward()
        else:
            self.scaler.scale(self.loss).backward(retain_graph=self.retain_graph)

    def optimizer_step(self) -> None:
        if self.scaler is None:
            super().optimizer_step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
