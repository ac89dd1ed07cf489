"""Opt-in variants of the kernels' arithmetic; the defaults are the measured kernels.

Per score the forward and the backward each take two exponentials (student and teacher),
against attention's one; at head dim 64 the special-function unit (MUFU, 16 exp2 per clock
and SM on Hopper) can bound the kernel. A variant moves part of the teacher's exponentials
to the FMA units (``common.exp2_polynomial``), as FlashAttention-4 does; another moves the
upstream gradient's product out of the backward's score loop. Which one pays is decided by
measurement (``benchmarks/grouped_and_exp_gpu.py``; docs/bench-kernel.md, Kernel variants): on the H200 moving the
gradient's product made the backward 6-10 % faster at head dim 64 and is on by default; every
polynomial share made the kernels slower, so the hardware exponential stays the default.

Select them with :mod:`cl_streamkl.kernels.config` (``forward_exp2``, ``backward_exp2``,
``grad_after_dot``): the exponential variants are keys of
:data:`~cl_streamkl.kernels.config.EXP2_VARIANTS`. With ``grad_after_dot`` the dq kernels
multiply by the upstream gradient g per row after the key loop instead of per score, and so
do the dk kernels when g is the same for every row of a (batch, head), as after a sum, a
batchmean or attention_kl_grouped's mean (attention_kl's mean() backward materialises g).
One product per score fewer; fp16 also keeps small g·(P_s − P_t) away from underflow before
the dot.
"""

from __future__ import annotations

import torch

from cl_streamkl.kernels.config import EXP2_VARIANTS, KernelOptions


def exp2_constants(options: KernelOptions, backward: bool, dtype: torch.dtype) -> dict[str, int]:
    """POLY_EXP2_DEGREE and POLY_EXP2_SPLITS of the forward or the backward kernels under ``options``.

    float32 inputs are promised float32 math: a degree-3 variant (relative error 8.3e-5,
    bf16-level, up to 9e-5 in float32 gradients against 3e-7) runs at degree 5 for them.
    """
    degree, splits = EXP2_VARIANTS[options.backward_exp2 if backward else options.forward_exp2]
    if dtype == torch.float32 and degree == 3:
        degree = 5
    return {"POLY_EXP2_DEGREE": degree, "POLY_EXP2_SPLITS": splits}
