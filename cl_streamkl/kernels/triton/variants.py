"""Opt-in variants of the kernels' arithmetic; the defaults are the measured kernels.

Per score the forward and the backward each take two exponentials (student and teacher),
against attention's one; at head dim 64 the special-function unit (MUFU, 16 exp2 per clock
and SM on Hopper) can bound the kernel. A variant moves part of the teacher's exponentials
to the FMA units (``common.exp2_polynomial``), as FlashAttention-4 does; another moves the
upstream gradient's product out of the backward's score loop. Which one pays is decided by
measurement (``benchmarks/grouped_and_exp_gpu.py``; BENCHMARKS.md): on the H200 moving the
gradient's product made the backward 6-10 % faster at head dim 64 and is on by default; every
polynomial share made the kernels slower, so the hardware exponential stays the default.

Select them with the environment (read at import) or, for a block of code, with
:func:`use_kernel_variant`:

* ``CL_STREAMKL_FORWARD_EXP2`` / ``CL_STREAMKL_BACKWARD_EXP2``: a key of
  :data:`EXP2_VARIANTS` for the forward kernels / the dq and dk kernels.
* ``CL_STREAMKL_GRAD_AFTER_DOT`` (default 1; 0 turns it off): the dq kernels multiply by the upstream gradient g per row
  after the key loop instead of per score, and so do the dk kernels when g is the same for
  every row of a (batch, head), as after a sum, a batchmean or attention_kl_grouped's mean
  (attention_kl's mean() backward materialises g). One product per score fewer; fp16 also
  keeps small g·(P_s − P_t) away from underflow before the dot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch

# name -> (POLY_EXP2_DEGREE, POLY_EXP2_SPLITS): the teacher's exponentials on the last
# 1/2**splits of each score tile's columns use the degree-d polynomial (common.teacher_exp2).
# "half" etc. name the share of all exponentials (student and teacher) that moves.
EXP2_VARIANTS: dict[str, tuple[int, int]] = {
    "hardware": (0, 0),
    "poly3-half": (3, 0),
    "poly3-quarter": (3, 1),
    "poly3-eighth": (3, 2),
    "poly5-half": (5, 0),
    "poly5-quarter": (5, 1),
    "poly5-eighth": (5, 2),
}


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """Which arithmetic the kernels use.

    Attributes:
        forward_exp2: key of :data:`EXP2_VARIANTS` for the forward kernels.
        backward_exp2: key of :data:`EXP2_VARIANTS` for the dq and dk kernels.
        grad_after_dot: multiply by the upstream gradient after the dot products, not per score.
    """

    forward_exp2: str = "hardware"
    backward_exp2: str = "hardware"
    grad_after_dot: bool = True

    def __post_init__(self) -> None:
        for name in ("forward_exp2", "backward_exp2"):
            if getattr(self, name) not in EXP2_VARIANTS:
                raise ValueError(f"{name} must be one of {sorted(EXP2_VARIANTS)}, got {getattr(self, name)!r}")
        if not isinstance(self.grad_after_dot, bool):
            raise TypeError(f"grad_after_dot must be a bool, got {type(self.grad_after_dot).__name__}")

    @classmethod
    def from_environment(cls) -> KernelVariant:
        return cls(
            forward_exp2=os.environ.get("CL_STREAMKL_FORWARD_EXP2", "hardware"),
            backward_exp2=os.environ.get("CL_STREAMKL_BACKWARD_EXP2", "hardware"),
            grad_after_dot=os.environ.get("CL_STREAMKL_GRAD_AFTER_DOT", "1") == "1",
        )

    def exp2_constants(self, backward: bool, dtype: torch.dtype) -> dict[str, int]:
        """POLY_EXP2_DEGREE and POLY_EXP2_SPLITS of the forward or the backward kernels.

        float32 inputs are promised float32 math: a degree-3 variant (relative error 8.3e-5,
        bf16-level, up to 9e-5 in float32 gradients against 3e-7) runs at degree 5 for them.
        """
        degree, splits = EXP2_VARIANTS[self.backward_exp2 if backward else self.forward_exp2]
        if dtype == torch.float32 and degree == 3:
            degree = 5
        return {"POLY_EXP2_DEGREE": degree, "POLY_EXP2_SPLITS": splits}


_current = KernelVariant.from_environment()


def kernel_variant() -> KernelVariant:
    """The variant the launchers use now."""
    return _current


@contextlib.contextmanager
def use_kernel_variant(**fields) -> Iterator[KernelVariant]:
    """Within the block, launch with these :class:`KernelVariant` fields changed (not thread-safe).

    Example:
        >>> with use_kernel_variant(forward_exp2="poly3-eighth"):
        ...     loss = attention_kl(q, k, q_teacher, k_teacher)
    """
    global _current
    previous = _current
    _current = dataclasses.replace(previous, **fields)
    try:
        yield _current
    finally:
        _current = previous
