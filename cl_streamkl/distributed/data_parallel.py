"""Data-parallel runs: the process group torchrun describes, and the few collectives a run needs.

``torchrun --nproc_per_node N -m cl_streamkl run ...`` starts N processes, each told its
place by torchrun's environment variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). :func:`start_data_parallel` checks them, joins the process group (NCCL on
CUDA with rank r on GPU LOCAL_RANK, gloo on the CPU) with a timeout, and returns a
:class:`DataParallel` handle. A process started without torchrun, or a world of one, gets
the handle of a single process, whose collectives return their input.
:func:`stop_data_parallel` leaves the group. A peer lost while joining or in any of the
handle's collectives raises a one-line :class:`~cl_streamkl.distributed.lost_peers.LostPeerError`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel as SingleProcessDataParallel
from torch.nn.parallel import DistributedDataParallel

from cl_streamkl.distributed.lost_peers import peers_checked

__all__ = [
    "DIST_TIMEOUT_S",
    "DataParallel",
    "resolve_device",
    "start_data_parallel",
    "stop_data_parallel",
    "unwrap_data_parallel",
]

# How long a process of a data-parallel run waits for the others in one collective (torch's NCCL default).
DIST_TIMEOUT_S = 600.0

# What torchrun sets for each process; any of them means a data-parallel start.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
# Where the ranks meet; clusters often export these for every job, so alone they mean nothing.
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel run; one process is rank 0 of a world of 1.

    Attributes:
        rank: global rank, 0 .. world_size - 1; rank 0 writes every file of the run.
        local_rank: rank on this node (the GPU it uses).
        world_size: number of processes.
        device: where this process computes (``cuda:LOCAL_RANK`` or the CPU).
        timeout_s: how long a rank waits for the others in one collective.

    Every collective raises :class:`~cl_streamkl.distributed.lost_peers.LostPeerError`
    when another process is lost (died, hung past ``timeout_s``, cut off).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = DIST_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        """Whether this process is rank 0, the one that prints and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether there are other processes (a process group exists)."""
        return self.world_size > 1

    def wrap(self, model: nn.Module, *, find_unused_parameters: bool = False) -> nn.Module:
        """``model`` in ``DistributedDataParallel`` (rank 0's weights broadcast); ``model`` itself alone.

        Args:
            model: the model, already on :attr:`device`.
            find_unused_parameters: some parameters get no gradient in a step (one head per
                task in the task scenario).
        """
        if not self.distributed:
            return model
        device_ids = [self.device] if self.device.type == "cuda" else None
        with self.peers_checked("broadcasting rank 0's weights"):
            return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=find_unused_parameters)

    def peers_checked(self, doing: str) -> contextlib.AbstractContextManager[None]:
        """A block whose lost peer (a ``DistributedDataParallel`` step's, say) raises ``LostPeerError``.

        Args:
            doing: what the block does, completing "lost contact with the other processes
                while ...".
        """
        return peers_checked(doing, self.timeout_s)

    def _reduced(self, values: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if not self.distributed:
            return values
        # NCCL reduces tensors on this rank's GPU only.
        work = values.to(self.device, copy=True)
        with self.peers_checked("adding up values over the ranks"):
            dist.all_reduce(work, op=op)
        return work.to(values.device)

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``values`` over the ranks (every rank passes the same shape)."""
        return self._reduced(values, dist.ReduceOp.SUM)

    def all_max(self, value: float) -> float:
        """The largest ``value`` over the ranks."""
        return float(self._reduced(torch.tensor([value], dtype=torch.float64), dist.ReduceOp.MAX))

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.distributed:
            with self.peers_checked("waiting for every rank"):
                dist.barrier(device_ids=[self.local_rank] if self.device.type == "cuda" else None)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (any picklable object)."""
        if not self.distributed:
            return obj
        holder = [obj]
        with self.peers_checked("broadcasting rank 0's state"):
            dist.broadcast_object_list(holder, src=0, device=self.device)
        return holder[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        with self.peers_checked("gathering every rank's state"):
            dist.all_gather_object(gathered, obj)
        return gathered

    def adopt_main_rng(self) -> None:
        """Give every rank rank 0's torch CPU generator state.

        Data loaders draw their shuffles from it, so the ranks draw the same batch order
        even after random numbers they drew apart (dropout on the CPU, over batches of
        different sizes).
        """
        if self.distributed:
            torch.set_rng_state(self.broadcast(torch.get_rng_state()))

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (a download, say), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


def resolve_device(device: str) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; ``"cuda"`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    return torch.device(device)


def _integer(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def _listed(names: list[str]) -> str:
    return ", ".join(names) + (" is" if len(names) == 1 else " are")


def start_data_parallel(device: str, timeout_s: float = DIST_TIMEOUT_S,
                        environ: Mapping[str, str] | None = None) -> DataParallel:
    """This process's :class:`DataParallel` handle, joining torchrun's process group if there is one.

    Without RANK, LOCAL_RANK and WORLD_SIZE in the environment (no torchrun), or with
    WORLD_SIZE=1, the run is one process and no group is made. Otherwise all five of
    torchrun's variables must be set; the group uses NCCL when the run computes on CUDA
    (``device`` "cuda", or "auto" with a GPU; rank r on ``cuda:LOCAL_RANK``) and gloo on
    the CPU.

    Args:
        device: the run's device choice, "auto", "cpu" or "cuda".
        timeout_s: how long a rank waits in one collective (or for the others to join)
            before it fails, so a rank that died or hangs stops the rest.
        environ: the environment (default ``os.environ``).

    Raises:
        ValueError: the environment is half set (e.g. WORLD_SIZE without MASTER_ADDR), a
            value is not an integer or out of range, more processes share a node than it
            has GPUs, or the device is unavailable. Every rank raises the same error.
        LostPeerError: the other processes did not all join within ``timeout_s``.
    """
    environ = os.environ if environ is None else environ
    present = [name for name in RANK_VARIABLES if name in environ]
    if not present:
        return DataParallel(device=resolve_device(device))
    missing = [name for name in (*RANK_VARIABLES, *RENDEZVOUS_VARIABLES) if not environ.get(name)]
    if missing:
        raise ValueError(
            f"{_listed(present)} set but {_listed(missing)} not: start data-parallel runs with torchrun "
            "(torchrun --nproc_per_node N -m cl_streamkl run ...), or set all of RANK, LOCAL_RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT (unset RANK, LOCAL_RANK and WORLD_SIZE for a single process)")
    rank, local_rank, world_size = (_integer(environ, name) for name in RANK_VARIABLES)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ValueError(f"torchrun's variables disagree: RANK={rank}, LOCAL_RANK={local_rank}, "
                         f"WORLD_SIZE={world_size} (need 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0)")
    if timeout_s <= 0:
        raise ValueError(f"the process group's timeout must be > 0 seconds; got {timeout_s}")
    chosen = resolve_device(device)
    if world_size == 1:
        return DataParallel(device=chosen)
    if chosen.type == "cuda":
        # Every rank of the node checks the node's process count, so all of them stop
        # here rather than some waiting for ranks that never join.
        per_node = _integer(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else local_rank + 1
        gpus = torch.cuda.device_count()
        if max(per_node, local_rank + 1) > gpus:
            raise ValueError(
                f"{max(per_node, local_rank + 1)} processes on this node but {gpus} GPU(s) visible: each process "
                f"needs a GPU of its own; start at most {gpus} per node (torchrun --nproc_per_node {gpus}) "
                "or train on the CPU with --device cpu")
        chosen = torch.device("cuda", local_rank)
        torch.cuda.set_device(chosen)
        # Bound to its GPU, NCCL connects the ranks now rather than at the first collective.
        options: dict[str, Any] = {"backend": "nccl", "device_id": chosen}
    else:
        options = {"backend": "gloo"}
    with peers_checked("joining the process group", timeout_s):
        dist.init_process_group(init_method="env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **options)
    return DataParallel(rank=rank, local_rank=local_rank, world_size=world_size, device=chosen, timeout_s=timeout_s)


def stop_data_parallel(data_parallel: DataParallel) -> None:
    """Leave the process group :func:`start_data_parallel` joined (nothing for one process)."""
    if data_parallel.distributed and dist.is_initialized():
        dist.destroy_process_group()


def unwrap_data_parallel(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` (or ``DataParallel``) wrapper holds; any other model as it is.

    The wrapper's forward runs this module, so hooks on its attention modules see every
    forward through the wrapper; a snapshot (a teacher) copies this module, never the
    wrapper with its process group and gradient reducer.
    """
    while isinstance(model, (DistributedDataParallel, SingleProcessDataParallel)):
        model = model.module
    return model
