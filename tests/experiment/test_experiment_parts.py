"""Pieces of the run loop without a full run: replay buffer, plugin states, checkpoints, config."""

from __future__ import annotations

import random
import time
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from avalanche.training.plugins import EWCPlugin, LwFPlugin

from cl_streamkl.experiment.data import build_stream, load_splits
from cl_streamkl.experiment.checkpoint import RunIdentity, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from cl_streamkl.experiment.config import ExperimentConfig, strategy_components
from cl_streamkl.experiment.model import build_model
from cl_streamkl.experiment.plugin_state import load_plugin_state, plugin_state
from cl_streamkl.experiment.replay_buffer import SeededClassBuffer, SeededExperienceBuffer


@pytest.fixture(scope="module")
def stream():
    return build_stream(load_splits("digits", data_root=None, image_size=8),
                        n_experiences=5, seed=0, val_fraction=0.1)


def _tiny_model() -> torch.nn.Module:
    return build_model("vit_tiny_patch16_224", image_size=8, patch_size=4, in_chans=1, num_classes=10,
                       model_kwargs={"depth": 1, "embed_dim": 16, "num_heads": 2})


def test_replay_buffer_balances_experiences_and_restores_exactly(stream):
    buffer = SeededExperienceBuffer(50, stream.train, seed=3)
    for exp_id in range(3):
        buffer.post_adapt(None, SimpleNamespace(current_experience=exp_id))
    assert buffer.quotas() == {0: 17, 1: 17, 2: 16}
    assert len(buffer.buffer) == 50
    labels = [int(buffer.buffer[i][1]) for i in range(50)]
    assert set(labels) == set(sum(stream.experience_classes[:3], []))

    restored = SeededExperienceBuffer(50, stream.train, seed=999)
    restored.load_state_dict(torch.load(_roundtrip(buffer.state_dict()), weights_only=True))
    for i in (0, 17, 49):
        torch.testing.assert_close(restored.buffer[i][0], buffer.buffer[i][0])
    # the global RNG is untouched by buffer updates
    state = torch.get_rng_state()
    buffer.post_adapt(None, SimpleNamespace(current_experience=3))
    assert torch.equal(state, torch.get_rng_state())
    buffer.resize(None, 8)
    assert len(buffer.buffer) == 8 and buffer.quotas() == {0: 2, 1: 2, 2: 2, 3: 2}


def _buffer_labels(buffer) -> list[int]:
    return [int(buffer.buffer[i][1]) for i in range(len(buffer.buffer))]


def test_class_buffer_keeps_as_many_of_every_class_and_restores_exactly(stream):
    per_class = SeededClassBuffer(0, stream.train, seed=3, per_class=4)
    total = SeededClassBuffer(10, stream.train, seed=3)
    for exp_id in range(3):
        for buffer in (per_class, total):
            buffer.post_adapt(None, SimpleNamespace(current_experience=exp_id))
    classes = sum(stream.experience_classes[:3], [])
    assert sorted(_buffer_labels(per_class)) == sorted(classes * 4)
    counts = [_buffer_labels(total).count(c) for c in classes]
    assert len(classes) == 6 and sorted(counts) == [1, 1, 2, 2, 2, 2]  # 10 = 6 + 4 remainder
    restored = SeededClassBuffer(0, stream.train, seed=999, per_class=4)
    restored.load_state_dict(torch.load(_roundtrip(per_class.state_dict()), weights_only=True))
    for i in (0, 5, len(per_class.buffer) - 1):
        torch.testing.assert_close(restored.buffer[i][0], per_class.buffer[i][0])
    other_seed = SeededClassBuffer(0, stream.train, seed=4, per_class=4)
    other_seed.post_adapt(None, SimpleNamespace(current_experience=0))
    assert not all(torch.equal(other_seed.buffer[i][0], per_class.buffer[i][0]) for i in range(8))


