"""GPU acceptance check for the StreamKL kernels: correctness first, then a first timing.

Checks, on CUDA, against the float64 materialising reference:
  * bf16 / fp16 / fp32 at N = 1, 17, 197, 577, 1024, 1025, 4096 (values and student gradients;
    the odd lengths run the masked tail tiles), causal and mutual (teacher-gradient) variants,
    each with the split and the one-pass backward (``--backwards``), and each with both
    log-sum-exps given (``lse``, ``lse_teacher`` as fused attention computes them) and without
    (``--known-lse``); head dims 32, 80, 128 and 256 with each backward; timm-style strided
    views; the grouped kernels over 4 blocks of 8x2xNx32 at N = 1025 (fixed grouped tiles) and
    4097 (the autotuner's path), with and without given log-sum-exps;
  * int64 addressing: a strided view whose offsets pass 2**31 elements, at N = 131072;
  * torch.compile(fullgraph=True) through the registered custom ops;
  * the fused forward (``fused``: a mean KL and its gradients in one pass, both log-sum-exps
    given, a random upstream scalar) at 197, 1025, 4097 and 8193 tokens, head dims 64 and 128,
    causal too, and grouped over 12 blocks at 197 and 1025 and 4 blocks at 4097.
Then times (1, 12, 8192, 64) bf16 fwd and fwd+bwd beside SDPA and eager PyTorch.

Usage (from the repository root, with the package installed: ``pip install -e .``):
python benchmarks/check_gpu.py [--skip-timing] [--skip-checks] [--json [PATH]]
Leave the autotuner on (no ``CL_STREAMKL_AUTOTUNE=0``): in a fresh process each tuning key's first
launch then goes through ``triton.autotune``, which zeroes some arguments before it times a
launch; that path is the one users run, and heuristic tiles would skip it.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn.functional as F

from _harness.fused_checks import check_fused, check_fused_grouped
from _harness.kl_workloads import log_sum_exps
from _harness.measure import median_ms, relative_error
from _harness.options import DTYPES
from _harness.report import add_json_flag, describe_environment, environment_line, run_settings, write_json
from cl_streamkl import attention_kl, attention_kl_grouped, attention_kl_reference
from cl_streamkl.kernels import eager_attention_kl
from cl_streamkl.kernels.config import BACKWARDS, kernel_options

LENGTHS = (1, 17, 197, 577, 1024, 1025, 4096)
EXTRA_CHECKS = ("strided", "grouped", "int64", "compile", "fused")


def given_lse(q, k, q_t, k_t, causal: bool = False) -> dict:
    """Both log-sum-exps as the models' fused attention hands them over (float32, natural log)."""
    return {"lse": log_sum_exps(q, k, causal), "lse_teacher": log_sum_exps(q_t, k_t, causal)}


def check_case(batch, heads, n, dim, dtype, causal=False, teacher_grad=False, known_lse=False) -> dict:
    def rand(grad):
        return torch.randn(batch, heads, n, dim, device="cuda", dtype=dtype).requires_grad_(grad)

    q, k = rand(True), rand(True)
    q_t, k_t = rand(teacher_grad), rand(teacher_grad)
    inputs = [q, k] + ([q_t, k_t] if teacher_grad else [])
    ref = attention_kl_reference(q, k, q_t, k_t, causal=causal, reduction="none")
    lse = given_lse(q, k, q_t, k_t, causal) if known_lse else {}
    out = attention_kl(q, k, q_t, k_t, causal=causal, reduction="none", backend="triton", **lse)
    upstream = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), inputs)
    grads = torch.autograd.grad((out * upstream.float()).sum(), inputs)
    return {
        "fwd": relative_error(out, ref),
        "grads": max(relative_error(g, r) for g, r in zip(grads, ref_grads)),
    }


