"""Dataset loaders on tiny files written in each format, and the class-incremental splitter."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cl_streamkl.experiment.data import build_stream, load_splits


def _images_of(dataset) -> torch.Tensor:
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


def _labels_of(dataset) -> list[int]:
    return [int(dataset[i][1]) for i in range(len(dataset))]


# ---------------------------------------------------------------- digits and splitting


def test_digits_stream_split_is_class_incremental_and_seeded():
    splits = load_splits("digits", data_root=None, image_size=16)
    assert splits.in_chans == 1 and splits.num_classes == 10
    assert len(splits.train) + len(splits.test) == 1797
    stream = build_stream(splits, n_experiences=None, seed=3, val_fraction=0.1)
    assert stream.n_experiences == 3  # the default stream: 6 classes, then 2 and 2
    assert sorted(c for cs in stream.experience_classes for c in cs) == list(range(10))
    assert [len(classes) for classes in stream.experience_classes] == [6, 2, 2]
    for classes, train, val, test in zip(stream.experience_classes, stream.train, stream.val, stream.test):
        for ds in (train, val, test):
            assert set(ds.targets) == set(classes)
            assert tuple(ds[0][0].shape) == (1, 16, 16)
        # about 10 % of each class held out for validation, none shared with training
        assert 0.07 < len(val) / (len(val) + len(train)) < 0.13
    x = _images_of(stream.train[0])
    assert x.min() >= -1.0 and x.max() <= 1.0 and x.std() > 0.1
    same = build_stream(splits, n_experiences=5, seed=3, val_fraction=0.1)
    other = build_stream(splits, n_experiences=5, seed=4, val_fraction=0.1)
    assert same.class_order == stream.class_order != other.class_order
    # the validation split is fixed across run seeds (split_seed), only the order moves
    val_a = sorted(map(tuple, _images_of(torch.utils.data.ConcatDataset(stream.val)).flatten(1)[:, :8].tolist()))
    val_b = sorted(map(tuple, _images_of(torch.utils.data.ConcatDataset(other.val)).flatten(1)[:, :8].tolist()))
    assert val_a == val_b


def test_val_and_train_are_disjoint():
    splits = load_splits("digits", data_root=None, image_size=8)
    stream = build_stream(splits, n_experiences=2, seed=0, val_fraction=0.2)
    train = {tuple(r) for r in _images_of(stream.train[0]).flatten(1).tolist()}
    val = {tuple(r) for r in _images_of(stream.val[0]).flatten(1).tolist()}
    # sklearn digits contains a few exact duplicates; almost all validation images are unseen
    assert len(val - train) >= 0.95 * len(val)


def test_split_errors():
    splits = load_splits("digits", data_root=None, image_size=8)
    with pytest.raises(ValueError, match="^n_experiences must divide the 10 classes"):  # the argument's name
        build_stream(splits, n_experiences=3, seed=0, val_fraction=0.1)
    with pytest.raises(ValueError, match="val_fraction"):
        build_stream(splits, n_experiences=5, seed=0, val_fraction=1.0)
    stream = build_stream(splits, n_experiences=5, seed=0, val_fraction=0.0)
    with pytest.raises(ValueError, match="val_fraction > 0"):
        stream.eval_datasets("val")


def test_unknown_dataset_and_missing_root(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        load_splits("mnist", data_root=None, image_size=8)
    with pytest.raises(ValueError, match="needs --data-root"):
        load_splits("cifar10", data_root=None, image_size=32)
    with pytest.raises(ValueError, match="does not exist"):
        load_splits("cifar10", data_root=tmp_path / "nope", image_size=32)
    with pytest.raises(ValueError, match="--download"):
        load_splits("cifar100", data_root=tmp_path, image_size=32)
    with pytest.raises(ValueError, match="--download"):
        load_splits("tiny-imagenet", data_root=tmp_path, image_size=64)


# ---------------------------------------------------------------- CIFAR python pickles


def _write_pickle(path: Path, obj: dict) -> None:
    with open(path, "wb") as handle:
        pickle.dump(obj, handle, protocol=2)


def _cifar_batch(rng: np.random.Generator, labels: list[int], label_key: str) -> dict:
    data = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
    return {"data": data, label_key: labels, "batch_label": "tiny"}


def _trust_files(monkeypatch, dataset_class, folder: Path) -> None:
    """Make the files just written count as the official release: the checksum table becomes theirs."""
    def md5(name: str) -> str:
        return hashlib.md5((folder / name).read_bytes()).hexdigest()

    monkeypatch.setattr(dataset_class, "train_list", [[n, md5(n)] for n, _ in dataset_class.train_list])
    monkeypatch.setattr(dataset_class, "test_list", [[n, md5(n)] for n, _ in dataset_class.test_list])
    monkeypatch.setattr(dataset_class, "meta", {**dataset_class.meta, "md5": md5(dataset_class.meta["filename"])})


def _write_cifar10(folder: Path) -> tuple[list[dict], list[int]]:
    rng = np.random.default_rng(0)
    folder.mkdir()
    batches = []
    for i in range(1, 6):
        batch = _cifar_batch(rng, [(4 * (i - 1) + k) % 10 for k in range(4)], "labels")
        batches.append(batch)
        _write_pickle(folder / f"data_batch_{i}", batch)
    test_labels = list(range(10)) * 2
    _write_pickle(folder / "test_batch", _cifar_batch(rng, test_labels, "labels"))
    _write_pickle(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})
    return batches, test_labels


class _WritesAFile:
    """Unpickling this runs code: it writes ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "code ran"))


