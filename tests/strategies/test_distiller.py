"""AttentionDistiller on its own: penalty and gradients against float64, the teacher's lifecycle, errors."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from strategy_helpers import (
    IMAGE,
    count_hooks,
    perturb,
    reference_penalty,
    tiny_model,
)

from cl_streamkl.strategies import (
    AttentionDistiller,
    StreamKLPlugin,
)


LAST_QK_WEIGHT = {
    "vit": "blocks.2.attn.qkv.weight",
    "eva": "blocks.2.attn.qkv.weight",
    "torchvision": "encoder.layers.encoder_layer_2.self_attention.in_proj_weight",
}


@pytest.mark.parametrize("arch", ["vit", "eva", "torchvision"])
def test_penalty_and_gradients_match_float64_reference(arch: str) -> None:
    model = tiny_model(arch, depth=3)
    distiller = AttentionDistiller(alpha=0.7, layers=[0, -1], temperature=1.5, backend="torch")
    x = torch.randn(2, *IMAGE)
    assert distiller.penalty(x, []).item() == 0.0
    teacher = distiller.update_teacher(model)
    perturb(model)

    with distiller.student_capture(model) as cap:
        model(x)
    penalty = distiller.penalty(x, cap)
    assert penalty.dim() == 0 and penalty.dtype == torch.float32 and penalty.item() > 1e-4
    weight = 0.37  # grad_output != 1
    (weight * penalty).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    reference = reference_penalty(model, teacher, x, 0.7, layers=[0, -1], temperature=1.5)
    (weight * reference).backward()
    torch.testing.assert_close(penalty.double(), reference.detach(), rtol=1e-5, atol=0)
    assert ours[LAST_QK_WEIGHT[arch]].abs().sum() > 0
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(ours[name], param.grad, rtol=1e-4, atol=1e-8, msg=name)
    assert all(p.grad is None for p in teacher.parameters())


def test_teacher_forward_stops_after_the_last_distilled_block() -> None:
    model = tiny_model(depth=3)
    distiller = AttentionDistiller(layers=[0], backend="torch")
    teacher = distiller.update_teacher(model)
    ran = []
    teacher.blocks[1].register_forward_pre_hook(lambda *_: ran.append("block 1"))
    teacher.head.register_forward_pre_hook(lambda *_: ran.append("head"))
    x = torch.randn(2, *IMAGE)
    with distiller.student_capture(model) as cap:
        model(x)
    assert distiller.penalty(x, cap).item() == 0.0  # teacher = student
    assert ran == []


def test_teacher_is_frozen_hook_free_copy_and_old_one_is_released() -> None:
    model = tiny_model()
    user_hook = model.blocks[0].register_forward_hook(lambda *_: None)
    distiller = AttentionDistiller(backend="torch")
    assert distiller.teacher is None
    first = distiller.update_teacher(model)
    assert first is distiller.teacher and first is not model
    assert not first.training and model.training
    assert all(not p.requires_grad for p in first.parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert count_hooks(first) == 0 and count_hooks(model) == 1
    assert next(first.parameters()).device == next(model.parameters()).device
    for (name, p), q in zip(model.state_dict().items(), first.state_dict().values()):
        assert torch.equal(p, q), name
        assert p.data_ptr() != q.data_ptr() or p.numel() == 0
    user_hook.remove()

    first_ref = weakref.ref(first)
    del first
    second = distiller.update_teacher(model)
    gc.collect()
    assert first_ref() is None and distiller.teacher is second and distiller.teacher_updates == 2


def test_penalty_is_zero_when_alpha_is_zero() -> None:
    model = tiny_model()
    distiller = AttentionDistiller(alpha=0.0, backend="torch")
    distiller.update_teacher(model)
    perturb(model)
    with distiller.student_capture(model) as cap:
        model(torch.randn(1, *IMAGE))
    assert distiller.penalty(torch.randn(1, *IMAGE), cap).item() == 0.0


def test_triton_backend_matches_torch_backend_on_cpu_interpreter() -> None:
    from cl_streamkl.kernels.triton import INTERPRETING

    if not INTERPRETING:
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")
    model = tiny_model()
    x = torch.randn(1, *IMAGE)
    values = {}
    for backend in ("torch", "triton"):
        distiller = AttentionDistiller(alpha=1.0, backend=backend)
        distiller.update_teacher(tiny_model(seed=3))
        with distiller.student_capture(model) as cap:
            model(x)
        values[backend] = distiller.penalty(x, cap)
    torch.testing.assert_close(values["triton"], values["torch"], rtol=1e-4, atol=1e-6)


def test_triton_penalty_is_one_grouped_launch_per_kernel(launch_counter) -> None:
    from cl_streamkl.kernels.triton import INTERPRETING

    if not INTERPRETING:
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")
    model = tiny_model(depth=3)
    x = torch.randn(2, *IMAGE)
    distiller = AttentionDistiller(alpha=0.5, backend="triton")
    teacher = distiller.update_teacher(model)
    perturb(model)
    with distiller.student_capture(model) as cap:
        model(x)
    penalty = distiller.penalty(x, cap)
    penalty.backward()
    # three blocks: one grouped forward, one launch of each backward kernel, nothing per block
    assert {name: n for name, n in launch_counter.counts.items() if n} == {
        "grouped_forward": 1, "grouped_backward_dq": 1, "grouped_backward_dk": 1}
    reference = reference_penalty(model, teacher, x, 0.5)
    torch.testing.assert_close(penalty.double(), reference.detach(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(alpha=-0.1), ValueError, "alpha must be a finite number >= 0"),
        (dict(alpha=float("nan")), ValueError, "alpha"),
        (dict(alpha="1"), TypeError, "alpha must be a real number"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(backend="cuda"), ValueError, "backend"),
        (dict(layers=0), ValueError, "n >= 1"),
        (dict(layers="last"), ValueError, "'all'"),
        (dict(layers=[]), ValueError, "empty"),
        (dict(layers=[1.5]), TypeError, "ints"),
        (dict(layers=True), TypeError, "bool"),
    ],
    ids=str,
)
def test_bad_arguments_fail_at_construction(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        AttentionDistiller(**kwargs)
    with pytest.raises(error, match=match):
        StreamKLPlugin(**kwargs)



@pytest.mark.parametrize("change", ["replaced", "edited in place"])
def test_teacher_reruns_when_the_batch_changed_after_before_forward(change: str) -> None:
    # The teacher runs in before_forward; a plugin acting later may still swap or edit mb_x.
    model, x = tiny_model(), torch.randn(2, *IMAGE)
    plugin = StreamKLPlugin(alpha=1.0, backend="torch")
    strategy = SimpleNamespace(model=model, mb_x=x, loss=torch.zeros(()))
    plugin.after_training_exp(strategy)
    perturb(model)
    plugin.before_forward(strategy)
    if change == "replaced":
        strategy.mb_x = x.flip(-1)
    else:
        strategy.mb_x.mul_(-1.0)
    model(strategy.mb_x)
    plugin.after_forward(strategy)
    plugin.before_backward(strategy)
    expected = reference_penalty(model, plugin.teacher, strategy.mb_x, 1.0)
    assert plugin.last_penalty == pytest.approx(expected.item(), rel=1e-5)


def test_forward_after_load_state_dict_rebuilds_the_teacher_from_the_model_it_runs(tmp_path) -> None:
    model = tiny_model()
    distiller = AttentionDistiller(alpha=1.0, backend="torch")
    distiller.update_teacher(model)
    perturb(model)
    x = torch.randn(3, *IMAGE)
    expected = distiller.forward(model, x)[1]
    torch.save({"distiller": distiller.state_dict(), "model": model.state_dict()}, tmp_path / "checkpoint.pt")

    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    resumed_model = tiny_model(seed=7)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = AttentionDistiller(alpha=1.0, backend="torch")
    resumed.load_state_dict(checkpoint["distiller"])
    penalty = resumed.forward(resumed_model, x)[1]  # no attach(model) call: forward has the model
    assert not resumed.restore_pending and penalty > 0
    torch.testing.assert_close(penalty, expected, rtol=0, atol=0)


def test_a_model_cast_after_the_snapshot_is_refused_in_one_line_naming_both() -> None:
    model = tiny_model("vit")
    distiller = AttentionDistiller(backend="torch")
    distiller.update_teacher(model)
    model.double()
    expected = r"^the model is torch.float64 on cpu but its teacher snapshot is torch.float32 on cpu: "
    with pytest.raises(ValueError, match=expected + r".*distiller\.teacher\.to\('cpu', torch\.float64\)") as error:
        distiller.forward(model, torch.randn(1, *IMAGE, dtype=torch.float64))
    assert "\n" not in str(error.value)
    model.float()  # cast back: distilled again
    assert distiller.forward(model, torch.randn(1, *IMAGE))[1].item() == pytest.approx(0.0, abs=1e-5)
    model.bfloat16()
    distiller.teacher.to("cpu", torch.bfloat16)  # the snapshot cast the same way, as the error says
    penalty = distiller.forward(model, torch.randn(1, *IMAGE, dtype=torch.bfloat16))[1]
    assert penalty.item() == pytest.approx(0.0, abs=1e-2)
