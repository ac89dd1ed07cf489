"""The comparators StreamKL is measured against: weight aligning and pooled attention distillation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from cl_streamkl.strategies import PADPlugin, PooledAttentionDistiller
from cl_streamkl.strategies import pooled_attention as pad_module
from cl_streamkl.strategies.pooled_attention import pooled_attention_distance
from cl_streamkl.strategies.weight_aligning import WeightAlignPlugin, align_weights


def test_align_weights_by_hand():
    head = nn.Linear(2, 4)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [0.0, 10.0]]))
        head.bias.copy_(torch.tensor([1.0, 1.0, 2.0, 2.0]))
    # old classes 0, 1: mean norm (5 + 1) / 2 = 3; new classes 2, 3: (10 + 10) / 2 = 10
    gamma = align_weights(head, [0, 1], [2, 3])
    assert gamma == pytest.approx(0.3)
    assert torch.allclose(head.weight[2:], torch.tensor([[1.8, 2.4], [0.0, 3.0]]))
    assert torch.allclose(head.bias, torch.tensor([1.0, 1.0, 0.6, 0.6]))
    assert float(head.weight.norm(dim=1)[2:].mean()) == pytest.approx(3.0)
    assert align_weights(head, [], [2, 3]) == 1.0
    with pytest.raises(TypeError, match="linear classifier"):
        align_weights(nn.Identity(), [0], [1])


def test_weight_align_plugin_aligns_after_each_experience():
    model = SimpleNamespace(head=nn.Linear(3, 4))
    model.get_classifier = lambda: model.head

    def experience(classes):
        return SimpleNamespace(dataset=SimpleNamespace(targets=SimpleNamespace(uniques=set(classes))))

    plugin = WeightAlignPlugin()
    strategy = SimpleNamespace(model=model, experience=experience([0, 1]))
    plugin.before_training(strategy)
    before = model.head.weight.detach().clone()
    plugin.after_training_exp(strategy)
    assert plugin.gammas == [1.0] and torch.equal(model.head.weight, before)
    with torch.no_grad():
        model.head.weight[2:] *= 5.0
    strategy.experience = experience([2, 3])
    plugin.after_training_exp(strategy)
    norms = model.head.weight.norm(dim=1)
    assert float(norms[:2].mean()) == pytest.approx(float(norms[2:].mean()), rel=1e-5)
    assert plugin.seen_classes == [0, 1, 2, 3]
    restored = WeightAlignPlugin()
    restored.load_state_dict(plugin.state_dict())
    assert restored.seen_classes == [0, 1, 2, 3] and restored.gammas == plugin.gammas
    with pytest.raises(TypeError, match="shared linear classifier"):
        plugin.before_training(SimpleNamespace(model=nn.Sequential()))


def _pad_reference(q, k, q_t, k_t) -> float:
    """PAD in float64 numpy, one sample and one head at a time."""
    distances = []
    for b in range(q.shape[0]):
        pooled = []
        for qq, kk in ((q_t, k_t), (q, k)):
            parts_h, parts_w = [], []
            for h in range(q.shape[1]):
                scores = qq[b, h] @ kk[b, h].T / np.sqrt(qq.shape[-1])
                attention = np.exp(scores - scores.max(axis=1, keepdims=True))
                attention /= attention.sum(axis=1, keepdims=True)
                squared = attention ** 2
                parts_h.append(squared.sum(axis=0))
                parts_w.append(squared.sum(axis=1))
            vector = np.concatenate([np.concatenate([a, b_]) for a, b_ in zip(parts_h, parts_w)])
            pooled.append(vector / np.linalg.norm(vector))
        distances.append(np.linalg.norm(pooled[0] - pooled[1]))
    return float(np.mean(distances))


@pytest.mark.parametrize("streaming", [False, True], ids=["materialised", "streamed"])
@pytest.mark.parametrize("n, d", [(1, 8), (17, 32), (5, 16)])
def test_pad_matches_a_materialised_float64_reference(n, d, streaming):
    torch.manual_seed(n)
    q, k = torch.randn(2, 3, n, d, requires_grad=True), torch.randn(2, 3, n, d, requires_grad=True)
    q_t, k_t = torch.randn(2, 3, n, d), torch.randn(2, 3, n, d)
    value = pooled_attention_distance(q, k, q_t, k_t, streaming=streaming)
    expected = _pad_reference(*(t.detach().double().numpy() for t in (q, k, q_t, k_t)))
    assert value.dtype == torch.float32
    assert float(value) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    value.backward()
    if n > 1:
        assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    assert float(pooled_attention_distance(q_t, k_t, q_t, k_t, streaming=streaming)) == pytest.approx(0.0, abs=1e-6)


def test_streamed_pad_has_the_materialised_gradients():
    torch.manual_seed(7)
    q, k = torch.randn(2, 3, 19, 16, requires_grad=True), torch.randn(2, 3, 23, 16, requires_grad=True)
    q_t, k_t = torch.randn(2, 3, 19, 16), torch.randn(2, 3, 23, 16)
    values, grads = [], []
    for streaming in (False, True):
        value = pooled_attention_distance(q, k, q_t, k_t, scale=0.3, streaming=streaming) * 2.5
        values.append(value)
        grads.append(torch.autograd.grad(value, (q, k)))
    torch.testing.assert_close(values[1], values[0])
    for streamed, materialised in zip(grads[1], grads[0]):
        torch.testing.assert_close(streamed, materialised, rtol=1e-4, atol=1e-7)


def test_auto_streams_past_the_threshold(monkeypatch):
    calls, streamed = [], pad_module.pooled_attention
    monkeypatch.setattr(pad_module, "pooled_attention", lambda *args, **kwargs: calls.append(1) or
                        streamed(*args, **kwargs))
    q = torch.randn(2, 3, 8, 4)
    pooled_attention_distance(q, q, q, q)
    assert calls == []  # 2·3·8·8 entries per map
    monkeypatch.setattr(pad_module, "STREAMING_THRESHOLD", 2 * 3 * 8 * 8 - 1)
    pooled_attention_distance(q, q, q, q)
    assert calls == [1, 1]  # the student's and the teacher's


def test_streaming_option_of_the_distiller_and_the_plugin():
    assert PooledAttentionDistiller().streaming == "auto"
    distiller = PooledAttentionDistiller(streaming=True)
    assert "streaming=True" in repr(distiller) and "streaming" not in distiller.state_dict()["config"]
    assert "streaming=False" in repr(PADPlugin(streaming=False))
    for make in (PooledAttentionDistiller, PADPlugin):
        with pytest.raises(ValueError, match="streaming must be True, False or 'auto', got 'yes'"):
            make(streaming="yes")


def test_pad_errors():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="4-D"):
        pooled_attention_distance(q[0], q, q, q)
    with pytest.raises(ValueError, match="share batch, heads and lengths"):
        pooled_attention_distance(q, q, torch.randn(1, 2, 5, 8), q)
    with pytest.raises(ValueError, match="streaming must be"):
        pooled_attention_distance(q, q, q, q, streaming=1)