def test_cifar_files_that_differ_from_the_release_are_never_unpickled(tmp_path, monkeypatch):
    from torchvision import datasets

    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar10(folder)
    _trust_files(monkeypatch, datasets.CIFAR10, folder)
    marker = tmp_path / "pwned"
    _write_pickle(folder / "data_batch_1", {"data": _WritesAFile(marker), "labels": [0]})
    with pytest.raises(ValueError, match=r"data_batch_1 is not the official release's file"):
        load_splits("cifar10", data_root=tmp_path, image_size=32)
    assert not marker.exists()
    # Without the test's trusted table, even well-formed files are refused before unpickling.
    monkeypatch.undo()
    with pytest.raises(ValueError, match="MD5 mismatch"):
        load_splits("cifar10", data_root=tmp_path, image_size=32)
    assert not marker.exists()


def test_cifar10_pickles(tmp_path, monkeypatch):
    from torchvision import datasets

    folder = tmp_path / "cifar-10-batches-py"
    batches, test_labels = _write_cifar10(folder)
    _trust_files(monkeypatch, datasets.CIFAR10, folder)

    splits = load_splits("cifar10", data_root=tmp_path, image_size=32)
    assert splits.in_chans == 3 and splits.num_classes == 10
    assert splits.class_names[3] == "c3"
    assert len(splits.train) == 20 and len(splits.test) == 20
    image, label = splits.train[5]
    expected = torch.from_numpy(batches[1]["data"][1].reshape(3, 32, 32)).float() / 255 * 2 - 1
    assert label == batches[1]["labels"][1]
    torch.testing.assert_close(image, expected)
    assert _labels_of(splits.test) == test_labels
    # the folder itself works as --data-root too, and resizing gives the requested size
    resized = load_splits("cifar10", data_root=folder, image_size=16)
    assert tuple(resized.train[0][0].shape) == (3, 16, 16)
    stream = build_stream(splits, n_experiences=5, seed=0, val_fraction=0.0)
    assert sum(len(d) for d in stream.train) == 20 and sum(len(d) for d in stream.test) == 20


