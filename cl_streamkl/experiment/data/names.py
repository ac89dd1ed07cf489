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
}
