"""Context parallelism on GPUs: attention_kl_key_sharded over keys split across ranks vs one GPU.

For each N (default 65536 and 131072), inputs (1, 12, N, 64) bf16 with a frozen teacher; every
rank holds all queries and N / world keys. Checks the sharded KL and gradients against one GPU
and float64, then times both (fixed repetitions, the slowest rank's) and reads the peak memory
per GPU. The kernels use the heuristic tiles (autotuned with --autotune); why, and why
fixed repetitions: docs/benchmarks.md (Method, Several GPUs).
Out of memory on one GPU is reported as OOM; in the sharded run it ends the job (the other
ranks are waiting in a collective).

Usage, from the repository root (NCCL, one GPU per rank; exits 1 if a check fails):
    torchrun --nproc_per_node 2 benchmarks/context_parallel_gpu.py [--json [PATH]]
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/context_parallel_gpu.py --smoke      # gloo on the CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from _harness.distributed import start_process_group
from _harness.measure import PeakMemory, relative_error, sync
from _harness.options import DTYPES
from _harness.report import (
    add_json_flag, aligned, cell, describe_environment, environment_line, header_line, run_settings, write_json,
)
from cl_streamkl import attention_kl, attention_kl_reference
from cl_streamkl.distributed import attention_kl_key_sharded
from cl_streamkl.kernels.config import set_kernel_options

# check_gpu.py's bounds for the kernels against float64; the sharded result against one GPU
# is held to the same (its gradients add two partial sums rounded to the inputs' dtype).
VALUE_BOUND, GRAD_BOUND = 1e-4, 2e-2
TABLE = [("N", 8), ("run", 8), ("GPUs", 4), ("fwd ms", 9), ("fwd+bwd ms", 10), ("peak GiB/GPU", 12),
         ("fwd+bwd speedup", 15)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[65536, 131072], help="sequence lengths N")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    parser.add_argument("--reps", type=int, default=5, help="timed calls (the median is reported)")
    parser.add_argument("--check-rows", type=int, default=64, help="query rows compared with float64")
    parser.add_argument("--autotune", action="store_true", help="autotune the tiles (default: heuristic tiles)")
    parser.add_argument("--smoke", action="store_true", help="gloo on the CPU at tiny sizes")
    add_json_flag(parser)
    parser.add_argument("--commit", default=None, help="commit to print when the tree has no .git")
    args = parser.parse_args()
    if args.smoke:
        args.seqs, args.heads, args.head_dim, args.warmup, args.reps, args.check_rows = [32, 48], 1, 16, 0, 1, 8
    return args


def make_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Student q, k (requiring grad), a frozen teacher near them, and row weights; rank 0's everywhere."""
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device)

    q, k = randn(*shape), randn(*shape)
    tensors = {
        "q": q, "k": k, "q_teacher": q + 0.5 * randn(*shape), "k_teacher": k + 0.5 * randn(*shape),
    }
    tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    tensors["weight"] = torch.rand(shape[:3], generator=generator, device=device) + 0.5
    for tensor in tensors.values():
        dist.broadcast(tensor, src=0)
    tensors["q"].requires_grad_()
    tensors["k"].requires_grad_()
    return tensors


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` after ``warmup`` (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def peak_gib(fn: Callable[[], object], inputs: list[torch.Tensor], device: torch.device) -> float | None:
    """Inputs plus the peak extra allocation of one ``fn()``, in GiB (CUDA only)."""
    with PeakMemory(device) as memory:
        fn()
    if memory.extra_bytes is None:
        return None
    return (sum(tensor.nbytes for tensor in inputs) + memory.extra_bytes) / 2**30


def slowest(value: float | None, device: torch.device) -> float | None:
    """The largest ``value`` over the ranks (None stays None: it is None everywhere)."""
    if value is None:
        return None
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def fwd_bwd(kl: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> Callable[[], object]:
    return lambda: torch.autograd.grad(kl(), inputs)


def run_length(n: int, args, device: torch.device, backend: str) -> tuple[list[dict], list[dict]]:
    """Checks (on rank 0; empty elsewhere) and table rows (rank 0) for sequence length ``n``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = (1, args.heads, n, args.head_dim)
    t = make_inputs(shape, DTYPES[args.dtype], device)
    q, q_teacher, weight = t["q"], t["q_teacher"], t["weight"]
    start = rank * (n // world)
    k_shard = t["k"].detach()[:, :, start : start + n // world].clone().requires_grad_()
    k_teacher_shard = t["k_teacher"][:, :, start : start + n // world].clone()

    def sharded(reduction: str = "mean") -> torch.Tensor:
        return attention_kl_key_sharded(q, k_shard, q_teacher, k_teacher_shard, reduction=reduction, backend=backend)

    def single(reduction: str = "mean") -> torch.Tensor:
        return attention_kl(q, t["k"], q_teacher, t["k_teacher"], reduction=reduction, backend=backend)

    rows = sharded("none")
    dq, dk_shard = torch.autograd.grad((rows * weight).sum(), (q, k_shard))
    dk_shards = [torch.empty_like(dk_shard) for _ in range(world)] if rank == 0 else None
    dist.gather(dk_shard, dk_shards, dst=0)
    sharded_ms = [median_ms(fn, device, args.warmup, args.reps) for fn in (sharded, fwd_bwd(sharded, (q, k_shard)))]
    sharded_ms = [slowest(ms, device) for ms in sharded_ms]
    sharded_gib = slowest(peak_gib(fwd_bwd(sharded, (q, k_shard)), [q, k_shard, q_teacher, k_teacher_shard],
                                   device), device)
    checks, table = [], []
    if rank == 0:
        checks, single_row = check_and_time_single(
            n, args, device, backend, t, single, (rows, dq, torch.cat(dk_shards, dim=2))
        )
        speedup = None if single_row["fwd_bwd_ms"] is None else single_row["fwd_bwd_ms"] / sharded_ms[1]
        table = [single_row, {"seq": n, "run": "sharded", "gpus": world, "fwd_ms": sharded_ms[0],
                              "fwd_bwd_ms": sharded_ms[1], "peak_gib": sharded_gib, "speedup_fwd_bwd": speedup}]
    dist.barrier()
    return checks, table


def check_and_time_single(n, args, device, backend, t, single, sharded_results) -> tuple[list[dict], dict]:
    """Rank 0: the whole problem on one GPU, the checks, and its table row (OOM: None entries)."""
    q, k, q_teacher, k_teacher, weight = (t[name] for name in ("q", "k", "q_teacher", "k_teacher", "weight"))
    rows, dq, dk = sharded_results
    subsample = torch.linspace(0, n - 1, min(args.check_rows, n), device=device).long()
    q_rows = q.detach()[:, :, subsample].requires_grad_()
    reference = attention_kl_reference(q_rows, k, q_teacher[:, :, subsample], k_teacher, reduction="none")
    (reference_dq,) = torch.autograd.grad((reference * weight[:, :, subsample]).sum(), (q_rows,))
    checks = [check(n, "sharded vs float64 rows", rows[:, :, subsample], reference,
                    dq[:, :, subsample], reference_dq)]
    row = {"seq": n, "run": "single", "gpus": 1, "fwd_ms": None, "fwd_bwd_ms": None, "peak_gib": None,
           "speedup_fwd_bwd": 1.0}
    try:
        single_rows = single("none")
        single_dq, single_dk = torch.autograd.grad((single_rows * weight).sum(), (q, k))
        checks.append(check(n, "single GPU vs float64 rows", single_rows[:, :, subsample], reference,
                            single_dq[:, :, subsample], reference_dq))
        checks.append(check(n, "sharded vs single GPU", rows, single_rows, dq, single_dq, dk, single_dk))
        del single_rows, single_dq, single_dk
        row["fwd_ms"], row["fwd_bwd_ms"] = (median_ms(fn, device, args.warmup, args.reps)
                                            for fn in (single, fwd_bwd(single, (q, k))))
        row["peak_gib"] = peak_gib(fwd_bwd(single, (q, k)), [q, k, q_teacher, k_teacher], device)
    except torch.OutOfMemoryError:
        row["speedup_fwd_bwd"] = None
        row["oom"] = True
    return checks, row


def check(n, what, value, value_ref, dq, dq_ref, dk=None, dk_ref=None) -> dict:
    errors = {"value": relative_error(value, value_ref), "dq": relative_error(dq, dq_ref),
              "dk": None if dk is None else relative_error(dk, dk_ref)}
    passed = errors["value"] <= VALUE_BOUND and all(errors[name] <= GRAD_BOUND for name in ("dq", "dk")
                                                    if errors[name] is not None)
    return {"seq": n, "what": what, **errors, "passed": passed}


def format_check(result: dict) -> str:
    dk = "" if result["dk"] is None else f" dk {result['dk']:.1e}"
    return (f"N={result['seq']} {result['what']}: KL {result['value']:.1e} dq {result['dq']:.1e}{dk} "
            f"(bounds {VALUE_BOUND:.0e}, {GRAD_BOUND:.0e}) {'ok' if result['passed'] else 'FAIL'}")


def format_row(row: dict) -> str:
    if row.get("oom"):
        cells = [str(row["seq"]), row["run"], str(row["gpus"]), "OOM", "OOM", "OOM", "-"]
    else:
        cells = [str(row["seq"]), row["run"], str(row["gpus"]), cell(row["fwd_ms"], ".1f"),
                 cell(row["fwd_bwd_ms"], ".1f"), cell(row["peak_gib"], ".2f"), cell(row["speedup_fwd_bwd"], ".2f")]
    return aligned(cells, TABLE)


def main() -> int:
    args = parse_args()
    set_kernel_options(autotune=args.autotune)
    device = start_process_group(args.smoke)
    from cl_streamkl.kernels.triton import INTERPRETING

    rank, world = dist.get_rank(), dist.get_world_size()
    if any(n % world for n in args.seqs):
        raise SystemExit(f"every N must split evenly over {world} ranks, got {args.seqs}")
    backend = "triton" if device.type == "cuda" or INTERPRETING else "torch"
    environment = describe_environment(device, args.commit)
    if rank == 0:
        print("# " + environment_line(environment))
        print(f"# {world} ranks ({dist.get_backend()}), backend {backend}, "
              f"tiles {'autotuned' if args.autotune else 'heuristic'}, {args.dtype}, "
              f"B=1 H={args.heads} D={args.head_dim}, frozen teacher")
    checks, rows = [], []
    for n in args.seqs:
        length_checks, length_rows = run_length(n, args, device, backend)
        for result in length_checks:
            print(format_check(result))
        checks += length_checks
        rows += length_rows
    passed = torch.tensor([all(result["passed"] for result in checks)], dtype=torch.int64, device=device)
    dist.broadcast(passed, src=0)
    if rank == 0:
        print(header_line(TABLE))
        for row in rows:
            print(format_row(row))
        if args.json is not None:
            write_json(args.json, {"environment": environment, "settings": run_settings(args),
                                   "backend": backend, "world_size": world, "checks": checks, "rows": rows,
                                   "passed": bool(passed.item())})
    dist.destroy_process_group()
    return 0 if passed.item() else 1


if __name__ == "__main__":
    sys.exit(main())
