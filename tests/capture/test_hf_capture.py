"""QKCapture on Hugging Face ``transformers`` vision transformers, built from tiny configs (no weights).

The captured q, k and scale must reproduce the models' own attention maps
(``output_attentions=True`` under eager attention), under eager and SDPA attention alike; the
log-sum-exp is recorded where SDPA's fused kernel keeps one; attention whose scores are more
than q kᵀ is refused by reason.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cl_streamkl import attention_kl  # noqa: E402
from cl_streamkl.capture import CompiledQK, QKCapture, find_attention_modules, register_qk_extractor  # noqa: E402
from cl_streamkl.capture import extractors  # noqa: E402
from cl_streamkl.capture.compiled import eager_teacher_qk  # noqa: E402
from cl_streamkl.strategies import AttentionDistiller, frozen_copy  # noqa: E402
from cl_streamkl.strategies import teacher_forward  # noqa: E402

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
            patch_size=8)
# family → (config class, encoder-only model, classification model, tokens of a 32x32 image)
FAMILIES = {
    "vit": ("ViTConfig", "ViTModel", "ViTForImageClassification", 17),
    "deit": ("DeiTConfig", "DeiTModel", "DeiTForImageClassification", 18),
    "dinov2": ("Dinov2Config", "Dinov2Model", "Dinov2ForImageClassification", 17),
    "clip": ("CLIPVisionConfig", "CLIPVisionModel", "CLIPForImageClassification", 17),
    "siglip": ("SiglipVisionConfig", "SiglipVisionModel", "SiglipForImageClassification", 16),
}
CASES = [(family, head) for family in FAMILIES for head in (False, True)]
IDS = [f"{family}-{'classifier' if head else 'encoder'}" for family, head in CASES]


def tiny_config(family: str) -> object:
    options = dict(TINY)
    if family == "dinov2":
        options.pop("intermediate_size")
        options["mlp_ratio"] = 2
    return getattr(transformers, FAMILIES[family][0])(**options)


def tiny_model(family: str, attention: str, head: bool = False, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised model of ``family`` with ``attention`` ('eager' or 'sdpa'), in eval mode."""
    config_cls, encoder, classifier, _ = FAMILIES[family]
    config = tiny_config(family)
    if head and family in ("clip", "siglip"):
        # CLIP's and SigLIP's classifiers take the two-tower config and build only its vision tower.
        config = getattr(transformers, config_cls.replace("Vision", ""))(vision_config=config.to_dict(), num_labels=3)
    elif head:
        config.num_labels = 3
    torch.manual_seed(seed)
    model = getattr(transformers, classifier if head else encoder)._from_config(config, attn_implementation=attention)
    return model.eval()


def key_weight(attention: torch.nn.Module) -> torch.Tensor:
    """The key projection's weight (``k_proj`` in transformers 5, ``key`` in 4.x)."""
    projection = getattr(attention, "k_proj", None) or attention.key
    return projection.weight


