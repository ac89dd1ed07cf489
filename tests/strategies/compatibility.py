"""Run the attention-distillation plugins through Avalanche strategies on tiny models of every supported kind.

Each combination trains two experiences of a few 16 px images on the CPU and returns the
plugin's penalties per experience; the compatibility table of docs/plugins.md is built
from these runs (tests/docs/test_compatibility_table.py), and the strategy tests assert on
them. A model kind is a builder in :data:`MODEL_KINDS`; a kind whose extra is not installed
(``peft``, ``transformers``) is skipped, and its row says so.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import timm
import torch
import torchvision
from avalanche.benchmarks import tensors_benchmark
from avalanche.models import IncrementalClassifier, MultiHeadClassifier, MultiTaskModule
from avalanche.training import Naive, Replay
from avalanche.training.plugins import EvaluationPlugin, EWCPlugin, LwFPlugin, SupervisedPlugin
from torch import nn

from cl_streamkl.strategies import PADPlugin, StreamKLPlugin

IMAGE = (3, 16, 16)
DIM = 16
STRATEGIES = ("Naive", "Replay", "LwF", "EWC")
PLUGINS = {"StreamKLPlugin": lambda: StreamKLPlugin(alpha=1.0, backend="torch"),
           "PADPlugin": lambda: PADPlugin(alpha=1.0)}


def timm_backbone(num_classes: int = 0) -> nn.Module:
    """A one-block timm ViT, 16 px images, 4 tokens and a class token."""
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, depth=1,
                             embed_dim=DIM, num_heads=2, num_classes=num_classes)


class TaskIncrementalViT(MultiTaskModule):
    """Avalanche's task-incremental layout: a timm backbone and a ``MultiHeadClassifier``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = timm_backbone()
        self.classifier = MultiHeadClassifier(DIM, initial_out_features=2)

    def forward_single_task(self, x: torch.Tensor, task_label: int) -> torch.Tensor:
        return self.classifier.forward_single_task(self.backbone(x), task_label)


class ClassIncrementalViT(nn.Module):
    """A timm backbone and Avalanche's ``IncrementalClassifier`` (grows with the classes seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = timm_backbone()
        self.classifier = IncrementalClassifier(DIM, initial_out_features=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(x))


def torchvision_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2,
                                                hidden_dim=DIM, mlp_dim=2 * DIM, num_classes=4)


def peft_timm_vit() -> nn.Module:
    """LoRA adapters (peft) on the ``qkv`` projections of a timm ViT; only they and the head train."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(timm_backbone(num_classes=4),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["qkv"], modules_to_save=["head"]))


# name → (builder, the extra it needs or None, task labels per experience)
MODEL_KINDS: dict[str, tuple[Callable[[], nn.Module], str | None, tuple[int, int]]] = {
    "timm ViT": (lambda: timm_backbone(num_classes=4), None, (0, 0)),
    "torchvision ViT": (torchvision_vit, None, (0, 0)),
    "peft LoRA on timm ViT": (peft_timm_vit, "peft", (0, 0)),
    "MultiTaskModule + MultiHeadClassifier (timm)": (TaskIncrementalViT, None, (0, 1)),
    "IncrementalClassifier (timm)": (ClassIncrementalViT, None, (0, 0)),
}


def available(kind: str) -> bool:
    """Whether the extra that ``kind`` needs is installed."""
    extra = MODEL_KINDS[kind][1]
    return extra is None or importlib.util.find_spec(extra) is not None


class _PenaltyLog(SupervisedPlugin):
    """Records the distillation plugin's penalty after every backward, per experience."""

    def __init__(self, plugin: SupervisedPlugin) -> None:
        super().__init__()
        self.plugin, self.penalties = plugin, []

    def before_training_exp(self, strategy, *args, **kwargs) -> None:
        self.penalties.append([])

    def after_backward(self, strategy, *args, **kwargs) -> None:
        self.penalties[-1].append(self.plugin.last_penalty)


def _stream(task_labels: tuple[int, int]):
    """Two experiences of 8 images: classes 0-1, then 2-3."""
    generator = torch.Generator().manual_seed(0)

    def experience(index: int) -> list[torch.Tensor]:
        return [torch.randn(8, *IMAGE, generator=generator), torch.arange(8) % 2 + 2 * index]

    data = [experience(i) for i in range(2)]
    return tensors_benchmark(train_tensors=data, test_tensors=data, task_labels=list(task_labels))


@functools.lru_cache(maxsize=None)
def run(kind: str, strategy: str, plugin: str) -> tuple[tuple[float, ...], ...]:
    """Train ``kind`` under ``strategy`` with ``plugin`` over two experiences; the penalties of each."""
    torch.manual_seed(0)
    builder, _, task_labels = MODEL_KINDS[kind]
    model = builder()
    distillation = PLUGINS[plugin]()
    log = _PenaltyLog(distillation)
    plugins = [distillation, log]
    if strategy == "LwF":
        plugins.append(LwFPlugin(alpha=1.0, temperature=2.0))
    if strategy == "EWC":
        plugins.append(EWCPlugin(ewc_lambda=1.0))
    # Adam moves every trained weight by about lr at once: a KL well above float32 rounding by the second step.
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    common = dict(model=model, optimizer=optimizer,
                  criterion=nn.CrossEntropyLoss(), train_mb_size=4, train_epochs=1, eval_mb_size=8, device="cpu",
                  plugins=plugins, evaluator=EvaluationPlugin(loggers=[]))
    trainer = Replay(mem_size=4, **common) if strategy == "Replay" else Naive(**common)
    for experience in _stream(task_labels).train_stream:
        trainer.train(experience)
    return tuple(tuple(values) for values in log.penalties)


def hugging_face_vit() -> nn.Module:
    """transformers' ViT for classification, built from a config (no weights)."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=16, patch_size=8, hidden_size=DIM, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=2 * DIM, num_labels=4)
    return _Logits(ViTForImageClassification(config))


class _Logits(nn.Module):
    """A Hugging Face classifier whose forward returns the logits tensor (Avalanche's criterion takes it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def _capturable(builder: Callable[[], nn.Module]) -> bool:
    """Whether QKCapture reads this model's attention in this version."""
    from cl_streamkl.capture import QKCapture

    try:
        QKCapture(builder())
    except TypeError:
        return False
    return True


if importlib.util.find_spec("transformers") is not None and _capturable(hugging_face_vit):
    MODEL_KINDS["Hugging Face ViTForImageClassification"] = (hugging_face_vit, "transformers", (0, 0))
