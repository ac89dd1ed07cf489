"""Which blocks' recorded log-sum-exps the distiller hands to the kernels, and that doing so
changes nothing but the work: the fallback choice, proved on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from strategy_helpers import IMAGE, perturb, tiny_model

from cl_streamkl.capture import QKCapture, TeacherQK
from cl_streamkl.strategies import AttentionDistiller
from cl_streamkl.strategies import block_penalties
from cl_streamkl.strategies import distiller as distiller_module
from cl_streamkl.strategies.block_penalties import known_lse

CUDA_Q = SimpleNamespace(is_cuda=True)  # known_lse reads only where q lives
CPU_Q = SimpleNamespace(is_cuda=False)


def problems(q=CUDA_Q, scale=0.125, teacher_scale=0.125, blocks=2):
    return [(q, None, None, None, scale, teacher_scale)] * blocks


LSE = torch.zeros(1, 2, 3)


@pytest.mark.parametrize(
    "temperature, blocks, student, teacher, usable",
    [
        (1.0, problems(), [LSE, LSE], [LSE, LSE], True),
        (0.5, problems(), [LSE, LSE], [LSE, LSE], False),  # LSE(s / T) is no function of LSE(s)
        (1.0, problems(q=CPU_Q), [LSE, LSE], [LSE, LSE], False),  # the CPU computes both itself
        (1.0, problems(scale=None), [LSE, LSE], [LSE, LSE], False),  # scale not the capture's
        (1.0, problems(teacher_scale=None), [LSE, LSE], [LSE, LSE], False),
        (1.0, problems(), [LSE, None], [LSE, LSE], False),  # a block without fused SDPA
        (1.0, problems(), [LSE, LSE], None, False),  # a compiled teacher records none
        (1.0, problems(), None, [LSE, LSE], False),
        (1.0, problems(), [LSE], [LSE, LSE], False),
    ],
    ids=["usable", "temperature", "cpu", "scale", "teacher-scale", "one-missing", "no-teacher-lse",
         "no-student-lse", "count"],
)
def test_known_lse_is_used_only_where_valid(temperature, blocks, student, teacher, usable) -> None:
    given = known_lse(temperature, blocks, student, teacher)
    assert (given is not None) == usable
    if usable:
        assert given == (student, teacher)


def captured_forward(distiller: AttentionDistiller) -> tuple[torch.Tensor, QKCapture]:
    """A tiny ViT made the distiller's teacher, then one forward of it as the student, captured."""
    model = tiny_model("vit", depth=2)
    distiller.update_teacher(model)
    x = torch.randn(2, *IMAGE)
    with distiller.student_capture(model) as capture:
        model(x)
    return x, capture


def test_cpu_penalty_falls_back_although_the_capture_recorded_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    distiller = AttentionDistiller(layers="all", backend="torch")
    x, capture = captured_forward(distiller)
    assert all(lse is not None for lse in capture.lse)  # the CPU's flash backend saved them
    seen = []
    grouped = block_penalties.attention_kl_grouped
    monkeypatch.setattr(block_penalties, "attention_kl_grouped",
                        lambda *args, **kwargs: seen.append(kwargs) or grouped(*args, **kwargs))
    distiller.penalty(x, capture)
    assert seen[0]["lse"] is None and seen[0]["lse_teacher"] is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_penalty_with_the_recorded_lse_equals_the_penalty_without(backend: str, monkeypatch) -> None:
    """Handing the models' log-sum-exps over (as on CUDA) gives the same penalty and gradients."""
    model = tiny_model("vit", depth=2)
    distiller = AttentionDistiller(alpha=0.7, layers="all", backend=backend)
    distiller.update_teacher(model)
    perturb(model)
    x = torch.randn(2, *IMAGE)
    # The teacher with a graph (its input requires grad), so that its SDPA nodes hold the LSE on the CPU too.
    with distiller.student_capture(distiller.teacher) as teacher_capture:
        distiller.teacher(x.clone().requires_grad_())
    teacher = TeacherQK(qk=[(q.detach(), k.detach()) for q, k in teacher_capture.qk],
                        scales=teacher_capture.scales, lse=teacher_capture.lse)
    results = []
    for use_lse in (False, True):
        model.zero_grad(set_to_none=True)
        if use_lse:
            monkeypatch.setattr(distiller_module, "known_lse",
                                lambda temperature, problems, student, teacher: (list(student), list(teacher)))
        with distiller.student_capture(model) as capture:
            model(x)
        penalty = distiller.penalty(x, capture, teacher=teacher)
        penalty.backward()
        results.append((penalty.detach(), model.blocks[0].attn.qkv.weight.grad.clone()))
    (value, grad), (value_lse, grad_lse) = results
    torch.testing.assert_close(value_lse, value, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_lse, grad, rtol=1e-4, atol=1e-8)


def test_a_subclass_with_its_own_layer_penalties_gets_the_problems_alone(monkeypatch) -> None:
    """PooledAttentionDistiller overrides layer_penalties(problems): no log-sum-exps reach it."""

    class Counting(AttentionDistiller):
        def layer_penalties(self, problems):
            return torch.zeros(len(problems))

    monkeypatch.setattr(distiller_module, "known_lse", lambda *args: pytest.fail("asked for log-sum-exps"))
    distiller = Counting(layers="all", backend="torch")
    x, capture = captured_forward(distiller)
    assert distiller.penalty(x, capture).item() == 0.0
