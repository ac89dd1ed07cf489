"""Continual streams (class-, task- and domain-incremental) over offline, generated and on-disk image datasets.

The names and defaults (:data:`DATASETS`, :data:`SCENARIOS`, :data:`DOMAIN_SHIFTS`) and the two
entry points import cheaply; the loaders and :mod:`~cl_streamkl.experiment.data.stream`, which
need Avalanche, are imported when data is loaded. :mod:`~cl_streamkl.experiment.data.benchmark`
gives a stream as an Avalanche benchmark (:func:`~cl_streamkl.experiment.data.benchmark.avalanche_benchmark`).
"""

from cl_streamkl.experiment.data.names import DATASETS, DOMAIN_SHIFTS, SCENARIOS, ClutterOptions
from cl_streamkl.experiment.data.registry import build_stream, load_splits

__all__ = ["DATASETS", "DOMAIN_SHIFTS", "SCENARIOS", "ClutterOptions", "build_stream", "load_splits"]
