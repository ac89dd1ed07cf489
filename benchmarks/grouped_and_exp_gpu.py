"""GPU check and timing of attention_kl_grouped and of the opt-in kernel variants.

Three parts, in this order:

(a) correctness, bf16, L=12 timm-like blocks (q/k views of one permuted qkv tensor per block):
    attention_kl_grouped against 12 attention_kl calls (equal up to the rounding of other tiles)
    and both against the float64 reference,
    values and gradients under a random upstream gradient. NaN or Inf stops the script; an
    error over the bound marks the check FAIL and the exit status 1.
(b) timing (triton.testing.do_bench, median) of fwd and fwd+bwd at the same shapes: 12
    attention_kl calls, one attention_kl_grouped call (also handed both models' log-sum-exps,
    forward then the split or the one-pass backward, and fused: the gradients in the forward
    pass, the default), and 12 F.scaled_dot_product_attention
    calls (the backend SDPA picked is named from the kernels it launched), with the peak
    memory each allocates per query row (fwd: what stays for backward; fwd+bwd: with gradients).
(c) each variant of cl_streamkl.kernels.config (EXP2_VARIANTS, grad_after_dot) timed in fwd, bwd and fwd+bwd against
    the default (hardware exponentials), with its error against float64 on the first two heads.
    The loss is reduction="sum": its expanded upstream gradient lets grad-after-dot act in both
    backward kernels (after a "mean", attention_kl's backward materialises the gradient and
    only dq can).

The tables of (b) and (c) come last; --json writes everything. Autotuning is off unless
--autotune: kernel_options' autotune=False gives every implementation and variant the fixed heuristic
tiles (forward 128x64, backward 64x64 at bf16; the grouped kernels at ViT lengths run their
per-bucket tiles, tuning.GROUPED_TILES, either way), so the ~40 kernel variants compile once each
and the run stays within about 4 minutes on an H200; with --autotune the first run compiles
every candidate tile of every variant (many minutes).

Usage:
    python benchmarks/grouped_and_exp_gpu.py --json
    python benchmarks/grouped_and_exp_gpu.py --smoke   # tiny sizes on the CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __name__ == "__main__":
    # Before triton is imported.
    if "--smoke" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from _harness.kl_workloads import log_sum_exps  # noqa: E402
from _harness.measure import gpu_kernel_times_us  # noqa: E402
from _harness.report import add_json_flag, write_json  # noqa: E402
from cl_streamkl import attention_kl, attention_kl_grouped, attention_kl_reference  # noqa: E402
from cl_streamkl.kernels.config import EXP2_VARIANTS, get_kernel_options, kernel_options, set_kernel_options  # noqa: E402

BLOCKS = 12
GROUPED_SHAPES = [(32, 12, 197, 64), (16, 12, 577, 64), (16, 12, 1025, 64)]
VARIANT_SHAPES = [(1, 12, 8192, 64), (1, 16, 8192, 128), (2, 12, 4096, 64)]
# "hardware" is the kernels without any variant; the default now has grad-after-dot on.
VARIANTS = {
    **{name: {"forward_exp2": name, "backward_exp2": name, "grad_after_dot": False} for name in EXP2_VARIANTS},
    "grad-after-dot": {"grad_after_dot": True},
    "poly3-eighth+grad-after-dot": {"forward_exp2": "poly3-eighth", "backward_exp2": "poly3-eighth",
                                    "grad_after_dot": True},
}
SMOKE = {"blocks": 2, "grouped_shapes": [(1, 1, 17, 16)], "variant_shapes": [(1, 1, 17, 16)],
         "variants": ["hardware", "poly3-eighth+grad-after-dot"]}
# bf16 bounds on ‖out − ref‖/‖ref‖ against float64 (the kernels compute in fp32 from bf16 inputs;
# gradients are stored in bf16) and between grouped and separate launches. At ViT lengths the
# grouped kernels run tiles of their own (tuning.GROUPED_TILES), which order the sums differently:
# on the H200 the two differed by 7e-5 and 9e-5 at 577 and 1025 tokens (bf16 gradients).
VALUE_BOUND, GRAD_BOUND, SAME_BOUND = 1e-4, 2e-2, 5e-4


@dataclass
class Check:
    shape: str
    kl_grouped: float  # max over blocks of the relative error against float64
    kl_separate: float
    grad_grouped: float
    grad_separate: float
    grouped_vs_separate: float  # max relative difference, values and gradients
    kl_grouped_lse: float  # the grouped kernels handed both log-sum-exps
    grad_grouped_lse: float
    passed: bool


@dataclass
class GroupedRow:
    shape: str
    impl: str
    mode: str
    ms: float
    ratio_to_separate: float | None
    bytes_per_row: float | None
    sdpa_backend: str | None = None
    gpu_ms: float | None = None  # summed device time of the kernels one call launches (CUDA)


@dataclass
class VariantRow:
    shape: str
    variant: str
    fwd_ms: float
    bwd_ms: float
    fwd_bwd_ms: float
    speedup_fwd: float | None
    speedup_bwd: float | None
    speedup_fwd_bwd: float | None
    kl_err: float
    dq_err: float
    dk_err: float


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        raise RuntimeError("NaN or Inf in an output or gradient: stopping")
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def label(shape) -> str:
    return "x".join(map(str, shape))


def median_ms(fn, device: torch.device, warmup_ms: int, rep_ms: int) -> float:
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()  # the CPU interpreter (--smoke): one run after a warm-up, to exercise the code
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def peak_extra_bytes(fn, device: torch.device) -> int | None:
    """Peak memory allocated while ``fn`` runs and its result lives, above what was allocated before."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


