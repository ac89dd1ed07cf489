"""Continual streams (class-, task- and domain-incremental) over offline and on-disk image datasets."""

from cl_streamkl.data.images import FileImages, TensorImages
from cl_streamkl.data.registry import DATASETS, build_stream, load_splits
from cl_streamkl.data.stream import (
    DOMAIN_SHIFTS, SCENARIOS, ExperienceStream, LabeledSplits, split_class_incremental, split_domain_incremental,
)

__all__ = [
    "DATASETS",
    "DOMAIN_SHIFTS",
    "SCENARIOS",
    "ExperienceStream",
    "FileImages",
    "LabeledSplits",
    "TensorImages",
    "build_stream",
    "load_splits",
    "split_class_incremental",
    "split_domain_incremental",
]
