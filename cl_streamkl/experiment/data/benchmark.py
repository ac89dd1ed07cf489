"""A stream as an Avalanche benchmark, for training with Avalanche's own strategies and loops.

:func:`avalanche_benchmark` hands the experiences of an
:class:`~cl_streamkl.experiment.data.stream.ExperienceStream` (what
:func:`~cl_streamkl.experiment.data.build_stream` returns, the streams ``cl-streamkl run``
trains on) to Avalanche's public builder ``benchmark_from_datasets``, so a script gets the same
experiences, in the same seeded class order, as the command line.

Example:
    >>> from cl_streamkl.experiment.data import build_stream, load_splits
    >>> from cl_streamkl.experiment.data.benchmark import avalanche_benchmark
    >>> splits = load_splits("digits", data_root=None, image_size=16)
    >>> benchmark = avalanche_benchmark(build_stream(splits, n_experiences=5, seed=0, val_fraction=0.1))
    >>> for experience in benchmark.train_stream:
    ...     strategy.train(experience)
    ...     strategy.eval(benchmark.test_stream)
"""

from __future__ import annotations

from avalanche.benchmarks import benchmark_from_datasets, with_classes_timeline
from avalanche.benchmarks.scenarios import CLScenario, with_task_labels

from cl_streamkl.experiment.data.stream import ExperienceStream

__all__ = ["avalanche_benchmark"]


def avalanche_benchmark(stream: ExperienceStream) -> CLScenario:
    """The Avalanche benchmark of ``stream``: a train, a test and, when held out, a valid stream.

    Experience i of each stream holds ``stream.train[i]``, ``stream.test[i]`` and
    ``stream.val[i]``: samples ``(image, label, task_label)``. Every experience knows its
    classes (``classes_in_this_experience``); in the ``task`` scenario also its task label
    (``task_label``, i for experience i), as Avalanche's task-incremental benchmarks do, so
    strategies pass it to a multi-head model.

    Args:
        stream: a stream from :func:`~cl_streamkl.experiment.data.build_stream`.

    Returns:
        The benchmark, with ``train_stream``, ``test_stream`` and, when ``stream`` holds
        validation samples, ``valid_stream``.

    Raises:
        TypeError: ``stream`` is not an :class:`ExperienceStream`.
    """
    if not isinstance(stream, ExperienceStream):
        raise TypeError(f"stream must be an ExperienceStream (from build_stream), got {type(stream).__name__}")
    datasets = {"train": stream.train, "test": stream.test}
    if sum(len(dataset) for dataset in stream.val):
        datasets["valid"] = stream.val
    benchmark = with_classes_timeline(benchmark_from_datasets(**datasets))
    return with_task_labels(benchmark) if stream.scenario == "task" else benchmark
