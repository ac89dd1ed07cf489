"""AttentionDistiller and StreamKLPlugin: penalty, teacher lifecycle, Avalanche runs, state, errors."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref
from types import SimpleNamespace

import pytest
import timm
import torch
from avalanche.benchmarks import tensors_benchmark
from avalanche.evaluation.metrics import loss_metrics
from avalanche.logging import CSVLogger, InteractiveLogger, TensorboardLogger, TextLogger
from avalanche.training import Naive, Replay
from avalanche.training.plugins import EvaluationPlugin, EWCPlugin, LwFPlugin, SupervisedPlugin
from torch import nn

from cl_streamkl import attention_kl_reference
from cl_streamkl.capture import QKCapture
from cl_streamkl.strategies import (
    AttentionDistiller,
    StreamKLPenaltyMetric,
    StreamKLPlugin,
    streamkl_penalty_metrics,
)

IMAGE = (3, 32, 32)


def tiny_model(arch: str = "vit", depth: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    name = "vit_tiny_patch16_224" if arch == "vit" else "eva02_tiny_patch14_224"
    return timm.create_model(
        name, pretrained=False, img_size=32, patch_size=8, num_classes=4, depth=depth, embed_dim=64, num_heads=2
    )


def count_hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )


def perturb(model: nn.Module, seed: int = 1, size: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(size * torch.randn(param.shape, generator=generator))


def reference_penalty(student: nn.Module, teacher: nn.Module, x: torch.Tensor, alpha: float, layers="all",
                      temperature: float = 1.0) -> torch.Tensor:
    """alpha × mean float64 KL, from separate forwards of both models (graph kept on the student)."""
    with QKCapture(student, layers) as cap_s:
        student(x)
    with torch.no_grad(), QKCapture(teacher, layers) as cap_t:
        teacher(x)
    per_layer = [
        attention_kl_reference(q, k, qt, kt, temperature=temperature, reduction="mean")
        for (q, k), (qt, kt) in zip(cap_s.qk, cap_t.qk)
    ]
    return alpha * torch.stack(per_layer).mean()


def tensor_benchmark(experiences: int = 2, per_experience: int = 16):
    """A small random-image stream with task labels (LwF needs them)."""

    def tensors(seed: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(per_experience, *IMAGE, generator=generator)
        return [x, torch.randint(0, 4, (per_experience,), generator=generator)]

    return tensors_benchmark(
        train_tensors=[tensors(seed) for seed in range(experiences)],
        test_tensors=[tensors(100 + seed) for seed in range(experiences)],
        task_labels=[0] * experiences,
    )


def make_strategy(kind: str, model: nn.Module, plugins: list, evaluator=None):
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    common = dict(
        model=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), train_mb_size=8, train_epochs=1,
        eval_mb_size=16, device="cpu", plugins=plugins,
        evaluator=evaluator if evaluator is not None else EvaluationPlugin(loggers=[]),
    )
    if kind == "replay":
        return Replay(mem_size=8, **common)
    if kind == "lwf":
        common["plugins"] = plugins + [LwFPlugin(alpha=1.0, temperature=2.0)]
    if kind == "ewc":
        common["plugins"] = plugins + [EWCPlugin(ewc_lambda=1.0)]
    return Naive(**common)


# ---------------------------------------------------------------- distiller (framework-free)


@pytest.mark.parametrize("arch", ["vit", "eva"])
def test_penalty_and_gradients_match_float64_reference(arch: str) -> None:
    model = tiny_model(arch, depth=3)
    distiller = AttentionDistiller(alpha=0.7, layers=[0, -1], temperature=1.5, backend="torch")
    x = torch.randn(2, *IMAGE)
    assert distiller.penalty(x, []).item() == 0.0
    teacher = distiller.update_teacher(model)
    perturb(model)

    with distiller.student_capture(model) as cap:
        model(x)
    penalty = distiller.penalty(x, cap.qk, student_scales=cap.scales)
    assert penalty.dim() == 0 and penalty.dtype == torch.float32 and penalty.item() > 1e-4
    weight = 0.37  # grad_output != 1
    (weight * penalty).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    reference = reference_penalty(model, teacher, x, 0.7, layers=[0, -1], temperature=1.5)
    (weight * reference).backward()
    torch.testing.assert_close(penalty.double(), reference.detach(), rtol=1e-5, atol=0)
    qkv = "blocks.2.attn.qkv.weight"
    assert ours[qkv].abs().sum() > 0
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
    assert distiller.penalty(x, cap.qk).item() == 0.0  # teacher = student
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
    assert distiller.penalty(torch.randn(1, *IMAGE), cap.qk).item() == 0.0


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
        values[backend] = distiller.penalty(x, cap.qk)
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
    penalty = distiller.penalty(x, cap.qk, student_scales=cap.scales)
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


# ---------------------------------------------------------------- plugin callbacks without a strategy


def test_plugin_callbacks_capture_once_and_add_penalty() -> None:
    model = tiny_model()
    plugin = StreamKLPlugin(alpha=0.5, backend="torch")
    x = torch.randn(4, *IMAGE)
    strategy = SimpleNamespace(model=model, mb_x=x, loss=torch.zeros(()))
    plugin.before_training(strategy)

    forwards = []
    model.blocks[0].register_forward_pre_hook(lambda *_: forwards.append(1))
    plugin.before_forward(strategy)
    assert count_hooks(model) == 1  # no teacher yet: nothing installed
    model(x)
    plugin.after_forward(strategy)
    plugin.before_backward(strategy)
    assert strategy.loss.item() == 0.0 and plugin.last_penalty == 0.0

    plugin.after_training_exp(strategy)
    perturb(model)
    forwards.clear()
    plugin.before_forward(strategy)
    assert count_hooks(model) > 1
    model(x)
    plugin.after_forward(strategy)
    assert count_hooks(model) == 1
    plugin.before_backward(strategy)
    assert len(forwards) == 1, "the student must run exactly once per iteration"
    expected = reference_penalty(model, plugin.teacher, x, 0.5)
    assert isinstance(plugin.last_penalty, float)
    assert plugin.last_penalty == pytest.approx(expected.item(), rel=1e-5)
    assert strategy.loss.requires_grad
    strategy.loss.backward()
    assert model.blocks[1].attn.qkv.weight.grad.abs().sum() > 0
    plugin.after_training_iteration(strategy)
    assert count_hooks(model) == 1


def test_plugin_under_cpu_bf16_autocast() -> None:
    model = tiny_model()
    plugin = StreamKLPlugin(alpha=1.0, backend="torch")
    x = torch.randn(2, *IMAGE)
    strategy = SimpleNamespace(model=model, mb_x=x, loss=torch.zeros(()))
    plugin.before_training(strategy)
    plugin.after_training_exp(strategy)
    perturb(model, size=0.2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plugin.before_forward(strategy)
        model(x)
        plugin.after_forward(strategy)
        plugin.before_backward(strategy)
    strategy.loss.backward()
    expected = reference_penalty(model, plugin.teacher, x, 1.0).item()
    assert expected > 1e-3
    assert plugin.last_penalty == pytest.approx(expected, rel=0.1)


# ---------------------------------------------------------------- real Avalanche strategies


class Probe(SupervisedPlugin):
    """Checks the StreamKL plugin from inside a strategy, after it has run each callback."""

    def __init__(self, streamkl: StreamKLPlugin, alpha: float) -> None:
        super().__init__()
        self.streamkl, self.alpha = streamkl, alpha
        self.records: list[tuple[int, float, float]] = []
        self.frozen: dict[str, torch.Tensor] | None = None
        self.frozen_teacher: nn.Module | None = None

    def before_training_exp(self, strategy, *args, **kwargs) -> None:
        teacher = self.streamkl.teacher
        self.frozen_teacher = teacher
        self.frozen = None if teacher is None else {k: v.clone() for k, v in teacher.state_dict().items()}

    def before_backward(self, strategy, *args, **kwargs) -> None:
        assert count_hooks(strategy.model) == 0
        teacher = self.streamkl.teacher
        reference = 0.0
        if teacher is not None:
            with torch.no_grad():
                reference = reference_penalty(strategy.model, teacher, strategy.mb_x, self.alpha).item()
        self.records.append((strategy.experience.current_experience, self.streamkl.last_penalty, reference))

    def after_training_iteration(self, strategy, *args, **kwargs) -> None:
        if self.frozen is not None:
            assert self.streamkl.teacher is self.frozen_teacher
            for name, value in self.streamkl.teacher.state_dict().items():
                assert torch.equal(value, self.frozen[name]), f"teacher {name} changed during training"

    def after_training_exp(self, strategy, *args, **kwargs) -> None:
        self.frozen_teacher = self.frozen = None  # let the plugin release the old teacher


@pytest.mark.parametrize("kind", ["naive", "replay", "lwf", "ewc"])
def test_plugin_in_avalanche_strategies(kind: str) -> None:
    model = tiny_model()
    alpha = 2.0
    plugin = StreamKLPlugin(alpha=alpha, backend="torch")
    probe = Probe(plugin, alpha)
    strategy = make_strategy(kind, model, [plugin, probe])
    teachers = []
    for experience in tensor_benchmark(experiences=3).train_stream:
        strategy.train(experience, num_workers=0)
        teachers.append(weakref.ref(plugin.teacher))
        assert count_hooks(model) == 0
    gc.collect()
    assert teachers[0]() is None and teachers[1]() is None and teachers[2]() is plugin.teacher
    assert plugin.distiller.teacher_updates == 3

    first = [(p, r) for exp, p, r in probe.records if exp == 0]
    later = [(p, r) for exp, p, r in probe.records if exp > 0]
    assert len(first) == 2 and all(p == 0.0 and r == 0.0 for p, r in first)
    assert len(later) == 4
    for penalty, reference in later:
        # fp32 KL of nearly equal distributions: absolute error ~1e-7 from log-prob rounding.
        assert penalty == pytest.approx(reference, rel=1e-4, abs=1e-6)
    # Iteration 0 of an experience starts from the teacher's weights; after a step it differs.
    assert later[1][0] > 1e-7 and later[3][0] > 1e-7
    copy.deepcopy(model)
    pickle.loads(pickle.dumps(model))


def test_penalty_reaches_every_logger(tmp_path, capsys) -> None:
    model = tiny_model()
    plugin = StreamKLPlugin(alpha=1.0, backend="torch")
    text = io.StringIO()
    evaluator = EvaluationPlugin(
        loss_metrics(epoch=True),
        streamkl_penalty_metrics(minibatch=True, epoch=True, experience=True),
        loggers=[TextLogger(text), InteractiveLogger(), TensorboardLogger(tmp_path / "tb"), CSVLogger(tmp_path / "csv")],
    )
    strategy = make_strategy("naive", model, [plugin], evaluator)
    for experience in tensor_benchmark().train_stream:
        strategy.train(experience, num_workers=0)
    last = evaluator.get_last_metrics()
    epoch_name = "StreamKL_Penalty_Epoch/train_phase/train_stream/Task000"
    epoch_value = last[epoch_name]
    assert epoch_value > 0
    assert last["StreamKL_Penalty_MB/train_phase/train_stream/Task000"] == pytest.approx(plugin.last_penalty)
    assert last["StreamKL_Penalty_Exp/train_phase/train_stream/Task000/Exp001"] == pytest.approx(epoch_value)
    assert f"{epoch_name} = {epoch_value:.4f}" in text.getvalue()
    assert epoch_name in capsys.readouterr().out
    events = b"".join(path.read_bytes() for path in (tmp_path / "tb").rglob("events.out.tfevents*"))
    assert b"StreamKL_Penalty_MB" in events and b"StreamKL_Penalty_Epoch" in events


def test_penalty_metric_needs_the_plugin() -> None:
    with pytest.raises(ValueError, match="period"):
        StreamKLPenaltyMetric("stream")
    model = tiny_model()
    strategy = make_strategy("naive", model, [], EvaluationPlugin(streamkl_penalty_metrics(), loggers=[]))
    with pytest.raises(RuntimeError, match="needs exactly one StreamKLPlugin"):
        strategy.train(tensor_benchmark(experiences=1).train_stream[0], num_workers=0)


@pytest.mark.parametrize(
    ("model_fn", "layers", "error", "match"),
    [
        (lambda: tiny_model(depth=2), [2], ValueError, "out of range"),
        (lambda: tiny_model(depth=2), 3, ValueError, "1 <= n <= 2"),
        (lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4)), "all", TypeError, "Sequential"),
    ],
    ids=["index", "count", "no-attention"],
)
def test_bad_model_fails_when_training_starts(model_fn, layers, error, match) -> None:
    model = model_fn()
    before = copy.deepcopy(model.state_dict())
    plugin = StreamKLPlugin(layers=layers, backend="torch")
    with pytest.raises(error, match=match):
        plugin.check_model(model)
    strategy = make_strategy("naive", model, [plugin])
    with pytest.raises(error, match=match):
        strategy.train(tensor_benchmark(experiences=1).train_stream[0], num_workers=0)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), "no training step may run before the error"


# ---------------------------------------------------------------- state round trip


def run_iteration(plugin: StreamKLPlugin, model: nn.Module, x: torch.Tensor) -> float:
    strategy = SimpleNamespace(model=model, mb_x=x, loss=torch.zeros(()))
    plugin.before_forward(strategy)
    model(x)
    plugin.after_forward(strategy)
    plugin.before_backward(strategy)
    return plugin.last_penalty


@pytest.mark.parametrize("arch", ["vit", "eva"])
def test_state_dict_round_trip_through_weights_only_load(tmp_path, arch: str) -> None:
    model = tiny_model(arch)
    plugin = StreamKLPlugin(alpha=1.5, layers=[-1, 0], temperature=2.0, backend="torch")
    strategy = make_strategy("naive", model, [plugin])
    strategy.train(tensor_benchmark(experiences=1).train_stream[0], num_workers=0)
    perturb(model, size=0.02)
    x = torch.randn(3, *IMAGE)
    run_iteration(plugin, model, x)

    torch.save({"plugin": plugin.state_dict(), "model": model.state_dict()}, tmp_path / "ckpt.pt")
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)

    restored_model = tiny_model(arch, seed=123)
    restored_model.load_state_dict(checkpoint["model"])
    restored = StreamKLPlugin(alpha=1.5, layers=[-1, 0], temperature=2.0, backend="torch")
    restored.load_state_dict(checkpoint["plugin"])
    assert restored.teacher is None and restored.distiller.restore_pending
    # Each rank of a data-parallel run has its own last penalty: it is no state, so every rank saves the same.
    assert "last_penalty" not in checkpoint["plugin"] and restored.last_penalty == 0.0
    assert restored.distiller.teacher_updates == 1
    # The teacher is rebuilt when the plugin first sees the strategy's model.
    restored.before_training(SimpleNamespace(model=restored_model))
    original_tensors = dict(plugin.teacher.named_parameters()) | dict(plugin.teacher.named_buffers())
    restored_tensors = dict(restored.teacher.named_parameters()) | dict(restored.teacher.named_buffers())
    assert original_tensors.keys() == restored_tensors.keys()
    for name, value in original_tensors.items():
        assert torch.equal(value, restored_tensors[name]), name
    assert not restored.teacher.training and count_hooks(restored.teacher) == 0
    assert all(not p.requires_grad for p in restored.teacher.parameters())
    assert run_iteration(restored, restored_model, x) == run_iteration(plugin, model, x)
    assert restored.last_penalty > 0


def test_state_without_teacher_and_rejected_states(tmp_path) -> None:
    plugin = StreamKLPlugin(alpha=1.0, backend="torch")
    torch.save(plugin.state_dict(), tmp_path / "empty.pt")
    fresh = StreamKLPlugin(alpha=1.0, backend="torch")
    fresh.load_state_dict(torch.load(tmp_path / "empty.pt", weights_only=True))
    assert fresh.teacher is None and not fresh.distiller.restore_pending

    other = StreamKLPlugin(alpha=2.0, backend="torch")
    with pytest.raises(ValueError, match="saved with"):
        other.load_state_dict(plugin.state_dict())
    with pytest.raises(ValueError, match="not a StreamKLPlugin state"):
        fresh.load_state_dict({"format": "something else"})
    with pytest.raises(TypeError, match="dict"):
        fresh.load_state_dict([1, 2])
    # The previous format also held the last penalty; it loads without it.
    fresh.load_state_dict({"format": "cl_streamkl.StreamKLPlugin/1", "distiller": plugin.distiller.state_dict(),
                           "last_penalty": 0.25})
    assert fresh.last_penalty == 0.0

    plugin.distiller.update_teacher(tiny_model(depth=2))
    pending = StreamKLPlugin(alpha=1.0, backend="torch")
    pending.load_state_dict(plugin.state_dict())
    with pytest.raises(RuntimeError, match="attach"):
        pending.distiller.penalty(torch.randn(1, *IMAGE), [])
    with pytest.raises(ValueError, match="does not fit this model"):
        pending.attach(tiny_model(depth=3))


def test_state_from_a_model_with_another_head_count_is_refused(tmp_path) -> None:
    plugin = StreamKLPlugin(alpha=1.0, backend="torch")
    plugin.distiller.update_teacher(tiny_model())
    torch.save(plugin.state_dict(), tmp_path / "plugin.pt")
    state = torch.load(tmp_path / "plugin.pt", weights_only=True)
    assert state["distiller"]["teacher_heads"] == [2, 2]
    four_heads = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                   num_classes=4, depth=2, embed_dim=64, num_heads=4)
    # Same tensor names and shapes: only the head count tells the two apart.
    assert {k: v.shape for k, v in four_heads.state_dict().items()} == {
        k: v.shape for k, v in tiny_model().state_dict().items()}
    restored = StreamKLPlugin(alpha=1.0, backend="torch")
    restored.load_state_dict(state)
    with pytest.raises(ValueError, match=r"\[2, 2\] attention heads per block but this model has \[4, 4\]"):
        restored.attach(four_heads)
    restored.attach(tiny_model(seed=3))
    assert restored.teacher is not None


# ---------------------------------------------------------------- GPU smoke script, CPU dry run


@pytest.mark.parametrize("mode", ["avalanche", "plain"])
def test_gpu_smoke_script_dry_run_on_cpu(tmp_path, monkeypatch, mode: str) -> None:
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "plugin_gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("plugin_gpu_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, smoke)  # dataclasses look their module up there
    spec.loader.exec_module(smoke)
    args = [
        "--device", "cpu", "--img-size", "32", "--patch-size", "8", "--depth", "2", "--embed-dim", "64",
        "--heads", "2", "--batch", "2", "--iters", "2", "--backend", "torch", "--lr", "1e-2",
        "--json", str(tmp_path / "smoke.json"),
    ]
    assert smoke.main(args + (["--no-avalanche"] if mode == "plain" else [])) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["summary"]["mode"] == mode and result["summary"]["all_checks_passed"]
    rows = result["rows"]
    assert [(r["experience"], r["iteration"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rows[3]["penalty"] > 0 and rows[3]["reference"] is not None


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
