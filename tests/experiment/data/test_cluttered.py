"""Cluttered MNIST: placement, determinism, labels, the cache and its checks, refused options."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from cl_streamkl.experiment.data import load_splits
from cl_streamkl.experiment.data import cluttered
from cl_streamkl.experiment.data.bundled import mnist5k_arrays, stratified_split
from cl_streamkl.experiment.data.names import MNIST_SIDE, ClutterOptions

SMALL = ClutterOptions(canvas=32, clutter=2, clutter_size=8)


def constant_digits(n: int) -> np.ndarray:
    """(n, 28, 28) digits, digit i filled with the value i + 1, so every pixel names its source."""
    return np.broadcast_to(np.arange(1, n + 1, dtype=np.uint8)[:, None, None], (n, MNIST_SIDE, MNIST_SIDE)).copy()


def bounding_box(mask: np.ndarray) -> tuple[int, int, int, int]:
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    return rows[0], rows[-1] + 1, cols[0], cols[-1] + 1


@pytest.fixture(scope="module")
def small_arrays(tmp_path_factory) -> tuple[dict[str, np.ndarray], object]:
    cache_dir = tmp_path_factory.mktemp("cache")
    return cluttered.load_arrays(SMALL, 0, cache_dir), cache_dir


def test_digits_land_whole_inside_the_canvas():
    digits = constant_digits(40)
    canvases = cluttered.clutter_canvases(digits, ClutterOptions(canvas=50, clutter=0), np.random.default_rng(0))
    assert canvases.shape == (40, 50, 50) and canvases.dtype == np.uint8
    corners = set()
    for value, canvas in enumerate(canvases, start=1):
        top, bottom, left, right = bounding_box(canvas > 0)
        assert (bottom - top, right - left) == (MNIST_SIDE, MNIST_SIDE)
        assert (canvas == value).sum() == MNIST_SIDE**2 and (canvas > 0).sum() == MNIST_SIDE**2
        corners.add((top, left))
    assert len(corners) > 30  # positions vary over the canvas


def test_clutter_is_cut_from_other_digits():
    digits = constant_digits(60)
    options = ClutterOptions(canvas=64, clutter=6, clutter_size=5)
    canvases = cluttered.clutter_canvases(digits, options, np.random.default_rng(1))
    pieces_seen = 0
    for value, canvas in enumerate(canvases, start=1):
        # Only the digit's own block holds its value: no piece was cut from it.
        top, bottom, left, right = bounding_box(canvas == value)
        assert bottom - top <= MNIST_SIDE and right - left <= MNIST_SIDE
        others = set(np.unique(canvas).tolist()) - {0, value}
        assert others <= set(range(1, 61))
        pieces_seen += len(others)
    assert pieces_seen > 60 * 4  # most of the six pieces per canvas are visible


def test_generation_is_deterministic_and_keeps_labels(small_arrays):
    arrays, _ = small_arrays
    again = cluttered.generate(SMALL, 0)
    for name, array in arrays.items():
        assert array.tobytes() == again[name].tobytes(), name
    more = cluttered.generate(ClutterOptions(canvas=32, clutter=3, clutter_size=8), 0)
    bigger_pieces = cluttered.generate(ClutterOptions(canvas=32, clutter=2, clutter_size=9), 0)
    assert more["train_pixels"].tobytes() != arrays["train_pixels"].tobytes()
    assert bigger_pieces["train_pixels"].tobytes() != arrays["train_pixels"].tobytes()
    assert cluttered.generate(SMALL, 1)["train_targets"].tobytes() != arrays["train_targets"].tobytes()
    digits, targets = mnist5k_arrays()
    train, test = stratified_split(targets, 0)
    assert np.array_equal(arrays["train_targets"], targets[train])
    assert np.array_equal(arrays["test_targets"], targets[test])
    assert arrays["train_pixels"].shape == (4000, 32, 32) and arrays["test_pixels"].shape == (1000, 32, 32)


def test_without_clutter_each_canvas_holds_its_own_digit_unchanged():
    arrays = cluttered.generate(ClutterOptions(canvas=40, clutter=0), 0)
    digits, targets = mnist5k_arrays()
    _, test = stratified_split(targets, 0)
    for canvas, digit in zip(arrays["test_pixels"][:50], digits[test][:50]):
        top, bottom, left, right = bounding_box(canvas > 0)
        d_top, d_bottom, d_left, d_right = bounding_box(digit > 0)
        assert np.array_equal(canvas[top:bottom, left:right], digit[d_top:d_bottom, d_left:d_right])


def test_second_load_reads_the_cache(small_arrays, monkeypatch):
    arrays, cache_dir = small_arrays

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again although the cache holds these canvases")

    monkeypatch.setattr(cluttered, "generate", no_generation)
    again = cluttered.load_arrays(SMALL, 0, cache_dir)
    assert all(np.array_equal(arrays[name], again[name]) for name in arrays)
    splits = load_splits("cluttered-mnist", data_root=cache_dir, image_size=32, clutter=SMALL)
    assert (len(splits.train), len(splits.test), splits.num_classes, splits.in_chans) == (4000, 1000, 10, 1)
    image, label = splits.train[0]
    assert image.shape == (1, 32, 32) and label == arrays["train_targets"][0]
    shrunk = load_splits("cluttered-mnist", data_root=cache_dir, image_size=16, clutter=SMALL)
    assert shrunk.test[3][0].shape == (1, 16, 16) and shrunk.test.targets == splits.test.targets


def test_cache_file_is_made_under_the_umask_not_private(tmp_path):
    options = ClutterOptions(canvas=28, clutter=0)
    previous = os.umask(0o022)
    try:
        cluttered.load_arrays(options, 0, tmp_path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(cluttered.cache_file(tmp_path, options, 0).stat().st_mode) == 0o644
    assert [path.name for path in tmp_path.iterdir()] == [cluttered.cache_file(tmp_path, options, 0).name]


def test_damaged_cache_is_refused(small_arrays, tmp_path):
    arrays, _ = small_arrays
    path = cluttered.cache_file(tmp_path, SMALL, 0)
    path.write_bytes(b"not an npz file")
    with pytest.raises(ValueError, match="is unreadable or damaged.*delete it"):
        cluttered.load_arrays(SMALL, 0, tmp_path)
    altered = dict(arrays, train_pixels=arrays["train_pixels"].copy())
    altered["train_pixels"][0, 0, 0] ^= 1
    np.savez_compressed(path, sha256=np.array(cluttered.arrays_digest(arrays)), **altered)
    with pytest.raises(ValueError, match="does not match its stored SHA-256"):
        cluttered.load_arrays(SMALL, 0, tmp_path)


@pytest.mark.parametrize("kwargs, argument", [
    ({"canvas": 27}, "canvas"),
    ({"canvas": 1025}, "canvas"),
    ({"clutter": -1}, "clutter"),
    ({"clutter": 1025}, "clutter"),
    ({"canvas": 32, "clutter_size": 33}, "clutter_size"),
    ({"clutter_size": 0}, "clutter_size"),
    ({"canvas": 64.0}, "canvas"),
])
def test_bad_options_are_refused_in_one_line(kwargs, argument):
    with pytest.raises(ValueError, match=f"^{argument} must") as error:
        ClutterOptions(**kwargs)
    assert "\n" not in str(error.value)


def test_clutter_options_belong_to_cluttered_mnist():
    with pytest.raises(ValueError, match="cluttered-mnist"):
        load_splits("mnist5k", data_root=None, image_size=28, clutter=SMALL)
