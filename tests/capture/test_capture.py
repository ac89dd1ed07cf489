"""QKCapture: faithful Q/K of timm ViT and EVA blocks, layer rules, hooks and errors."""

from __future__ import annotations

import copy
import pickle

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from cl_streamkl.capture import extractors
from cl_streamkl.capture import QKCapture, register_qk_extractor, resolve_layer_indices

DEPTH = 3


def tiny_vit(qk_norm: bool = False) -> nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=4,
        depth=DEPTH, embed_dim=64, num_heads=2, qk_norm=qk_norm,
    )


def tiny_eva(qk_norm: bool = False) -> nn.Module:
    return timm.create_model(
        "eva02_tiny_patch14_224", pretrained=False, img_size=32, patch_size=8, num_classes=4,
        depth=DEPTH, embed_dim=64, num_heads=2, qk_norm=qk_norm,
    )


MODELS = {"vit": tiny_vit, "eva": tiny_eva}


def count_hooks(model: nn.Module) -> int:
    total = 0
    for m in model.modules():
        total += len(m._forward_hooks) + len(m._forward_pre_hooks)
        total += len(m._backward_hooks) + len(getattr(m, "_backward_pre_hooks", {}))
    return total


def set_fused(model: nn.Module, fused: bool) -> None:
    for block in model.blocks:
        block.attn.fused_attn = fused


