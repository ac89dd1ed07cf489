"""A whole ViT compiled for training: values, gradients and captured Q/K of the eager model, deep copies, errors."""

from __future__ import annotations

import copy
import shutil

import pytest
import timm
import torch
from torch import nn
from torch._dynamo.utils import counters

from cl_streamkl.capture import CompiledQK, QKCapture, compile_model
from cl_streamkl.capture import compiled_model as compiled_model_module
from cl_streamkl.experiment.task_heads import MultiHeadViT

_INDUCTOR = compiled_model_module._compiled


@pytest.fixture(autouse=True)
def _fresh_traces(traced_not_generated):
    torch._dynamo.reset()
    counters.clear()


def _vit(depth: int = 3, num_classes: int = 5, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=12, patch_size=4, in_chans=1,
                             num_classes=num_classes, depth=depth, embed_dim=16, num_heads=2, **kwargs).double()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _kl(q, k, q_teacher, k_teacher, scale: float, teacher_scale: float) -> torch.Tensor:
    """Mean KL(softmax(teacher scores) ‖ softmax(student scores)) per query row, in the inputs' float64."""
    log_p = torch.log_softmax(q @ k.transpose(-1, -2) * scale, dim=-1)
    log_p_teacher = torch.log_softmax(q_teacher @ k_teacher.transpose(-1, -2) * teacher_scale, dim=-1)
    return (log_p_teacher.exp() * (log_p_teacher - log_p)).sum(-1).mean()


def _loss_and_qk(model: nn.Module, teacher: nn.Module, x: torch.Tensor, layers) -> tuple[torch.Tensor, list]:
    """Cross-entropy-like output term plus the StreamKL penalty against ``teacher``, as a plugin computes it."""
    with torch.no_grad(), QKCapture(teacher, layers, stop_early=True) as teacher_capture:
        teacher(x)
    with QKCapture(model, layers) as capture:
        out = model(x)
    kl = sum(_kl(q, k, q_t, k_t, scale, teacher_scale)
             for (q, k), (q_t, k_t), scale, teacher_scale
             in zip(capture.qk, teacher_capture.qk, capture.scales, teacher_capture.scales, strict=True))
    return out.square().mean() + kl, capture.qk


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    shutil.which("cc") is None, reason="inductor's CPU code needs a C compiler"))])
@pytest.mark.parametrize("layers", ["all", [0, 2]])
def test_values_gradients_and_captured_qk_equal_the_eager_model(backend, layers, monkeypatch):
    if backend == "inductor":
        monkeypatch.setattr(compiled_model_module, "_compiled", _INDUCTOR)
    eager = _vit()
    teacher = copy.deepcopy(eager)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    compiled = copy.deepcopy(eager)
    assert compile_model(compiled) == 1
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    x = torch.randn(3, 1, 12, 12, dtype=torch.float64)
    loss_eager, qk_eager = _loss_and_qk(eager, teacher, x, layers)
    loss_compiled, qk_compiled = _loss_and_qk(compiled, teacher, x, layers)
    assert len(qk_compiled) == len(qk_eager) == (3 if layers == "all" else 2)
    for (q, k), (q_eager, k_eager) in zip(qk_compiled, qk_eager):
        assert q.requires_grad and _relative(q, q_eager) < 1e-12 and _relative(k, k_eager) < 1e-12
    assert _relative(loss_compiled, loss_eager) < 1e-12
    loss_eager.backward()
    loss_compiled.backward()
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters()):
        assert p_compiled.grad is not None, name
        assert _relative(p_compiled.grad, p_eager.grad) < 1e-10, name
    assert compiled_model_module.compiled_model_checks() < 1e-12


def test_deep_copies_and_other_batch_sizes_run_without_recompiling():
    student = _vit()
    compile_model(student)
    x = torch.randn(2, 1, 12, 12, dtype=torch.float64)
    student(x)
    graphs = counters["stats"]["unique_graphs"]
    snapshot = copy.deepcopy(student)
    with torch.no_grad():
        for p in snapshot.parameters():
            p.mul_(0.5)
    reference = copy.deepcopy(snapshot)
    reference.__class__ = compiled_model_module._ORIGINAL_CLASS[type(reference)]
    torch.testing.assert_close(snapshot(x), reference(x), rtol=1e-12, atol=0)
    assert not torch.allclose(snapshot(x), student(x))
    student(torch.randn(5, 1, 12, 12, dtype=torch.float64))  # another batch size: the same, dynamic graph
    assert counters["stats"]["unique_graphs"] == graphs


