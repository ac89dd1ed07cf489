"""Each rank's share of every training batch: the batches of one process, split over the ranks.

A data-parallel run trains on the batches one process would draw with the same
``--batch-size`` (the global batch). Every rank draws the whole batch order, with the same
samplers and the same random numbers, so the same order, and keeps its share of each
batch: samples r, r + W, r + 2W, ... of it, the only ones it loads. DDP averages the
ranks' gradients, so each rank weights its loss by ``W × share / batch`` (1 when the
shares are equal): the update is then that of the whole batch's mean loss, whatever the
sizes of the shares (the last batch of an epoch rarely divides evenly). A rank left
without a sample, when a batch holds fewer samples than there are ranks, computes on the
batch's first sample with weight 0, since every rank takes part in every step.

The loaders Avalanche builds for task-labelled experiences and for replay get the same
treatment in :mod:`cl_streamkl.experiment.sharded_loaders`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sized
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

__all__ = ["BatchShards", "ShardedBatchSampler", "sharded_loader"]


class BatchShards:
    """One rank's share of each batch, and the loss weight each share carries, in batch order.

    Shares are taken as a loader draws its batches; :meth:`next_loss_weight` hands out
    their weights in the same order, one per training step (a loader that prefetches
    draws ahead, and the weights wait in line).

    Args:
        rank: this process's rank.
        world_size: number of ranks.
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world size {world_size}")
        self.rank, self.world_size = rank, world_size
        self._weights: deque[float] = deque()

    def share(self, batch: list[int]) -> list[int]:
        """This rank's indices of ``batch`` (a whole batch's sample indices); records their weight."""
        mine = batch[self.rank::self.world_size]
        if mine:
            self._weights.append(self.world_size * len(mine) / len(batch))
            return mine
        self._weights.append(0.0)
        return batch[:1]

    def next_loss_weight(self) -> float:
        """The weight of the next step's share (1.0 when nothing was drawn through these shards)."""
        return self._weights.popleft() if self._weights else 1.0

    def clear(self) -> None:
        """Forget the weights of shares not trained on (call before each epoch's loader runs)."""
        self._weights.clear()

    def sampler(self, batches: Iterable[list[int]]) -> ShardedBatchSampler:
        """A batch sampler yielding this rank's share of each of ``batches``."""
        return ShardedBatchSampler(batches, self)


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields :meth:`BatchShards.share` of every batch another batch sampler yields.

    Args:
        batches: the whole batches (e.g. a ``BatchSampler``).
        shards: which share, and where its weights go.
    """

    def __init__(self, batches: Iterable[list[int]], shards: BatchShards) -> None:
        self.batches, self.shards = batches, shards

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            yield self.shards.share(list(batch))

    def __len__(self) -> int:
        if not isinstance(self.batches, Sized):
            raise TypeError(f"{type(self.batches).__name__} has no length")
        return len(self.batches)


def sharded_loader(dataset: Dataset, shards: BatchShards, *, batch_size: int, shuffle: bool = True,
                   drop_last: bool = False, **loader_args: Any) -> DataLoader:
    """``DataLoader(dataset, batch_size, shuffle, drop_last, **loader_args)``, loading this rank's share of each batch.

    The batches are those of that plain ``DataLoader``, drawn with the same random numbers
    (its ``RandomSampler`` takes its seed from torch's generator as each epoch starts).
    """
    order = RandomSampler(dataset) if shuffle else SequentialSampler(dataset)
    batches = BatchSampler(order, batch_size=batch_size, drop_last=drop_last)
    return DataLoader(dataset, batch_sampler=shards.sampler(batches), **loader_args)