def timm_attention_probs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Softmax probabilities from timm's own non-fused path (the input of attn_drop)."""
    set_fused(model, False)
    probs: list[torch.Tensor] = []
    handles = [
        block.attn.attn_drop.register_forward_hook(lambda _m, _i, out: probs.append(out.detach()))
        for block in model.blocks
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return probs


@pytest.mark.parametrize("fused", [False, True], ids=["manual", "fused"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
@pytest.mark.parametrize("arch", ["vit", "eva"])
def test_captured_qk_reproduce_timm_attention(arch: str, qk_norm: bool, fused: bool) -> None:
    torch.manual_seed(0)
    model = MODELS[arch](qk_norm).eval()
    if arch == "eva":
        assert model.rope is not None, "the EVA test model must use rotary embeddings"
    if qk_norm:
        assert not isinstance(model.blocks[0].attn.q_norm, nn.Identity)
    x = torch.randn(2, 3, 32, 32)
    expected = timm_attention_probs(model, x)
    set_fused(model, fused)
    with QKCapture(model) as cap:
        model(x)
    assert cap.block_indices == list(range(DEPTH))
    for (q, k), scale, probs, module in zip(cap.qk, cap.scales, expected, cap.attention_modules):
        assert q.shape == k.shape == (2, 2, 17, 32)
        assert scale == module.scale
        ours = (q.double() @ k.double().transpose(-2, -1) * scale).softmax(-1)
        torch.testing.assert_close(ours, probs.double(), rtol=0, atol=2e-6)


def test_rope_is_applied_to_captured_eva_qk() -> None:
    """Without rope the scores would differ: guards against capturing pre-rope tensors."""
    torch.manual_seed(0)
    model = tiny_eva().eval()
    x = torch.randn(1, 3, 32, 32)
    with QKCapture(model, layers=[0]) as cap:
        model(x)
    q_rope, _ = cap.qk[0]
    pre_rope = {}
    model.blocks[0].attn.q_norm.register_forward_hook(lambda _m, _i, out: pre_rope.setdefault("q", out))
    model(x)
    assert not torch.allclose(q_rope[:, :, 1:], pre_rope["q"][:, :, 1:])
    torch.testing.assert_close(q_rope[:, :, :1], pre_rope["q"][:, :, :1])


def test_capture_keeps_graph_and_views_without_copy() -> None:
    torch.manual_seed(0)
    model = tiny_vit()
    x = torch.randn(2, 3, 32, 32)
    with QKCapture(model, layers=[0]) as cap:
        model(x)
    q, k = cap.qk[0]
    assert q.requires_grad and q.grad_fn is not None and k.grad_fn is not None
    # timm's q and k are strided views of one permuted qkv tensor: same storage, not contiguous.
    assert not q.is_contiguous() and not k.is_contiguous()
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    (q.square().sum() + k.sum()).backward()
    grad = model.blocks[0].attn.qkv.weight.grad
    assert grad is not None and grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("layers", "expected"),
    [("all", [0, 1, 2]), (1, [2]), (2, [1, 2]), (3, [0, 1, 2]), ([0], [0]), ([-1], [2]), ([2, -3], [0, 2])],
    ids=str,
)
def test_layer_selection_follows_timm_rules(layers, expected) -> None:
    model = tiny_vit().eval()
    with QKCapture(model, layers=layers) as cap:
        model(torch.randn(1, 3, 32, 32))
    assert cap.block_indices == expected
    assert cap.attention_modules == [model.blocks[i].attn for i in expected]
    assert len(cap.qk) == len(expected)


@pytest.mark.parametrize(
    ("layers", "error", "match"),
    [
        (0, ValueError, "1 <= n <= 3"),
        (4, ValueError, "1 <= n <= 3"),
        ([3], ValueError, "out of range"),
        ([-4], ValueError, "out of range"),
        ([], ValueError, "empty"),
        ([1, -2], ValueError, "same block"),
        ("last", ValueError, "'all'"),
        (True, TypeError, "bool"),
        (1.0, TypeError, "float"),
        ([0.0], TypeError, "ints"),
    ],
    ids=str,
)
def test_bad_layer_selection_is_rejected(layers, error, match) -> None:
    with pytest.raises(error, match=match):
        QKCapture(tiny_vit(), layers=layers)
    with pytest.raises(error, match=match):
        resolve_layer_indices(layers, 3)


def test_hooks_removed_on_exit_and_when_forward_raises() -> None:
    model = tiny_vit().eval()
    before = count_hooks(model)
    with QKCapture(model) as cap:
        assert cap.active and count_hooks(model) > before
        model(torch.randn(1, 3, 32, 32))
    assert not cap.active and count_hooks(model) == before

    def explode(_module, _inputs, _output):
        raise RuntimeError("boom inside attention")

    # Raised while the capture's torch-function mode is active inside block 1's attention.
    bomb = model.blocks[1].attn.qkv.register_forward_hook(explode)
    with pytest.raises(RuntimeError, match="boom inside attention"):
        with QKCapture(model):
            model(torch.randn(1, 3, 32, 32))
    bomb.remove()
    assert count_hooks(model) == before
    assert torch._C._len_torch_function_stack() == 0
    # The model still works and can be captured again afterwards.
    with QKCapture(model) as cap:
        model(torch.randn(1, 3, 32, 32))
    assert len(cap.qk) == DEPTH


@pytest.mark.parametrize("layers", ["all", [0], [0, 1]])
@pytest.mark.parametrize("arch", ["vit", "eva"])
def test_stop_early_skips_the_rest_of_the_forward_and_keeps_the_same_qk(arch: str, layers) -> None:
    model = MODELS[arch]().eval()
    x = torch.randn(2, 3, 32, 32)
    with QKCapture(model, layers) as full:
        model(x)
    calls = {"head": 0, "blocks": [0] * DEPTH}
    counters = [model.head.register_forward_hook(lambda *_: calls.__setitem__("head", calls["head"] + 1))]
    for index, block in enumerate(model.blocks):
        counters.append(block.register_forward_hook(lambda *_, i=index: calls["blocks"].__setitem__(i, 1)))
    before = count_hooks(model)
    after_forward = []
    with torch.no_grad(), QKCapture(model, layers, stop_early=True) as early:
        model(x)
        after_forward.append("ran")
    last = early.block_indices[-1]
    assert calls["head"] == 0 and after_forward == []
    assert calls["blocks"] == [1] * last + [0] * (DEPTH - last)  # the last selected block's MLP never ran
    assert count_hooks(model) == before and torch._C._len_torch_function_stack() == 0
    for (q, k), (q_full, k_full) in zip(early.qk, full.qk):
        torch.testing.assert_close(q, q_full, rtol=0, atol=0)
        torch.testing.assert_close(k, k_full, rtol=0, atol=0)
    for handle in counters:
        handle.remove()


def test_stop_early_lets_other_errors_through() -> None:
    model = tiny_vit().eval()
    bomb = model.blocks[0].attn.qkv.register_forward_hook(lambda *_: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        with QKCapture(model, stop_early=True):
            model(torch.randn(1, 3, 32, 32))
    bomb.remove()
    assert torch._C._len_torch_function_stack() == 0


def test_model_stays_copyable_and_picklable() -> None:
    model = tiny_eva()
    with QKCapture(model) as cap:
        model(torch.randn(1, 3, 32, 32))
    copy.deepcopy(model)
    pickle.loads(pickle.dumps(model))
    assert len(cap.qk) == DEPTH


def test_last_forward_wins_and_access_before_forward_fails() -> None:
    torch.manual_seed(0)
    model = tiny_vit().eval()
    x1, x2 = torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32)
    cap = QKCapture(model, layers=1)
    with pytest.raises(RuntimeError, match="no Q/K was captured for blocks \\[2\\]"):
        cap.qk
    with cap:
        model(x1)
        model(x2)
        with pytest.raises(RuntimeError, match="already active"):
            cap.__enter__()
    with QKCapture(model, layers=1) as fresh:
        model(x2)
    torch.testing.assert_close(cap.qk[0][0], fresh.qk[0][0])


def test_attention_with_relative_position_bias_is_rejected() -> None:
    beit = timm.create_model(
        "beit_base_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=4,
        depth=2, embed_dim=64, num_heads=2,
    )
    with pytest.raises(TypeError, match=r"block 0 .*timm\.models\.beit\.Attention.*register_qk_extractor"):
        QKCapture(beit)


def test_user_registration_of_a_timm_class_is_not_overridden(isolated_registry) -> None:
    attention_cls = type(tiny_vit().blocks[0].attn)

    def custom(module, record):
        return []

    register_qk_extractor(attention_cls, custom)
    extractors._ensure_defaults()
    assert extractors.qk_extractor_for(tiny_vit().blocks[0].attn) is custom


def test_model_without_attention_is_rejected() -> None:
    with pytest.raises(TypeError, match="Sequential.*register_qk_extractor"):
        QKCapture(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        QKCapture("vit")


class SdpaAttention(nn.Module):
    """A plain attention written outside timm, optionally passing a mask."""

    def __init__(self, dim: int = 16, heads: int = 2, masked: bool = False) -> None:
        super().__init__()
        self.heads, self.masked = heads, masked
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        mask = torch.ones(n, n, dtype=torch.bool).tril() if self.masked else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, c)


class EinsumAttention(SdpaAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.einsum("bhnd,bhmd->bhnm", q, k).softmax(-1)
        return (attn @ v).transpose(1, 2).reshape(b, n, c)


class Blocks(nn.Module):
    def __init__(self, attention: type, **kwargs) -> None:
        super().__init__()
        self.blocks = nn.Sequential(attention(**kwargs), attention(**kwargs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test vanish afterwards; timm's defaults stay."""
    extractors._ensure_defaults()
    monkeypatch.setattr(extractors, "_EXTRACTORS", dict(extractors._EXTRACTORS))


def test_registering_another_attention_class(isolated_registry) -> None:
    model = Blocks(SdpaAttention)
    with pytest.raises(TypeError, match="SdpaAttention which has no registered Q/K extractor"):
        QKCapture(model)
    register_qk_extractor(SdpaAttention)
    x = torch.randn(2, 5, 16)
    with QKCapture(model, layers=[-1]) as cap:
        model(x)
    q, k = cap.qk[0]
    assert q.shape == (2, 2, 5, 8) and cap.scales == [8**-0.5]

    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_qk_extractor(int)
    with pytest.raises(TypeError, match="callable"):
        register_qk_extractor(SdpaAttention, extractor="not callable")


def test_custom_extractor_function(isolated_registry) -> None:

    def from_qkv_output(module: nn.Module, record):
        def hook(_m, _inputs, out):
            b, n, _ = out.shape
            q, k, _ = out.reshape(b, n, 3, module.heads, -1).permute(2, 0, 3, 1, 4)
            record(q, k, 0.5)

        return [module.qkv.register_forward_hook(hook)]

    register_qk_extractor(EinsumAttention, from_qkv_output)
    model = Blocks(EinsumAttention)
    with QKCapture(model) as cap:
        model(torch.randn(1, 4, 16))
    assert cap.scales == [0.5, 0.5] and cap.qk[1][0].shape == (1, 2, 4, 8)
    assert count_hooks(model) == 0


def test_unreadable_forward_fails_loudly(isolated_registry) -> None:
    register_qk_extractor(EinsumAttention)
    register_qk_extractor(SdpaAttention)
    for model, match in [
        (Blocks(EinsumAttention), "EinsumAttention: no score products"),
        (Blocks(SdpaAttention, masked=True), "SdpaAttention: it passes an attention mask"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            with QKCapture(model):
                model(torch.randn(1, 4, 16))
        assert count_hooks(model) == 0
        assert torch._C._len_torch_function_stack() == 0


class MaskedCall(nn.Module):
    """Runs timm attention blocks with a mask or ``is_causal``, as a causal or padded model would."""

    def __init__(self, arch: str, mask: str) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(block.attn for block in MODELS[arch]().blocks[:2]))
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        for attn in self.blocks:
            if self.mask == "causal":
                x = attn(x, is_causal=True)
            else:
                bool_mask = torch.ones(n, n, dtype=torch.bool).tril()
                x = attn(x, attn_mask=bool_mask if self.mask == "bool" else torch.randn(n, n))
        return x


@pytest.mark.parametrize("fused", [False, True], ids=["manual", "fused"])
@pytest.mark.parametrize("mask", ["causal", "bool", "additive"])
@pytest.mark.parametrize("arch", ["vit", "eva"])
def test_masked_attention_is_refused(arch: str, mask: str, fused: bool) -> None:
    model = MaskedCall(arch, mask)
    for attn in model.blocks:
        attn.fused_attn = fused
    expected = "passes an attention mask" if fused else "pass through .*add.* before the softmax"
    with pytest.raises(RuntimeError, match=f"{type(model.blocks[0]).__name__}: .*{expected}"):
        with QKCapture(model):
            model(torch.randn(2, 5, 64))
    assert count_hooks(model) == 0 and torch._C._len_torch_function_stack() == 0


def test_nested_captures_see_the_same_tensors() -> None:
    model = tiny_vit().eval()
    with QKCapture(model) as outer, QKCapture(model, layers=[1]) as inner:
        model(torch.randn(1, 3, 32, 32))
    assert outer.qk[1][0] is inner.qk[0][0] and outer.qk[1][1] is inner.qk[0][1]
    assert count_hooks(model) == 0 and torch._C._len_torch_function_stack() == 0