def images(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,head", CASES, ids=IDS)
def test_captured_qk_reproduce_the_models_attention_maps(family: str, head: bool) -> None:
    eager, sdpa, x = tiny_model(family, "eager", head), tiny_model(family, "sdpa", head), images()
    sdpa.load_state_dict(eager.state_dict())
    with QKCapture(eager) as eager_capture:
        maps = eager(pixel_values=x, output_attentions=True).attentions
    with QKCapture(sdpa) as sdpa_capture:
        sdpa(pixel_values=x)
    tokens = FAMILIES[family][3]
    assert len(maps) == len(eager_capture.qk) == len(sdpa_capture.qk) == TINY["num_hidden_layers"]
    for capture in (eager_capture, sdpa_capture):
        assert capture.scales == [16**-0.5] * 2
        for (q, k), scale, attention in zip(capture.qk, capture.scales, maps):
            assert q.shape == k.shape == (2, 2, tokens, 16)
            expected = torch.softmax(q.double() @ k.double().transpose(-2, -1) * scale, dim=-1)
            torch.testing.assert_close(attention.double(), expected, rtol=0, atol=2e-6)
    # Same weights: the blocks after the first differ only by the rounding of the attention before them.
    for (q, k), (q_sdpa, k_sdpa) in zip(eager_capture.qk, sdpa_capture.qk):
        torch.testing.assert_close(q_sdpa, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k_sdpa, k, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sdpa_records_the_log_sum_exp_and_eager_none(family: str) -> None:
    sdpa, eager, x = tiny_model(family, "sdpa"), tiny_model(family, "eager"), images()
    with QKCapture(sdpa) as capture:
        sdpa(pixel_values=x)  # with gradients: the CPU's flash kernel keeps its LSE on the graph
    for (q, k), scale, lse in zip(capture.qk, capture.scales, capture.lse):
        assert lse is not None and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        expected = torch.logsumexp(q.double() @ k.double().transpose(-2, -1) * scale, dim=-1)
        torch.testing.assert_close(lse.double(), expected, rtol=0, atol=1e-5)
    with QKCapture(eager) as capture:
        eager(pixel_values=x)
    assert capture.lse == [None, None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the gradient-free fused backends run on CUDA")
def test_the_teachers_and_the_students_lse_on_cuda() -> None:
    model = tiny_model("clip", "sdpa", head=True).cuda()
    x = images().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        teacher = eager_teacher_qk(frozen_copy(model), "all", x)
        with QKCapture(model) as student:
            model(pixel_values=x)
    for result in (teacher, student):
        for (q, k), scale, lse in zip(result.qk, result.scales, result.lse):
            assert lse is not None and lse.shape == q.shape[:3]
            expected = torch.logsumexp(q.double() @ k.double().transpose(-2, -1) * scale, dim=-1)
            torch.testing.assert_close(lse.double(), expected, rtol=0, atol=2e-2)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_captured_qk_are_the_models_tensors_with_their_gradient(attention: str) -> None:
    model, x = tiny_model("vit", attention, head=True), images()
    block = find_attention_modules(model)[1]
    projection = getattr(block, "q_proj", None) or block.query
    projected = []
    handle = projection.register_forward_hook(lambda _m, _args, out: projected.append(out))
    try:
        with QKCapture(model) as capture:
            model(pixel_values=x)
    finally:
        handle.remove()
    q, k = capture.qk[1]
    if attention == "eager":  # (SDPA's wrapper in some 4.x releases makes q contiguous itself.)
        # A strided view of the projection, split into heads: the capture copies nothing.
        assert not q.is_contiguous() and q.untyped_storage().data_ptr() == projected[0].untyped_storage().data_ptr()
    weights = [parameter for name, parameter in block.named_parameters() if name.endswith("weight")]
    grads = torch.autograd.grad((q * k).sum(), weights, allow_unused=True)
    used = [grad is not None and bool(grad.abs().sum() > 0) for grad in grads]
    assert sum(used) == 2  # the query and key projections' weights, not the value's or the output's


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_repeated_forwards_and_layer_selection(attention: str) -> None:
    # With SDPA the second forward is read from its autograd graph (verified by the first).
    model, x = tiny_model("clip", attention), images()
    with QKCapture(model, layers=[-1]) as capture:
        model(pixel_values=x)
        first = [t.detach().clone() for t in capture.qk[0]]
        model(pixel_values=x + 1)
        model(pixel_values=x)
    assert capture.block_indices == [1]
    torch.testing.assert_close(capture.qk[0][0], first[0], rtol=0, atol=0)
    torch.testing.assert_close(capture.qk[0][1], first[1], rtol=0, atol=0)


def test_siglip_pooling_head_is_not_a_block() -> None:
    # SigLIP's attention-pooling head is an nn.MultiheadAttention: not one of the encoder's blocks.
    model = tiny_model("siglip", "sdpa")
    assert any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())
    assert len(find_attention_modules(model)) == 2
    assert all(type(m).__name__ in ("SiglipAttention", "SiglipSdpaAttention") for m in find_attention_modules(model))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_teacher_path_stops_early_and_matches_the_full_forward(attention: str) -> None:
    model, x = tiny_model("dinov2", attention, head=True), images()
    teacher = eager_teacher_qk(frozen_copy(model), [0], x)
    with torch.no_grad(), QKCapture(model, [0]) as capture:
        model(pixel_values=x)
    torch.testing.assert_close(teacher.qk[0][0], capture.qk[0][0], rtol=0, atol=0)
    assert teacher.scales == capture.scales and not teacher.qk[0][0].requires_grad


def test_distiller_teacher_and_student_of_a_hf_model() -> None:
    model, x = tiny_model("vit", "sdpa", head=True), images()
    distiller = AttentionDistiller(layers="all", compile_teacher=False)
    distiller.update_teacher(model)
    with distiller.student_capture(model) as capture:
        model(pixel_values=x)
    teacher = distiller.teacher_qk(x)
    kl = [attention_kl(q, k, q_t, k_t, scale=s, teacher_scale=s_t)
          for (q, k), (q_t, k_t), s, s_t in zip(capture.qk, teacher.qk, capture.scales, teacher.scales)]
    assert max(float(value.abs().max()) for value in kl) < 1e-5  # the snapshot is the student
    with torch.no_grad():
        weight = key_weight(find_attention_modules(model)[0])
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(2)))
    with distiller.student_capture(model) as capture:
        model(pixel_values=x)
    q, k = capture.qk[0]
    kl = attention_kl(q, k, *teacher.qk[0], scale=capture.scales[0], teacher_scale=teacher.scales[0])
    assert float(kl.sum()) > 1e-3
    kl.sum().backward()
    assert key_weight(find_attention_modules(model)[0]).grad.abs().sum() > 0


