"""Continual streams: a labelled train/test pair in, per-experience datasets out.

Three scenarios (van de Ven et al. 2022, "Three types of incremental learning"):

- ``class``: each experience brings new classes; one shared head over all classes;
  no task label at test time.
- ``task``: the same class split, but every sample carries its experience's task label
  and labels are renumbered within the experience (0..k-1): one head per experience.
- ``domain``: every experience holds all classes, under an input shift of its own (a
  fixed rotation or a fixed pixel permutation); one shared head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from avalanche.benchmarks.scenarios import TaskLabels
from avalanche.benchmarks.utils import as_classification_dataset, as_taskaware_classification_dataset
from avalanche.benchmarks.utils.data import AvalancheDataset
from avalanche.benchmarks.utils.flat_data import ConstantSequence
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as TF

from cl_streamkl.experiment.data.names import DOMAIN_SHIFTS, EVAL_SPLITS, experience_sizes


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
class ExperienceStream:
    """The experiences of one continual stream, ready for Avalanche.

    ``train``, ``val`` and ``test`` hold one Avalanche classification dataset per
    experience; ``val`` is carved out of the training data, never out of ``test``.

    Attributes:
        name: dataset name.
        scenario: ``"class"``, ``"task"`` or ``"domain"``.
        num_classes: classes of the dataset.
        in_chans: image channels.
        class_order: the seeded class order (``domain``: ``0..num_classes-1``).
        experience_classes: the dataset's class ids in each experience (``domain``: all
            classes in every experience).
        shifts: per experience, the input shift it applies (``domain``), else empty.
        train / val / test: per-experience datasets. In ``task`` they carry task label i
            for experience i and labels renumbered to the position of the class in
            ``experience_classes[i]``; otherwise task label 0 and the dataset's labels.
    """

    name: str
    scenario: str
    num_classes: int
    in_chans: int
    class_order: list[int]
    experience_classes: list[list[int]]
    train: list[AvalancheDataset]
    val: list[AvalancheDataset]
    test: list[AvalancheDataset]
    shifts: list[str] = field(default_factory=list)

    @property
    def n_experiences(self) -> int:
        return len(self.train)

    @property
    def head_sizes(self) -> list[int] | None:
        """Outputs of each experience's head in ``task``; ``None`` (one shared head) otherwise."""
        if self.scenario != "task":
            return None
        return [len(classes) for classes in self.experience_classes]

    def eval_datasets(self, split: str) -> list[AvalancheDataset]:
        """The per-experience datasets used to fill the accuracy matrix (``"test"`` or ``"val"``)."""
        if split not in EVAL_SPLITS:
            raise ValueError(f"eval split must be one of {EVAL_SPLITS}; got {split!r}")
        if split == "val" and sum(len(d) for d in self.val) == 0:
            raise ValueError("eval split 'val' needs a validation split: set val_fraction > 0")
        return self.test if split == "test" else self.val


