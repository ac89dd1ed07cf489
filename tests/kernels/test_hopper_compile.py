"""The StreamKL kernels compile for an H100/H200 (sm_90) without a GPU.

The CPU interpreter that the other tests use never runs Triton's compiler, so a
kernel that the interpreter accepts can still fail to compile for a real GPU
(a runtime condition where a compile-time one is needed, a tile shape tl.dot
refuses, ...). Triton's compiler and ptxas ship with the triton wheel and need no
GPU, so this test compiles each kernel for sm_90 in a fresh process (the pytest
process itself runs with TRITON_INTERPRET=1): the one-problem and the grouped kernels,
causal and not, every arithmetic variant (``kernels/triton/variants.py``) and the one-pass
backward, whose dk kernel alone may add with atomics.

Arguments are specialised as Triton specialises a launch on timm's q/k views (addresses and
strides divisible by 16), so the PTX also shows what the GPU would run: the test checks that
the grouped kernels load their tiles with the same 16-byte asynchronous copies as the
one-problem kernels (their addresses come from a table, so only hints tell the compiler they
are aligned) and that each exp2 variant leaves fewer hardware exponentials.

Run directly (``python tests/kernels/test_hopper_compile.py``) it prints one line per kernel.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

import pytest
from hopper_ptx import COPY16, compile_sm90, compiled_counts, print_counts



class Case(NamedTuple):
    kind: str  # "fwd", "dq" or "dk"
    causal: bool = False
    grouped: bool = False
    exp2: str = "hardware"  # a key of variants.EXP2_VARIANTS
    grad_after_dot: bool = False
    one_pass: bool = False  # dk only: the key-side kernel also adds up dq
    known_lse: bool = False  # fwd only: both log-sum-exps given, one exponential per score
    row_terms: bool = False  # dk only, one-pass: the fused forward (also adds up the KL's row sums)

    def label(self) -> str:
        return " ".join(
            [self.kind, "causal" if self.causal else "full", "grouped" if self.grouped else "single", self.exp2]
            + (["grad-after-dot"] if self.grad_after_dot else []) + (["one-pass"] if self.one_pass else [])
            + (["known-lse"] if self.known_lse else []) + (["fused"] if self.row_terms else [])
        )


POLY_VARIANTS = ["poly3-half", "poly3-quarter", "poly3-eighth", "poly5-half", "poly5-quarter", "poly5-eighth"]
# bf16 at the default GPU tiles (forward 128x64, backward 64x64), the backward with teacher
# gradients, which compiles every code path of the frozen-teacher case. Each exp2 variant in
# the forward and in the dk kernel (the transposed score tile); the dq kernel with two.
CASES = (
    [Case(kind, causal, grouped) for grouped in (False, True) for causal in (False, True) for kind in ("fwd", "dq", "dk")]
    + [Case(kind, exp2=variant) for variant in POLY_VARIANTS for kind in ("fwd", "dk")]
    + [Case("dq", exp2="poly3-eighth"), Case("dq", exp2="poly5-quarter", grad_after_dot=True)]
    + [Case(kind, grad_after_dot=True) for kind in ("dq", "dk")]
    + [Case(kind, grouped=True, grad_after_dot=True) for kind in ("dq", "dk")]
    + [Case("dk", causal, grouped, one_pass=True) for grouped in (False, True) for causal in (False, True)]
    + [Case("fwd", causal, grouped, known_lse=True) for grouped in (False, True) for causal in (False, True)]
    + [Case("dk", False, grouped, one_pass=True, row_terms=True) for grouped in (False, True)]
)


def compile_for_hopper(case: Case):
    """Compile one kernel for sm_90 (bf16 inputs, head dims 64); raises on a compile error."""
    import triton.language as tl

    from cl_streamkl.kernels.config import EXP2_VARIANTS
    from cl_streamkl.kernels.triton import backward, forward

    if case.kind == "fwd":
        kernel = forward._attention_kl_grouped_fwd_kernel if case.grouped else forward._attention_kl_fwd_kernel
    elif case.grouped:
        kernel = backward._attention_kl_grouped_bwd_kernel  # both sides, by KEY_SIDE
    else:
        kernel = backward._attention_kl_bwd_dq_kernel if case.kind == "dq" else backward._attention_kl_bwd_dk_kernel
    degree, splits = EXP2_VARIANTS[case.exp2]
    constants = {
        "CAUSAL": case.causal,
        "DOT_PRECISION": "tf32",
        "POLY_EXP2_DEGREE": degree,
        "POLY_EXP2_SPLITS": splits,
        "BLOCK_M": 128 if case.kind == "fwd" else 64,
        "BLOCK_N": 64,
        "BLOCK_DS": 64,
        "BLOCK_DT": 64,
    }
    if case.kind == "fwd":
        constants["KNOWN_LSE"] = case.known_lse
    else:
        constants["TEACHER_GRAD"] = True
    if case.kind != "fwd":
        constants["GRAD_AFTER_DOT"] = case.grad_after_dot
    if case.kind == "dk" or case.grouped and case.kind != "fwd":
        constants["ONE_PASS"] = case.one_pass
        constants["ROW_TERMS"] = case.row_terms
        if case.row_terms:
            constants["TEACHER_GRAD"] = False  # the fused forward runs for a frozen teacher only
    if case.grouped:
        constants.update(ELEMENT=tl.bfloat16, ALIGNED=True)
        if case.kind != "fwd":
            constants["KEY_SIDE"] = case.kind == "dk"
    # Integer arguments Triton would not see as divisible by 16 at 32x12x197x64.
    odd_integers = {"num_heads", "n_q", "n_k", "batch_size", "stride_gl", "stride_lsb", "stride_lsh", "stride_lsn",
                    "stride_ltb", "stride_lth", "stride_ltn"}
    float32_pointers = {"ROW_KL", "LSE_S", "LSE_T", "LSE_S_IN", "LSE_T_IN", "GRAD", "DQ_SUM", "DQT_SUM", "ROW_SUMS"}

    def pointer_type(arg: str) -> str | None:
        if arg == "TABLE":
            return "*i64"
        if arg.isupper() and not arg.endswith("_BUCKET"):  # tensors; the buckets are ints
            return "*fp32" if arg in float32_pointers else "*bf16"
        return None

    warps, stages = (8, 3) if case.kind == "fwd" else (4, 2)
    return compile_sm90(kernel, constants, pointer_type, odd_integers, {"num_warps": warps, "num_stages": stages})


def ptx_counts(ptx: str) -> dict[str, int]:
    """Atomic adds, hardware exponentials and 16-byte asynchronous global-to-shared copies in a kernel's PTX."""
    return {
        "atomics": len(re.findall(r"\bred\.|\batom\.", ptx)),
        "ex2": len(re.findall(r"\bex2\.approx", ptx)),
        "copy16": len(COPY16.findall(ptx)),
    }


def main() -> int:
    return print_counts(CASES, lambda case: ptx_counts(compile_for_hopper(case).asm["ptx"]))


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    counts = compiled_counts(__file__, timeout=1800)
    assert len(counts) == len(CASES)
    for case in CASES:
        these = counts[case.label()]
        baseline = counts[case._replace(grouped=False, exp2="hardware", grad_after_dot=False, known_lse=False).label()]
        assert these["copy16"] > 0, f"{case.label()}: tiles are not loaded with 16-byte copies"
        if case.one_pass:
            assert these["atomics"] > 0, f"{case.label()}: dq is not added up with atomics"
        else:
            assert these["atomics"] == 0, f"{case.label()}: atomics in a deterministic kernel"
        if case.known_lse:
            # One exponential per score instead of two (the online rescalings are gone too).
            assert these["ex2"] * 2 <= baseline["ex2"], f"{case.label()}: {these['ex2']} exponentials, {baseline}"
        elif case.grouped:
            assert these == baseline, f"{case.label()} compiles to other loads or exponentials than {baseline}"
        if case.exp2 != "hardware":
            assert these["ex2"] < baseline["ex2"], f"{case.label()}: no hardware exponential moved"


if __name__ == "__main__":
    sys.exit(main())
