"""The end-to-end benchmark's penalty check: every method's penalty on one batch against float64."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from _harness.vit_training import build_distiller, build_model, random_batch
from cl_streamkl import attention_kl_reference
from cl_streamkl.capture import QKCapture
from cl_streamkl.strategies import frozen_copy

PENALTY_METHODS = ("eager", "triton", "torch")
PERTURBATION_STD = 0.02


@dataclass
class PenaltyCheck:
    """Penalty values of (b), (c), (d) and the float64 reference on one batch."""

    image_size: int
    tokens: int
    batch: int
    values: dict[str, float]
    reference: float
    max_pairwise_rel: float
    rtol: float

    @property
    def passed(self) -> bool:
        return self.max_pairwise_rel <= self.rtol


def _perturb(model: nn.Module, std: float) -> None:
    # Teacher and student start identical (KL = 0); noise gives a penalty worth comparing.
    generator = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator) * std
            parameter.add_(noise.to(parameter.device, parameter.dtype))


def check_penalties(
    methods: Sequence[str],
    model_name: str,
    model_kwargs: dict,
    image_size: int,
    batch: int,
    alpha: float,
    rtol: float,
    device: torch.device,
    compile_teacher: bool | Mapping[str, Any] = False,
) -> PenaltyCheck:
    """Penalty of each method in ``methods`` ∩ (b, c, d) and the float64 reference, one batch.

    The teacher snapshot is taken, then the student is perturbed; every method sees the
    same student, teacher weights and images under bf16 autocast.
    """
    torch.manual_seed(0)
    model = build_model(model_name, model_kwargs, image_size, device).eval()
    distillers = {
        method: build_distiller(method, alpha, compile_teacher) for method in methods if method in PENALTY_METHODS
    }
    for distiller in distillers.values():
        distiller.update_teacher(model)
    teacher = frozen_copy(model)
    _perturb(model, PERTURBATION_STD)
    images, _ = random_batch(batch, image_size, model.num_classes, device)
    values = {}
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for method, distiller in distillers.items():
            with distiller.student_capture(model) as capture:
                model(images)
            values[method] = float(distiller.penalty(images, capture))
        with QKCapture(model, layers="all") as student, QKCapture(teacher, layers="all") as teacher_capture:
            model(images)
            teacher(images)
    reference = alpha * reference_penalty(student, teacher_capture)
    pairs = [(a, b) for i, a in enumerate(values) for b in list(values)[i + 1 :]]
    max_pairwise = max((_relative_gap(values[a], values[b]) for a, b in pairs), default=0.0)
    return PenaltyCheck(
        image_size=image_size,
        tokens=model.patch_embed.num_patches + getattr(model, "num_prefix_tokens", 1),
        batch=batch,
        values=values,
        reference=reference,
        max_pairwise_rel=max_pairwise,
        rtol=rtol,
    )


def reference_penalty(student: QKCapture, teacher: QKCapture) -> float:
    """The float64 mean over blocks of the row-mean KL(P_teacher ‖ P_student) of two captures (alpha 1)."""
    with torch.no_grad():
        return statistics.fmean(
            float(attention_kl_reference(q, k, q_teacher, k_teacher, scale=scale, teacher_scale=teacher_scale))
            for (q, k), (q_teacher, k_teacher), scale, teacher_scale in zip(
                student.qk, teacher.qk, student.scales, teacher.scales
            )
        )


def _relative_gap(value: float, other: float) -> float:
    scale = max(abs(value), abs(other))
    return abs(value - other) / scale if scale > 0 else 0.0


def format_check(check: PenaltyCheck) -> str:
    """One line: each method's penalty, its gap to the float64 reference, the pass verdict."""
    parts = [
        f"{method} {value:.6g} (ref {_relative_gap(value, check.reference):.1e})"
        for method, value in check.values.items()
    ]
    verdict = "ok" if check.passed else "FAIL"
    return (
        f"penalty check {check.image_size}px ({check.tokens} tokens, batch {check.batch}): "
        + " | ".join(parts)
        + f" | float64 {check.reference:.6g} | max pairwise rel {check.max_pairwise_rel:.1e} "
        f"(rtol {check.rtol:.0e}) {verdict}"
    )
