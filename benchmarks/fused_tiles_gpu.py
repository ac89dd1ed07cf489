"""Tiles of the fused forward (the KL and its gradients in one pass), swept on the GPU.

For each candidate (BLOCK_M queries streamed, BLOCK_N keys held, warps, stages), times a mean
KL's forward+backward with both log-sum-exps given (``do_bench`` medians) in one process beside
SDPA's default backend (cuDNN on Hopper; forward+backward of attention on the same q, k and a v)
and beside the forward-then-backward kernels (``kernel_options(fused_gradients="off")``):
single problems at 4096 and 8192 tokens (``tuning.FUSED_TILES``, autotuning off) and 12 blocks
grouped at ViT lengths (``tuning.GROUPED_TILES[...]["fused"]``). The tiles the package uses come
from this sweep.

Usage (from the repository root, with the package installed)::

    python benchmarks/fused_tiles_gpu.py --json
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton.testing

from _harness.kl_workloads import log_sum_exps
from _harness.options import add_run_flags
from _harness.report import describe_environment, environment_line, run_settings, write_json
from cl_streamkl import attention_kl, attention_kl_grouped
from cl_streamkl.kernels.config import kernel_options
from cl_streamkl.kernels.triton import tuning

CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 2),
           (128, 64, 4, 2), (32, 128, 4, 3), (128, 128, 8, 2), (32, 64, 4, 2)]
SINGLE = [(2, 12, 4096, 64), (1, 12, 8192, 64)]
GROUPED = [(32, 12, 197, 64), (16, 12, 577, 64), (16, 12, 1025, 64)]
BLOCKS = 12


def _problem(shape) -> tuple[torch.Tensor, ...]:
    q, k, q_t, k_t = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), q_t, k_t


def _ms(fn, leaves) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")


def sweep_single(shape) -> list[dict]:
    q, k, q_t, k_t = problem = _problem(shape)
    v = torch.randn_like(q_t).requires_grad_()
    lse = {"lse": log_sum_exps(q, k), "lse_teacher": log_sum_exps(q_t, k_t)}
    sdpa = _ms(lambda: F.scaled_dot_product_attention(q, k, v).backward(torch.ones_like(q)), [q, k, v])

    def kl():
        attention_kl(*problem, backend="triton", **lse).backward()

    with kernel_options(fused_gradients="off"):
        unfused = _ms(kl, [q, k])
    rows = []
    for config in CONFIGS:
        tuning.FUSED_TILES = config
        with kernel_options(autotune=False, fused_gradients="on"):
            ms = _ms(kl, [q, k])
        rows.append({"shape": "x".join(map(str, shape)), "tiles": config, "fused_ms": ms, "sdpa_ms": sdpa,
                     "unfused_ms": unfused, "fused_vs_sdpa": ms / sdpa, "unfused_vs_sdpa": unfused / sdpa})
        print(rows[-1], flush=True)
    return rows


def sweep_grouped(shape) -> list[dict]:
    problems = [_problem(shape) for _ in range(BLOCKS)]
    leaves = [t for p in problems for t in p[:2]]
    values = [torch.randn_like(p[2]).requires_grad_() for p in problems]
    lse = {"lse": [log_sum_exps(q, k) for q, k, _, _ in problems],
           "lse_teacher": [log_sum_exps(q_t, k_t) for _, _, q_t, k_t in problems]}

    def attention():
        for (q, k, _, _), v in zip(problems, values):
            F.scaled_dot_product_attention(q, k, v).backward(torch.ones_like(q))

    def kl():
        attention_kl_grouped(problems, backend="triton", **lse).sum().backward()

    sdpa = _ms(attention, leaves + values)
    with kernel_options(fused_gradients="off"):
        unfused = _ms(kl, leaves)
    bucket = 256 if tuning.length_bucket(shape[2]) <= 256 else tuning.SHORT_SEQUENCE_BUCKET
    rows = []
    for config in CONFIGS:
        tuning.GROUPED_TILES[bucket]["fused"] = config
        with kernel_options(fused_gradients="on"):
            ms = _ms(kl, leaves)
        rows.append({"shape": f"{BLOCKS}x" + "x".join(map(str, shape)), "tiles": config, "fused_ms": ms,
                     "sdpa_ms": sdpa, "unfused_ms": unfused, "fused_vs_sdpa": ms / sdpa,
                     "unfused_vs_sdpa": unfused / sdpa})
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_flags(parser)
    args = parser.parse_args()
    environment = describe_environment(torch.device("cuda"), args.commit)
    print(environment_line(environment), flush=True)
    torch.manual_seed(0)
    rows = [row for shape in SINGLE for row in sweep_single(shape)]
    rows += [row for shape in GROUPED for row in sweep_grouped(shape)]
    for shape in dict.fromkeys(row["shape"] for row in rows):
        best = min((row for row in rows if row["shape"] == shape), key=lambda row: row["fused_ms"])
        print(f"{shape}: best {best['tiles']} {best['fused_vs_sdpa']:.2f}x cuDNN "
              f"(forward then backward {best['unfused_vs_sdpa']:.2f}x)")
    if args.json is not None:
        write_json(args.json, {"environment": environment, "settings": run_settings(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
