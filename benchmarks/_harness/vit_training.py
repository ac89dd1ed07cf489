"""timm ViT training steps with and without attention distillation, for the end-to-end scripts.

A step is cross-entropy under bf16 autocast with AdamW, plus, for a distilling method,
``alpha`` times the mean over all blocks of the row-averaged KL(P_teacher ‖ P_student)
against a frozen snapshot of the student taken before the first step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import timm
import torch
import torch.nn.functional as F
from torch import nn

from _harness.measure import PeakMemory, sync
from _harness.options import KL_IMPLEMENTATIONS
from cl_streamkl.capture import QKCapture, TeacherQK
from cl_streamkl.kernels import eager_attention_kl
from cl_streamkl.strategies import AttentionDistiller

# Step methods: (a) no distillation, (b) the eager penalty, (c), (d) StreamKL's backends.
METHODS = ("none", "eager", "triton", "torch")
# (t): (c) without its penalty.
EXTRA_METHODS = ("teacher",)

DEFAULT_MODEL = "vit_base_patch16_224"
TINY_MODEL_KWARGS = {"depth": 2, "embed_dim": 32, "num_heads": 2, "num_classes": 10}



class EagerAttentionDistiller(AttentionDistiller):
    """Method (b): :class:`AttentionDistiller` with the KL computed by materialising both maps.

    Teacher snapshot, captures and the teacher's forward are the distiller's own; only
    :func:`attention_kl` is swapped for the usual eager code.
    """

    def penalty(
        self, x: torch.Tensor, capture: QKCapture | TeacherQK, *, teacher: TeacherQK | None = None, **_: Any,
    ) -> torch.Tensor:
        """``alpha`` · mean over blocks of the row-mean KL(P_teacher ‖ P_student).

        Args:
            x: the images the student saw, (B, 3, S, S).
            capture: the student's :meth:`student_capture` (its log-sum-exps are unused: the
                eager code computes its own).
            teacher: ``teacher_qk(x)`` if already run, else None (run here).
        """
        teacher_capture = self.teacher_qk(x) if teacher is None else teacher
        per_block = [
            eager_attention_kl(q, k, q_teacher, k_teacher, scale=scale, teacher_scale=teacher_scale)
            for (q, k), (q_teacher, k_teacher), scale, teacher_scale in zip(
                capture.qk, teacher_capture.qk, capture.scales, teacher_capture.scales
            )
        ]
        return self.alpha * torch.stack(per_block).mean()


class TeacherOnlyDistiller(AttentionDistiller):
    """(t): runs the teacher's captured forward like (c) but returns a zero penalty."""

    def penalty(
        self, x: torch.Tensor, capture: QKCapture | TeacherQK, *, teacher: TeacherQK | None = None, **_: Any,
    ) -> torch.Tensor:
        """Zero (on ``x``'s device), after the teacher's forward on ``x`` unless ``teacher`` is given."""
        if teacher is None:
            self.teacher_qk(x)
        return torch.zeros((), device=x.device)


def build_distiller(
    method: str, alpha: float, compile_teacher: bool | Mapping[str, Any] = False
) -> AttentionDistiller | None:
    """The penalty object of ``method`` (None for ``none``), teacher not yet taken.

    ``compile_teacher`` (``AttentionDistiller``'s argument) gives every distilling method
    the ``torch.compile``'d teacher.
    """
    if method == "none":
        return None
    if method == "eager":
        return EagerAttentionDistiller(alpha=alpha, layers="all", compile_teacher=compile_teacher)
    if method == "teacher":
        return TeacherOnlyDistiller(alpha=alpha, layers="all", compile_teacher=compile_teacher)
    if method in KL_IMPLEMENTATIONS:
        return AttentionDistiller(
            alpha=alpha, layers="all", temperature=1.0, backend=method, compile_teacher=compile_teacher
        )
    raise ValueError(f"method must be one of {METHODS + EXTRA_METHODS}, got {method!r}")


def student_qk(capture: QKCapture, with_lse: bool) -> QKCapture | TeacherQK:
    """The capture whole, or (``with_lse`` False) its Q/K and scales without the log-sum-exps."""
    return capture if with_lse else TeacherQK(qk=capture.qk, scales=capture.scales)


@dataclass
class Trainer:
    """A student, its AdamW optimizer and the method's distiller (teacher = initial student)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    distiller: AttentionDistiller | None
    num_classes: int
    device: torch.device
    # False: the student's log-sum-exps are withheld, so the penalty computes both online.
    pass_student_lse: bool = True

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One training step on images (B, 3, S, S) and labels (B,); returns the detached loss."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            if self.distiller is None:
                loss = F.cross_entropy(self.model(images), labels)
            else:
                # The plugin's order: teacher first, so its GPU work overlaps the student's forward.
                teacher = self.distiller.teacher_qk(images)
                with self.distiller.student_capture(self.model) as capture:
                    logits = self.model(images)
                # As the plugin: the student's log-sum-exps, which the kernels reuse where they fit.
                penalty = self.distiller.penalty(images, student_qk(capture, self.pass_student_lse), teacher=teacher)
                # Leave the teacher's Q/K to the penalty's graph, whose backward runs first and
                # frees them; a reference held through the whole backward keeps them alive (about
                # 0.6 GB at 1025 tokens, batch 16) while the student's gradients are allocated.
                del teacher
                loss = F.cross_entropy(logits, labels) + penalty
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def build_model(model_name: str, model_kwargs: dict, image_size: int, device: torch.device) -> nn.Module:
    """A randomly initialised timm model for ``image_size`` px inputs, on ``device``."""
    with device:
        return timm.create_model(model_name, pretrained=False, img_size=image_size, **model_kwargs)


def build_trainer(
    method: str,
    model_name: str,
    model_kwargs: dict,
    image_size: int,
    alpha: float,
    device: torch.device,
    compile_teacher: bool | Mapping[str, Any] = False,
) -> Trainer:
    """Fresh student, AdamW (fused on CUDA) and the method's distiller with its teacher snapshot."""
    torch.manual_seed(0)
    model = build_model(model_name, model_kwargs, image_size, device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    distiller = build_distiller(method, alpha, compile_teacher)
    if distiller is not None:
        distiller.update_teacher(model)
    return Trainer(model, optimizer, distiller, model.num_classes, device)


def random_batch(
    batch: int, image_size: int, num_classes: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (batch, 3, S, S) and labels (batch,)."""
    images = torch.randn(batch, 3, image_size, image_size, device=device)
    labels = torch.randint(num_classes, (batch,), device=device)
    return images, labels


def time_steps(
    trainer: Trainer, batch: int, image_size: int, warmup_steps: int, steps: int
) -> tuple[float, float | None]:
    """Median step time (ms) and peak device memory (GiB, CUDA only) at ``batch``.

    Raises:
        torch.OutOfMemoryError: the batch does not fit.
    """
    device = trainer.device
    images, labels = random_batch(batch, image_size, trainer.num_classes, device)
    for _ in range(warmup_steps):
        trainer.step(images, labels)
    times = []
    with PeakMemory(device) as memory:
        for _ in range(steps):
            start = time.perf_counter()
            trainer.step(images, labels)
            sync(device)
            times.append(time.perf_counter() - start)
    peak = None if memory.peak_bytes is None else memory.peak_bytes / 2**30
    return statistics.median(times) * 1e3, peak
