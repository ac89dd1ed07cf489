"""CompiledQK and compile_teacher: the compiled teacher's Q/K equal the eager capture's."""

from __future__ import annotations

import shutil

import pytest
import timm
import torch
import torchvision
from timm.models.vision_transformer import Block
from torch import nn
from torch._dynamo.utils import counters

from cl_streamkl.capture import CompiledQK, QKCapture, TeacherQK, attention_lse, compile_model, extractors, recording
from cl_streamkl.capture.compiled import check_compile_options
from cl_streamkl.capture.compiled_model import is_compiled
from cl_streamkl.strategies import AttentionDistiller, PADPlugin, StreamKLPlugin, frozen_copy
from cl_streamkl.strategies import teacher_forward

DEPTH = 3
# Dynamo alone (no code generation): the traced program runs op by op, so results are exact.
TRACE_ONLY = {"backend": "eager"}


def tiny_teacher(arch: str = "vit", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    name = "vit_tiny_patch16_224" if arch == "vit" else "eva02_tiny_patch14_224"
    model = timm.create_model(
        name, pretrained=False, img_size=32, patch_size=8, num_classes=4, depth=DEPTH, embed_dim=64, num_heads=2
    )
    return frozen_copy(model)


def eager_qk(model: nn.Module, x: torch.Tensor, layers="all") -> QKCapture:
    with torch.no_grad(), QKCapture(model, layers) as capture:
        model(x)
    return capture


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("arch", ["vit", "eva"])
@pytest.mark.parametrize("layers", ["all", [0], [-1], 2])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_qk_equals_the_eager_capture(arch: str, layers, backend: str) -> None:
    teacher, x = tiny_teacher(arch), torch.randn(2, 3, 32, 32)
    compiled = CompiledQK(teacher, layers, {"backend": backend})
    result = compiled(x)
    expected = eager_qk(teacher, x, layers)
    assert compiled.block_indices == expected.block_indices
    assert len(result.qk) == len(expected.qk)
    for (q, k), (q_eager, k_eager) in zip(result.qk, expected.qk):
        assert q.shape == q_eager.shape and k.shape == k_eager.shape
        torch.testing.assert_close(q, q_eager, rtol=0, atol=0)
        torch.testing.assert_close(k, k_eager, rtol=0, atol=0)
        assert not q.requires_grad
    assert result.scales == expected.scales
    assert compiled.max_check_error == 0.0


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="Inductor on CPU needs a C++ compiler"
)
def test_inductor_compiled_qk_matches_and_is_checked_once_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    teacher = tiny_teacher()
    compiled = CompiledQK(teacher, "all")
    checks = []
    check = CompiledQK._check_against_eager
    monkeypatch.setattr(CompiledQK, "_check_against_eager", lambda self, *a: checks.append(1) or check(self, *a))
    for batch in (2, 2, 3):
        x = torch.randn(batch, 3, 32, 32)
        result = compiled(x)
        for (q, k), (q_eager, k_eager) in zip(result.qk, eager_qk(teacher, x).qk):
            torch.testing.assert_close(q, q_eager, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(k, k_eager, rtol=1e-5, atol=1e-6)
    assert len(checks) == 2, "one check per new input shape"
    assert compiled.max_check_error < 1e-5


def reference_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.logsumexp(q.double() @ k.double().transpose(-1, -2) * scale, dim=-1)


@pytest.mark.parametrize("arch", ["vit", "eva"])
@pytest.mark.parametrize("layers", ["all", [1]])
def test_compiled_teacher_records_each_blocks_lse(arch: str, layers) -> None:
    """The fused op runs in SDPA's place inside the graph: its LSE belongs to the recorded Q/K."""
    teacher, x = tiny_teacher(arch), torch.randn(2, 3, 32, 32)
    compiled = CompiledQK(teacher, layers, {"backend": "aot_eager"})
    for _ in range(2):  # the first call is checked against the eager capture, the second is not
        result = compiled(x)
        assert result.lse is not None and len(result.lse) == len(result.qk)
        for (q, k), scale, lse in zip(result.qk, result.scales, result.lse):
            assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
            torch.testing.assert_close(lse.double(), reference_lse(q, k, scale), rtol=1e-5, atol=1e-5)


def test_a_compiled_lse_unlike_the_eager_captures_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def eager_with_lse(q, k, v, dropout_p=0.0, scale=None):  # as on CUDA: the eager teacher records LSEs too
        return attention_lse.run_with_lse(1, q, k, v, dropout_p, scale)

    def shifted(*args):
        out, lse = attention_lse.run_with_lse(*args)
        return out, lse + 1.0

    monkeypatch.setattr(extractors, "attention_with_lse", eager_with_lse)
    teacher, x = tiny_teacher(), torch.randn(2, 3, 32, 32)
    CompiledQK(teacher, "all", TRACE_ONLY)(x)  # the same LSEs pass
    monkeypatch.setattr(recording, "run_with_lse", shifted)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="log-sum-exps differ from the eager capture's by up to 1"):
        CompiledQK(teacher, "all", TRACE_ONLY)(x)


