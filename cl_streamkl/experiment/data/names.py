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
    ``num_classes`` is None where only the loaded data knows it (``imagefolder``).
    """

    n_experiences: int
    native_size: int | None
    needs_root: bool
    num_classes: int | None
    first_experience_classes: int | None = None


DATASETS: dict[str, DatasetInfo] = {
    # 6 classes, then 2 and 2: the first experience is large enough that forgetting it shows.
    "digits": DatasetInfo(n_experiences=3, native_size=8, needs_root=False, num_classes=10,
                          first_experience_classes=6),
    "mnist5k": DatasetInfo(n_experiences=5, native_size=28, needs_root=False, num_classes=10),
    "cifar10": DatasetInfo(n_experiences=5, native_size=32, needs_root=True, num_classes=10),
    "cifar100": DatasetInfo(n_experiences=10, native_size=32, needs_root=True, num_classes=100),
    "tiny-imagenet": DatasetInfo(n_experiences=10, native_size=64, needs_root=True, num_classes=200),
    "imagefolder": DatasetInfo(n_experiences=5, native_size=None, needs_root=True, num_classes=None),
    # The side is the canvas's (ClutterOptions.canvas); --data-root, if given, holds the generated cache.
    "cluttered-mnist": DatasetInfo(n_experiences=5, native_size=None, needs_root=False, num_classes=10),
}


def experience_sizes(num_classes: int, n_experiences: int, first_experience_classes: int | None, *,
                     count_name: str = "n_experiences") -> list[int]:
    """Classes per experience: equal shares, or ``first_experience_classes`` then equal shares.

    Args:
        num_classes: classes to share out.
        n_experiences: number of experiences.
        first_experience_classes: the first experience's classes; None for equal shares.
        count_name: what the errors call ``n_experiences``: the name the caller's user typed
            (a run's settings call it ``experiences``).

    Raises:
        ValueError: the classes cannot be shared out that way.
    """
    if n_experiences < 1:
        raise ValueError(f"{count_name} must be positive; got {n_experiences}")
    if first_experience_classes is None:
        if num_classes % n_experiences:
            raise ValueError(f"{count_name} must divide the {num_classes} classes; got {n_experiences} "
                             "(or set first_experience_classes)")
        return [num_classes // n_experiences] * n_experiences
    first = first_experience_classes
    if not 1 <= first < num_classes or n_experiences < 2:
        raise ValueError(f"first_experience_classes must be in [1, {num_classes}) with at least 2 experiences; "
                         f"got {first} with {n_experiences} experiences")
    rest, later = num_classes - first, n_experiences - 1
    if rest % later:
        raise ValueError(f"after {first} classes first, the other {rest} classes do not split evenly "
                         f"into {later} experiences")
    return [first] + [rest // later] * later


def check_class_split(dataset: str, scenario: str, experiences: int | None, first_experience_classes: int | None,
                      num_classes: int | None = None) -> None:
    """Refuse a run's settings whose classes cannot be shared out, naming them as the user set them.

    The stream's own checks name the library's argument, ``n_experiences``; a run's setting is
    ``experiences`` (``--experiences``, and the key in configuration files and study plans).

    Args:
        dataset: the run's dataset.
        scenario: the run's scenario (``domain`` shares no classes: nothing to check).
        experiences: the run's number of experiences; None for the dataset's default.
        first_experience_classes: the first experience's classes; None for equal shares.
        num_classes: the loaded data's classes; default: the dataset's own, where known
            (``imagefolder`` is checked once it is loaded).

    Raises:
        ValueError: one line naming ``experiences`` or ``first_experience_classes``.
    """
    info = DATASETS[dataset]
    classes = info.num_classes if num_classes is None else num_classes
    if scenario == "domain" or classes is None:
        return
    count = info.n_experiences if experiences is None else experiences
    experience_sizes(classes, count, first_experience_classes, count_name="experiences")

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
