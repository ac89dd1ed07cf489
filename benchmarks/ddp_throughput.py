"""Data-parallel training throughput with StreamKL distillation: ViT-B/16 at 1025 tokens on 1 and 2 GPUs.

Images per second and peak memory per GPU for each world size, and the scaling over one GPU
(two GPUs: target 1.85×), of DDP training steps doing the StreamKL plugin's work; the set-up:
docs/benchmarks.md (Method, Several GPUs).

Usage, from the repository root (one GPU per rank; torchrun's standalone rendezvous on this
host, no network):
    python benchmarks/ddp_throughput.py [--json [PATH]]        # 1 and 2 GPUs, then the table
    torchrun --nproc_per_node 2 benchmarks/ddp_throughput.py [--json [PATH]]     # one world size
    python benchmarks/ddp_throughput.py --smoke                 # gloo on the CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from _harness.distributed import start_process_group
from _harness.report import add_json_flag, aligned, cell, describe_environment, environment_line, header_line, run_settings, write_json

TARGET_SCALING = 1.85
TABLE = [("GPUs", 4), ("batch/GPU", 9), ("step ms", 8), ("images/s", 9), ("scaling", 7), ("peak GiB/GPU", 12)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2], metavar="N",
                        help="GPU counts to run, each through torchrun (default: 1 2); ignored under torchrun")
    parser.add_argument("--batch", type=int, default=16, help="images per GPU and step (default: 16)")
    parser.add_argument("--image-size", type=int, default=512, help="input side, 512 px: 1025 tokens (default)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps, the median reported (default: 20)")
    parser.add_argument("--timeout-s", type=float, default=170.0, help="limit per world size (default: 170)")
    parser.add_argument("--smoke", action="store_true", help="gloo on the CPU: a tiny ViT, batch 2, 2 steps")
    add_json_flag(parser)
    parser.add_argument("--commit", default=None, help="commit to print when the tree has no .git")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.image_size, args.warmup, args.steps = 2, 32, 1, 2
    return args


def format_row(row: dict) -> str:
    return aligned([str(row["gpus"]), str(row["batch_per_gpu"]), cell(row["step_ms"], ".1f"),
                    cell(row["images_per_s"], ".1f"), cell(row.get("scaling"), ".2f"),
                    cell(row["peak_gib_per_gpu"], ".2f")], TABLE)


def print_table(rows: list[dict]) -> None:
    print(header_line(TABLE))
    for row in rows:
        print(format_row(row))


# ---------------------------------------------------------------- one world size, under torchrun


def measure(args: argparse.Namespace) -> int:
    """This rank's part of one world size's measurement; rank 0 prints the row and writes the JSON."""
    # The ranks alone import timm and Avalanche: seconds of imports that the launching process
    # would spend for nothing before each torchrun.
    from _harness.vit_training import DEFAULT_MODEL, TINY_MODEL_KWARGS, Trainer, build_distiller, build_model, time_steps

    device = start_process_group(args.smoke)
    # timm's class token (1, 1, D) gets a gradient strided along its size-1 dimensions; DDP
    # copies those D numbers into its bucket and would warn about it.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = "torch" if args.smoke else "triton"
    model_kwargs = TINY_MODEL_KWARGS if args.smoke else {}
    torch.manual_seed(0)
    model = build_model(DEFAULT_MODEL, model_kwargs, args.image_size, device).train()
    student = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                      gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4, fused=device.type == "cuda")
    distiller = build_distiller(backend, alpha=1.0)
    distiller.update_teacher(student)  # a snapshot of the module inside the wrapper
    trainer = Trainer(student, optimizer, distiller, model.num_classes, device)
    torch.manual_seed(1 + rank)  # each rank its own images
    step_ms, peak_gib = time_steps(trainer, args.batch, args.image_size, args.warmup, args.steps)
    slowest = torch.tensor([step_ms], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_gib)
    if rank == 0:
        tokens = (args.image_size // model.patch_embed.patch_size[0]) ** 2 + 1
        environment = describe_environment(device, args.commit)
        print("# " + environment_line(environment))
        print(f"# {world} rank(s) ({dist.get_backend()}), {DEFAULT_MODEL} at {args.image_size} px ({tokens} tokens), "
              f"batch {args.batch} per rank, bf16 autocast, AdamW, StreamKL over {len(model.blocks)} blocks "
              f"({backend}), DDP")
        row = {"gpus": world, "batch_per_gpu": args.batch, "step_ms": slowest.item(),
               "images_per_s": world * args.batch / slowest.item() * 1e3,
               "peak_gib_per_gpu": None if peaks[0] is None else max(peaks), "peak_gib_by_rank": peaks}
        print_table([row])
        if args.json is not None:
            write_json(args.json, {"environment": environment, "settings": run_settings(args), "model": DEFAULT_MODEL,
                                   "tokens": tokens, "rows": [row]})
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- every world size, one torchrun each


def launch(args: argparse.Namespace) -> int:
    """Run each world size through torchrun, then print every row with its scaling over one GPU."""
    if not args.smoke and torch.cuda.device_count() < max(args.world_sizes):
        print(f"{max(args.world_sizes)} GPUs needed, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 1
    forwarded = ["--batch", str(args.batch), "--image-size", str(args.image_size), "--warmup", str(args.warmup),
                 "--steps", str(args.steps), *(["--smoke"] if args.smoke else []),
                 *(["--commit", args.commit] if args.commit else [])]
    reports = []
    with tempfile.TemporaryDirectory() as folder:
        for world in args.world_sizes:
            report = Path(folder) / f"{world}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                       __file__, *forwarded, "--json", str(report)]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                print(f"{world} GPU(s): no result within {args.timeout_s:g} s", file=sys.stderr)
                return 1
            if result.returncode != 0:
                print(f"{world} GPU(s) failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}", file=sys.stderr)
                return 1
            reports.append(json.loads(report.read_text()))
    rows = [row for report in reports for row in report["rows"]]
    single = next((row for row in rows if row["gpus"] == 1), None)
    for row in rows:
        row["scaling"] = None if single is None else row["images_per_s"] / single["images_per_s"]
    two = next((row for row in rows if row["gpus"] == 2), None)
    meets = None if two is None or two["scaling"] is None else two["scaling"] >= TARGET_SCALING
    print("# " + environment_line(reports[0]["environment"]))
    print(f"# {reports[0]['model']} at {args.image_size} px ({reports[0]['tokens']} tokens), batch {args.batch} per GPU, "
          f"StreamKL distillation, DDP; slowest rank's median of {args.steps} steps after {args.warmup}")
    if meets is not None:
        print(f"# 2 GPUs: {two['scaling']:.2f}x one GPU's throughput, target {TARGET_SCALING}x: "
              f"{'met' if meets else 'MISSED'}")
    print_table(rows)
    if args.json is not None:
        write_json(args.json, {"environment": reports[0]["environment"], "settings": run_settings(args),
                               "tokens": reports[0]["tokens"], "rows": rows, "target_scaling": TARGET_SCALING,
                               "meets_target": meets})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return measure(args) if "RANK" in os.environ else launch(args)


if __name__ == "__main__":
    sys.exit(main())