def test_every_mode_a_process_meets_stays_compiled():
    """Twelve modes (train or eval, gradients or not, frozen weights or not, another dtype), more
    than Dynamo's default of 8 graphs per function: compile_model raises the limit, so none
    falls back to running eagerly; a higher limit is left as it is."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(name, 8):
        model = _vit(depth=1)
        compile_model(model)
        assert getattr(config, name) == compiled_model_module.RECOMPILE_LIMIT
        modes = 0
        for dtype in (torch.float64, torch.float32):
            model.to(dtype)
            for training in (True, False):
                for grad in (True, False):
                    for frozen in ((False, True) if dtype == torch.float64 else (False,)):
                        model.train(training).requires_grad_(not frozen)
                        with torch.set_grad_enabled(grad):
                            model(torch.randn(2, 1, 12, 12, dtype=dtype))
                        modes += 1
        assert modes == 12 and counters["stats"]["unique_graphs"] == modes  # each compiled, none eager
    with config.patch(name, 100):
        compile_model(_vit(depth=1))
        assert getattr(config, name) == 100


def test_a_teacher_capture_neither_stops_early_nor_recompiles_per_call():
    teacher = _vit()
    compile_model(teacher)
    x = torch.randn(2, 1, 12, 12, dtype=torch.float64)
    for _ in range(2):
        with torch.no_grad(), QKCapture(teacher, [1], stop_early=True) as capture:
            teacher(x)
        assert capture.qk[0][0].shape == (2, 2, 10, 8)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(3):
        with torch.no_grad(), QKCapture(teacher, "all", stop_early=True) as capture:
            teacher(x)
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_backbone_of_a_multi_head_model_is_compiled_and_captured():
    torch.manual_seed(0)
    backbone = _vit(num_classes=0)
    model = MultiHeadViT(backbone, [2, 2]).double()
    reference = copy.deepcopy(model)
    assert compile_model(model) == 1
    x = torch.randn(4, 1, 12, 12, dtype=torch.float64)
    with QKCapture(model, "all") as capture:
        out = model(x, 1)
    with QKCapture(reference, "all") as expected:
        out_reference = reference(x, 1)
    torch.testing.assert_close(out, out_reference, rtol=1e-12, atol=0)
    torch.testing.assert_close(capture.qk[2][1], expected.qk[2][1], rtol=1e-12, atol=0)
    assert compile_model(model) == 0  # already compiled


def test_models_it_cannot_compile_are_refused_by_name():
    with pytest.raises(ValueError, match="compile_model: Sequential holds no timm VisionTransformer"):
        compile_model(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="has dropout"):
        compile_model(_vit(proj_drop_rate=0.1))
    compiled = _vit()
    compile_model(compiled)
    with pytest.raises(ValueError, match="compiled by compile_model already"):
        CompiledQK(compiled)
    manual = _vit()
    for block in manual.blocks:
        block.attn.fused_attn = False
    with pytest.raises(ValueError, match="must be timm's Attention with fused attention"):
        compile_model(manual)


def test_a_compiled_forward_that_differs_from_eager_is_refused(monkeypatch):
    model = _vit()
    compile_model(model)

    def wrong(module, *args, **kwargs):
        output, records = compiled_model_module._recording_forward(module, *args, **kwargs)
        return output, [(q * 2, k, scale, plain, lse) for q, k, scale, plain, lse in records]

    monkeypatch.setattr(compiled_model_module, "_compiled", lambda fn: wrong)
    with pytest.raises(RuntimeError, match="differ from its eager forward's"):
        model(torch.randn(2, 1, 12, 12, dtype=torch.float64))


def test_the_compiled_forward_records_each_blocks_lse_beside_its_qk():
    """The fused op runs in SDPA's place in the compiled graph; the capture gets its LSE."""
    model = _vit().float()  # the fused kernels' LSE is float32 (float64 inputs record none)
    compile_model(model)
    x = torch.randn(3, 1, 12, 12)
    for _ in range(2):  # the first forward is checked against the eager one, the second is not
        with QKCapture(model, "all") as capture:
            model(x).sum().backward()
        assert len(capture.lse) == 3
        for (q, k), scale, lse in zip(capture.qk, capture.scales, capture.lse, strict=True):
            assert lse is not None and lse.shape == q.shape[:3] and not lse.requires_grad
            reference = torch.logsumexp(q.detach() @ k.detach().transpose(-1, -2) * scale, dim=-1)
            torch.testing.assert_close(lse, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused CUDA backends (cuDNN, flash) need a GPU")
def test_on_cuda_a_compiled_student_records_the_lse_its_backward_uses(monkeypatch):
    """bf16 autocast, 197 tokens: each LSE is its block's float64 logsumexp, and the compiled (recording)
    student's gradients are about as close to float32's as the eager student's bf16 gradients are."""
    monkeypatch.setattr(compiled_model_module, "_compiled", _INDUCTOR)
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=4, depth=2).cuda().train()
    eager, reference = copy.deepcopy(model), copy.deepcopy(model)
    compile_model(model)
    x = torch.randn(3, 3, 224, 224, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16), QKCapture(model, "all") as capture:
        loss = model(x).float().square().mean()
    loss.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager(x).float().square().mean().backward()
    reference(x).square().mean().backward()
    for (q, k), scale, lse in zip(capture.qk, capture.scales, capture.lse, strict=True):
        assert lse is not None and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        expected = torch.logsumexp(q.detach().double() @ k.detach().double().transpose(-1, -2) * scale, dim=-1)
        torch.testing.assert_close(lse.double(), expected, rtol=0, atol=1e-4)
    # Compiled and eager bf16 round differently (2 % apart on a LayerNorm weight's gradient);
    # what recording must not do is make the compiled gradients worse than eager's.
    for (name, p_reference), p_eager, p_compiled in zip(reference.named_parameters(), eager.parameters(),
                                                        model.parameters()):
        compiled_error = _relative(p_compiled.grad.float(), p_reference.grad.float())
        eager_error = _relative(p_eager.grad.float(), p_reference.grad.float())
        assert compiled_error < max(3 * eager_error, 1e-2), (name, compiled_error, eager_error)
