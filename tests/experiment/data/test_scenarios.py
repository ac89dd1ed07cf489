"""The three scenarios' streams, the mnist5k loader, the first-experience split and the task-head model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cl_streamkl.experiment.data import build_stream, load_splits
from cl_streamkl.experiment.data.stream import domain_shift, experience_sizes
from cl_streamkl.experiment.model import build_model
from cl_streamkl.experiment.task_heads import MultiHeadViT


@pytest.fixture(scope="module")
def digits():
    return load_splits("digits", data_root=None, image_size=16)


def _labels(dataset) -> list[int]:
    return [int(dataset[i][1]) for i in range(len(dataset))]


def test_experience_sizes():
    assert experience_sizes(10, 5, None) == [2] * 5
    assert experience_sizes(10, 3, 6) == [6, 2, 2]
    assert experience_sizes(10, 5, 6) == [6, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="do not split evenly"):
        experience_sizes(10, 4, 6)
    with pytest.raises(ValueError, match="must divide"):
        experience_sizes(10, 3, None)
    with pytest.raises(ValueError, match="first_experience_classes"):
        experience_sizes(10, 1, 6)


def test_first_experience_holds_more_classes(digits):
    stream = build_stream(digits, n_experiences=3, seed=1, val_fraction=0.1, first_experience_classes=6)
    assert [len(c) for c in stream.experience_classes] == [6, 2, 2]
    assert stream.experience_classes[0] == stream.class_order[:6]
    assert set(_labels(stream.test[0])) == set(stream.class_order[:6])
    assert stream.head_sizes is None


def test_task_stream_renumbers_labels_and_carries_task_labels(digits):
    stream = build_stream(digits, n_experiences=3, seed=2, val_fraction=0.1, scenario="task",
                          first_experience_classes=4)
    assert stream.scenario == "task" and stream.head_sizes == [4, 3, 3]
    class_stream = build_stream(digits, n_experiences=3, seed=2, val_fraction=0.1, first_experience_classes=4)
    for task, (classes, test, class_test) in enumerate(
            zip(stream.experience_classes, stream.test, class_stream.test)):
        assert set(test.targets_task_labels) == {task}
        # the same images, labels renumbered to the class's position in its experience
        assert _labels(test) == [classes.index(y) for y in _labels(class_test)]
        assert torch.equal(test[0][0], class_test[0][0])


def test_domain_stream_rotates_every_class(digits):
    stream = build_stream(digits, n_experiences=4, seed=5, val_fraction=0.1, scenario="domain", image_size=16)
    assert all(classes == list(range(10)) for classes in stream.experience_classes)
    assert sorted(stream.shifts) == ["rotate 0 degrees", "rotate 30 degrees", "rotate 60 degrees",
                                     "rotate 90 degrees"]
    # disjoint training parts, every class in each; whole test set under each shift
    for train in stream.train:
        assert set(_labels(train)) == set(range(10))
    total = sum(len(train) for train in stream.train)
    assert total == len(digits.train) - len(stream.val[0])
    assert all(len(test) == len(digits.test) for test in stream.test)
    unrotated = stream.shifts.index("rotate 0 degrees")
    rotated = stream.shifts.index("rotate 90 degrees")
    plain, turned = stream.test[unrotated][0][0], stream.test[rotated][0][0]
    assert torch.equal(plain, digits.test[0][0])
    assert torch.allclose(turned, torch.rot90(plain, k=1, dims=(-2, -1)), atol=1e-5)
    other = build_stream(digits, n_experiences=4, seed=6, val_fraction=0.1, scenario="domain", image_size=16)
    assert other.shifts != stream.shifts and sorted(other.shifts) == sorted(stream.shifts)


def test_domain_permutations_are_fixed_per_split_seed():
    image = torch.arange(2 * 16, dtype=torch.float32).view(2, 4, 4)
    name, identity = domain_shift("permute", 0, image_size=4)
    assert identity is None and name == "identity"
    _, first = domain_shift("permute", 1, image_size=4, split_seed=0)
    _, again = domain_shift("permute", 1, image_size=4, split_seed=0)
    _, reseeded = domain_shift("permute", 1, image_size=4, split_seed=1)
    out = first(image)
    assert torch.equal(out, again(image)) and not torch.equal(out, reseeded(image))
    # one permutation of pixel positions, the same for every channel
    assert torch.equal(out[1] - out[0], torch.full((4, 4), 16.0))
    assert sorted(out[0].flatten().tolist()) == list(range(16))
    with pytest.raises(ValueError, match="domain shift"):
        domain_shift("blur", 1, image_size=4)


def test_domain_rejects_first_experience_classes(digits):
    with pytest.raises(ValueError, match="first_experience_classes"):
        build_stream(digits, n_experiences=2, seed=0, val_fraction=0.1, scenario="domain",
                     first_experience_classes=4, image_size=16)


def test_mnist5k_loader():
    splits = load_splits("mnist5k", data_root=None, image_size=20, split_seed=3)
    assert (len(splits.train), len(splits.test), splits.num_classes, splits.in_chans) == (4000, 1000, 10, 1)
    assert np.bincount(splits.test.targets).tolist() == [100] * 10
    image, label = splits.train[0]
    assert image.shape == (1, 20, 20) and -1.0 <= float(image.min()) < float(image.max()) <= 1.0
    again = load_splits("mnist5k", data_root=None, image_size=20, split_seed=3)
    assert again.test.targets == splits.test.targets
    # MNIST, not sklearn's digits: 28×28 strokes on a black background
    assert float((image == -1.0).float().mean()) > 0.5


def test_multi_head_vit_routes_each_sample_to_its_head():
    torch.manual_seed(0)
    model = build_model("vit_tiny_patch16_224", image_size=16, patch_size=8, in_chans=1, num_classes=10,
                        model_kwargs={"depth": 1, "embed_dim": 16, "num_heads": 2}, head_sizes=[3, 2])
    assert isinstance(model, MultiHeadViT)
    x = torch.randn(4, 1, 16, 16)
    features = model.backbone(x)
    all_heads = model(x)
    assert set(all_heads) == {0, 1} and all_heads[0].shape == (4, 3)
    assert torch.allclose(model(x, 1), model.heads[1](features))
    mixed = model(x, torch.tensor([0, 1, 1, 0]))
    assert mixed.shape == (4, 3)
    assert torch.allclose(mixed[0], model.heads[0](features[0:1])[0], atol=1e-6)
    assert torch.allclose(mixed[1, :2], model.heads[1](features[1:2])[0], atol=1e-6)
    assert mixed[1, 2] == float("-inf")
    # cross-entropy over a padded row sees only its own head
    loss = torch.nn.functional.cross_entropy(mixed, torch.tensor([2, 1, 0, 0]))
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with pytest.raises(ValueError, match="head_sizes"):
        MultiHeadViT(model.backbone, [])
