"""Model-ready image datasets: stored pixels in, normalised fixed-size tensors out.

Every loader in this package produces one of two datasets, both returning
``(image, label)`` with ``image`` a float32 tensor of shape (C, S, S), values
normalised to mean 0.5 / std 0.5 per channel, and ``label`` an int:

- :class:`TensorImages` for formats that arrive as one pixel array (digits, CIFAR);
- :class:`FileImages` for formats that arrive as one file per image (Tiny-ImageNet,
  ImageFolder), decoded lazily so large directories never sit in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from cl_streamkl.experiment.data.errors import DataError


def _resize_and_normalise(image: torch.Tensor, image_size: int) -> torch.Tensor:
    """(C, H, W) float in [0, 1] → (C, image_size, image_size) normalised to [-1, 1]."""
    if image.shape[-2:] != (image_size, image_size):
        image = F.interpolate(
            image.unsqueeze(0), size=(image_size, image_size), mode="bilinear",
            align_corners=False, antialias=image.shape[-1] > image_size,
        ).squeeze(0)
    return (image - 0.5) / 0.5


def resize_to_uint8(images: torch.Tensor, image_size: int) -> torch.Tensor:
    """Resize every image once, for a :class:`TensorImages` that then serves them as stored.

    Stored as uint8, a quarter of float32's memory (5,000 images at 128 px are 82 MB).

    Args:
        images: (N, C, H, W) float in [0, 1].
        image_size: side S of the result.

    Returns:
        (N, C, S, S) uint8 in [0, 255]; bilinear, antialiased when shrinking.
    """
    resized = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False,
                            antialias=image_size < images.shape[-1])
    return (resized.clamp_(0.0, 1.0) * 255.0).round_().to(torch.uint8)


class TensorImages(Dataset):
    """Images held in one uint8 or float array.

    Args:
        pixels: (N, C, H, W); uint8 in [0, 255] or floating point in [0, 1].
        targets: (N,) integer class labels.
        image_size: side length S of the square images returned.
    """

    def __init__(self, pixels: torch.Tensor, targets: Sequence[int], image_size: int) -> None:
        if pixels.ndim != 4:
            raise ValueError(f"pixels must be (N, C, H, W); got shape {tuple(pixels.shape)}")
        if len(targets) != len(pixels):
            raise ValueError(f"{len(pixels)} images but {len(targets)} targets")
        self.pixels = pixels
        self.targets = [int(t) for t in targets]
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.pixels[index]
        image = image.float() / 255.0 if image.dtype == torch.uint8 else image.float()
        return _resize_and_normalise(image, self.image_size), self.targets[index]


class FileImages(Dataset):
    """Images stored one per file (JPEG, PNG, ...), decoded on access.

    A file that cannot be decoded raises :class:`~cl_streamkl.experiment.data.errors.DataError`
    naming it.

    Args:
        paths: image file paths, one per sample.
        targets: integer class label per path.
        image_size: side length S of the square images returned.
        in_chans: 1 decodes as greyscale, 3 as RGB.
    """

    def __init__(
        self, paths: Sequence[Path], targets: Sequence[int], image_size: int, in_chans: int = 3
    ) -> None:
        if len(paths) != len(targets):
            raise ValueError(f"{len(paths)} paths but {len(targets)} targets")
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3; got {in_chans}")
        self.paths = [Path(p) for p in paths]
        self.targets = [int(t) for t in targets]
        self.image_size = image_size
        self.in_chans = in_chans

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        try:
            with Image.open(self.paths[index]) as img:
                array = np.asarray(img.convert("L" if self.in_chans == 1 else "RGB"), dtype=np.uint8)
        except (OSError, ValueError) as err:  # missing, unreadable, truncated or not an image
            raise DataError(f"cannot read image {self.paths[index]}: {err}; replace or remove it") from None
        image = torch.from_numpy(array.copy()).float() / 255.0
        image = image.unsqueeze(0) if image.ndim == 2 else image.permute(2, 0, 1)
        return _resize_and_normalise(image, self.image_size), self.targets[index]
