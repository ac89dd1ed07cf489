"""What the strategy tests share: tiny timm models, a float64 reference penalty, small Avalanche runs."""

from __future__ import annotations

from types import SimpleNamespace

import timm
import torch
import torchvision
from avalanche.benchmarks import tensors_benchmark
from avalanche.training import Naive, Replay
from avalanche.training.plugins import EvaluationPlugin, EWCPlugin, LwFPlugin
from torch import nn

from cl_streamkl import attention_kl_reference
from cl_streamkl.capture import QKCapture
from cl_streamkl.strategies import StreamKLPlugin

IMAGE = (3, 32, 32)


def tiny_model(arch: str = "vit", depth: int = 2, seed: int = 0) -> nn.Module:
    """A tiny timm ViT (``"vit"``), EVA-02 (``"eva"``) or torchvision ViT (``"torchvision"``), 4 classes."""
    torch.manual_seed(seed)
    if arch == "torchvision":
        return torchvision.models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=depth, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=4
        )
    name = "vit_tiny_patch16_224" if arch == "vit" else "eva02_tiny_patch14_224"
    return timm.create_model(
        name, pretrained=False, img_size=32, patch_size=8, num_classes=4, depth=depth, embed_dim=64, num_heads=2
    )


def count_hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )


def perturb(model: nn.Module, seed: int = 1, size: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(size * torch.randn(param.shape, generator=generator))


def reference_penalty(student: nn.Module, teacher: nn.Module, x: torch.Tensor, alpha: float, layers="all",
                      temperature: float = 1.0) -> torch.Tensor:
    """alpha × mean float64 KL, from separate forwards of both models (graph kept on the student)."""
    with QKCapture(student, layers) as cap_s:
        student(x)
    with torch.no_grad(), QKCapture(teacher, layers) as cap_t:
        teacher(x)
    per_layer = [
        attention_kl_reference(q, k, qt, kt, temperature=temperature, reduction="mean")
        for (q, k), (qt, kt) in zip(cap_s.qk, cap_t.qk)
    ]
    return alpha * torch.stack(per_layer).mean()


def tensor_benchmark(experiences: int = 2, per_experience: int = 16):
    """A small random-image stream with task labels (LwF needs them)."""

    def tensors(seed: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(per_experience, *IMAGE, generator=generator)
        return [x, torch.randint(0, 4, (per_experience,), generator=generator)]

    return tensors_benchmark(
        train_tensors=[tensors(seed) for seed in range(experiences)],
        test_tensors=[tensors(100 + seed) for seed in range(experiences)],
        task_labels=[0] * experiences,
    )


def make_strategy(kind: str, model: nn.Module, plugins: list, evaluator=None):
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    common = dict(
        model=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), train_mb_size=8, train_epochs=1,
        eval_mb_size=16, device="cpu", plugins=plugins,
        evaluator=evaluator if evaluator is not None else EvaluationPlugin(loggers=[]),
    )
    if kind == "replay":
        return Replay(mem_size=8, **common)
    if kind == "lwf":
        common["plugins"] = plugins + [LwFPlugin(alpha=1.0, temperature=2.0)]
    if kind == "ewc":
        common["plugins"] = plugins + [EWCPlugin(ewc_lambda=1.0)]
    return Naive(**common)


def plugin_on_tiny_vit(alpha: float, batch: int) -> tuple[nn.Module, StreamKLPlugin, SimpleNamespace]:
    """A tiny ViT, a torch-backend plugin and a stand-in strategy holding one random batch, training started."""
    model = tiny_model()
    plugin = StreamKLPlugin(alpha=alpha, backend="torch")
    strategy = SimpleNamespace(model=model, mb_x=torch.randn(batch, *IMAGE), loss=torch.zeros(()))
    plugin.before_training(strategy)
    return model, plugin, strategy
