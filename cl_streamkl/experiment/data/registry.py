"""One entry point to load a dataset by name and one to split it into a stream.

Importing this module is cheap (no torch, Avalanche or loaders): the command line builds
its help from it. The loaders are imported when data is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cl_streamkl.experiment.data.names import DATASETS, ClutterOptions

if TYPE_CHECKING:
    from cl_streamkl.experiment.data.stream import ExperienceStream, LabeledSplits

def load_splits(
    name: str,
    *,
    data_root: str | Path | None,
    image_size: int,
    download: bool = False,
    in_chans: int | None = None,
    split_seed: int = 0,
    clutter: ClutterOptions | None = None,
) -> LabeledSplits:
    """Load a dataset's whole train and test sets by name.

    Args:
        name: one of :data:`DATASETS`.
        data_root: where the files live; required for every dataset except the bundled
            ``digits`` and ``mnist5k`` and the generated ``cluttered-mnist`` (whose cache
            it holds when given).
        image_size: side length of the images the loaders return.
        download: allow fetching CIFAR / Tiny-ImageNet into ``data_root`` when missing.
        in_chans: channels for ``imagefolder`` (default 3); other datasets have fixed channels.
        split_seed: seeds the train/test split of datasets that ship without one.
        clutter: canvas and clutter of ``cluttered-mnist`` (default: ``ClutterOptions()``).

    Raises:
        ValueError: unknown name, missing ``data_root``, options of another dataset, or a
            loader's format error.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if in_chans is not None and name != "imagefolder":
        raise ValueError(f"in_chans can only be chosen for 'imagefolder'; {name!r} has fixed channels")
    if clutter is not None and name != "cluttered-mnist":
        raise ValueError(f"canvas and clutter options are for 'cluttered-mnist'; {name!r} is not generated")
    if name == "cluttered-mnist":
        from cl_streamkl.experiment.data.cluttered import load_cluttered_mnist

        return load_cluttered_mnist(image_size=image_size, options=clutter or ClutterOptions(),
                                    split_seed=split_seed, cache_dir=data_root)
    if name in ("digits", "mnist5k"):
        from cl_streamkl.experiment.data.bundled import load_digits, load_mnist5k

        loader = load_digits if name == "digits" else load_mnist5k
        return loader(image_size=image_size, split_seed=split_seed)
    if data_root is None:
        raise ValueError(f"dataset {name!r} needs --data-root (the folder holding its files)")
    root = Path(data_root).expanduser()
    if not root.exists() and name == "imagefolder":
        raise ValueError(f"data root {str(root)!r} does not exist: point --data-root at the folder of your images")
    if not root.exists() and not download:
        raise ValueError(f"data root {str(root)!r} does not exist (pass --download to fetch {name})")
    if name in ("cifar10", "cifar100"):
        from cl_streamkl.experiment.data.cifar import load_cifar

        return load_cifar(name, root, image_size=image_size, download=download)
    if name == "tiny-imagenet":
        from cl_streamkl.experiment.data.tiny_imagenet import load_tiny_imagenet

        return load_tiny_imagenet(root, image_size=image_size, download=download)
    if download:
        raise ValueError("imagefolder data cannot be downloaded; point --data-root at your folder")
    from cl_streamkl.experiment.data.image_folder import load_image_folder

    return load_image_folder(root, image_size=image_size, in_chans=in_chans or 3,
                             split_seed=split_seed)


def build_stream(
    splits: LabeledSplits,
    *,
    n_experiences: int | None,
    seed: int,
    val_fraction: float,
    split_seed: int = 0,
    scenario: str = "class",
    first_experience_classes: int | None = None,
    image_size: int | None = None,
    domain_shift: str = "rotate",
    rotation_step: float = 30.0,
) -> ExperienceStream:
    """Split loaded data into a ``scenario`` stream; ``n_experiences=None`` takes the dataset default.

    ``first_experience_classes`` applies to ``class`` and ``task``; ``image_size``,
    ``domain_shift`` and ``rotation_step`` to ``domain`` (see :mod:`cl_streamkl.experiment.data.stream`).

    Raises:
        ValueError: unknown scenario, or options that do not fit it or the data.
    """
    from cl_streamkl.experiment.data.stream import split_class_incremental, split_domain_incremental

    if n_experiences is None:
        n_experiences = DATASETS[splits.name].n_experiences
        if scenario != "domain" and first_experience_classes is None:
            # The dataset's default stream is its default split too (digits: 6, then 2 and 2 classes).
            first_experience_classes = DATASETS[splits.name].first_experience_classes
    if scenario == "domain":
        if first_experience_classes is not None:
            raise ValueError("first_experience_classes needs scenario 'class' or 'task': "
                             "in 'domain' every experience holds every class")
        if image_size is None:
            raise ValueError("scenario 'domain' needs image_size")
        return split_domain_incremental(
            splits, n_experiences=n_experiences, seed=seed, image_size=image_size, val_fraction=val_fraction,
            split_seed=split_seed, shift=domain_shift, rotation_step=rotation_step,
        )
    if scenario not in ("class", "task"):
        raise ValueError(f"scenario must be one of class, task, domain; got {scenario!r}")
    return split_class_incremental(
        splits, n_experiences=n_experiences, seed=seed, val_fraction=val_fraction, split_seed=split_seed,
        first_experience_classes=first_experience_classes, task_labels=scenario == "task",
    )
