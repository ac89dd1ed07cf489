"""Starting the process group of a benchmark run under torchrun."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

# A rank that died or hangs ends the others' run within this, inside a device call's limits.
GROUP_TIMEOUT = timedelta(seconds=150)


def start_process_group(smoke: bool) -> torch.device:
    """Join torchrun's process group: gloo on the CPU for a smoke run, else NCCL on GPU LOCAL_RANK.

    Returns:
        The device this rank computes on.
    """
    if smoke:
        dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=GROUP_TIMEOUT, device_id=device)
    return device