def check_grouped(batch: int, heads: int, n: int, dim: int, blocks: int = 4, known_lse: bool = False) -> dict:
    """:func:`attention_kl_grouped` over ``blocks`` bf16 problems (one launch per kernel) against
    float64 per problem: values (reduction "none") and the student gradients under a random
    upstream. Past 2048 tokens the grouped kernels take the autotuner's path, not the fixed
    grouped tiles (the efficacy study's 4097-token blocks: 32x2x4097x32)."""
    problems = []
    for _ in range(blocks):
        q, k, q_t, k_t = (torch.randn(batch, heads, n, dim, device="cuda", dtype=torch.bfloat16) * 1.5
                          for _ in range(4))
        problems.append((q.requires_grad_(), k.requires_grad_(), q_t, k_t))
    inputs = [tensor for problem in problems for tensor in problem[:2]]
    lse = {}
    if known_lse:
        given = [given_lse(*problem) for problem in problems]
        lse = {"lse": [g["lse"] for g in given], "lse_teacher": [g["lse_teacher"] for g in given]}
    out = attention_kl_grouped(problems, reduction="none", backend="triton", **lse)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    fwd_err, grad_err = 0.0, 0.0
    for index, (q, k, q_t, k_t) in enumerate(problems):
        ref = attention_kl_reference(q, k, q_t, k_t, reduction="none")
        ref_grads = torch.autograd.grad((ref * upstream[index].double()).sum(), (q, k))
        fwd_err = max(fwd_err, relative_error(out[index], ref))
        grad_err = max(grad_err, *(relative_error(g, r) for g, r in zip(grads[2 * index:2 * index + 2], ref_grads)))
        del ref, ref_grads
        torch.cuda.empty_cache()
    return {"fwd": fwd_err, "grads": grad_err}


def _timm_views(batch: int, tokens: int, heads: int, dim: int, requires_grad: bool):
    """q, k as timm's Attention makes them: views of one permuted (B, N, 3·H·D) qkv projection."""
    qkv = torch.randn(batch, tokens, 3 * heads * dim, device="cuda", dtype=torch.bfloat16)
    q, k, _ = qkv.requires_grad_(requires_grad).reshape(batch, tokens, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k


def check_strided_timm_views() -> dict:
    """Values and all four gradients on timm-style views; grads inf if one is not laid out like its input."""
    q, k = _timm_views(4, 577, 12, 64, requires_grad=True)
    q_t, k_t = _timm_views(4, 577, 12, 64, requires_grad=True)
    inputs = (q, k, q_t, k_t)
    out = attention_kl(q, k, q_t, k_t, reduction="none", backend="triton")
    ref = attention_kl_reference(q, k, q_t, k_t, reduction="none")
    upstream = torch.randn_like(ref)
    grads = torch.autograd.grad((out * upstream.float()).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), inputs)
    laid_out_like_inputs = all(grad.stride() == torch.empty_like(x).stride() for grad, x in zip(grads, inputs))
    grad_err = max(relative_error(g, r) for g, r in zip(grads, ref_grads))
    return {"fwd": relative_error(out, ref), "grads": grad_err if laid_out_like_inputs else float("inf")}


