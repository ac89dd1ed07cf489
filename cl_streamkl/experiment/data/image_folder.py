"""Any ImageFolder-style directory (one sub-folder per class), split class-incrementally.

Two layouts are accepted:

- ``root/train/<class>/*`` and ``root/test/<class>/*`` (``val/`` is accepted in place
  of ``test/``): the given split is used as test set;
- ``root/<class>/*``: a stratified, seeded fraction of each class becomes the test set.

Classes are the sorted sub-folder names, as in ``torchvision.datasets.ImageFolder``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from cl_streamkl.experiment.data.errors import DataError
from cl_streamkl.experiment.data.images import FileImages
from cl_streamkl.experiment.data.stream import LabeledSplits

TEST_FRACTION = 0.2


def _samples(folder: Path, class_to_idx: dict[str, int]) -> tuple[list[str], list[int]]:
    """Every image file under ``folder``'s class folders, with its class; a dangling link is refused."""
    pairs = make_dataset(str(folder), class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    missing = [p for p, _ in pairs if not os.path.isfile(p)]  # a link whose target is gone
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DataError(f"imagefolder: {missing[0]}{more} is a link to a missing file; replace or remove it")
    return [p for p, _ in pairs], [t for _, t in pairs]


def _refuse_classes_too_small(root: Path, classes: list[str], counts: np.ndarray) -> None:
    """In the single-folder layout every class gives a test image and keeps a training one: 2 images at least."""
    small = [f"{name!r} ({count})" for name, count in zip(classes, counts.tolist()) if count < 2]
    if small:
        more = f" and {len(small) - 3} more" if len(small) > 3 else ""
        raise ValueError(
            f"imagefolder: class folders under {str(root)!r} need at least 2 images each, one or more held out "
            f"for testing ({TEST_FRACTION:.0%} of each class) and the rest for training; images found: "
            f"{', '.join(small[:3])}{more}; add images, or give train/ and test/ folders of class folders")


def _refuse_one_class(root: Path, classes: list[str]) -> None:
    """A stream shares classes out over experiences and its accuracy is only meaningful over 2 or more."""
    if len(classes) == 1:
        raise ValueError(f"imagefolder: {str(root)!r} holds one class folder ({classes[0]!r}) and a stream needs "
                         "2 classes at least; point the data root at the folder that holds one folder per class")


def load_image_folder(
    root: str | Path, *, image_size: int, in_chans: int = 3, split_seed: int = 0
) -> LabeledSplits:
    """Read an ImageFolder-style directory (see the module docstring for the layouts).

    Args:
        root: the directory.
        image_size: side length of the returned square images.
        in_chans: 3 decodes RGB, 1 greyscale.
        split_seed: seeds the train/test split of the single-folder layout.

    Returns:
        Splits whose labels index the sorted class folder names; images load lazily.

    Raises:
        ValueError: ``root`` is not a directory, has no class folders, one only, or no images, a class
            of the single-folder layout has fewer than 2 images (one is held out for testing),
            or the train and test folders name different classes;
            :class:`~cl_streamkl.experiment.data.errors.DataError` (a ValueError) for a
            link to a missing file.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise ValueError(f"imagefolder: data root {str(root)!r} is not a directory")
    test_dir = next((root / n for n in ("test", "val") if (root / n).is_dir()), None)
    if (root / "train").is_dir() and test_dir is not None:
        classes, class_to_idx = find_classes(str(root / "train"))
        _refuse_one_class(root / "train", classes)
        test_classes, _ = find_classes(str(test_dir))
        if test_classes != classes:
            raise ValueError(
                f"imagefolder: {root / 'train'} and {test_dir} hold different class folders"
            )
        train_paths, train_targets = _samples(root / "train", class_to_idx)
        test_paths, test_targets = _samples(test_dir, class_to_idx)
    else:
        try:
            classes, class_to_idx = find_classes(str(root))
        except FileNotFoundError as err:
            raise ValueError(f"imagefolder: {err}") from err
        _refuse_one_class(root, classes)
        paths, targets = _samples(root, class_to_idx)
        targets_arr = np.asarray(targets, dtype=np.int64)
        if paths:
            _refuse_classes_too_small(root, classes, np.bincount(targets_arr, minlength=len(classes)))
        rng = np.random.default_rng(split_seed)
        is_test = np.zeros(len(paths), dtype=bool)
        for cls in range(len(classes)):
            idx = rng.permutation(np.flatnonzero(targets_arr == cls))
            is_test[idx[: max(1, int(round(TEST_FRACTION * len(idx))))] if len(idx) > 1 else []] = True
        train_paths = [p for p, t in zip(paths, is_test) if not t]
        train_targets = [y for y, t in zip(targets, is_test) if not t]
        test_paths = [p for p, t in zip(paths, is_test) if t]
        test_targets = [y for y, t in zip(targets, is_test) if t]
    for split, split_paths in (("training", train_paths), ("test", test_paths)):
        if not split_paths:
            raise ValueError(f"imagefolder: no {split} images found under {str(root)!r} (image files: "
                             f"{', '.join(IMG_EXTENSIONS)})")
    return LabeledSplits(
        name="imagefolder",
        train=FileImages(train_paths, train_targets, image_size, in_chans=in_chans),
        test=FileImages(test_paths, test_targets, image_size, in_chans=in_chans),
        num_classes=len(classes), in_chans=in_chans, class_names=list(classes),
    )
