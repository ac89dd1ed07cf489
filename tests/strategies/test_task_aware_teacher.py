"""The teacher is called as the strategy calls the model: task labels for a MultiTaskModule, the
user's extra forward arguments in the framework-free distiller; a call the model cannot take fails
in one line before training."""

from __future__ import annotations

import pytest
import torch
from compatibility import IMAGE, PLUGINS, STRATEGIES, TaskIncrementalViT, run
from strategy_helpers import perturb, reference_penalty

from cl_streamkl.capture import QKCapture
from cl_streamkl.strategies import AttentionDistiller, StreamKLPlugin

AVALANCHE_MODELS = ["MultiTaskModule + MultiHeadClassifier (timm)", "IncrementalClassifier (timm)"]


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", AVALANCHE_MODELS)
def test_avalanche_dynamic_models_are_distilled_in_the_second_experience(kind: str, strategy: str,
                                                                         plugin: str) -> None:
    first, second = run(kind, strategy, plugin)
    assert first and all(value == 0.0 for value in first)  # no teacher yet
    assert second and max(second) > 0.0


def add_second_head(model: TaskIncrementalViT) -> None:
    """What Avalanche's adaptation does for a second task: a head, its active units, the output width."""
    model.classifier.classifiers["1"] = torch.nn.Linear(16, 2)
    model.classifier.register_buffer("active_units_T1", torch.ones(2, dtype=torch.int8))
    model.max_class_label = 2


def mixed_task_batch() -> tuple[TaskIncrementalViT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TaskIncrementalViT()
    add_second_head(model)
    return model, torch.randn(6, *IMAGE), torch.tensor([1, 0, 1, 1, 0, 0])


def test_a_mixed_task_batch_is_distilled_over_every_sample() -> None:
    """A MultiTaskModule runs its backbone once per task in the batch: both models' runs are recorded,
    in the same order, and the penalty is the mean over all samples."""
    model, x, tasks = mixed_task_batch()
    distiller = AttentionDistiller(alpha=0.5, backend="torch")
    teacher = distiller.update_teacher(model)
    perturb(model, size=0.3)  # a KL well above float32's rounding
    output, penalty = distiller.forward(model, x, tasks)
    assert output.shape == (6, 2)
    expected = reference_penalty(model.backbone, teacher.backbone, x, 0.5)
    torch.testing.assert_close(penalty.double(), expected.detach(), rtol=1e-5, atol=0)


def test_the_teacher_stops_before_a_head_it_lacks() -> None:
    """The teacher snapshot predates the second task's head; its forward ends after the last block."""
    model, x, tasks = mixed_task_batch()
    del model.classifier.classifiers["1"]
    distiller = AttentionDistiller(backend="torch")
    distiller.update_teacher(model)
    add_second_head(model)
    _, penalty = distiller.forward(model, x, tasks)
    assert penalty.item() == pytest.approx(0.0, abs=1e-6)  # teacher = student before the new head


def test_a_teacher_called_with_extra_arguments_runs_eager() -> None:
    """The compiled teacher records teacher(x) calls only; one with task labels takes the eager path."""
    model, x, tasks = mixed_task_batch()
    distiller = AttentionDistiller(backend="torch")
    distiller.update_teacher(model)
    distiller._compiled_teacher = lambda inputs: pytest.fail("the compiled teacher got a call with task labels")
    (q, _), = distiller.teacher_qk(x, tasks).qk
    assert q.shape[0] == 6


def test_a_teacher_call_the_forward_cannot_take_fails_in_one_line() -> None:
    model, x, tasks = mixed_task_batch()
    distiller = AttentionDistiller(backend="torch")
    distiller.update_teacher(model)
    with pytest.raises(TypeError, match=r"teacher cannot be called as the student is: .*TaskIncrementalViT") as err:
        distiller.teacher_qk(x)  # the task labels left out
    assert "\n" not in str(err.value)
    with QKCapture(model, every_run=True) as capture:
        model(x, tasks)
    with pytest.raises(TypeError, match="teacher cannot be called"):
        distiller.penalty(x, capture, forward_kwargs={"task_label": tasks})


def test_the_plugin_refuses_a_model_the_strategy_cannot_call_when_training_starts() -> None:
    class NoTaskLabels(TaskIncrementalViT):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.forward_single_task(x, 0)

    plugin = StreamKLPlugin(backend="torch")
    strategy = type("Strategy", (), {"model": NoTaskLabels()})()
    with pytest.raises(TypeError, match=r"NoTaskLabels\.forward\(x.*cannot be called with the input and 1 more"):
        plugin.before_training(strategy)
    strategy.model = TaskIncrementalViT()
    plugin.before_training(strategy)


def test_every_run_capture_concatenates_and_stops_after_the_samples() -> None:
    model, x, tasks = mixed_task_batch()
    with torch.no_grad(), QKCapture(model, every_run=True) as capture:
        model(x, tasks)
    (q, k), = capture.qk
    assert q.shape[0] == k.shape[0] == 6
    assert capture.lse[0] is None or capture.lse[0].shape[0] == 6
    with QKCapture(model) as last:
        model(x, tasks)
    assert last.qk[0][0].shape[0] == 3  # the last task's samples only
    with pytest.raises(ValueError, match="stop_early"):
        QKCapture(model, stop_early=6)
