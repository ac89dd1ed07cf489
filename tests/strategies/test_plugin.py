"""StreamKLPlugin in Avalanche: callbacks, autocast, strategies, loggers, metrics, errors at training start."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from avalanche.evaluation.metrics import loss_metrics
from avalanche.logging import (
    CSVLogger,
    InteractiveLogger,
    TensorboardLogger,
    TextLogger,
)
from avalanche.training.plugins import (
    EvaluationPlugin,
    SupervisedPlugin,
)
from strategy_helpers import (
    count_hooks,
    make_strategy,
    perturb,
    plugin_on_tiny_vit,
    reference_penalty,
    tensor_benchmark,
    tiny_model,
)
from torch import nn

from cl_streamkl.strategies import (
    StreamKLPenaltyMetric,
    StreamKLPlugin,
    streamkl_penalty_metrics,
)


def test_plugin_callbacks_capture_once_and_add_penalty() -> None:
    model, plugin, strategy = plugin_on_tiny_vit(alpha=0.5, batch=4)
    x = strategy.mb_x

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
    model, plugin, strategy = plugin_on_tiny_vit(alpha=1.0, batch=2)
    x = strategy.mb_x
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


def test_plugin_distils_a_torchvision_vit() -> None:
    model = tiny_model("torchvision")
    plugin = StreamKLPlugin(alpha=2.0, backend="torch")
    probe = Probe(plugin, 2.0)
    strategy = make_strategy("naive", model, [plugin, probe])
    for experience in tensor_benchmark(experiences=2).train_stream:
        strategy.train(experience, num_workers=0)
        assert count_hooks(model) == 0
    later = [(p, r) for exp, p, r in probe.records if exp > 0]
    assert len(later) == 2 and later[1][0] > 1e-7
    for penalty, reference in later:
        assert penalty == pytest.approx(reference, rel=1e-4, abs=1e-6)


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


def test_plugin_refuses_a_model_cast_after_its_snapshot() -> None:
    model, plugin, strategy = plugin_on_tiny_vit(alpha=0.5, batch=2)
    plugin.after_training_exp(strategy)
    model.to(torch.bfloat16)
    strategy.mb_x = strategy.mb_x.to(torch.bfloat16)
    expected = "the model is torch.bfloat16 on cpu but its teacher snapshot is torch.float32"
    with pytest.raises(ValueError, match=expected):
        plugin.before_forward(strategy)
