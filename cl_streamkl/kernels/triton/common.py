"""Triton helpers that the forward and backward kernels share, and interpreter detection.

Matrix products with the precision the launcher asks for, zero-padded row loads, and the
split of a query tile's keys into tiles that need a mask and tiles that do not.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation; DOT_PRECISION is "ieee", "tf32" or "upcast"."""
    if DOT_PRECISION == "upcast":
        # Triton's CPU interpreter multiplies bfloat16 operands as raw uint16 bits
        # (triton 3.8); exact fp32 products of the same bf16 values sidestep it.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


# Triton picks its CPU interpreter when a kernel is defined (TRITON_INTERPRET=1 set
# before triton was imported); ask the kernel object rather than the environment.
INTERPRETING = type(dot).__name__ == "InterpretedFunction"


@triton.jit
def load_rows(base, index, stride, dims, limit, dim_limit):
    """Load a [len(index), len(dims)] tile of rows index (< limit), zero-padded."""
    return tl.load(
        base + index.to(tl.int64)[:, None] * stride + dims[None, :],
        mask=(index[:, None] < limit) & (dims[None, :] < dim_limit),
        other=0.0,
    )


@triton.jit
def key_ranges(pid_m, n_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges a query tile visits: [0, full_end) needs no mask, [full_end, key_end) does.

    Only the ragged tail (and, causal, the diagonal tiles) pay for the selects per score.
    """
    if CAUSAL:
        full_end = (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N
        key_end = tl.minimum((pid_m + 1) * BLOCK_M, n_k)
    else:
        full_end = (n_k // BLOCK_N) * BLOCK_N
        key_end = n_k
    return full_end, key_end