def check_int64_offsets() -> float:
    """Head 1 of a view whose head stride is 2**31 elements, against the same data copied."""
    n, dim = 131072, 64
    head_stride = 2**31
    storage = torch.empty(head_stride + n * dim, device="cuda", dtype=torch.bfloat16)
    storage[head_stride:].normal_()
    storage[: n * dim].normal_()

    def view():
        return storage.as_strided((1, 2, n, dim), (0, head_stride, dim, 1))

    q = view()
    k_t = torch.randn(1, 2, n, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(k_t)
    q_t = torch.randn_like(k_t)
    out = attention_kl(q, k, q_t, k_t, reduction="none", backend="triton")
    copied = attention_kl(q.contiguous(), k, q_t, k_t, reduction="none", backend="torch")
    del storage
    return relative_error(out, copied)


def check_compile() -> float:
    """torch.compile(fullgraph=True) against eager on timm-style views: Inductor asserts the
    custom op's real output strides against its fake ones, so a layout mismatch fails here."""
    q, k = _timm_views(2, 256, 4, 64, requires_grad=True)
    q_t, k_t = _timm_views(2, 256, 4, 64, requires_grad=False)

    def loss(q, k, q_t, k_t):
        return attention_kl(q, k, q_t, k_t, temperature=2.0) * 3.0

    compiled = torch.compile(loss, fullgraph=True)
    value = compiled(q, k, q_t, k_t)
    grad = torch.autograd.grad(value, q)[0]
    eager_value = loss(q, k, q_t, k_t)
    eager_grad = torch.autograd.grad(eager_value, q)[0]
    return max(relative_error(value, eager_value), relative_error(grad, eager_grad))


def time_first_table() -> list[tuple[str, str, float]]:
    shape = (1, 12, 8192, 64)
    q, k, q_t, k_t = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q.requires_grad_()
    k.requires_grad_()
    v = torch.randn_like(q_t).requires_grad_()
    rows = []

    def fwd_bwd(fn):
        def run():
            out = fn()
            torch.autograd.grad(out, (q, k))
        return run

    impls = {
        "streamkl-triton": lambda: attention_kl(q, k, q_t, k_t, backend="triton"),
        "streamkl-torch": lambda: attention_kl(q, k, q_t, k_t, backend="torch"),
        "eager": lambda: eager_attention_kl(q, k, q_t, k_t),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v).float().sum(),
    }
    for name, fn in impls.items():
        for mode, runner in (("fwd", fn), ("fwd+bwd", fwd_bwd(fn))):
            try:
                with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                    ms = median_ms(runner, torch.device("cuda"), warmup_ms=100, rep_ms=300)
            except torch.OutOfMemoryError:
                ms = float("nan")
            rows.append((name, mode, ms))
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=list(LENGTHS), help=f"sequence lengths checked (default {LENGTHS})"
    )
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--backwards", nargs="+", choices=BACKWARDS, default=["split", "onepass"],
                        help="backward kernels the per-length checks run (default: split and onepass)")
    parser.add_argument("--known-lse", nargs="+", choices=("off", "on"), default=["off", "on"],
                        help="check without (off) and with (on) both log-sum-exps given (default: both)")
    parser.add_argument("--skip-extras", action="store_true", help="only the per-length checks")
    parser.add_argument("--head-dims", type=int, nargs="*", default=[32, 80, 128, 256],
                        help="head dims of the extra checks (default 32 80 128 256; none to skip them)")
    parser.add_argument("--extra-checks", nargs="*", choices=EXTRA_CHECKS, default=list(EXTRA_CHECKS),
                        help="which other extra checks run (default: all)")
    parser.add_argument(
        "--commit", default=None, help="commit to print (default: git rev-parse HEAD, which a copied tree may lack)"
    )
    add_json_flag(parser, "also write the checks and timings as JSON")
    args = parser.parse_args()
    environment = describe_environment(torch.device("cuda"), args.commit)
    print("# " + environment_line(environment))
    torch.manual_seed(0)
    known = [choice == "on" for choice in args.known_lse]
    checks = [] if args.skip_checks else run_checks(args.lengths, args.dtypes, args.backwards, known,
                                                    not args.skip_extras, args.head_dims, args.extra_checks)
    timings = []
    if not args.skip_timing:
        print("\n| impl | mode | ms (1,12,8192,64) bf16 |\n|---|---|---|")
        for name, mode, ms in time_first_table():
            print(f"| {name} | {mode} | {ms:.3f} |")
            timings.append({"impl": name, "mode": mode, "ms": ms})
    if args.json is not None:
        write_json(args.json, {"environment": environment, "settings": run_settings(args), "checks": checks,
                               "timings": timings})
    sys.exit(1 if any(not check["ok"] for check in checks) else 0)


