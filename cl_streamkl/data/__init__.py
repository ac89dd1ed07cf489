"""Class-incremental streams: Split-Digits, split CIFAR-10/100, Tiny-ImageNet, ImageFolder."""

from cl_streamkl.data.images import FileImages, TensorImages
from cl_streamkl.data.registry import DATASETS, build_stream, load_splits
from cl_streamkl.data.stream import ClassIncrementalStream, LabeledSplits, split_class_incremental

__all__ = [
    "DATASETS",
    "ClassIncrementalStream",
    "FileImages",
    "LabeledSplits",
    "TensorImages",
    "build_stream",
    "load_splits",
    "split_class_incremental",
]