class _ExperienceView(Dataset):
    """Samples ``indices`` of ``base``, labels mapped through ``label_map``, images through ``shift``."""

    def __init__(self, base: Dataset, indices: Sequence[int], labels: Sequence[int],
                 shift: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.base, self.indices, self.targets, self.shift = base, list(indices), list(labels), shift

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.base[self.indices[index]][0]
        return (image if self.shift is None else self.shift(image)), self.targets[index]


def _experience_dataset(
    base: Dataset,
    indices: np.ndarray,
    base_targets: np.ndarray,
    *,
    task_label: int = 0,
    label_map: dict[int, int] | None = None,
    shift: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> AvalancheDataset:
    """A task-aware Avalanche classification dataset of ``(image, label, task_label)`` samples.

    Built with Avalanche's public dataset helpers; task-aware, so that Avalanche's loaders and
    plugins can split it by task (``task_set``).
    """
    labels = [int(t) if label_map is None else label_map[int(t)] for t in base_targets[indices]]
    view = _ExperienceView(base, indices.tolist(), labels, shift)
    task_labels = TaskLabels(ConstantSequence(task_label, len(view)))
    return as_taskaware_classification_dataset(
        as_classification_dataset(view).update_data_attribute("targets_task_labels", task_labels))


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


def _check_splits(splits: LabeledSplits, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1); got {val_fraction}")
    train_targets = np.asarray(splits.train.targets, dtype=np.int64)
    test_targets = np.asarray(splits.test.targets, dtype=np.int64)
    for label_name, targets in (("training", train_targets), ("test", test_targets)):
        missing = sorted(set(range(splits.num_classes)) - set(np.unique(targets).tolist()))
        if missing:
            raise ValueError(f"{splits.name!r}: classes {missing} have no {label_name} samples")
    return train_targets, test_targets


def split_class_incremental(
    splits: LabeledSplits,
    *,
    n_experiences: int,
    seed: int,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    first_experience_classes: int | None = None,
    task_labels: bool = False,
) -> ExperienceStream:
    """Split a dataset into a class-incremental (or, with ``task_labels``, task-incremental) stream.

    Args:
        splits: whole train/test sets from a loader.
        n_experiences: number of experiences.
        seed: seeds the class order (different seeds, different orders).
        val_fraction: fraction of each class's training samples held out for validation,
            in [0, 1).
        split_seed: seeds the train/validation split, kept fixed across run seeds so
            every seed validates on the same samples.
        first_experience_classes: classes of the first experience (the others share the
            rest equally); ``None`` gives every experience the same number.
        task_labels: build the ``task`` scenario: task label i on experience i, labels
            renumbered within each experience.

    Returns:
        The stream; experience i holds the next ``sizes[i]`` classes of ``class_order``.

    Raises:
        ValueError: the classes cannot be split that way, val_fraction is out of range,
            or a class has no training or test samples.
    """
    sizes = experience_sizes(splits.num_classes, n_experiences, first_experience_classes)
    train_targets, test_targets = _check_splits(splits, val_fraction)
    class_order = np.random.default_rng(seed).permutation(splits.num_classes).tolist()
    bounds = np.cumsum([0, *sizes])
    experience_classes = [class_order[bounds[i]:bounds[i + 1]] for i in range(n_experiences)]
    kept, held = _holdout_per_class(train_targets, val_fraction, np.random.default_rng(split_seed))

    stream = ExperienceStream(
        name=splits.name, scenario="task" if task_labels else "class", num_classes=splits.num_classes,
        in_chans=splits.in_chans, class_order=class_order, experience_classes=experience_classes,
        train=[], val=[], test=[],
    )
    for task, classes in enumerate(experience_classes):
        options = ({"task_label": task, "label_map": {c: i for i, c in enumerate(classes)}}
                   if task_labels else {})
        stream.train.append(_experience_dataset(
            splits.train, kept[np.isin(train_targets[kept], classes)], train_targets, **options))
        stream.val.append(_experience_dataset(
            splits.train, held[np.isin(train_targets[held], classes)], train_targets, **options))
        stream.test.append(_experience_dataset(
            splits.test, np.flatnonzero(np.isin(test_targets, classes)), test_targets, **options))
    return stream


class _Rotation:
    """Rotates (C, S, S) images by a fixed angle; corners filled with -1 (black once normalised)."""

    def __init__(self, degrees: float) -> None:
        self.degrees = degrees

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return TF.rotate(image, self.degrees, fill=-1.0)


class _PixelPermutation:
    """Reorders the pixels of (C, S, S) images by one fixed permutation, the same for every channel."""

    def __init__(self, order: torch.Tensor) -> None:
        self.order = order

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.flatten(1)[:, self.order].view_as(image)


def domain_shift(kind: str, domain: int, *, image_size: int, rotation_step: float = 30.0,
                 split_seed: int = 0) -> tuple[str, Callable[[torch.Tensor], torch.Tensor] | None]:
    """The fixed input shift of domain ``domain``: (description, function on (C, S, S) images).

    ``rotate``: by ``domain * rotation_step`` degrees. ``permute``: domain 0 unchanged,
    domain d > 0 a pixel permutation drawn from (split_seed, d). The function is ``None``
    where the images stay as they are.
    """
    if kind not in DOMAIN_SHIFTS:
        raise ValueError(f"domain shift must be one of {DOMAIN_SHIFTS}; got {kind!r}")
    if kind == "rotate":
        degrees = domain * rotation_step
        return f"rotate {degrees:g} degrees", (_Rotation(degrees) if degrees else None)
    if domain == 0:
        return "identity", None
    order = np.random.default_rng([split_seed, domain]).permutation(image_size * image_size)
    return f"pixel permutation {domain}", _PixelPermutation(torch.from_numpy(order))


def split_domain_incremental(
    splits: LabeledSplits,
    *,
    n_experiences: int,
    seed: int,
    image_size: int,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    shift: str = "rotate",
    rotation_step: float = 30.0,
) -> ExperienceStream:
    """Split a dataset into a domain-incremental stream: all classes, one input shift per experience.

    The training data (after the validation hold-out) is divided into ``n_experiences``
    stratified, disjoint parts, so each experience trains on new images of every class
    under its shift. Validation and test data are the whole held-out and test sets under
    each experience's shift.

    Args:
        splits: whole train/test sets from a loader.
        n_experiences: number of experiences (domains).
        seed: seeds the order in which the domains arrive.
        image_size: side of the images (a permutation is drawn over its pixels).
        val_fraction: fraction of each class's training samples held out for validation.
        split_seed: seeds the train/validation split, the division into parts and the
            pixel permutations, fixed across run seeds.
        shift: ``"rotate"`` or ``"permute"`` (see :func:`domain_shift`).
        rotation_step: degrees between consecutive rotated domains.

    Raises:
        ValueError: unknown shift, fewer training samples per class than experiences,
            val_fraction out of range, or a class without samples.
    """
    if n_experiences < 1:
        raise ValueError(f"n_experiences must be positive; got {n_experiences}")
    train_targets, test_targets = _check_splits(splits, val_fraction)
    rng = np.random.default_rng(split_seed)
    kept, held = _holdout_per_class(train_targets, val_fraction, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(n_experiences)]
    for cls in range(splits.num_classes):
        idx = rng.permutation(kept[train_targets[kept] == cls])
        if len(idx) < n_experiences:
            raise ValueError(f"{splits.name!r}: class {cls} has {len(idx)} training samples, fewer than the "
                             f"{n_experiences} experiences (domains) each needs one of; set fewer experiences")
        for part, chunk in zip(parts, np.array_split(idx, n_experiences)):
            part.append(chunk)
    domains = np.random.default_rng(seed).permutation(n_experiences).tolist()
    stream = ExperienceStream(
        name=splits.name, scenario="domain", num_classes=splits.num_classes, in_chans=splits.in_chans,
        class_order=list(range(splits.num_classes)),
        experience_classes=[list(range(splits.num_classes)) for _ in range(n_experiences)],
        train=[], val=[], test=[],
    )
    for part, domain in zip(parts, domains):
        description, function = domain_shift(shift, domain, image_size=image_size,
                                              rotation_step=rotation_step, split_seed=split_seed)
        stream.shifts.append(description)
        stream.train.append(_experience_dataset(splits.train, np.sort(np.concatenate(part)), train_targets,
                                                shift=function))
        stream.val.append(_experience_dataset(splits.train, held, train_targets, shift=function))
        stream.test.append(_experience_dataset(splits.test, np.arange(len(test_targets)), test_targets,
                                               shift=function))
    return stream
