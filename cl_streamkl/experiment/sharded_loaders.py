"""Avalanche's multi-dataset loaders, each rank of a data-parallel run loading its share of every batch.

How a batch is shared, and the loss weight of each share, is :mod:`cl_streamkl.distributed.sharding`.
"""

from __future__ import annotations

from typing import Any

from avalanche.benchmarks.utils.data_loader import ReplayDataLoader, TaskBalancedDataLoader
from torch.utils.data import DataLoader, Sampler

from cl_streamkl.distributed.sharding import BatchShards

__all__ = ["ShardedReplayDataLoader", "ShardedTaskBalancedDataLoader"]


class _ShardedMultiDatasetLoader:
    """For Avalanche's multi-dataset loaders: their whole batches, drawn as in one process, split by ``shards``.

    The loader is built without Avalanche's own distributed sampling (a
    ``DistributedSampler`` per dataset, which pads datasets with repeated samples and
    shuffles every epoch the same way); its batch sampler is wrapped instead.
    """

    def __init__(self, *args: Any, shards: BatchShards, **kwargs: Any) -> None:
        self.shards = shards
        super().__init__(*args, distributed_sampling=False, **kwargs)

    def _make_pytorch_loader(self, datasets: Any, batch_sampler: Sampler[list[int]]) -> DataLoader:
        return super()._make_pytorch_loader(datasets, self.shards.sampler(batch_sampler))


class ShardedTaskBalancedDataLoader(_ShardedMultiDatasetLoader, TaskBalancedDataLoader):
    """Avalanche's ``TaskBalancedDataLoader`` (task-labelled experiences), each rank loading its share.

    Takes ``TaskBalancedDataLoader``'s arguments (but ``distributed_sampling``) and ``shards``.
    """


class ShardedReplayDataLoader(_ShardedMultiDatasetLoader, ReplayDataLoader):
    """Avalanche's ``ReplayDataLoader`` (new data and replayed samples), each rank loading its share.

    Takes ``ReplayDataLoader``'s arguments (but ``distributed_sampling``) and ``shards``.
    """
