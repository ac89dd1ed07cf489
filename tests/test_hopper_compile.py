"""The StreamKL kernels compile for an H100/H200 (sm_90) without a GPU.

The CPU interpreter that the other tests use never runs Triton's compiler, so a
kernel that the interpreter accepts can still fail to compile for a real GPU
(a runtime condition where a compile-time one is needed, a tile shape tl.dot
refuses, ...). Triton's compiler and ptxas ship with the triton wheel and need no
GPU, so this test compiles each kernel for sm_90 in a fresh process (pytest
itself runs with TRITON_INTERPRET=1).

Run directly (``python tests/test_hopper_compile.py``) it prints one line per kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# bf16 at the default GPU tiles (forward 128x64, backward 64x64), causal and not; the
# backward with teacher gradients, which compiles every code path of the frozen-teacher case.
CASES = [
    (kind, causal, block_m, block_n)
    for causal in (False, True)
    for kind, block_m, block_n in (("fwd", 128, 64), ("dq", 64, 64), ("dk", 64, 64))
]


def compile_for_hopper(kind: str, causal: bool, block_m: int, block_n: int) -> None:
    """Compile one kernel for sm_90 (bf16 inputs, head dims 64); raises on a compile error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cl_streamkl.kernels.triton import backward, forward

    kernel = {
        "fwd": forward._attention_kl_fwd_kernel,
        "dq": backward._attention_kl_bwd_dq_kernel,
        "dk": backward._attention_kl_bwd_dk_kernel,
    }[kind]
    constants = {
        "CAUSAL": causal,
        "DOT_PRECISION": "tf32",
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_DS": 64,
        "BLOCK_DT": 64,
    }
    if kind != "fwd":
        constants["TEACHER_GRAD"] = True
    float32_pointers = {"ROW_KL", "LSE_S", "LSE_T", "GRAD"}
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.isupper() and not name.endswith("_BUCKET"):  # tensors; the buckets are ints
            signature[name] = "*fp32" if name in float32_pointers else "*bf16"
        elif name.startswith("scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()},
    )
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})


def main() -> int:
    failures = 0
    for case in CASES:
        try:
            compile_for_hopper(*case)
            print(f"ok   {case}", flush=True)
        except Exception as error:  # report every kernel, then fail
            failures += 1
            print(f"FAIL {case}: {type(error).__name__}: {error}", flush=True)
    return 1 if failures else 0


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == len(CASES)


if __name__ == "__main__":
    sys.exit(main())
