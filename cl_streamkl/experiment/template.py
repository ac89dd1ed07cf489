"""The Avalanche training template every strategy runs on: SupervisedTemplate, mixed precision, data parallelism."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from avalanche.training.plugins import EvaluationPlugin
from avalanche.training.templates import SupervisedTemplate

from cl_streamkl.distributed.data_parallel import DataParallel
from cl_streamkl.distributed.sharding import BatchShards, sharded_loader
from cl_streamkl.experiment.sharded_loaders import ShardedTaskBalancedDataLoader

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``amp`` in {"bf16", "fp16"}; a no-op context for ``"none"``."""
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp must be one of {tuple(AMP_DTYPES)}; got {amp!r}")
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class AmpSupervisedTemplate(SupervisedTemplate):
    """Avalanche's supervised template with the forward pass under autocast, on one process or several.

    The plugins' ``before_forward`` callbacks run under the same autocast, so a teacher
    that a plugin runs there (the StreamKL plugin's) computes in the student's precision.

    Plugins see the same callbacks as with ``avalanche.training.Naive``; the
    strategies differ only in their plugin lists. With ``amp="fp16"`` a gradient
    scaler wraps backward and the optimizer step. Avalanche's metric evaluator is
    replaced by an empty one: the experiment runner computes its own metrics and
    prints its own progress.

    Data parallel: pass the model wrapped in ``DistributedDataParallel`` and the run's
    :class:`~cl_streamkl.distributed.data_parallel.DataParallel`. ``train_mb_size`` is the
    global batch: the training loaders draw the batches one process would and load each
    rank's share of them (:mod:`~cl_streamkl.distributed.sharding`), and backward weights
    each rank's loss so that DDP's average is the whole batch's gradient. Every epoch
    starts from rank 0's random-number state, so the ranks agree on the batch order.

    Args:
        amp: "none", "bf16" or "fp16".
        data_parallel: this process's place in the run (default: a single process).
        **kwargs: ``SupervisedTemplate`` arguments (model, optimizer, plugins, ...).

    Attributes:
        batch_shards: this rank's share of each training batch.
        loss_weight: the weight of the last backward's loss (1.0 in a single process).
    """

    def __init__(self, *, amp: str = "none", data_parallel: DataParallel | None = None, **kwargs: Any) -> None:
        if "evaluator" not in kwargs:
            with warnings.catch_warnings():
                # An evaluator without loggers is the point here, not a mistake to warn about.
                warnings.filterwarnings("ignore", message="No loggers specified")
                kwargs["evaluator"] = EvaluationPlugin(loggers=[])
        super().__init__(**kwargs)
        self.amp = amp
        autocast(self.device, amp)  # validates amp early
        self.scaler = torch.amp.GradScaler(self.device.type) if amp == "fp16" else None
        self.data_parallel = DataParallel(device=self.device) if data_parallel is None else data_parallel
        self.batch_shards = BatchShards(self.data_parallel.rank, self.data_parallel.world_size)
        self.loss_weight = 1.0

    def make_train_dataloader(self, num_workers: int = 0, shuffle: bool = True, pin_memory: bool | None = None,
                              persistent_workers: bool = False, drop_last: bool = False, **kwargs: Any) -> None:
        """Avalanche's training loader (task-balanced for task-labelled experiences), sharded over the ranks."""
        loader_args = self._obtain_common_dataloader_parameters(
            batch_size=self.train_mb_size, num_workers=num_workers, shuffle=shuffle, pin_memory=pin_memory,
            persistent_workers=persistent_workers, drop_last=drop_last)
        if hasattr(self.experience, "task_labels"):
            self.dataloader = ShardedTaskBalancedDataLoader(
                self.adapted_dataset, shards=self.batch_shards, oversample_small_groups=True, **loader_args)
        else:
            self.dataloader = sharded_loader(self.adapted_dataset, self.batch_shards, **loader_args)

    def _before_training_epoch(self, **kwargs: Any) -> None:
        super()._before_training_epoch(**kwargs)
        self.batch_shards.clear()
        self.data_parallel.adopt_main_rng()

    def _before_forward(self, **kwargs: Any) -> None:
        # Plugins that run a model here (StreamKLPlugin's teacher) get the forward's precision.
        with autocast(self.device, self.amp):
            super()._before_forward(**kwargs)

    def forward(self) -> torch.Tensor:
        with autocast(self.device, self.amp):
            return super().forward()

    def backward(self) -> None:
        self.loss_weight = self.batch_shards.next_loss_weight()
        loss = self.loss if self.loss_weight == 1.0 else self.loss * self.loss_weight
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(retain_graph=self.retain_graph)

    def optimizer_step(self) -> None:
        if self.scaler is None:
            super().optimizer_step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
