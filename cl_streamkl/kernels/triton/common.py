"""Triton helpers that the forward and backward kernels share, and interpreter detection.

Matrix products with the precision the launcher asks for, zero-padded row loads, the split of
a query tile's keys into tiles that need a mask and tiles that do not, a program's place in the
grid, the per-problem address table of the grouped kernels, and a software exp2 on the FMA units.
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


@triton.jit
def program_coordinates(length, BLOCK: tl.constexpr, num_heads):
    """(tile, batch·head index, batch, head) of this program.

    Tiles of ``length`` rows (or keys) and the (batch, head) pairs share grid axis 0, tiles
    fastest, so B·H is not capped by the 65535 limit of grid axes 1 and 2. In the grouped
    kernels the problems are a further, slowest factor: ``batch`` then counts L·B.
    """
    tiles = tl.cdiv(length, BLOCK)
    pid = tl.program_id(0)
    pid_bh = (pid // tiles).to(tl.int64)
    return pid % tiles, pid_bh, pid_bh // num_heads, pid_bh % num_heads


# The grouped kernels read one row of an int64 table per problem (built by the launcher):
# TABLE_SCALES float32 bit patterns (the student's and teacher's softmax scale over T in base 2,
# then in natural units), then four entries per tensor: its address and its batch, head and
# row strides in elements (0 for a dimension of size 1). Tensors: q, k, q_t, k_t, and in the
# backward the gradient outputs dq, dq_t, dk, dk_t.
TABLE_SCALES: tl.constexpr = tl.constexpr(4)
TABLE_TENSOR: tl.constexpr = tl.constexpr(4)
FORWARD_TABLE_WIDTH: tl.constexpr = tl.constexpr(4 + 4 * 4)
BACKWARD_TABLE_WIDTH: tl.constexpr = tl.constexpr(4 + 8 * 4)


@triton.jit
def table_scale(entry, index: tl.constexpr):
    """Scale ``index`` (0: student base 2, 1: teacher base 2, 2, 3: natural) of a table row."""
    return tl.load(entry + index).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def table_rows(entry, tensor: tl.constexpr, batch, head, ELEMENT: tl.constexpr, ALIGNED: tl.constexpr):
    """(address of row 0 of (batch, head), row stride) of tensor number ``tensor`` of a table row.

    ALIGNED says that every address in the table is a multiple of 16 bytes and every stride
    a multiple of 16 elements.
    """
    column = TABLE_SCALES + tensor * TABLE_TENSOR
    base = tl.load(entry + column).to(tl.pointer_type(ELEMENT))
    stride_b = tl.load(entry + column + 1)
    stride_h = tl.load(entry + column + 2)
    stride_n = tl.load(entry + column + 3)
    if ALIGNED:
        # What Triton infers by itself from kernel arguments divisible by 16: vectorised
        # loads. The hints must sit on values made in this function (a hint on a function
        # argument is lost when the call is inlined) and on the pointer (not the int64 address).
        base = tl.multiple_of(base, 16)
        stride_b = tl.multiple_of(stride_b, 16)
        stride_h = tl.multiple_of(stride_h, 16)
        stride_n = tl.multiple_of(stride_n, 16)
    return base + batch * stride_b + head * stride_h, stride_n


@triton.jit
def exp2_polynomial(x, DEGREE: tl.constexpr):
    """2^x on the FMA units (FlashAttention-4's software exponential), for x <= 127.

    Cody–Waite reduction x = n + f with n the integer nearest x (adding 1.5·2^23 leaves it
    in the low mantissa bits, no conversion instruction) and f in [-1/2, 1/2]; 2^f by the
    minimax polynomial of relative error (7.5e-5 at degree 3, 2.1e-7 at degree 5 evaluated
    in float32; the special-function unit's ex2.approx is within 2 ulp, about 2.4e-7);
    2^n by adding n to the exponent bits. x is clamped at -126 so that adding n never borrows
    from the sign bit: 2^-inf (a masked score) is about 1.2e-38 instead of 0, which no sum notices.
    """
    x = tl.maximum(x, -126.0)
    shifted = x + 12582912.0
    fraction = x - (shifted - 12582912.0)
    if DEGREE == 3:
        power = tl.fma(tl.fma(tl.fma(0.0551716685295105, fraction, 0.2426111251115799), fraction,
                              0.6932609677314758), fraction, 0.9999280571937561)
    else:
        tl.static_assert(DEGREE == 5, "exp2_polynomial has degrees 3 and 5")
        power = tl.fma(tl.fma(0.0013248049654066563, fraction, 0.009675051085650921), fraction, 0.05550799518823624)
        power = tl.fma(tl.fma(tl.fma(power, fraction, 0.24022135138511658), fraction,
                              0.6931469440460205), fraction, 1.0000001192092896)
    # shifted's bits are 0x4B400000 + n; shifting them left by 23 leaves n << 23 (mod 2^32).
    exponent = shifted.to(tl.uint32, bitcast=True) << 23
    return (power.to(tl.uint32, bitcast=True) + exponent).to(tl.float32, bitcast=True)


@triton.jit
def _column_halves(x):
    # Column c and c + N/2 sit in the same thread of an MMA accumulator, so this moves no data.
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, [rows, 2, cols // 2]), [0, 2, 1]))


@triton.jit
def _join_column_halves(left, right):
    rows: tl.constexpr = left.shape[0]
    cols: tl.constexpr = left.shape[1]
    return tl.reshape(tl.permute(tl.join(left, right), [0, 2, 1]), [rows, 2 * cols])


@triton.jit
def teacher_exp2(x, POLY_DEGREE: tl.constexpr, POLY_SPLITS: tl.constexpr):
    """2^x of a teacher score tile, the special-function unit's or partly the FMA units'.

    POLY_DEGREE 0 takes every exponential from the special-function unit (MUFU); otherwise
    the last 1/2**POLY_SPLITS of the tile's columns use :func:`exp2_polynomial` of that degree
    (POLY_SPLITS 0, 1, 2: all, half, a quarter of the teacher's exponentials).
    """
    if POLY_DEGREE == 0:
        return tl.math.exp2(x)
    elif POLY_SPLITS == 0:
        return exp2_polynomial(x, POLY_DEGREE)
    elif POLY_SPLITS == 1:
        left, right = _column_halves(x)
        return _join_column_halves(tl.math.exp2(left), exp2_polynomial(right, POLY_DEGREE))
    else:
        tl.static_assert(POLY_SPLITS == 2, "teacher_exp2 splits a tile at most twice")
        left, right = _column_halves(x)
        right_left, right_right = _column_halves(right)
        right = _join_column_halves(tl.math.exp2(right_left), exp2_polynomial(right_right, POLY_DEGREE))
        return _join_column_halves(tl.math.exp2(left), right)
