"""Split CIFAR-10 / CIFAR-100 from the standard python-pickle release, checksums verified first.

The release stores its batches as Python pickles, and unpickling runs whatever code a
file names. So every file is compared with the official release's MD5 checksum (the
table torchvision's ``CIFAR10`` / ``CIFAR100`` carry) before anything is unpickled, and
torchvision's readers, which check the same table, load them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from cl_streamkl.experiment.data.images import TensorImages
from cl_streamkl.experiment.data.stream import LabeledSplits

VARIANTS = ("cifar10", "cifar100")


def _dataset_class(variant: str) -> type:
    from torchvision import datasets

    return datasets.CIFAR10 if variant == "cifar10" else datasets.CIFAR100


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _expected_checksums(dataset_class: type) -> dict[str, str]:
    """File name → MD5 of every file of the official release (train, test and meta)."""
    files = {name: md5 for name, md5 in [*dataset_class.train_list, *dataset_class.test_list]}
    files[dataset_class.meta["filename"]] = dataset_class.meta["md5"]
    return files


def verify_release(variant: str, folder: Path) -> None:
    """Check that ``folder`` holds the official files of ``variant``, byte for byte.

    Raises:
        ValueError: a file is missing or its MD5 differs from the official release's
            (the message names the file; nothing has been unpickled).
    """
    dataset_class = _dataset_class(variant)
    expected = _expected_checksums(dataset_class)
    missing = [name for name in expected if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{variant}: {folder} lacks {missing}")
    for name, md5 in expected.items():
        if _md5(folder / name) != md5:
            raise ValueError(
                f"{variant}: {folder / name} is not the official release's file (MD5 mismatch), so it is not "
                f"unpickled (a pickle can run code); replace it with the file from {dataset_class.url} "
                f"or pass --download with an empty --data-root"
            )


def _find_folder(root: Path, folder_name: str) -> Path | None:
    for candidate in (root / folder_name, root):
        if candidate.name == folder_name and candidate.is_dir():
            return candidate
    return None


def _read_split(dataset_class: type, folder: Path, train: bool) -> tuple[torch.Tensor, np.ndarray, list[str]]:
    dataset = dataset_class(str(folder.parent), train=train)
    # torchvision keeps (N, H, W, C) uint8; the loaders here hand out (N, C, H, W).
    pixels = torch.from_numpy(np.ascontiguousarray(dataset.data.transpose(0, 3, 1, 2)))
    return pixels, np.asarray(dataset.targets, dtype=np.int64), list(dataset.classes)


def load_cifar(
    variant: str, root: str | Path, *, image_size: int, download: bool = False
) -> LabeledSplits:
    """Read CIFAR-10 or CIFAR-100 (python version) from ``root``.

    ``root`` may be the folder that contains ``cifar-10-batches-py`` /
    ``cifar-100-python`` or that folder itself. Every file is checked against the
    official MD5 checksums before it is read.

    Args:
        variant: ``"cifar10"`` or ``"cifar100"`` (fine labels).
        root: data root.
        image_size: side length of the returned RGB images (32 keeps the original size).
        download: fetch the archive with torchvision into ``root`` if it is missing
            (torchvision verifies the archive's checksum).

    Returns:
        Splits of 3 × ``image_size``² images (train 50 000, test 10 000).

    Raises:
        ValueError: unknown variant; the files are missing and ``download`` is False;
            or a file differs from the official release.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}; got {variant!r}")
    dataset_class = _dataset_class(variant)
    folder_name = dataset_class.base_folder
    root = Path(root).expanduser()
    folder = _find_folder(root, folder_name)
    if folder is None and download:
        dataset_class(str(root), train=True, download=True)
        folder = _find_folder(root, folder_name)
    if folder is None:
        raise ValueError(
            f"{variant}: no {folder_name}/ folder under data root {str(root)!r}; "
            f"put the python-pickle release there or pass --download"
        )
    verify_release(variant, folder)
    train_pixels, train_labels, names = _read_split(dataset_class, folder, train=True)
    test_pixels, test_labels, _ = _read_split(dataset_class, folder, train=False)
    return LabeledSplits(
        name=variant,
        train=TensorImages(train_pixels, train_labels, image_size),
        test=TensorImages(test_pixels, test_labels, image_size),
        num_classes=10 if variant == "cifar10" else 100, in_chans=3, class_names=names,
    )