def timm_blocks(blocks: int, shape, device, teacher: bool):
    """Per block (q, k, v) as timm's Attention makes them: views of one permuted qkv projection."""
    batch, heads, tokens, dim = shape
    views = []
    for _ in range(blocks):
        qkv = torch.randn(batch, tokens, 3 * heads * dim, device=device, dtype=torch.bfloat16)
        qkv.requires_grad_(not teacher)
        views.append(qkv.reshape(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0))
    return views


def check_grouped(blocks: int, shape, device) -> Check:
    torch.manual_seed(0)
    student = timm_blocks(blocks, shape, device, teacher=False)
    teacher = timm_blocks(blocks, shape, device, teacher=True)
    problems = [(s[0], s[1], t[0], t[1]) for s, t in zip(student, teacher)]
    inputs = [tensor for q, k, _, _ in problems for tensor in (q, k)]
    grouped = attention_kl_grouped(problems, reduction="none", backend="triton")
    upstream = torch.randn_like(grouped)
    grouped_grads = torch.autograd.grad((grouped * upstream).sum(), inputs)
    separate = torch.stack([attention_kl(*problem, reduction="none", backend="triton") for problem in problems])
    separate_grads = torch.autograd.grad((separate * upstream).sum(), inputs)
    known = attention_kl_grouped(problems, reduction="none", backend="triton", **given_lse(problems))
    known_grads = torch.autograd.grad((known * upstream).sum(), inputs)
    errors = {"kl_grouped": 0.0, "kl_separate": 0.0, "grad_grouped": 0.0, "grad_separate": 0.0,
              "kl_grouped_lse": 0.0, "grad_grouped_lse": 0.0}
    same = max(rel_err(a, b) for a, b in zip([grouped, *grouped_grads], [separate, *separate_grads]))
    for index, (q, k, q_t, k_t) in enumerate(problems):
        # float32 copies are exact; the reference computes in float64 and returns float32 gradients.
        q32, k32 = (tensor.detach().float().requires_grad_() for tensor in (q, k))
        ref = attention_kl_reference(q32, k32, q_t.float(), k_t.float(), reduction="none")
        ref_grads = torch.autograd.grad((ref * upstream[index].double()).sum(), (q32, k32))
        errors["kl_grouped"] = max(errors["kl_grouped"], rel_err(grouped[index], ref))
        errors["kl_separate"] = max(errors["kl_separate"], rel_err(separate[index], ref))
        errors["kl_grouped_lse"] = max(errors["kl_grouped_lse"], rel_err(known[index], ref))
        for position, ref_grad in enumerate(ref_grads):
            errors["grad_grouped"] = max(errors["grad_grouped"], rel_err(grouped_grads[2 * index + position], ref_grad))
            errors["grad_separate"] = max(errors["grad_separate"], rel_err(separate_grads[2 * index + position], ref_grad))
            errors["grad_grouped_lse"] = max(errors["grad_grouped_lse"],
                                             rel_err(known_grads[2 * index + position], ref_grad))
        del ref, ref_grads, q32, k32
    passed = (max(errors["kl_grouped"], errors["kl_separate"], errors["kl_grouped_lse"]) < VALUE_BOUND
              and max(errors["grad_grouped"], errors["grad_separate"], errors["grad_grouped_lse"]) < GRAD_BOUND
              and same < SAME_BOUND)
    return Check(label(shape), **errors, grouped_vs_separate=same, passed=passed)


