"""The comparators StreamKL is measured against: weight aligning and pooled attention distillation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cl_streamkl.strategies import PADPlugin, PooledAttentionDistiller
from cl_streamkl.strategies import pooled_attention as pad_module
from cl_streamkl.strategies.pooled_attention import pooled_attention_distance, pooled_maps_distance
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
    value = pooled_attention_distance(q, k, q_t, k_t, streaming=streaming, variant="symmetric")
    expected = _pad_reference(*(t.detach().double().numpy() for t in (q, k, q_t, k_t)))
    assert value.dtype == torch.float32
    assert float(value) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    value.backward()
    if n > 1:
        assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    assert float(pooled_attention_distance(q_t, k_t, q_t, k_t, streaming=streaming, variant="symmetric")) == (
        pytest.approx(0.0, abs=1e-6))


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


def _authors_layer_loss(a, b, sym: bool, after_norm: bool = True):
    """``asymmetric_headwise_loss`` of olwf_asym.py for one block, line by line (a: old maps, b: new maps).

    ``sym``: ``--sym`` with ``--pool-along spatial``; otherwise ``--pool-along height``.
    ``after_norm=False`` is that file's default asymmetric path (normalised after the ReLU).
    """
    if sym:
        a = torch.pow(a, 2)
        b = torch.pow(b, 2)
        a_h = a.sum(dim=2).view(a.shape[0], -1)
        b_h = b.sum(dim=2).view(b.shape[0], -1)
        a_w = a.sum(dim=3).view(a.shape[0], -1)
        b_w = b.sum(dim=3).view(b.shape[0], -1)
        a = torch.cat([a_h, a_w], dim=-1)
        b = torch.cat([b_h, b_w], dim=-1)
        a = F.normalize(a, dim=1, p=2)
        b = F.normalize(b, dim=1, p=2)
        return torch.mean(torch.linalg.vector_norm(a - b, dim=-1))
    a = a.sum(dim=2).view(a.shape[0], -1)
    b = b.sum(dim=2).view(b.shape[0], -1)
    if after_norm:
        a = F.normalize(a, dim=1, p=2)
        b = F.normalize(b, dim=1, p=2)
        return torch.mean(torch.linalg.vector_norm(torch.relu(a - b), dim=-1))
    return torch.mean(torch.linalg.vector_norm(F.normalize(torch.relu(a - b), dim=1, p=2))) / 100.0


def _random_maps(*shape: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.softmax(torch.randn(*shape, generator=generator, dtype=torch.float64), dim=-1)
                 for _ in range(2))


@pytest.mark.parametrize("variant", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("shape", [(2, 3, 17, 17), (3, 2, 1, 5), (1, 4, 9, 7)], ids=lambda s: "-".join(map(str, s)))
def test_pad_variants_equal_the_authors_formula_in_float64(variant, shape):
    old, new = _random_maps(*shape, seed=sum(shape))
    new.requires_grad_(True)
    value = pooled_maps_distance(old, new, variant)
    expected = _authors_layer_loss(old, new.detach(), sym=variant == "symmetric")
    assert value.dtype == torch.float64
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-14)
    value.backward()
    assert torch.isfinite(new.grad).all() and new.grad.abs().sum() > 0
    assert float(pooled_maps_distance(old, old, variant)) == 0.0


def test_asymmetric_pad_charges_only_attention_taken_away():
    old, new = _random_maps(2, 2, 6, 6, seed=0)
    assert float(pooled_maps_distance(old, new, "asymmetric")) > 0
    # the student attends wherever the teacher did, and more to key 0: nothing to pay
    more = old.clone()
    more[..., 0] += 1.0
    pooled_old = F.normalize(old.sum(dim=-2).flatten(1), dim=1)
    pooled_more = F.normalize(more.sum(dim=-2).flatten(1), dim=1)
    assert float(pooled_maps_distance(old, more, "asymmetric")) == pytest.approx(
        float(torch.relu(pooled_old - pooled_more).norm(dim=1).mean()))
    assert float(pooled_maps_distance(more, old, "asymmetric")) != pytest.approx(
        float(pooled_maps_distance(old, more, "asymmetric")))


def test_the_authors_default_asymmetric_form_is_constant():
    # Normalised after the ReLU, every sample with a positive difference contributes norm 1:
    # the value is sqrt(that count) / 100 and the gradient vanishes; hence the normalise-first form.
    old, new = _random_maps(4, 2, 9, 9, seed=1)
    new.requires_grad_(True)
    value = _authors_layer_loss(old, new, sym=False, after_norm=False)
    value.backward()
    assert float(value) == pytest.approx(2 / 100) and float(new.grad.abs().max()) < 1e-15


@pytest.mark.parametrize("streaming", [False, True], ids=["materialised", "streamed"])
def test_asymmetric_distance_from_queries_and_keys_pools_the_softmax_maps(streaming):
    torch.manual_seed(0)
    q, k, q_t, k_t = (torch.randn(2, 3, 11, 8, requires_grad=True) for _ in range(4))
    maps = [torch.softmax(a.double() @ b.double().transpose(-2, -1) / np.sqrt(8), dim=-1)
            for a, b in ((q_t, k_t), (q, k))]
    value = pooled_attention_distance(q, k, q_t, k_t, variant="asymmetric", streaming=streaming)
    expected = pooled_maps_distance(*maps, "asymmetric")
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)
    gradient, expected_gradient = (torch.autograd.grad(v, (q, k)) for v in (value, expected))
    for got, want in zip(gradient, expected_gradient):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="variant must be one of"):
        pooled_attention_distance(q, k, q_t, k_t, variant="height")


def test_pad_defaults_to_the_authors_asymmetric_variant():
    from cl_streamkl.experiment.config import ExperimentConfig

    assert PooledAttentionDistiller().variant == PADPlugin().distiller.variant == "asymmetric"
    assert ExperimentConfig().pad_variant == "asymmetric"


def test_pad_distiller_restores_a_state_written_before_the_variants():
    state = PooledAttentionDistiller(alpha=2.0, variant="symmetric").state_dict()
    old = {**state, "format": PooledAttentionDistiller.previous_state_format,
           "config": {"alpha": 2.0, "layers": "all"}}
    PooledAttentionDistiller(alpha=2.0, variant="symmetric").load_state_dict(old)
    with pytest.raises(ValueError, match="variant"):
        PooledAttentionDistiller(alpha=2.0, variant="asymmetric").load_state_dict(old)
    with pytest.raises(ValueError, match="variant must be one of"):
        PooledAttentionDistiller(variant="sym")


_P = torch.randn(1, 2, 4, 8)
PAD_BAD_INPUTS = [
    (dict(q=torch.randn(1, 2, 0, 8), k=torch.randn(1, 2, 0, 8), q_teacher=torch.randn(1, 2, 0, 8),
          k_teacher=torch.randn(1, 2, 0, 8)), ValueError, "^q must not be empty"),
    (dict(scale=-0.5), ValueError, "^scale must be a finite number > 0"),
    (dict(teacher_scale=float("nan")), ValueError, r"^teacher \(q_teacher, k_teacher\): scale must be a finite"),
    (dict(q=_P.double(), k=_P.double()), TypeError, "^q must be float32, float16 or bfloat16"),
    (dict(q_teacher=_P.long(), k_teacher=_P.long()), TypeError, r"^teacher .*: q must be float32"),
    (dict(k=torch.randn(1, 2, 4, 4)), ValueError, "B, H and D must match"),
    (dict(q_teacher=_P.half()), TypeError, "k has dtype torch.float32 but q has torch.float16"),
]


@pytest.mark.parametrize("streaming", [False, True, "auto"], ids=["materialised", "streamed", "auto"])
@pytest.mark.parametrize("change, error, message", PAD_BAD_INPUTS, ids=[
    "empty", "negative-scale", "nan-teacher-scale", "float64", "int64-teacher", "head-dims", "mixed-dtypes"])
def test_both_paths_refuse_what_the_streamed_op_refuses(change, error, message, streaming):
    arguments = {"q": _P, "k": _P, "q_teacher": _P, "k_teacher": _P, **change}
    tensors = [arguments.pop(name) for name in ("q", "k", "q_teacher", "k_teacher")]
    with pytest.raises(error, match=message) as raised:
        pooled_attention_distance(*tensors, streaming=streaming, **arguments)
    assert "\n" not in str(raised.value)


def test_pad_errors():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="4-D"):
        pooled_attention_distance(q[0], q, q, q)
    with pytest.raises(ValueError, match="share batch, heads and lengths"):
        pooled_attention_distance(q, q, torch.randn(1, 2, 5, 8), q)
    with pytest.raises(ValueError, match="streaming must be"):
        pooled_attention_distance(q, q, q, q, streaming=1)