def test_distiller_with_compiled_teacher_gives_the_eager_penalty() -> None:
    student, x = tiny_teacher(seed=1).train().requires_grad_(True), torch.randn(2, 3, 32, 32)
    eager = AttentionDistiller(alpha=0.5, backend="torch")
    compiled = AttentionDistiller(alpha=0.5, backend="torch", compile_teacher=TRACE_ONLY)
    for task in range(3):
        eager.update_teacher(student)
        compiled.update_teacher(student)
        with torch.no_grad():
            for parameter in student.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        with eager.student_capture(student) as capture:
            student(x)
        expected = eager.penalty(x, capture)
        got = compiled.penalty(x, capture)
        assert float(expected) > 0
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        if task == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a new teacher of the same architecture must not recompile"


def test_penalty_takes_a_teacher_run_before_the_student() -> None:
    student, x = tiny_teacher(seed=1).train().requires_grad_(True), torch.randn(2, 3, 32, 32)
    distiller = AttentionDistiller(alpha=1.0, backend="torch")
    distiller.update_teacher(tiny_teacher(seed=2))
    teacher = distiller.teacher_qk(x)
    assert isinstance(teacher, TeacherQK)
    with distiller.student_capture(student) as capture:
        student(x)
    given = distiller.penalty(x, capture, teacher=teacher)
    computed = distiller.penalty(x, capture)
    torch.testing.assert_close(given, computed, rtol=0, atol=0)
    with pytest.raises(TypeError, match="teacher must be the TeacherQK"):
        distiller.penalty(x, capture, teacher=teacher.qk)


def test_plugin_runs_the_teacher_before_the_student_and_drops_it_before_backward() -> None:
    student, x = tiny_teacher(seed=1).train().requires_grad_(True), torch.randn(2, 3, 32, 32)
    plugin = StreamKLPlugin(alpha=1.0, backend="torch", compile_teacher=TRACE_ONLY)
    strategy = type("Strategy", (), {"model": student, "mb_x": x, "loss": torch.zeros(())})()
    plugin.after_training_exp(strategy)
    order = []
    student.register_forward_pre_hook(lambda *_: order.append("student"))
    teacher_qk = plugin.distiller.teacher_qk
    plugin.distiller.teacher_qk = lambda inputs: order.append("teacher") or teacher_qk(inputs)
    plugin.before_forward(strategy)
    student(x)
    plugin.after_forward(strategy)
    plugin.before_backward(strategy)
    assert order == ["teacher", "student"]
    assert plugin._teacher_run is None
    strategy.loss.backward()
    assert "compile_teacher=True" in repr(plugin)


