"""Where a StreamKL call spends its time: GPU kernel time against the time a caller waits.

For each shape, prints the do_bench median of a forward and of a forward+backward
(what the caller sees, host overhead included when the GPU work is short) beside the
summed device time of every kernel the call launched, from torch.profiler. A large
gap between the two means the call is host-bound (launch and dispatch overhead).

With --host-profile, also prints the Python functions that take the host's time in
one forward+backward (cProfile, sorted by own time).

Usage: python benchmarks/profile_kernels.py [--shapes 32x12x197x64 8x12x1024x64] [--host-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from cl_streamkl import attention_kl


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = tuple(int(part) for part in text.lower().split("x"))
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"shape must be BxHxNxD, got {text!r}")
    return parts


def kernel_times_us(fn, iterations: int = 20) -> dict[str, float]:
    """Mean device time per call of each kernel launched by fn."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:60]] += event.device_time / iterations
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(32, 12, 197, 64), (8, 12, 1024, 64)])
    parser.add_argument("--host-profile", action="store_true")
    args = parser.parse_args()
    for batch, heads, n, dim in args.shapes:
        q, k, q_t, k_t = (torch.randn(batch, heads, n, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        q.requires_grad_()
        k.requires_grad_()

        def forward():
            return attention_kl(q, k, q_t, k_t, backend="triton")

        def forward_backward():
            torch.autograd.grad(forward(), (q, k))

        for mode, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
            waited_ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            kernels = kernel_times_us(fn)
            device_us = sum(kernels.values())
            print(
                f"{batch}x{heads}x{n}x{dim} {mode:8s} waited {waited_ms * 1e3:8.1f} us, "
                f"device {device_us:8.1f} us, host-bound gap {waited_ms * 1e3 - device_us:8.1f} us"
            )
            for name, us in sorted(kernels.items(), key=lambda item: -item[1]):
                print(f"    {us:8.1f} us  {name}")
        if args.host_profile:
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [forward_backward() for _ in range(100)])
            torch.cuda.synchronize()
            print("host profile of 100 forward+backward calls:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