def test_cifar100_pickles_use_fine_labels(tmp_path, monkeypatch):
    from torchvision import datasets

    rng = np.random.default_rng(1)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    fine = list(range(100)) * 2
    train = _cifar_batch(rng, fine, "fine_labels")
    train["coarse_labels"] = [f % 20 for f in fine]
    _write_pickle(folder / "train", train)
    _write_pickle(folder / "test", {**_cifar_batch(rng, list(range(100)), "fine_labels"),
                                    "coarse_labels": [0] * 100})
    _write_pickle(folder / "meta", {"fine_label_names": [f"f{i}" for i in range(100)]})
    _trust_files(monkeypatch, datasets.CIFAR100, folder)
    splits = load_splits("cifar100", data_root=tmp_path, image_size=32)
    assert splits.num_classes == 100 and len(splits.train) == 200
    assert _labels_of(splits.train)[:5] == [0, 1, 2, 3, 4]
    assert splits.class_names[99] == "f99"
    stream = build_stream(splits, n_experiences=None, seed=0, val_fraction=0.5)
    assert stream.n_experiences == 10 and all(len(d) == 10 for d in stream.train)


def test_cifar_missing_batch_is_reported(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    _write_pickle(folder / "test_batch", _cifar_batch(np.random.default_rng(0), [0], "labels"))
    with pytest.raises(ValueError, match="data_batch_1"):
        load_splits("cifar10", data_root=tmp_path, image_size=32)


# ---------------------------------------------------------------- image files


def _write_image(path: Path, value: int, size: int = 12, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    color = (value, 255 - value, 0) if mode == "RGB" else value
    Image.new(mode, (size, size), color).save(path)


def test_tiny_imagenet_layout(tmp_path):
    root = tmp_path / "tiny-imagenet-200"
    wnids = ["n01", "n02", "n03", "n04"]
    (root).mkdir()
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (root / "words.txt").write_text("n01\tgoldfish\nn02\tsalamander\nn99\tunused\n")
    for c, wnid in enumerate(wnids):
        for k in range(3):
            _write_image(root / "train" / wnid / "images" / f"{wnid}_{k}.JPEG", 40 * c)
    lines = []
    for k, wnid in enumerate(wnids[::-1] * 2):
        name = f"val_{k}.JPEG"
        _write_image(root / "val" / "images" / name, 40 * wnids.index(wnid))
        lines.append(f"{name}\t{wnid}\t0\t0\t11\t11")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")

    splits = load_splits("tiny-imagenet", data_root=tmp_path, image_size=16)
    assert splits.num_classes == 4 and splits.in_chans == 3
    assert splits.class_names[:3] == ["goldfish", "salamander", "n03"]
    assert len(splits.train) == 12 and len(splits.test) == 8
    assert _labels_of(splits.test) == [3, 2, 1, 0, 3, 2, 1, 0]
    image, label = splits.test[1]
    assert tuple(image.shape) == (3, 16, 16) and label == 2
    # JPEG is lossy: the red channel holds 80/255 up to compression error
    assert abs(float(image[0].mean()) - (80 / 255 * 2 - 1)) < 0.05
    stream = build_stream(splits, n_experiences=2, seed=0, val_fraction=0.0)
    assert [len(d) for d in stream.train] == [6, 6]


def test_tiny_imagenet_bad_annotation(tmp_path):
    root = tmp_path / "tiny-imagenet-200"
    (root / "train" / "n01" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("n01\n")
    (root / "val").mkdir()
    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn77\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match="unknown class"):
        load_splits("tiny-imagenet", data_root=root, image_size=16)


@pytest.mark.parametrize("name", ["../../outside.png", "/tmp/outside.png", "..", "sub/../../x.png"])
def test_tiny_imagenet_annotations_stay_inside_val_images(tmp_path, name):
    root = tmp_path / "data" / "tiny-imagenet-200"
    _write_image(root / "train" / "n01" / "images" / "a.JPEG", 10)
    _write_image(tmp_path / "outside.png", 10)
    (root / "wnids.txt").write_text("n01\n")
    (root / "val" / "images").mkdir(parents=True)
    (root / "val" / "val_annotations.txt").write_text(f"{name}\tn01\t0\t0\t1\t1\n")
    with pytest.raises(ValueError, match=r"val_annotations.txt:1: .* is not a file name inside"):
        load_splits("tiny-imagenet", data_root=root, image_size=16)


def test_tiny_imagenet_download_is_https_and_checksummed(tmp_path, monkeypatch):
    from torchvision.datasets import utils

    calls = []
    monkeypatch.setattr(utils, "download_and_extract_archive", lambda url, **kwargs: calls.append((url, kwargs)))
    with pytest.raises(ValueError, match="--download"):
        load_splits("tiny-imagenet", data_root=tmp_path, image_size=64, download=True)
    (url, kwargs), = calls
    assert url == "https://cs231n.stanford.edu/tiny-imagenet-200.zip"
    assert kwargs["md5"] == "90528d7ca1a48142e341f4ef8d21d0de"


def test_image_folder_with_train_and_test(tmp_path):
    for split, n in (("train", 3), ("test", 2)):
        for c, name in enumerate(["cat", "dog"]):
            for k in range(n):
                _write_image(tmp_path / split / name / f"{k}.png", 100 * c, mode="L")
    splits = load_splits("imagefolder", data_root=tmp_path, image_size=8, in_chans=1)
    assert splits.class_names == ["cat", "dog"] and splits.in_chans == 1
    assert len(splits.train) == 6 and len(splits.test) == 4
    image, label = splits.test[3]
    assert tuple(image.shape) == (1, 8, 8) and label == 1
    torch.testing.assert_close(image, torch.full((1, 8, 8), 100 / 255 * 2 - 1))


def test_image_folder_single_level_holds_out_test(tmp_path):
    for c, name in enumerate(["a", "b", "c", "d"]):
        for k in range(5):
            _write_image(tmp_path / name / f"{k}.jpg", 60 * c)
    splits = load_splits("imagefolder", data_root=tmp_path, image_size=8)
    assert len(splits.train) == 16 and len(splits.test) == 4
    assert sorted(_labels_of(splits.test)) == [0, 1, 2, 3]
    stream = build_stream(splits, n_experiences=2, seed=1, val_fraction=0.25)
    assert [len(d) for d in stream.val] == [2, 2]


@pytest.mark.parametrize("per_class, message", [
    ([1, 1, 1], "images found: 'c0' (1), 'c1' (1), 'c2' (1);"),
    ([5, 1, 0, 1, 1, 1], "images found: 'c1' (1), 'c2' (0), 'c3' (1) and 2 more;"),
])
def test_image_folder_with_too_few_images_per_class_says_why(tmp_path, per_class, message):
    for c, count in enumerate(per_class):
        (tmp_path / f"c{c}").mkdir()
        for k in range(count):
            _write_image(tmp_path / f"c{c}" / f"{k}.png", 40 * c)
    with pytest.raises(ValueError, match="need at least 2 images each") as error:
        load_splits("imagefolder", data_root=tmp_path, image_size=8)
    assert message in str(error.value) and "no images found" not in str(error.value)


def test_image_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory|does not exist"):
        load_splits("imagefolder", data_root=tmp_path / "missing", image_size=8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="imagefolder"):
        load_splits("imagefolder", data_root=tmp_path / "empty", image_size=8)
    with pytest.raises(ValueError, match="cannot be downloaded"):
        load_splits("imagefolder", data_root=tmp_path, image_size=8, download=True)


@pytest.mark.parametrize("layout", ["single", "train_test"])
def test_image_folder_with_one_class_folder_is_refused(tmp_path, layout):
    # One class gives no stream to learn continually: chance is 100 % and the run meant nothing.
    folders = [tmp_path / "only"] if layout == "single" else [tmp_path / "train" / "only", tmp_path / "test" / "only"]
    for folder in folders:
        for k in range(3):
            _write_image(folder / f"{k}.png", 10 * k)
    with pytest.raises(ValueError, match="holds one class folder \\('only'\\) and a stream needs 2 classes at least"):
        load_splits("imagefolder", data_root=tmp_path, image_size=8)
