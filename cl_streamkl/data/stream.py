"""Class-incremental splitting: a labelled train/test pair in, per-experience datasets out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from avalanche.benchmarks.utils import _make_taskaware_classification_dataset
from avalanche.benchmarks.utils.data import AvalancheDataset
from torch.utils.data import Dataset, Subset

EVAL_SPLITS = ("test", "val")


@dataclass
class LabeledSplits:
    """What a dataset loader returns: whole train and test sets before any splitting.

    Attributes:
        name: dataset name as given on the command line.
        train: training images; must expose ``targets`` (one int label per sample).
        test: held-out images with the same label space; must expose ``targets``.
        num_classes: number of classes; labels are 0..num_classes-1.
        in_chans: image channels (1 or 3).
        class_names: human-readable class names, index = label.
    """

    name: str
    train: Dataset
    test: Dataset
    num_classes: int
    in_chans: int
    class_names: list[str] = field(default_factory=list)


@dataclass
class ClassIncrementalStream:
    """A class-incremental stream: experience i holds the classes ``experience_classes[i]``.

    ``train``, ``val`` and ``test`` hold one Avalanche classification dataset per
    experience (task label 0, original class labels kept, one shared head). ``val``
    is carved out of the training data, never out of ``test``.
    """

    name: str
    num_classes: int
    in_chans: int
    class_order: list[int]
    experience_classes: list[list[int]]
    train: list[AvalancheDataset]
    val: list[AvalancheDataset]
    test: list[AvalancheDataset]

    @property
    def n_experiences(self) -> int:
        return len(self.train)

    def eval_datasets(self, split: str) -> list[AvalancheDataset]:
        """The per-experience datasets used to fill the accuracy matrix (``"test"`` or ``"val"``)."""
        if split not in EVAL_SPLITS:
            raise ValueError(f"eval split must be one of {EVAL_SPLITS}; got {split!r}")
        if split == "val" and sum(len(d) for d in self.val) == 0:
            raise ValueError("eval split 'val' needs a validation split: set val_fraction > 0")
        return self.test if split == "test" else self.val


def _as_avalanche(dataset: Dataset, indices: Sequence[int], targets: Sequence[int]) -> AvalancheDataset:
    subset = Subset(dataset, list(indices))
    return _make_taskaware_classification_dataset(
        subset, targets=[targets[i] for i in indices], task_labels=0
    )


def _holdout_per_class(
    targets: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split of sample indices: (kept, held_out), ``fraction`` of each class held out."""
    kept, held = [], []
    for cls in np.unique(targets):
        idx = rng.permutation(np.flatnonzero(targets == cls))
        n_held = int(round(fraction * len(idx)))
        if fraction > 0 and len(idx) > 1:
            n_held = min(max(n_held, 1), len(idx) - 1)
        held.append(idx[:n_held])
        kept.append(idx[n_held:])
    return np.sort(np.concatenate(kept)), np.sort(np.concatenate(held))


def split_class_incremental(
    splits: LabeledSplits,
    *,
    n_experiences: int,
    seed: int,
    val_fraction: float = 0.1,
    split_seed: int = 0,
) -> ClassIncrementalStream:
    """Split a dataset into a class-incremental stream with equal classes per experience.

    Args:
        splits: whole train/test sets from a loader.
        n_experiences: number of experiences; must divide ``splits.num_classes``.
        seed: seeds the class order (different seeds, different orders).
        val_fraction: fraction of each class's training samples held out for validation,
            in [0, 1).
        split_seed: seeds the train/validation split, kept fixed across run seeds so
            every seed validates on the same samples.

    Returns:
        The stream; experience i holds classes ``class_order[i*k:(i+1)*k]`` with
        k = num_classes / n_experiences.

    Raises:
        ValueError: n_experiences does not divide the classes, val_fraction is out of
            range, or a class has no training or test samples.
    """
    if n_experiences < 1 or splits.num_classes % n_experiences:
        raise ValueError(
            f"n_experiences must be a positive divisor of the {splits.num_classes} classes of "
            f"{splits.name!r}; got {n_experiences}"
        )
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1); got {val_fraction}")
    train_targets = np.asarray(splits.train.targets, dtype=np.int64)
    test_targets = np.asarray(splits.test.targets, dtype=np.int64)
    for label_name, targets in (("training", train_targets), ("test", test_targets)):
        missing = sorted(set(range(splits.num_classes)) - set(np.unique(targets).tolist()))
        if missing:
            raise ValueError(f"{splits.name!r}: classes {missing} have no {label_name} samples")

    class_order = np.random.default_rng(seed).permutation(splits.num_classes).tolist()
    per_exp = splits.num_classes // n_experiences
    experience_classes = [class_order[i * per_exp:(i + 1) * per_exp] for i in range(n_experiences)]
    kept, held = _holdout_per_class(train_targets, val_fraction, np.random.default_rng(split_seed))

    train_list, test_list = train_targets.tolist(), test_targets.tolist()
    stream = ClassIncrementalStream(
        name=splits.name, num_classes=splits.num_classes, in_chans=splits.in_chans,
        class_order=class_order, experience_classes=experience_classes, train=[], val=[], test=[],
    )
    for classes in experience_classes:
        stream.train.append(_as_avalanche(
            splits.train, kept[np.isin(train_targets[kept], classes)], train_list))
        stream.val.append(_as_avalanche(
            splits.train, held[np.isin(train_targets[held], classes)], train_list))
        stream.test.append(_as_avalanche(
            splits.test, np.flatnonzero(np.isin(test_targets, classes)), test_list))
    return stream