def given_lse(problems) -> dict:
    """Each block's two log-sum-exps, as the models' fused attention hands them over (float32)."""
    return {"lse": [log_sum_exps(q, k) for q, k, _, _ in problems],
            "lse_teacher": [log_sum_exps(q_t, k_t) for _, _, q_t, k_t in problems]}


def sdpa_backend(q, k, v, device) -> str:
    """The SDPA backend, named from the kernels one fwd+bwd launches."""
    if device.type != "cuda":
        return "math (cpu)"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v).sum(), (q, k, v))
        torch.cuda.synchronize()
    names = " ".join(event.key.lower() for event in profile.key_averages())
    for key, name in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"), ("efficient", "efficient")):
        if key in names:
            return name
    return "math"


def time_grouped(blocks: int, shape, device, warmup_ms: int, rep_ms: int) -> list[GroupedRow]:
    torch.manual_seed(1)
    student = timm_blocks(blocks, shape, device, teacher=False)
    teacher = timm_blocks(blocks, shape, device, teacher=True)
    problems = [(s[0], s[1], t[0], t[1]) for s, t in zip(student, teacher)]
    kl_inputs = [tensor for q, k, _, _ in problems for tensor in (q, k)]
    sdpa_inputs = [tensor for block in student for tensor in block]
    ones = torch.ones(blocks, device=device)
    sdpa_ones = [torch.ones_like(q) for q, _, _ in student]
    lse = given_lse(problems)

    def known(backward: str, fused: bool = False):
        def forward():
            # Forward then backward kernels, or (fused, the default) the gradients in the forward pass.
            with kernel_options(fused_gradients="on" if fused else "off"):
                return attention_kl_grouped(problems, backend="triton", **lse)

        def forward_backward():
            with kernel_options(backward=backward):
                return torch.autograd.grad(forward(), kl_inputs, grad_outputs=ones)

        return forward, forward_backward

    workloads = {
        f"attention_kl x{blocks}": (
            lambda: [attention_kl(*problem, backend="triton") for problem in problems], kl_inputs, None
        ),
        "attention_kl_grouped": (lambda: attention_kl_grouped(problems, backend="triton"), kl_inputs, ones),
        "attention_kl_grouped lse": known("split"),
        "attention_kl_grouped lse onepass": known("onepass"),
        "attention_kl_grouped lse fused": known("onepass", fused=True),
        f"sdpa x{blocks}": (lambda: [F.scaled_dot_product_attention(*block) for block in student], sdpa_inputs, sdpa_ones),
    }
    rows_per_call = blocks * shape[0] * shape[1] * shape[2]
    backend = sdpa_backend(*student[0], device)
    rows = []
    for impl, workload in workloads.items():
        if len(workload) == 2:
            forward, forward_backward = workload
        else:
            def forward_backward(forward=workload[0], inputs=workload[1], grad_outputs=workload[2]):
                return torch.autograd.grad(forward(), inputs, grad_outputs=grad_outputs)

            forward = workload[0]
        for mode, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
            ms = median_ms(fn, device, warmup_ms, rep_ms)
            peak = peak_extra_bytes(fn, device)
            gpu_ms = sum(gpu_kernel_times_us(fn).values()) / 1e3 if device.type == "cuda" else None
            rows.append(GroupedRow(label(shape), impl, mode, ms, None, None if peak is None else peak / rows_per_call,
                                   backend if impl.startswith("sdpa") else None, gpu_ms))
    for row in rows:
        reference = next(r for r in rows if r.mode == row.mode and r.impl == f"attention_kl x{blocks}")
        row.ratio_to_separate = row.ms / reference.ms
    return rows


