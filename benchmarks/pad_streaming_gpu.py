"""PAD with and without its attention maps on the GPU: correctness first, then time and peak memory.

(a) correctness of :func:`cl_streamkl.pooled_attention` (triton) against the float64 reference at
    odd lengths, float32 and bf16, both variants (P² and P): values and gradients of q and k under
    random weights on both pooled vectors. An error over the bound marks the check FAIL and the
    exit status 1.
(b) PAD over 12 ViT-B-like blocks (B×12×N×64 bf16, a student whose q and k need gradients and a
    frozen teacher), ``pooled_attention_distance(streaming=False)`` (the maps materialised in
    float32) against ``streaming=True`` (the Triton kernels): median ms (triton.testing.do_bench)
    of fwd (no autograd) and fwd+bwd, the peak memory each allocates above its inputs, and the
    two penalties' relative difference. Out of memory is a result.

The pooled kernels use fixed tiles (no autotuning); the run takes about two minutes on an H200.

Usage:
    python benchmarks/pad_streaming_gpu.py --json benchmarks/results/pad-streaming.json
    python benchmarks/pad_streaming_gpu.py --smoke   # tiny sizes on the CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

if __name__ == "__main__" and "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from _harness.measure import PeakMemory, free_memory, median_ms, relative_error  # noqa: E402
from _harness.report import add_json_flag, describe_environment, environment_line, table_header, write_json  # noqa: E402
from cl_streamkl import PooledAttention, pooled_attention, pooled_attention_reference  # noqa: E402
from cl_streamkl.strategies.pooled_attention import pooled_attention_distance  # noqa: E402

BLOCKS = 12
CHECK_LENGTHS = (17, 577, 1025, 4097)
TIMED_SHAPES = ((16, 12, 1025, 64), (4, 12, 4097, 64))
SMOKE = {"check_lengths": (17,), "timed_shapes": ((1, 2, 17, 16),), "blocks": 2}
# ‖out − ref‖/‖ref‖ against float64: the kernels compute in float32; bf16 gradients are stored in
# bf16 and their score gradients enter the last product in bf16.
BOUNDS = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-4, 3e-2)}
COLUMNS = [
    {"name": "B×H×N×D, 12 blocks"}, {"name": "mode"},
    {"name": "materialised ms", "align": "right", "format": ".2f"},
    {"name": "streamed ms", "align": "right", "format": ".2f"},
    {"name": "speed-up", "align": "right", "format": ".2f"},
    {"name": "materialised peak GiB", "align": "right", "format": ".2f"},
    {"name": "streamed peak GiB", "align": "right", "format": ".3f"},
]


def check(n: int, dim: int, dtype: torch.dtype, squared: bool, device: torch.device) -> dict:
    """Errors of pooled_attention against float64 at (1, 2, n, dim)."""
    q = torch.randn(1, 2, n, dim, device=device).to(dtype).requires_grad_()
    k = torch.randn(1, 2, n, dim, device=device).to(dtype).requires_grad_()
    out = pooled_attention(q, k, squared=squared, backend="triton")
    ref = pooled_attention_reference(q, k, squared=squared)
    weights = [torch.randn_like(vector) for vector in ref]
    grads = torch.autograd.grad(sum((v * w.float()).sum() for v, w in zip(out, weights)), (q, k))
    ref_grads = torch.autograd.grad(sum((v * w).sum() for v, w in zip(ref, weights)), (q, k))
    value_err = max(relative_error(v, r) for v, r in zip(out, ref))
    grad_err = max(relative_error(g, r) for g, r in zip(grads, ref_grads))
    value_bound, grad_bound = BOUNDS[dtype]
    name = f"N={n} D={dim} {str(dtype).removeprefix('torch.')} {'squared' if squared else 'plain'}"
    return {"name": name, "value_err": value_err, "grad_err": grad_err,
            "passed": value_err < value_bound and grad_err < grad_bound}


def blocks(shape: Sequence[int], count: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """``count`` blocks of (q, k, q_teacher, k_teacher), bf16 (on the CPU float32); the student's need grad."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def rand(grad: bool) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    return [(rand(True), rand(True), rand(False), rand(False)) for _ in range(count)]


