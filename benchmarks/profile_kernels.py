"""Where a StreamKL call spends its time: GPU kernel time against the time a caller waits.

Per shape, the do_bench median of a forward and of a forward+backward beside the summed
kernel time of the same call (torch.profiler); ``--host-breakdown`` adds the host time per
call of each layer of the call stack, with and without compiled-kernel replay, and
``--host-profile`` a cProfile of one forward+backward. See docs/benchmarks.md (Method).

Usage (from the repository root, with the package installed: ``pip install -e .``):
python benchmarks/profile_kernels.py [--shapes 32x12x197x64 8x12x1024x64] [--host-breakdown] [--host-profile]
    [--json [PATH]]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from _harness.measure import gpu_kernel_times_us, median_ms
from _harness.options import parse_shape, shape_label
from _harness.report import add_json_flag, describe_environment, run_settings, write_json
from cl_streamkl import attention_kl
from cl_streamkl.kernels.backward_inputs import BackwardInputs
from cl_streamkl.kernels.triton import launch


def host_us_per_call(fn, calls: int = 50) -> float:
    """Host wall time of one call, from calls queued back to back before one sync.

    Few enough calls that CUDA's launch queue never fills (a full queue would make
    the host wait for the GPU and report device time instead).
    """
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


class _PythonIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def host_breakdown(q, k, q_t, k_t) -> dict[str, float]:
    """Host µs per call of each layer between the caller and the kernels (frozen teacher).

    Also times the autograd engine alone on a 16-element tensor: a C++ backward, a
    Python ``autograd.Function`` backward (which the engine's CUDA worker thread must
    take the GIL to run), and the latter with the engine's worker threads disabled.
    """
    scale = q.size(-1) ** -0.5
    launch_args = (q, k, q_t, k_t, scale, scale, False)
    rows, lse_s, lse_t = launch.launch_forward(*launch_args)
    grad_rows = torch.ones_like(rows)
    tiny = torch.randn(16, device=q.device, requires_grad=True)
    launchers = tuple(launch.KERNEL_LAUNCHERS.values())

    def launch_backward():
        saved = BackwardInputs(q, k, q_t, k_t, lse_s, lse_s, lse_t, scale, scale, False, False)
        launch.launch_backward(grad_rows, saved)

    def forward_no_grad():
        with torch.no_grad():
            attention_kl(q, k, q_t, k_t, backend="triton")

    def forward_grad():
        torch.autograd.grad(attention_kl(q, k, q_t, k_t, backend="triton"), (q, k))

    def single_threaded(fn):
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                fn()

        return run

    def sdpa_forward_grad():
        torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, k, q_t).sum(), (q, k))

    def tiny_cpp_backward():
        torch.autograd.grad((tiny * 2).sum(), tiny)

    def tiny_python_backward():
        torch.autograd.grad(_PythonIdentity.apply(tiny).sum(), tiny)

    layers = {
        "launch_forward": lambda: launch.launch_forward(*launch_args),
        "launch_backward": launch_backward,
        "attention_kl no_grad": forward_no_grad,
        "attention_kl (graph)": lambda: attention_kl(q, k, q_t, k_t, backend="triton"),
        "fwd + autograd.grad": forward_grad,
        "fwd + autograd.grad, 1 thread": single_threaded(forward_grad),
        "SDPA fwd + autograd.grad": sdpa_forward_grad,
        "tiny C++ backward": tiny_cpp_backward,
        "tiny Python backward": tiny_python_backward,
        "tiny Python backward, 1 thread": single_threaded(tiny_python_backward),
    }
    result = {name: host_us_per_call(fn) for name, fn in layers.items()}
    replaying = [launcher.replay for launcher in launchers]
    for launcher in launchers:
        launcher.replay = False
    for name in ("launch_forward", "launch_backward", "fwd + autograd.grad"):
        result[f"{name} (no replay)"] = host_us_per_call(layers[name])
    for launcher, replay in zip(launchers, replaying):
        launcher.replay = replay
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(32, 12, 197, 64), (8, 12, 1024, 64)])
    parser.add_argument("--host-breakdown", action="store_true")
    parser.add_argument("--host-profile", action="store_true")
    add_json_flag(parser, "also write the kernel and host times as JSON")
    args = parser.parse_args()
    rows = []
    for batch, heads, n, dim in args.shapes:
        q, k, q_t, k_t = (torch.randn(batch, heads, n, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        q.requires_grad_()
        k.requires_grad_()

        def forward():
            return attention_kl(q, k, q_t, k_t, backend="triton")

        def forward_backward():
            torch.autograd.grad(forward(), (q, k))

        for mode, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
            waited_ms = median_ms(fn, torch.device("cuda"), rep_ms=200)
            kernels = gpu_kernel_times_us(fn, iterations=20)
            device_us = sum(kernels.values())
            print(
                f"{batch}x{heads}x{n}x{dim} {mode:8s} waited {waited_ms * 1e3:8.1f} us, "
                f"device {device_us:8.1f} us, host-bound gap {waited_ms * 1e3 - device_us:8.1f} us"
            )
            for name, us in sorted(kernels.items(), key=lambda item: -item[1]):
                print(f"    {us:8.1f} us  {name}")
            rows.append({"shape": shape_label((batch, heads, n, dim)), "mode": mode, "waited_us": waited_ms * 1e3,
                         "device_us": device_us, "kernels_us": kernels})
        if args.host_breakdown:
            print(f"host time per call, {batch}x{heads}x{n}x{dim} (no sync between calls):")
            layers = host_breakdown(q, k, q_t, k_t)
            for name, us in layers.items():
                print(f"    {us:8.1f} us  {name}")
            rows.append({"shape": shape_label((batch, heads, n, dim)), "mode": "host", "host_us": layers})
        if args.host_profile:
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [forward_backward() for _ in range(100)])
            torch.cuda.synchronize()
            print("host profile of 100 forward+backward calls:")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    if args.json is not None:
        write_json(args.json, {"environment": describe_environment(torch.device("cuda")),
                               "settings": run_settings(args), "rows": rows})


if __name__ == "__main__":
    main()