def variant_errors(shape, device, fields) -> tuple[float, float, float]:
    """Errors against float64 of values, dq and dk on the first two heads (the tiles and masks of the full length)."""
    torch.manual_seed(2)
    batch, heads, tokens, dim = shape
    q, k, q_t, k_t = (torch.randn(1, min(heads, 2), tokens, dim, device=device, dtype=torch.bfloat16) for _ in range(4))
    q.requires_grad_()
    k.requires_grad_()
    with kernel_options(**fields):
        out = attention_kl(q, k, q_t, k_t, reduction="none", backend="triton")
        upstream = torch.randn_like(out)
        grads = torch.autograd.grad((out * upstream).sum(), (q, k))
    q32, k32 = (tensor.detach().float().requires_grad_() for tensor in (q, k))
    ref = attention_kl_reference(q32, k32, q_t.float(), k_t.float(), reduction="none")
    ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), (q32, k32))
    return rel_err(out, ref), rel_err(grads[0], ref_grads[0]), rel_err(grads[1], ref_grads[1])


def time_variants(shape, names, device, warmup_ms: int, rep_ms: int) -> list[VariantRow]:
    torch.manual_seed(3)
    q, k, q_t, k_t = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(4))
    q.requires_grad_()
    k.requires_grad_()
    rows = []
    for name in names:
        fields = VARIANTS[name]
        with kernel_options(**fields):
            forward = lambda: attention_kl(q, k, q_t, k_t, reduction="sum", backend="triton")  # noqa: E731
            fwd = median_ms(forward, device, warmup_ms, rep_ms)
            out = forward()
            bwd = median_ms(lambda: torch.autograd.grad(out, (q, k), retain_graph=True), device, warmup_ms, rep_ms)
            fwd_bwd = median_ms(lambda: torch.autograd.grad(forward(), (q, k)), device, warmup_ms, rep_ms)
            del out
        rows.append(VariantRow(label(shape), name, fwd, bwd, fwd_bwd, None, None, None,
                               *variant_errors(shape, device, fields)))
    baseline = next((row for row in rows if row.variant == "hardware"), None)
    if baseline is not None:
        for row in rows:
            row.speedup_fwd = baseline.fwd_ms / row.fwd_ms
            row.speedup_bwd = baseline.bwd_ms / row.bwd_ms
            row.speedup_fwd_bwd = baseline.fwd_bwd_ms / row.fwd_bwd_ms
    return rows


def environment(device: torch.device, commit: str | None = None) -> dict:
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "autotune": get_kernel_options().autotune,
        "date": time.strftime("%Y-%m-%d"),
    }


def format_speedup(value: float | None) -> str:
    return "" if value is None else f"({value:.2f}x)"


