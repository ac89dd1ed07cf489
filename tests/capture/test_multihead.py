"""nn.MultiheadAttention read by QKCapture: the module's own attention weights in float64, torchvision's ViT, refusals."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from cl_streamkl.capture import QKCapture


class Blocks(nn.Module):
    """Two attention modules called as ``attention(query, key, value, **call)``."""

    def __init__(self, cross: bool = False, **module_kwargs) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.MultiheadAttention(**module_kwargs) for _ in range(2))
        self.cross = cross
        self.call: dict = {}
        self.weights: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        self.weights = []
        for attention in self.blocks:
            key = memory if self.cross else x
            x, weights = attention(x, key, key, need_weights=True, average_attn_weights=False, **self.call)
            self.weights.append(weights)
        return x


def probabilities(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.softmax(scale * q @ k.transpose(-2, -1), dim=-1)


CASES = {
    "batch-first": (dict(embed_dim=16, num_heads=2, batch_first=True), (3, 5, 16), None),
    "sequence-first": (dict(embed_dim=16, num_heads=4), (5, 3, 16), None),
    "no-bias": (dict(embed_dim=12, num_heads=3, bias=False, batch_first=True), (2, 7, 12), None),
    "cross-kdim": (dict(embed_dim=16, num_heads=2, kdim=6, vdim=6, batch_first=True), (2, 5, 16), (2, 9, 6)),
    "unbatched": (dict(embed_dim=8, num_heads=2), (4, 8), None),
}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", CASES)
def test_captured_qk_reproduce_the_modules_own_attention_weights(case: str, training: bool) -> None:
    module_kwargs, x_shape, memory_shape = CASES[case]
    torch.manual_seed(0)
    model = Blocks(cross=memory_shape is not None, **module_kwargs).double().train(training)
    x = torch.randn(x_shape, dtype=torch.float64)
    memory = torch.randn(memory_shape, dtype=torch.float64) if memory_shape else None
    with QKCapture(model) as cap:
        model(x, memory)
    heads = module_kwargs["num_heads"]
    assert cap.scales == [(module_kwargs["embed_dim"] // heads) ** -0.5] * 2
    for (q, k), scale, weights in zip(cap.qk, cap.scales, model.weights):
        assert q.dim() == 4 and q.shape[1] == heads and q.requires_grad and k.requires_grad
        expected = weights if weights.dim() == 4 else weights.unsqueeze(0)  # unbatched: (H, Nq, Nk)
        torch.testing.assert_close(probabilities(q, k, scale), expected, rtol=1e-12, atol=1e-14)


def test_torchvision_vit_attention_is_read_exactly() -> None:
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=4
    ).double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    # The encoder blocks call their attention with need_weights=False; ask for the weights instead.
    expected: list[torch.Tensor] = []

    def with_weights(module: nn.Module, args: tuple, kwargs: dict) -> None:
        # module.forward, not module(): no hooks, so neither this hook nor the capture runs again.
        expected.append(module.forward(*args, need_weights=True, average_attn_weights=False)[1])

    attentions = [layer.self_attention for layer in model.encoder.layers]
    with QKCapture(model, layers="all") as cap:
        handles = [attention.register_forward_pre_hook(with_weights, with_kwargs=True) for attention in attentions]
        try:
            model(x)
        finally:
            for handle in handles:
                handle.remove()
    assert [q.shape for q, _ in cap.qk] == [(2, 2, 17, 8)] * 2
    for (q, k), scale, weights in zip(cap.qk, cap.scales, expected, strict=True):
        torch.testing.assert_close(probabilities(q, k, scale), weights, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "module_kwargs, call, match",
    [
        ({}, {"attn_mask": torch.zeros(4, 4)}, "called with attn_mask"),
        ({}, {"key_padding_mask": torch.zeros(2, 4, dtype=torch.bool)}, "called with key_padding_mask"),
        ({}, {"attn_mask": torch.ones(4, 4).triu(1).bool(), "is_causal": True}, "called with attn_mask"),
        ({"add_bias_kv": True}, {}, "adds key tokens"),
        ({"add_zero_attn": True}, {}, "adds key tokens"),
    ],
    ids=["attn_mask", "key_padding_mask", "is_causal", "add_bias_kv", "add_zero_attn"],
)
def test_scores_beyond_qk_are_refused(module_kwargs: dict, call: dict, match: str) -> None:
    model = Blocks(embed_dim=8, num_heads=2, batch_first=True, **module_kwargs)
    model.call = call
    with pytest.raises(RuntimeError, match=f"torch.nn.modules.activation.MultiheadAttention: .*{match}"):
        with QKCapture(model):
            model(torch.randn(2, 4, 8))
    assert all(not m._forward_pre_hooks for m in model.modules())
