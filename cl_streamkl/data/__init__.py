"""Continual streams (class-, task- and domain-incremental) over offline and on-disk image datasets.

The names and defaults (:data:`DATASETS`, :data:`SCENARIOS`, :data:`DOMAIN_SHIFTS`) import
cheaply; the datasets and streams, which need torch and Avalanche, are imported on first use.
"""

from __future__ import annotations

from cl_streamkl._lazy import lazy_attributes
from cl_streamkl.data.registry import DATASETS, DOMAIN_SHIFTS, SCENARIOS, build_stream, load_splits

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

_LAZY = {
    "FileImages": "cl_streamkl.data.images",
    "TensorImages": "cl_streamkl.data.images",
    "ExperienceStream": "cl_streamkl.data.stream",
    "LabeledSplits": "cl_streamkl.data.stream",
    "split_class_incremental": "cl_streamkl.data.stream",
    "split_domain_incremental": "cl_streamkl.data.stream",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