class ReversedViT(nn.Module):
    """Runs its blocks last to first: the i-th attention call is not block i's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim=32, num_heads=2) for _ in range(DEPTH)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = block(x)
        return x


def test_attention_calls_out_of_block_order_are_refused() -> None:
    torch.manual_seed(0)
    model = frozen_copy(ReversedViT())
    with pytest.raises(RuntimeError, match="block order"):
        CompiledQK(model, [0], TRACE_ONLY)(torch.randn(2, 7, 32))


def test_attention_without_sdpa_is_refused() -> None:
    teacher = tiny_teacher()
    for block in teacher.blocks:
        block.attn.fused_attn = False
    with pytest.raises(RuntimeError, match="F.scaled_dot_product_attention calls"):
        CompiledQK(teacher, "all", TRACE_ONLY)(torch.randn(2, 3, 32, 32))


def test_compile_options_are_checked() -> None:
    assert check_compile_options(False) is None
    assert check_compile_options(True) == {}
    assert check_compile_options({"mode": "max-autotune-no-cudagraphs"}) == {"mode": "max-autotune-no-cudagraphs"}
    with pytest.raises(TypeError, match="a bool, \"auto\" or a mapping"):
        check_compile_options("yes")
    with pytest.raises(TypeError, match=r"torch.compile does not take: \['fullgraf'\]"):
        AttentionDistiller(compile_teacher={"fullgraf": True})
    with pytest.raises(TypeError, match="needs a tensor input"):
        CompiledQK(tiny_teacher(), "all", TRACE_ONLY)([torch.randn(2, 3, 32, 32)])


def test_a_failing_first_call_falls_back_to_the_eager_teacher_when_asked() -> None:
    teacher, x = tiny_teacher(), torch.randn(2, 3, 32, 32)
    for block in teacher.blocks:
        block.attn.fused_attn = False  # no SDPA call: the compiled forward cannot see the attention
    compiled = CompiledQK(teacher, "all", TRACE_ONLY, fallback=True)
    with pytest.warns(RuntimeWarning, match="compiled teacher unavailable, running it eager .*RuntimeError"):
        first = compiled(x)
    assert compiled.eager_fallback is not None
    expected = eager_qk(teacher, x)
    for result in (first, compiled(x)):  # no second warning: eager from now on
        for (q, k), (q_eager, k_eager) in zip(result.qk, expected.qk, strict=True):
            torch.testing.assert_close(q, q_eager, rtol=0, atol=0)
            torch.testing.assert_close(k, k_eager, rtol=0, atol=0)


def test_compile_teacher_auto_is_the_default_and_keeps_a_cpu_teacher_eager() -> None:
    """'auto' (the default) compiles only a teacher on CUDA (the CUDA half: the test below, the GPU benchmarks)."""
    for distiller in (AttentionDistiller(backend="torch"), AttentionDistiller(backend="torch", compile_teacher="auto")):
        distiller.update_teacher(tiny_teacher(seed=1))
        assert distiller._compiled_teacher is None and "compile_teacher='auto'" in repr(distiller)
    for plugin in (StreamKLPlugin(), PADPlugin(), StreamKLPlugin(compile_teacher="auto")):
        assert "compile_teacher='auto'" in repr(plugin)
    assert "compile_teacher=False" in repr(StreamKLPlugin(compile_teacher=False))
    with pytest.raises(TypeError, match="compile_teacher must be"):
        AttentionDistiller(compile_teacher="Auto")


def test_compile_teacher_auto_on_cuda_compiles_with_fallback_but_not_a_compile_model_snapshot(monkeypatch):
    """With the device check answering CUDA: a plain teacher gets CompiledQK(fallback=True); a snapshot
    of a compile_model student (compiled already, refused by CompiledQK) and a torchvision ViT
    (nn.MultiheadAttention: no SDPA call to collect) stay eager instead of raising or warning."""
    monkeypatch.setattr(teacher_forward, "on_cuda", lambda module: True)
    distiller = AttentionDistiller(backend="torch")
    distiller.update_teacher(tiny_teacher(seed=1))
    assert isinstance(distiller._compiled_teacher, CompiledQK) and distiller._compiled_teacher.fallback
    student = tiny_teacher(seed=2)
    compile_model(student)
    distiller.update_teacher(student)
    assert distiller._compiled_teacher is None and is_compiled(distiller.teacher)
    with pytest.raises(ValueError, match="compiled by compile_model already"):
        AttentionDistiller(backend="torch", compile_teacher=True).update_teacher(student)
    vision = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                  hidden_dim=16, mlp_dim=32, num_classes=4)
    distiller.update_teacher(vision)
    assert distiller._compiled_teacher is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused CUDA backends (cuDNN, flash) need a GPU")
@pytest.mark.parametrize("batch", [2, 3])
def test_on_cuda_the_compiled_teacher_records_the_fused_backends_lse(batch: int) -> None:
    """Inductor, bf16 autocast, 197 tokens: the LSE from the graph belongs to the graph's Q/K, and 'auto' compiles."""
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=4, depth=2).cuda()
    distiller = AttentionDistiller(compile_teacher="auto")
    distiller.update_teacher(model)
    assert distiller._compiled_teacher is not None
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        result = distiller.teacher_qk(x)
    assert distiller._compiled_teacher.eager_fallback is None and result.lse is not None
    for (q, k), scale, lse in zip(result.qk, result.scales, result.lse, strict=True):
        assert lse.shape == q.shape[:3] == (batch, 6, 197) and lse.dtype == torch.float32
        torch.testing.assert_close(lse.double(), reference_lse(q, k, scale), rtol=0, atol=1e-4)
