"""QKCapture's autograd-graph reads: the same Q/K as a full watch, and used only when verified."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from cl_streamkl.capture import QKCapture, extractors, graph_reads, graph_reads_disabled
from cl_streamkl.capture.graph_reads import GraphReadRegistry, product_from_graph

DEPTH = 3


def tiny_model(arch: str = "vit") -> nn.Module:
    torch.manual_seed(0)
    name = "vit_tiny_patch16_224" if arch == "vit" else "eva02_tiny_patch14_224"
    model = timm.create_model(
        name, pretrained=False, img_size=32, patch_size=8, num_classes=4, depth=DEPTH, embed_dim=64, num_heads=2
    )
    return model.eval()  # no dropout: repeated forwards give identical tensors


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph_reads, "GRAPH_READS", GraphReadRegistry())


@pytest.fixture
def full_watches(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """The modules whose forward was watched with the TorchFunctionMode, one entry per forward."""
    watched: list[nn.Module] = []
    start = extractors.ProductWatcher.start

    def counting_start(self) -> None:
        watched.append(self.module)
        start(self)

    monkeypatch.setattr(extractors.ProductWatcher, "start", counting_start)
    return watched


def captured(model: nn.Module, x: torch.Tensor) -> QKCapture:
    with QKCapture(model) as capture:
        model(x)
    return capture


def assert_same_values(a: QKCapture, b: QKCapture, exact: bool = True) -> None:
    """Equal Q/K and scales; ``exact=False`` allows the rounding of timm's manual attention path."""
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-6}
    for (q_a, k_a), (q_b, k_b) in zip(a.qk, b.qk):
        torch.testing.assert_close(q_a, q_b, **tolerance)
        torch.testing.assert_close(k_a, k_b, **tolerance)
    assert a.scales == pytest.approx(b.scales)


@pytest.mark.parametrize("arch", ["vit", "eva"])
def test_later_training_forwards_are_read_from_the_graph(arch: str, full_watches: list[nn.Module]) -> None:
    model, x = tiny_model(arch), torch.randn(2, 3, 32, 32)
    first = captured(model, x)
    assert len(full_watches) == DEPTH
    second = captured(model, x)
    assert len(full_watches) == DEPTH, "verified modules must not be watched again"
    assert_same_values(first, second)
    for q, k in second.qk:
        assert q.grad_fn is not None and k.grad_fn is not None


def test_graph_read_qk_carry_the_same_gradients() -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)

    def gradients() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        capture = captured(model, x)
        sum((q * 1.5 - k).square().sum() for q, k in capture.qk).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    watched, read = gradients(), gradients()
    assert len(watched) == len(read) > 0
    for a, b in zip(watched, read):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_forwards_without_a_graph_are_watched_in_full(full_watches: list[nn.Module]) -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    reference = captured(model, x)
    with torch.no_grad():
        no_grad = captured(model, x)
    assert len(full_watches) == 2 * DEPTH
    assert_same_values(reference, no_grad)


def test_new_requires_grad_settings_are_verified_again(full_watches: list[nn.Module]) -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    reference = captured(model, x)
    model.blocks[1].attn.qkv.requires_grad_(False)
    frozen = captured(model, x)
    assert full_watches[DEPTH:] == [model.blocks[1].attn]
    assert_same_values(reference, frozen)
    captured(model, x)
    assert len(full_watches) == DEPTH + 1


def test_manual_attention_is_always_watched(full_watches: list[nn.Module]) -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    fused = captured(copy.deepcopy(model), x)
    for block in model.blocks:
        block.attn.fused_attn = False
    manual_first, manual_second = captured(model, x), captured(model, x)
    assert len(full_watches) == 3 * DEPTH
    assert_same_values(fused, manual_first, exact=False)
    assert_same_values(fused, manual_second, exact=False)


def test_a_forward_that_stops_matching_raises_then_is_watched_again(full_watches: list[nn.Module]) -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    fused = captured(model, x)
    model.blocks[0].attn.fused_attn = False  # the verified block now forms its scores by hand
    with pytest.raises(RuntimeError, match="next forward is watched in full again"), QKCapture(model):
        model(x)
    assert graph_reads.GRAPH_READS.allows(model.blocks[0].attn, (True,)) is False
    recovered = captured(model, x)
    assert full_watches.count(model.blocks[0].attn) == 2
    assert_same_values(fused, recovered, exact=False)


def test_attention_changed_in_every_block_fails_one_forward_only(full_watches: list[nn.Module]) -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    fused = captured(model, x)
    for block in model.blocks:  # a user's switch, made to the whole model after its first capture
        block.attn.fused_attn = False
    with pytest.raises(RuntimeError, match="watched in full again; run this forward again"), QKCapture(model):
        model(x)
    recovered = captured(model, x)  # the one retry the message asks for succeeds
    assert_same_values(fused, recovered, exact=False)


