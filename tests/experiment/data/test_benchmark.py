"""Streams built with Avalanche's public API only, pinned to the samples they held before; as an Avalanche benchmark."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from avalanche.training import Naive
from avalanche.training.plugins import EvaluationPlugin
from torch import nn

from cl_streamkl.experiment.data import build_stream, load_splits
from cl_streamkl.experiment.data.benchmark import avalanche_benchmark

PACKAGE = Path(__file__).resolve().parents[3] / "cl_streamkl"


@pytest.fixture(scope="module")
def digits():
    return load_splits("digits", data_root=None, image_size=8)


def _summary(dataset) -> tuple[int, float, int, int]:
    """Size, position-weighted sums of images, labels and task labels: changes with any sample or its order."""
    samples = [dataset[i] for i in range(len(dataset))]
    weights = torch.arange(1, len(samples) + 1, dtype=torch.float64)
    images = torch.stack([x for x, _, _ in samples]).double().flatten(1).sum(1)
    labels = torch.tensor([y for _, y, _ in samples], dtype=torch.float64)
    tasks = torch.tensor([t for _, _, t in samples], dtype=torch.float64)
    return len(samples), float((weights * images).sum()), int((weights * labels).sum()), int(tasks.sum())


# What the streams held when they were built with Avalanche's private dataset helper: the same
# seeded class order, samples, order, labels and task labels. (size, weighted image sum,
# weighted label sum, task-label sum) per training experience, then validation experience 1
# and test experience 2.
PINNED = {
    ("class", 0): ([4, 6, 2, 7, 3, 5, 9, 0, 8, 1], [
        (262, -864948.971, 175470, 0), (257, -835659.608, 148716, 0), (262, -884801.433, 139493, 0),
        (258, -825678.921, 152568, 0), (256, -777663.922, 143741, 0)],
        (28, -11279.521, 1977, 0), (74, -71375.865, 11215, 0)),
    ("class", 1): ([8, 4, 7, 0, 1, 2, 5, 9, 6, 3], [
        (256, -784294.14, 200592, 0), (257, -825743.338, 112266, 0), (259, -828317.209, 49991, 0),
        (261, -864558.311, 239435, 0), (262, -880453.661, 157881, 0)],
        (28, -11071.898, 1218, 0), (71, -63067.928, 3727, 0)),
    ("task", 2): ([2, 0, 7, 6, 9, 5, 3, 4, 8, 1], [
        (256, -806188.114, 16901, 0), (260, -861245.325, 17762, 260), (261, -864558.311, 17071, 522),
        (262, -878158.202, 16646, 786), (256, -777663.922, 17061, 1024)],
        (28, -10825.435, 198, 28), (73, -67945.473, 1431, 146)),
    ("domain", 1): ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [
        (264, -837030.46, 154058, 0), (259, -825691.755, 152921, 0), (259, -828399.41, 152938, 0),
        (257, -816736.813, 152268, 0), (256, -828152.242, 147424, 0)],
        (142, -264499.101, 42428, 0), (360, -1591752.476, 283622, 0)),
}


def _close(ours: tuple, pinned: tuple) -> bool:
    return ours[0] == pinned[0] and ours[1] == pytest.approx(pinned[1], rel=1e-9, abs=1e-3) and ours[2:] == pinned[2:]


@pytest.mark.parametrize(("scenario", "seed"), PINNED, ids=[f"{s}-seed{n}" for s, n in PINNED])
def test_streams_hold_the_pinned_samples(digits, scenario: str, seed: int):
    class_order, train, val_1, test_2 = PINNED[scenario, seed]
    stream = build_stream(digits, n_experiences=5, seed=seed, val_fraction=0.1, scenario=scenario, image_size=8)
    assert stream.class_order == class_order
    for experience, pinned in enumerate(train):
        assert _close(_summary(stream.train[experience]), pinned), (experience, _summary(stream.train[experience]))
    assert _close(_summary(stream.val[1]), val_1) and _close(_summary(stream.test[2]), test_2)
    assert all(hasattr(dataset, "task_set") for dataset in stream.train)  # task-aware, as Avalanche's loaders need


def test_the_package_imports_no_private_avalanche_name():
    private = [f"{path.name}: {alias.name}"
               for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("avalanche")
               for alias in node.names if alias.name.startswith("_")]
    assert not private


@pytest.mark.parametrize("scenario", ["class", "task"])
def test_avalanche_benchmark_holds_the_streams_experiences(digits, scenario: str):
    stream = build_stream(digits, n_experiences=5, seed=3, val_fraction=0.1, scenario=scenario)
    benchmark = avalanche_benchmark(stream)
    for name, datasets in (("train", stream.train), ("test", stream.test), ("valid", stream.val)):
        experiences = list(benchmark.streams[name])
        assert [e.current_experience for e in experiences] == list(range(5))
        assert all(e.dataset is dataset for e, dataset in zip(experiences, datasets, strict=True))
    for i, experience in enumerate(benchmark.train_stream):
        classes = list(range(2)) if scenario == "task" else stream.experience_classes[i]
        assert sorted(experience.classes_in_this_experience) == sorted(classes)
        assert getattr(experience, "task_label", None) == (i if scenario == "task" else None)
    assert "valid" not in avalanche_benchmark(build_stream(digits, n_experiences=5, seed=3, val_fraction=0.0)).streams
    with pytest.raises(TypeError, match="stream must be an ExperienceStream"):
        avalanche_benchmark(stream.train)


def test_an_avalanche_strategy_trains_on_the_benchmark(digits):
    benchmark = avalanche_benchmark(build_stream(digits, n_experiences=5, seed=0, val_fraction=0.1))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    strategy = Naive(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     criterion=nn.CrossEntropyLoss(), train_mb_size=64, train_epochs=3, eval_mb_size=256,
                     evaluator=EvaluationPlugin(loggers=[]))
    strategy.train(benchmark.train_stream[0])
    model.eval()
    test = benchmark.test_stream[0].dataset
    with torch.no_grad():
        images = torch.stack([test[i][0] for i in range(len(test))])
        labels = torch.tensor([test[i][1] for i in range(len(test))])
        accuracy = (model(images).argmax(1) == labels).float().mean().item()
    assert accuracy > 0.9  # two classes of the first experience, learnt
