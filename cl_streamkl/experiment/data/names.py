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
    """Defaults of one dataset: experiences, native image side, whether it reads --data-root."""

    n_experiences: int
    native_size: int | None
    needs_root: bool


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(n_experiences=5, native_size=8, needs_root=False),
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


@dataclass(frozen=True)
class ClutterOptions:
    """What cluttered-mnist generates: each digit on a ``canvas``-px square among ``clutter`` pieces.

    Every piece is a ``clutter_size``-px square cut from another digit. Made only with valid
    values, so a run is refused before anything is generated or written.

    Attributes:
        canvas: side of the square canvas in pixels, at least the digit's 28.
        clutter: pieces of other digits scattered on each canvas (0 for translation only).
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
        if self.canvas < MNIST_SIDE:
            raise ValueError(f"canvas must be at least {MNIST_SIDE} px (a whole digit fits on it); got {self.canvas}")
        if self.clutter < 0:
            raise ValueError(f"clutter must be 0 or more pieces; got {self.clutter}")
        # A piece is cut from a 28-px digit, so it also fits on any canvas allowed above.
        if not 1 <= self.clutter_size <= MNIST_SIDE:
            raise ValueError(f"clutter_size must be 1 to {MNIST_SIDE} px (a piece is cut from a {MNIST_SIDE}-px "
                             f"digit); got {self.clutter_size}")