def test_a_verified_module_run_by_torch_compile_is_refused_naming_compile_model() -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    captured(model, x)  # verified eager: later forwards are read from the graph
    compiled = torch.compile(model, backend="aot_eager")  # AOTAutograd's graph, as inductor's, without a compiler
    # Its graph holds one compiled node, not the attention call, on every run: running it again cannot help.
    with pytest.raises(RuntimeError, match=r"torch.compile.*compile_model\(model\)") as raised, QKCapture(model):
        compiled(x)
    assert "run this one again" not in str(raised.value) and "\n" not in str(raised.value)


def test_graph_reads_disabled_watches_every_forward_and_learns_nothing(full_watches: list[nn.Module]) -> None:
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    with graph_reads_disabled():
        inside = [captured(model, x) for _ in range(2)]
    assert len(full_watches) == 2 * DEPTH, "inside, every forward is watched"
    captured(model, x)
    assert len(full_watches) == 3 * DEPTH, "nothing was verified inside"
    with graph_reads_disabled(), graph_reads_disabled():
        captured(model, x)
    assert len(full_watches) == 4 * DEPTH, "what was verified before is not used inside"
    after = captured(model, x)
    assert len(full_watches) == 4 * DEPTH, "what was verified before is used again after"
    assert_same_values(inside[0], inside[1])
    assert_same_values(inside[0], after)


class OneProduct(nn.Module):
    """A minimal attention: q, k, v from one projection, scores by SDPA with the given options."""

    def __init__(self, twice: bool = False, **sdpa_options) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.twice = twice
        self.sdpa_options = sdpa_options
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        self.seen = [q, k]
        out = F.scaled_dot_product_attention(q, k, v, **self.sdpa_options)
        if self.twice:
            out = F.scaled_dot_product_attention(out, k, v)
        return out.transpose(1, 2).reshape(2, 5, 16)


def graph_product(module: OneProduct):
    x = torch.randn(2, 5, 16, requires_grad=True)
    hidden = x * 2.0  # gives the input a grad_fn for the walk to stop at
    return product_from_graph(module(hidden), [hidden]), module.seen


def test_product_from_graph_returns_the_called_tensors_scale_and_lse() -> None:
    (q, k, scale, lse), (q_seen, k_seen) = graph_product(OneProduct())
    assert q is q_seen and k is k_seen and scale == pytest.approx(8**-0.5)
    # The CPU's flash backend saves its log-sum-exp too.
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-1, -2) * scale, dim=-1))
    (_, _, scale, _), _ = graph_product(OneProduct(scale=0.3))
    assert scale == pytest.approx(0.3)


@pytest.mark.parametrize(
    "options",
    [{"is_causal": True}, {"attn_mask": torch.ones(5, 5, dtype=torch.bool).tril()}, {"twice": True}],
    ids=["causal", "mask", "two-products"],
)
def test_product_from_graph_refuses_what_q_k_alone_does_not_describe(options: dict) -> None:
    product, _ = graph_product(OneProduct(**options))
    assert product is None


def test_product_from_graph_without_a_graph_is_none() -> None:
    module = OneProduct()
    with torch.no_grad():
        assert product_from_graph(module(torch.randn(2, 5, 16)), []) is None


@pytest.mark.parametrize("hooks", ["checkpoint", "save_on_cpu"])
def test_forwards_under_saved_tensor_hooks_are_watched_not_read(
    hooks: str, full_watches: list[nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading a saved tensor there would run the unpack hook: a recomputation of the
    # checkpointed block, or a copy back from the CPU, handing back another tensor.
    model, x = tiny_model(), torch.randn(2, 3, 32, 32)
    walks = []
    for module in (extractors, graph_reads):
        monkeypatch.setattr(module, "product_from_graph", lambda *a: walks.append(1))

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        if hooks == "checkpoint":
            model.set_grad_checkpointing(True)
            capture = captured(model, x)
        else:
            with torch.autograd.graph.save_on_cpu():
                capture = captured(model, x)
        sum((q * 1.5 - k).square().sum() for q, k in capture.qk).backward()
        model.set_grad_checkpointing(False)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    first, second = step(), step()
    assert len(full_watches) == 2 * DEPTH and walks == []
    model.zero_grad(set_to_none=True)
    plain = captured(model, x)
    sum((q * 1.5 - k).square().sum() for q, k in plain.qk).backward()
    expected = [p.grad for p in model.parameters() if p.grad is not None]
    for a, b, c in zip(first, second, expected):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)
