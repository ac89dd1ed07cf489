"""The early-convolution stem: timm builds with it, its token grid, Q/K capture through it, refusals."""

from __future__ import annotations

import pytest
import torch
from timm.layers import PatchEmbed
from torch import nn

from cl_streamkl.capture import QKCapture
from cl_streamkl.experiment.conv_stem import ConvStem
from cl_streamkl.experiment.model import build_model

TINY = {"depth": 2, "embed_dim": 32, "num_heads": 2}


def tiny_model(image_size: int, patch_size: int = 4, stem: str = "conv", **kwargs) -> nn.Module:
    return build_model("vit_tiny_patch16_224", image_size=image_size, patch_size=patch_size, in_chans=1,
                       num_classes=10, model_kwargs=TINY, stem=stem, **kwargs)


def test_conv_stem_is_two_stride_two_convolutions_then_a_projection():
    stem = tiny_model(32).patch_embed
    assert isinstance(stem, ConvStem)
    convolutions = [m for m in stem.convolutions if isinstance(m, nn.Conv2d)]
    assert [(c.kernel_size, c.stride, c.in_channels, c.out_channels) for c in convolutions] == [
        ((3, 3), (2, 2), 1, 16), ((3, 3), (2, 2), 16, 32)]
    assert sum(isinstance(m, nn.BatchNorm2d) for m in stem.convolutions) == 2
    assert sum(isinstance(m, nn.ReLU) for m in stem.convolutions) == 2
    assert stem.proj.kernel_size == (1, 1) and stem.proj.out_channels == TINY["embed_dim"]
    assert isinstance(tiny_model(32, stem="patch").patch_embed, PatchEmbed)


@pytest.mark.parametrize("canvas", [32, 128])
def test_capture_reads_every_block_over_the_canvas_token_grid(canvas):
    torch.manual_seed(0)
    model = tiny_model(canvas).eval()
    with QKCapture(model) as capture:
        logits = model(torch.rand(2, 1, canvas, canvas))
    assert logits.shape == (2, 10)
    assert capture.block_indices == list(range(TINY["depth"]))
    tokens = (canvas // 4) ** 2 + 1
    assert all(q.shape == k.shape == (2, 2, tokens, 16) for q, k in capture.qk)


def test_stem_trains_with_task_heads():
    torch.manual_seed(0)
    model = tiny_model(16, head_sizes=[2, 2])
    loss = model(torch.rand(4, 1, 16, 16), 1).logsumexp(1).mean()
    loss.backward()
    assert all(p.grad is not None for p in model.backbone.patch_embed.parameters())


def test_larger_patches_take_more_convolutions():
    stem = tiny_model(32, patch_size=8).patch_embed
    assert sum(isinstance(m, nn.Conv2d) for m in stem.convolutions) == 3 and stem.num_patches == 16


@pytest.mark.parametrize("kwargs, match", [
    ({"patch_size": 6, "image_size": 24}, "power of two"),
    ({"pretrained_file": "weights.pth"}, "drop --pretrained-file"),
    ({"stem": "resnet"}, "stem must be one of"),
])
def test_stems_that_cannot_build_are_refused(kwargs, match):
    arguments = {"image_size": 32, **kwargs}
    with pytest.raises(ValueError, match=match):
        tiny_model(**arguments)


def test_conv_stem_needs_a_vision_transformer():
    with pytest.raises(ValueError, match="needs a timm VisionTransformer"):
        build_model("eva02_tiny_patch14_224", image_size=32, patch_size=4, in_chans=1, num_classes=10,
                    model_kwargs=TINY, stem="conv")
