"""Split CIFAR-10 / CIFAR-100 from the standard python-pickle release."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from cl_streamkl.data.images import TensorImages
from cl_streamkl.data.stream import LabeledSplits

# (folder, train files, test files, label key, meta file, names key) per variant.
_LAYOUT = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"],
                "labels", "batches.meta", "label_names"),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "fine_labels", "meta", "fine_label_names"),
}


def _read_pickle(path: Path) -> dict:
    # The official CIFAR files are Python 2 pickles; latin1 decodes their byte strings.
    with open(path, "rb") as handle:
        return pickle.load(handle, encoding="latin1")


def _read_batches(folder: Path, files: list[str], label_key: str) -> tuple[torch.Tensor, np.ndarray]:
    pixels, labels = [], []
    for name in files:
        batch = _read_pickle(folder / name)
        pixels.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[label_key], dtype=np.int64))
    return torch.from_numpy(np.concatenate(pixels)), np.concatenate(labels)


def _find_folder(root: Path, folder_name: str) -> Path | None:
    for candidate in (root / folder_name, root):
        if candidate.name == folder_name and candidate.is_dir():
            return candidate
    return None


def load_cifar(
    variant: str, root: str | Path, *, image_size: int, download: bool = False
) -> LabeledSplits:
    """Read CIFAR-10 or CIFAR-100 (python version) from ``root``.

    ``root`` may be the folder that contains ``cifar-10-batches-py`` /
    ``cifar-100-python`` or that folder itself.

    Args:
        variant: ``"cifar10"`` or ``"cifar100"`` (fine labels).
        root: data root.
        image_size: side length of the returned RGB images (32 keeps the original size).
        download: fetch the archive with torchvision into ``root`` if it is missing.

    Returns:
        Splits of 3 × ``image_size``² images (train 50 000, test 10 000 for the full release).

    Raises:
        ValueError: unknown variant, or the files are missing and ``download`` is False.
    """
    if variant not in _LAYOUT:
        raise ValueError(f"variant must be one of {sorted(_LAYOUT)}; got {variant!r}")
    folder_name, train_files, test_files, label_key, meta_file, names_key = _LAYOUT[variant]
    root = Path(root).expanduser()
    folder = _find_folder(root, folder_name)
    if folder is None and download:
        from torchvision import datasets

        downloader = datasets.CIFAR10 if variant == "cifar10" else datasets.CIFAR100
        downloader(str(root), train=True, download=True)
        folder = _find_folder(root, folder_name)
    if folder is None:
        raise ValueError(
            f"{variant}: no {folder_name}/ folder under data root {str(root)!r}; "
            f"put the python-pickle release there or pass --download"
        )
    missing = [f for f in train_files + test_files if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"{variant}: {folder} lacks {missing}")
    train_pixels, train_labels = _read_batches(folder, train_files, label_key)
    test_pixels, test_labels = _read_batches(folder, test_files, label_key)
    num_classes = 10 if variant == "cifar10" else 100
    names = [str(i) for i in range(num_classes)]
    if (folder / meta_file).is_file():
        names = list(_read_pickle(folder / meta_file).get(names_key, names))
    return LabeledSplits(
        name=variant,
        train=TensorImages(train_pixels, train_labels, image_size),
        test=TensorImages(test_pixels, test_labels, image_size),
        num_classes=num_classes, in_chans=3, class_names=names,
    )