def test_replay_buffer_update_is_not_avalanches_deprecated_one(stream):
    buffer = SeededExperienceBuffer(20, stream.train, seed=0)
    experience = SimpleNamespace(current_experience=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # what ReplayPlugin.after_training_exp calls
        buffer.update(SimpleNamespace(experience=experience))
    assert caught == [] and len(buffer.buffer) == 20


def test_chance_is_one_over_the_experiences_own_classes():
    from cl_streamkl.experiment.runner import chance_accuracy

    splits = load_splits("digits", data_root=None, image_size=8)
    task = build_stream(splits, n_experiences=3, seed=0, val_fraction=0.1, scenario="task",
                        first_experience_classes=4)
    assert [chance_accuracy(task, j) for j in range(3)] == [1 / 4, 1 / 3, 1 / 3]
    single_head = build_stream(splits, n_experiences=5, seed=0, val_fraction=0.1)
    assert chance_accuracy(single_head, 4) == 1 / 2  # predicting one of the two new classes
    domain = build_stream(splits, n_experiences=2, seed=0, val_fraction=0.1, scenario="domain", image_size=8)
    assert chance_accuracy(domain, 1) == 1 / 10


def test_peak_memory_is_each_runs_own_not_the_process_high_water_mark():
    from cl_streamkl.experiment.memory import PeakMemory

    cpu = torch.device("cpu")
    with PeakMemory(cpu) as large:
        block = torch.ones(50 * 2**20)  # 200 MiB, every page touched
        time.sleep(0.05)
        del block
    with PeakMemory(cpu) as small:
        time.sleep(0.05)
    assert large.peak_mb > small.peak_mb + 150
    assert small.peak_mb > 0


def _roundtrip(state: object):
    import io

    handle = io.BytesIO()
    torch.save(state, handle)
    handle.seek(0)
    return handle


def test_lwf_and_ewc_states_survive_weights_only(stream):
    model = _tiny_model()
    lwf = LwFPlugin(alpha=1.0, temperature=2.0)
    lwf.lwf.post_adapt(SimpleNamespace(model=model), SimpleNamespace(dataset=stream.train[0]))
    ewc = EWCPlugin(ewc_lambda=1.0, mode="separate")
    from avalanche.training.utils import ParamData

    ewc.saved_params[0] = {"w": ParamData("w", init_tensor=torch.ones(3))}
    ewc.importances[0] = {"w": ParamData("w", init_tensor=torch.full((3,), 0.5))}

    lwf_state = torch.load(_roundtrip(plugin_state(lwf)), weights_only=True)
    ewc_state = torch.load(_roundtrip(plugin_state(ewc)), weights_only=True)
    lwf2, ewc2 = LwFPlugin(), EWCPlugin(ewc_lambda=1.0, mode="separate")
    load_plugin_state(lwf2, lwf_state, _tiny_model)
    load_plugin_state(ewc2, ewc_state, _tiny_model)
    assert lwf2.lwf.expcount == 1
    assert lwf2.lwf.prev_classes_by_task == {0: set(stream.experience_classes[0])}
    for key, value in model.state_dict().items():
        torch.testing.assert_close(lwf2.lwf.prev_model.state_dict()[key], value)
    torch.testing.assert_close(ewc2.importances[0]["w"].data, torch.full((3,), 0.5))
    torch.testing.assert_close(ewc2.saved_params[0]["w"].data, torch.ones(3))
    with pytest.raises(TypeError, match="cannot checkpoint"):
        plugin_state(object())


def test_checkpoint_is_atomic_and_rng_roundtrips(tmp_path):
    path = tmp_path / "ckpt" / "run.pt"
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    identity = RunIdentity("naive", 0, ExperimentConfig().resolved().fingerprint_json())
    state = {"experiences_done": 1, "finished": False, "model": {"w": torch.arange(3)}, "optimizer": {},
             "scaler": None, "plugins": {}, "clock": {}, "rng": rng_state(), "result": {}}
    save_checkpoint(path, state, identity)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_state(load_checkpoint(path, identity)["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    assert [p.name for p in path.parent.iterdir()] == ["run.pt"]  # no temp file left behind


def test_config_resolution_and_errors():
    cfg = ExperimentConfig().resolved()
    assert cfg.image_size == 32 and cfg.model_kwargs == {"depth": 4, "embed_dim": 64, "num_heads": 2}
    assert ExperimentConfig(model="deit_tiny_patch16_224").resolved().model_kwargs == {}
    assert ExperimentConfig.from_dict(cfg.to_dict()) == cfg
    assert strategy_components("replay+streamkl") == {"replay", "streamkl"}
    assert strategy_components("naive") == set()
    assert strategy_components("joint") == {"joint"}
    assert ExperimentConfig(dataset="mnist5k").resolved().image_size == 32
    for bad, match in [({"strategies": ["gem"]}, "unknown strategy component 'gem'"),
                       ({"strategies": ["naive+lwf"]}, "unknown strategy component 'naive'"),
                       ({"strategies": ["lwf+streamkl", "streamkl+lwf"]}, "repeat a combination"),
                       ({"strategies": ["lwf+lwf"]}, "repeats a component"),
                       ({"strategies": ["streamkl+pad"]}, "both attention distillations"),
                       ({"strategies": ["wa"], "scenario": "task"}, "needs scenario 'class'"),
                       ({"scenario": "instance"}, "scenario"),
                       ({"scenario": "domain", "first_experience_classes": 4}, "first_experience_classes"),
                       ({"domain_shift": "blur"}, "domain_shift"),
                       ({"pad_alpha": -1.0}, "pad_alpha"),
                       ({"strategies": ["lwf", "lwf"]}, "repeat"),
                       ({"seeds": []}, "seeds"),
                       ({"image_size": 30}, "not divisible"),
                       ({"amp": "int8"}, "amp"),
                       ({"dataset": "mnist"}, "dataset must be one of"),
                       ({"strategies": ["replay+joint"]}, "does not combine"),
                       ({"model_kwargs": {"pretrained": True}}, "--pretrained-file")]:
        with pytest.raises(ValueError, match=match):
            ExperimentConfig(**bad).resolved()
    with pytest.raises(ValueError, match="unknown key .color."):
        ExperimentConfig.from_dict({"epochs": 1, "color": "red"})


@pytest.mark.parametrize("amp, expected", [("bf16", torch.bfloat16), ("none", None)])
def test_plugins_before_forward_runs_under_the_forward_autocast(amp, expected):
    from avalanche.training.plugins import SupervisedPlugin

    from cl_streamkl.experiment.template import AmpSupervisedTemplate

    seen = []

    class Probe(SupervisedPlugin):
        def before_forward(self, strategy, **kwargs):
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)

    model = torch.nn.Linear(4, 2)
    template = AmpSupervisedTemplate(
        amp=amp, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=torch.nn.CrossEntropyLoss(), device="cpu", plugins=[Probe()],
    )
    template._before_forward()
    assert seen == [expected]
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("scenario, classes, accuracy, warned", [
    ("class", [[0, 1], [2, 3]], 0.5, True),     # one new class always predicted: a coin flip, not learned
    ("task", [[0, 1], [2, 3]], 0.5, True),
    ("task", [[0, 1], [2, 3]], 0.9, False),
    ("class", [[0, 1, 2, 3, 4, 5], [6, 7]], 0.3, False),  # 1.8 × the six-way chance
    ("domain", [list(range(10))] * 2, 0.12, True),
])
def test_an_experience_is_judged_against_its_own_chance(scenario, classes, accuracy, warned):
    from types import SimpleNamespace

    from cl_streamkl.experiment.runner import _Run

    stream = SimpleNamespace(scenario=scenario, experience_classes=classes, num_classes=10)
    warnings = []
    _Run._warn_unlearned(SimpleNamespace(stream=stream, strategy="naive", seed=0), [accuracy, 1.0], [0],
                         warnings.append)
    assert bool(warnings) == warned
    if warned:
        assert f"chance is {100 / len(classes[0]):.1f} %" in warnings[0]


def test_the_progress_bar_shows_a_small_penalty_in_scientific_notation():
    from types import SimpleNamespace

    from cl_streamkl.experiment.progress import ProgressPlugin

    plugin = ProgressPlugin("streamkl seed 0", 1, penalty_source=SimpleNamespace(last_penalty=1e-4, last_share=2e-4))
    strategy = SimpleNamespace(experience=SimpleNamespace(current_experience=0), train_epochs=1, dataloader=[0],
                               loss=torch.tensor(0.5))
    plugin.before_training_exp(strategy)
    plugin.after_backward(strategy)
    plugin.after_training_iteration(strategy)
    assert "kl=1.0e-04" in plugin._bar.postfix
    assert "kl/loss=0.02%" in plugin._bar.postfix  # the penalty's share of the loss
    plugin.after_training_exp(strategy)
    assert plugin.penalties == [1e-4]
