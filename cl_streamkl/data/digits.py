"""Split-Digits source: scikit-learn's bundled 8×8 handwritten digits (offline, 1797 images)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits as _sklearn_load_digits
from sklearn.model_selection import train_test_split

from cl_streamkl.data.images import TensorImages
from cl_streamkl.data.stream import LabeledSplits

TEST_FRACTION = 0.2


def load_digits(*, image_size: int, split_seed: int = 0) -> LabeledSplits:
    """Load sklearn's digits and hold out a stratified test set.

    The dataset ships with scikit-learn, so nothing is read from disk or fetched.
    Pixels (0..16) are scaled to [0, 1] and upsampled to ``image_size``.

    Args:
        image_size: side length of the returned square greyscale images.
        split_seed: seeds the stratified 80/20 train/test split.

    Returns:
        Splits of 1 channel × ``image_size``² images over 10 classes.
    """
    bunch = _sklearn_load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    targets = bunch.target.astype(np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(len(targets)), test_size=TEST_FRACTION, stratify=targets, random_state=split_seed
    )
    # Resizing the whole set once (a few MB even at 32×32) keeps __getitem__ to a normalise.
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                           align_corners=False).clamp_(0.0, 1.0)
    train = TensorImages(images[train_idx], targets[train_idx], image_size)
    test = TensorImages(images[test_idx], targets[test_idx], image_size)
    return LabeledSplits(
        name="digits", train=train, test=test, num_classes=10, in_chans=1,
        class_names=[str(d) for d in range(10)],
    )
