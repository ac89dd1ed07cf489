"""The pooled-attention kernels compile for an H100/H200 (sm_90) without a GPU.

As ``test_hopper_compile.py`` does for the StreamKL kernels: the interpreter that the other tests
use never runs Triton's compiler, so each kernel is compiled here for sm_90 in a fresh process,
at the tiles the launchers pick on a GPU (:func:`~cl_streamkl.kernels.triton.pooled_ops.pooled_tiles`),
both variants, bf16 at head dim 64 and float32 at head dim 80. Arguments are specialised as on
timm's q/k views (addresses and strides divisible by 16), and the bf16 kernels must load their
tiles with 16-byte asynchronous copies.

Run directly (``python tests/kernels/test_pooled_hopper_compile.py``) it prints one line per kernel.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import pytest
from hopper_ptx import COPY16, compile_sm90, compiled_counts, print_counts

KERNELS = ("rows", "keys", "backward_dq", "backward_dk")


class Case(NamedTuple):
    kernel: str  # a key of pooled_ops.POOLED_LAUNCHERS
    squared: bool
    dtype: str = "bf16"  # or "fp32"

    def label(self) -> str:
        return f"{self.kernel} {'squared' if self.squared else 'plain'} {self.dtype}"


CASES = [Case(kernel, squared) for kernel in KERNELS for squared in (True, False)] + [
    Case(kernel, True, "fp32") for kernel in KERNELS
]


def compile_for_hopper(case: Case):
    """Compile one kernel for sm_90; raises on a compile error."""
    from cl_streamkl.kernels.triton.pooled_ops import POOLED_LAUNCHERS, pooled_tiles

    kernel = POOLED_LAUNCHERS[case.kernel].untuned
    head_dim, element_size = (64, 2) if case.dtype == "bf16" else (80, 4)
    tiles = pooled_tiles(case.kernel, head_dim, element_size)
    constants = {
        "SQUARED": case.squared,
        "DOT_PRECISION": "tf32" if case.dtype == "bf16" else "ieee",
        "BLOCK_M": tiles["BLOCK_M"],
        "BLOCK_N": tiles["BLOCK_N"],
        "BLOCK_D": 64 if head_dim == 64 else 128,
    }
    # Integers Triton would not see as divisible by 16 at 4x12x4097x64; a dense upstream gradient's row stride is 1.
    odd_integers = {"num_heads", "n_q", "n_k", "stride_gkn", "stride_grn"}

    def pointer_type(arg: str) -> str | None:
        if arg in ("Q", "K", "DQ", "DK"):
            return f"*{case.dtype}"
        return "*fp32" if arg.isupper() else None

    options = {"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]}
    return compile_sm90(kernel, constants, pointer_type, odd_integers, options)


def main() -> int:
    return print_counts(CASES, lambda case: {"copy16": len(COPY16.findall(compile_for_hopper(case).asm["ptx"]))})


def test_pooled_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    copies = {label: values["copy16"] for label, values in compiled_counts(__file__, timeout=1200).items()}
    assert set(copies) == {case.label() for case in CASES}
    for case in CASES:
        if case.dtype == "bf16":
            assert copies[case.label()] > 0, f"{case.label()}: tiles are not loaded with 16-byte copies"


if __name__ == "__main__":
    sys.exit(main())