def run_checks(
    lengths: list[int], dtype_names: list[str], backwards: list[str], known: list[bool], extras: bool,
    head_dims: list[int], extra_checks: list[str],
) -> list[dict]:
    """Print one line per check; return each check's name, errors and verdict."""
    records = []
    for n, dtype_name, backward, known_lse in (
        (n, d, b, g) for n in lengths for d in dtype_names for b in backwards for g in known
    ):
        dtype = DTYPES[dtype_name]
        for causal, teacher_grad in ((False, False), (True, False), (False, True)):
            with kernel_options(backward=backward):
                result = check_case(2 if n < 4096 else 1, 2, n, 64, dtype, causal, teacher_grad, known_lse)
            bound_fwd, bound_grad = (1e-4, 2e-5) if dtype == torch.float32 else (1e-4, 2e-2)
            ok = result["fwd"] < bound_fwd and result["grads"] < bound_grad
            name = (f"N={n:5d} {dtype_name} {backward:7} causal={causal!s:5} teacher_grad={teacher_grad!s:5}"
                    f"{' lse given' if known_lse else ''}")
            records.append({"name": name, "fwd_err": result["fwd"], "grad_err": result["grads"], "ok": ok})
            print(f"{name} fwd_err={result['fwd']:.2e} grad_err={result['grads']:.2e} {'ok' if ok else 'FAIL'}",
                  flush=True)
    if extras:
        records += run_extra_checks(backwards, known, head_dims, extra_checks)
    print(f"correctness failures: {sum(not record['ok'] for record in records)}")
    return records


def fused_cases() -> dict:
    """The fused forward's checks, by name (see the module docstring)."""
    cases = {f"fused 2x2x{n}x{dim} bf16{' causal' if causal else ''}": functools.partial(
        check_fused, 2 if n < 4096 else 1, 2, n, dim, torch.bfloat16, causal)
        for n in (197, 1025, 4097, 8193) for dim in (64, 128) for causal in (False, True) if not (causal and dim == 128)}
    cases["fused 2x2x1025x64 fp16"] = functools.partial(check_fused, 2, 2, 1025, 64, torch.float16)
    cases["fused 2x2x1025x64 fp32"] = functools.partial(check_fused, 2, 2, 1025, 64, torch.float32)
    for blocks, n in ((12, 197), (12, 1025), (4, 4097)):
        cases[f"fused grouped {blocks} blocks 4x3x{n}x64 bf16"] = functools.partial(
            check_fused_grouped, blocks, 4 if n < 4096 else 1, 3, n, 64)
    return cases


def run_extra_checks(
    backwards: list[str], known: list[bool], head_dims: list[int], extra_checks: list[str]
) -> list[dict]:
    """Head dims (with each of ``backwards``), strided views (values, gradients and their layout), int64
    offsets and torch.compile; return each check's name, errors and verdict."""
    records = []
    bf16_cases = {
        f"D={dim} bf16 {backward}": functools.partial(check_case, 1, 2, 577, dim, torch.bfloat16, teacher_grad=True)
        for dim in head_dims for backward in backwards
    }
    if "strided" in extra_checks:
        bf16_cases["strided timm views bf16 (grads in the inputs' layout)"] = check_strided_timm_views
    for n, known_lse in ((n, g) for n in (1025, 4097) for g in known if "grouped" in extra_checks):
        bf16_cases[f"grouped 4 blocks 8x2x{n}x32 bf16{' lse given' if known_lse else ''}"] = functools.partial(
            check_grouped, 8, 2, n, 32, known_lse=known_lse)
    if "fused" in extra_checks:
        bf16_cases.update(fused_cases())
    for name, check in bf16_cases.items():
        with kernel_options(backward=name.split()[-1] if name.split()[-1] in BACKWARDS else "split"):
            result = check()
        ok = result["fwd"] < 1e-4 and result["grads"] < 2e-2
        records.append({"name": name, "fwd_err": result["fwd"], "grad_err": result["grads"], "ok": ok})
        print(f"{name} fwd_err={result['fwd']:.2e} grad_err={result['grads']:.2e} {'ok' if ok else 'FAIL'}")
    for name, check in (("int64 offsets N=131072", check_int64_offsets), ("torch.compile fullgraph", check_compile)):
        if name.split()[0].replace("torch.", "") not in extra_checks:
            continue
        err = check()
        ok = err < 1e-4
        records.append({"name": name, "fwd_err": err, "grad_err": None, "ok": ok})
        print(f"{name}: rel_err={err:.2e} {'ok' if ok else 'FAIL'}")
        torch.cuda.empty_cache()
    return records


if __name__ == "__main__":
    main()
