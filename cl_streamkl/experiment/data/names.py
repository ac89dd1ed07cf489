"""Dataset and scenario names the command line accepts, and each dataset's defaults.

Importing this module is cheap (no torch, Avalanche or loaders): the command line builds
its help from it.
"""

from __future__ import annotations

from dataclasses import dataclass

EVAL_SPLITS = ("test", "val")
SCENARIOS = ("class", "task", "domain")
DOMAIN_SHIFTS = ("rotate", "permute")


@dataclass(frozen=True)
class DatasetInfo:
    """Defaults of one dataset: experiences, native image side, whether it reads --data-root.

    ``first_experience_classes``, where set, is the first experience's share of the classes in
    the class and task scenarios when neither that nor the number of experiences is given.
    """

    n_experiences: int
    native_size: int | None
    needs_root: bool
    first_experience_classes: int | None = None


DATASETS: dict[str, DatasetInfo] = {
    # 6 classes, then 2 and 2: the first experience is large enough that forgetting it shows.
    "digits": DatasetInfo(n_experiences=3, native_size=8, needs_root=False, first_experience_classes=6),
    "mnist5k": DatasetInfo(n_experiences=5, native_size=28, needs_root=False),
    "cifar10": DatasetInfo(n_experiences=5, native_size=32, needs_root=True),
    "cifar100": DatasetInfo(n_experiences=10, native_size=32, needs_root=True),
    "tiny-imagenet": DatasetInfo(n_experiences=10, native_size=64, needs_root=True),
    "imagefolder": DatasetInfo(n_experiences=5, native_size=None, needs_root=True),
    # The side is the canvas's (ClutterOptions.canvas); --data-root, if given, holds the generated cache.
    "cluttered-mnist": DatasetInfo(n_experiences=5, native_size=None, needs_root=False),
}

# The side of an MNIST digit, which cluttered-mnist places at native scale.
MNIST_SIDE = 28
# cluttered-mnist holds all 5,000 canvases in memory as it makes them: 5 GiB of pixels at
# 1024 px a side, and a 256 × 256 grid of 4-px patches, the most tokens a run takes.
MAX_CANVAS = 1024
# Pieces are pasted one by one (5,000 canvases × 1024 pieces is 5 M pastes, seconds);
# a 128-px canvas is covered by 256 pieces of 8 px.
MAX_CLUTTER = 1024


@dataclass(frozen=True)
class ClutterOptions:
    """What cluttered-mnist generates: each digit on a ``canvas``-px square among ``clutter`` pieces.

    Every piece is a ``clutter_size``-px square cut from another digit. Made only with valid
    values, so a run is refused before anything is generated or written.

    Attributes:
        canvas: side of the square canvas in pixels, from the digit's 28 to :data:`MAX_CANVAS`.
        clutter: pieces of other digits scattered on each canvas (0 for translation only), at
            most :data:`MAX_CLUTTER`.
        clutter_size: side of each piece in pixels, 1 to 28 (a piece is cut from a 28-px
            digit, so it fits on the canvas too).

    Raises:
        ValueError: one line naming the first argument out of range.
    """

    canvas: int = 128
    clutter: int = 4
    clutter_size: int = 8

    def __post_init__(self) -> None:
        for name in ("canvas", "clutter", "clutter_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer; got {value!r}")
        if not MNIST_SIDE <= self.canvas <= MAX_CANVAS:
            raise ValueError(f"canvas must be {MNIST_SIDE} to {MAX_CANVAS} px (a whole digit fits on it, and every "
                             f"canvas is held in memory); got {self.canvas}")
        if not 0 <= self.clutter <= MAX_CLUTTER:
            raise ValueError(f"clutter must be 0 to {MAX_CLUTTER} pieces; got {self.clutter}")
        # A piece is cut from a 28-px digit, so it also fits on any canvas allowed above.
        if not 1 <= self.clutter_size <= MNIST_SIDE:
            raise ValueError(f"clutter_size must be 1 to {MNIST_SIDE} px (a piece is cut from a {MNIST_SIDE}-px "
                             f"digit); got {self.clutter_size}")