def print_tables(blocks: int, checks: list[Check], grouped: list[GroupedRow], variants: list[VariantRow]) -> None:
    print("\n(a) correctness, bf16: max over blocks of ‖out − ref‖/‖ref‖ against float64")
    print(f"{'shape':<16}{'kl grouped':>12}{'kl separate':>13}{'grad grouped':>14}{'grad separate':>15}"
          f"{'grouped~sep':>13}{'kl lse':>10}{'grad lse':>10}  ok")
    for c in checks:
        print(f"{c.shape:<16}{c.kl_grouped:>12.2e}{c.kl_separate:>13.2e}{c.grad_grouped:>14.2e}{c.grad_separate:>15.2e}"
              f"{c.grouped_vs_separate:>13.2e}{c.kl_grouped_lse:>10.2e}{c.grad_grouped_lse:>10.2e}"
              f"  {'ok' if c.passed else 'FAIL'}")
    print(f"\n(b) {blocks} blocks, bf16, median ms; ratio to the separate attention_kl calls; "
          "peak bytes allocated per query row")
    print(f"{'shape':<16}{'impl':<34}{'mode':<9}{'ms':>9}{'ratio':>8}{'B/row':>9}{'GPU ms':>9}  sdpa backend")
    for r in grouped:
        per_row = "" if r.bytes_per_row is None else f"{r.bytes_per_row:.0f}"
        gpu = "" if r.gpu_ms is None else f"{r.gpu_ms:.3f}"
        print(f"{r.shape:<16}{r.impl:<34}{r.mode:<9}{r.ms:>9.3f}{r.ratio_to_separate:>8.2f}{per_row:>9}{gpu:>9}"
              f"  {r.sdpa_backend or ''}")
    print("\n(c) kernel variants, bf16, median ms (speedup over hardware); error against float64 on two heads")
    print(f"{'shape':<16}{'variant':<29}{'fwd':>17}{'bwd':>17}{'fwd+bwd':>17}{'kl err':>10}{'dq err':>10}{'dk err':>10}")
    for r in variants:
        cells = [f"{ms:.3f} {format_speedup(s)}" for ms, s in
                 ((r.fwd_ms, r.speedup_fwd), (r.bwd_ms, r.speedup_bwd), (r.fwd_bwd_ms, r.speedup_fwd_bwd))]
        print(f"{r.shape:<16}{r.variant:<29}{cells[0]:>17}{cells[1]:>17}{cells[2]:>17}"
              f"{r.kl_err:>10.1e}{r.dq_err:>10.1e}{r.dk_err:>10.1e}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU through Triton's interpreter")
    parser.add_argument("--autotune", action="store_true", help="autotune the tiles (slow: every variant's candidates)")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="variants to time in (c)")
    parser.add_argument("--skip", nargs="+", default=[], choices=["a", "b", "c"], help="parts to leave out")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=100)
    parser.add_argument("--commit", default=None,
                        help="commit to record (default: git rev-parse, which a copied tree may lack)")
    add_json_flag(parser, "write checks, timings and environment as JSON")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    set_kernel_options(autotune=args.autotune)
    start = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for the CPU interpreter", file=sys.stderr)
        return 2
    blocks = SMOKE["blocks"] if args.smoke else BLOCKS
    grouped_shapes = SMOKE["grouped_shapes"] if args.smoke else GROUPED_SHAPES
    variant_shapes = SMOKE["variant_shapes"] if args.smoke else VARIANT_SHAPES
    names = args.variants or (SMOKE["variants"] if args.smoke else list(VARIANTS))
    if "hardware" not in names:
        names = ["hardware", *names]
    env = environment(device, args.commit)
    print(" | ".join(f"{key} {value}" for key, value in env.items()), flush=True)

    checks, grouped_rows, variant_rows = [], [], []
    for shape in grouped_shapes:
        if "a" not in args.skip:
            checks.append(check_grouped(blocks, shape, device))
            print(f"(a) {checks[-1]}  [{time.perf_counter() - start:.0f} s]", flush=True)
        if "b" not in args.skip:
            grouped_rows += time_grouped(blocks, shape, device, args.warmup_ms, args.rep_ms)
            print(f"(b) {label(shape)} timed  [{time.perf_counter() - start:.0f} s]", flush=True)
    if "c" not in args.skip:
        for shape in variant_shapes:
            variant_rows += time_variants(shape, names, device, args.warmup_ms, args.rep_ms)
            print(f"(c) {label(shape)} timed  [{time.perf_counter() - start:.0f} s]", flush=True)
    print_tables(blocks, checks, grouped_rows, variant_rows)
    elapsed = time.perf_counter() - start
    print(f"\n{elapsed:.0f} s in all", flush=True)
    if args.json:
        write_json(args.json, {
            "environment": env, "blocks": blocks, "elapsed_s": elapsed,
            "checks": [asdict(c) for c in checks],
            "grouped": [asdict(r) for r in grouped_rows],
            "variants": [asdict(r) for r in variant_rows],
        })
    return 0 if all(check.passed for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