def penalty(problems, streaming: bool) -> torch.Tensor:
    """PAD's mean over the blocks, as PooledAttentionDistiller computes it."""
    return torch.stack([pooled_attention_distance(*problem, streaming=streaming) for problem in problems]).mean()


def measure(problems, streaming: bool, mode: str, device: torch.device) -> tuple[float, float]:
    """(median ms, peak GiB above the inputs) of one PAD evaluation; NaN for both when out of memory."""
    student = [tensor for problem in problems for tensor in problem[:2]]

    def run():
        if mode == "fwd":
            with torch.no_grad():
                return penalty(problems, streaming)
        return torch.autograd.grad(penalty(problems, streaming), student)

    try:
        run()  # compiles the kernels before the memory is measured
        with PeakMemory(device) as memory:
            run()
        ms = median_ms(run, device, warmup_ms=25, rep_ms=100)
    except torch.OutOfMemoryError:
        free_memory(device)
        return float("nan"), float("nan")
    free_memory(device, collect=False)
    return ms, (memory.extra_bytes or 0) / 2**30


def time_shape(shape: Sequence[int], count: int, device: torch.device) -> tuple[list[list], float]:
    """Table rows of one shape (fwd, fwd+bwd) and the relative difference of the two penalties."""
    problems = blocks(shape, count, device)
    with torch.no_grad():
        materialised, streamed = penalty(problems, False), penalty(problems, True)
    difference = relative_error(streamed, materialised)
    label = "×".join(map(str, shape))
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        ms_m, gib_m = measure(problems, False, mode, device)
        ms_s, gib_s = measure(problems, True, mode, device)
        rows.append([label, mode, ms_m, ms_s, ms_m / ms_s, gib_m, gib_s])
        print(f"{label:>16}  {mode:>7}  materialised {ms_m:9.2f} ms {gib_m:7.2f} GiB  "
              f"streamed {ms_s:8.2f} ms {gib_s:7.3f} GiB  speed-up {ms_m / ms_s:6.2f}", flush=True)
    return rows, difference


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton's interpreter)")
    parser.add_argument("--commit", default=None, help="commit to report when the tree has no .git")
    add_json_flag(parser, "also write the checks and the table as JSON")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    settings = SMOKE if args.smoke else {"check_lengths": CHECK_LENGTHS, "timed_shapes": TIMED_SHAPES,
                                         "blocks": BLOCKS}
    environment = describe_environment(device, args.commit)
    print("# " + environment_line(environment))
    torch.manual_seed(0)
    cases = [(n, 64, dtype, squared) for n in settings["check_lengths"]
             for dtype in (torch.float32, torch.bfloat16) for squared in (True, False)]
    cases.append((settings["check_lengths"][-1], 80, torch.bfloat16, True))
    checks = []
    for n, dim, dtype, squared in cases:
        checks.append(check(n, dim, dtype, squared, device))
        result = checks[-1]
        print(f"{result['name']:>30}  value_err={result['value_err']:.1e}  grad_err={result['grad_err']:.1e}  "
              f"{'ok' if result['passed'] else 'FAIL'}", flush=True)
    rows, differences = [], {}
    for shape in settings["timed_shapes"]:
        shape_rows, differences["×".join(map(str, shape))] = time_shape(shape, settings["blocks"], device)
        rows += shape_rows
    print(f"streamed against materialised penalty, relative difference: {differences}")
    if args.json is not None:
        write_json(args.json, {
            "title": f"PAD over {settings['blocks']} blocks, materialised against streamed (bf16, a frozen teacher)",
            **table_header(environment), "columns": COLUMNS, "rows": rows, "checks": checks, "penalty_differences": differences,
        })
    return 0 if all(result["passed"] for result in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