def test_compiled_teacher_of_a_sdpa_model_equals_the_eager_capture_with_its_lse() -> None:
    torch._dynamo.reset()
    teacher, x = frozen_copy(tiny_model("siglip", "sdpa")), images()
    result = CompiledQK(teacher, "all", {"backend": "eager"})(x)
    expected = eager_teacher_qk(teacher, "all", x)
    for (q, k), (q_eager, k_eager) in zip(result.qk, expected.qk):
        torch.testing.assert_close(q, q_eager, rtol=0, atol=0)
        torch.testing.assert_close(k, k_eager, rtol=0, atol=0)
    # The compiled forward runs the CPU's flash kernel in SDPA's place and keeps its LSE.
    assert result.lse is not None
    for (q, k), scale, lse in zip(result.qk, result.scales, result.lse):
        torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-2, -1) * scale, -1), rtol=0, atol=1e-5)


def test_compiled_teacher_of_an_eager_attention_model_is_refused_when_built_or_runs_eager() -> None:
    teacher, x = frozen_copy(tiny_model("vit", "eager")), images()
    with pytest.raises(ValueError, match="attn_implementation='eager', not 'sdpa'.*compile_teacher=False"):
        CompiledQK(teacher, "all", {"backend": "eager"})
    with pytest.warns(RuntimeWarning, match="running it eager"):
        compiled = CompiledQK(teacher, "all", {"backend": "eager"}, fallback=True)
    result = compiled(x)  # eager from the start: nothing is compiled
    assert compiled.eager_fallback is not None and len(result.qk) == 2


def test_distillers_compiled_teacher_of_an_eager_attention_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(teacher_forward, "on_cuda", lambda _module: True)  # where "auto" compiles
    model, x = tiny_model("vit", "eager"), images()
    with pytest.warns(RuntimeWarning, match="attn_implementation='eager'"):
        auto = AttentionDistiller(compile_teacher="auto")
        auto.update_teacher(model)
    assert len(auto.teacher_qk(x).qk) == 2
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        AttentionDistiller(compile_teacher={"backend": "eager"}).update_teacher(model)


def _swin() -> torch.nn.Module:
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                     window_size=4)
    return transformers.SwinModel(config)


def _beit(**bias: bool) -> torch.nn.Module:
    return transformers.BeitModel(transformers.BeitConfig(**TINY, **bias))


def _data2vec() -> torch.nn.Module:
    return transformers.Data2VecVisionModel(transformers.Data2VecVisionConfig(**TINY,
                                                                              use_shared_relative_position_bias=True))


def _vitdet() -> torch.nn.Module:
    config = transformers.VitDetConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                                       image_size=32, pretrain_image_size=32, patch_size=8,
                                       use_relative_position_embeddings=True)
    return transformers.VitDetModel(config)


@pytest.mark.parametrize("build,why", [
    (_swin, "SwinAttention attends within .*windows and adds a relative-position bias"),
    (lambda: _beit(use_relative_position_bias=True), "BeitAttention adds a relative-position bias"),
    (_data2vec, "Data2VecVisionAttention adds a relative-position bias"),
    (_vitdet, "VitDetAttention adds decomposed relative-position terms"),
], ids=["swin", "beit", "data2vec-vision", "vitdet"])
def test_attention_with_extra_score_terms_is_refused_by_reason(build, why: str) -> None:
    model = build()
    with pytest.raises(TypeError, match=why) as error:
        QKCapture(model)
    message = str(error.value)
    assert "\n" not in message and "register_qk_extractor" not in message and "would be wrong" in message


def test_a_model_with_two_encoders_names_them() -> None:
    config = transformers.CLIPConfig(vision_config=tiny_config("clip").to_dict(),
                                     text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                      intermediate_size=64))
    with pytest.raises(TypeError, match=r"2 \(text_model.encoder.layers, vision_model.encoder.layers\).*"
                                        "model.vision_model"):
        QKCapture(transformers.CLIPModel(config))
    assert len(QKCapture(transformers.CLIPModel(config).vision_model).block_indices) == 2


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_masked_attention_fails_the_forward_by_name(attention: str) -> None:
    # CLIP's text tower applies a causal mask: its scores are more than q kᵀ.
    config = transformers.CLIPTextConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64)
    model = transformers.CLIPTextModel._from_config(config, attn_implementation=attention)
    with pytest.raises(RuntimeError, match=r"CLIP(Sdpa)?Attention.*(mask|add).*attn_implementation 'eager' or 'sdpa'"):
        with QKCapture(model):
            model(input_ids=torch.tensor([[1, 2, 3]]))


def test_a_user_extractor_for_a_hf_class_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("vit", "eager")
    attention_cls = type(find_attention_modules(model)[0])
    monkeypatch.setattr(extractors, "_EXTRACTORS", {})
    monkeypatch.setattr(extractors, "_DEFAULTS_REGISTERED", False)
    calls = []

    def mine(module, record):
        return [module.register_forward_hook(lambda *_: calls.append(1))]

    register_qk_extractor(attention_cls, mine)
    with QKCapture(model):
        model(pixel_values=images())
    assert len(calls) == 2


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_saved_teacher_knows_the_models_heads(family: str) -> None:
    """The heads a saved teacher is checked against on restore come from ``num_attention_heads`` here."""
    assert teacher_forward.attention_heads(tiny_model(family, "sdpa")) == [2, 2]
