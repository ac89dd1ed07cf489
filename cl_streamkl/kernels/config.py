"""The kernels' global switches, in one place (as timm's ``layers/config.py``).

Eight options change how the Triton kernels run, never what they compute beyond rounding:

* ``autotune`` (default on): tiles chosen by ``triton.autotune`` per (dtype, head dims,
  causal, length bucket), which costs seconds to a minute of compiling per new combination;
  off, fixed heuristic tiles (correctness runs, short jobs). Lengths past 2048 and the grouped
  kernels at ViT lengths run fixed, measured tiles either way
  (:mod:`cl_streamkl.kernels.triton.tuning`). The CPU interpreter never autotunes, whatever
  this says: timing it is meaningless.
* ``backward`` (default ``"auto"``): ``"split"`` runs a query-side and a key-side kernel, each
  recomputing the score tiles, with no atomics; ``"onepass"`` runs the key-side kernel alone,
  adding dq up in float32 with atomics (half the exponentials and products per score, 4·D bytes
  more memory per query row, summation order not fixed). ``"auto"`` takes the one-pass backward
  where it measured faster on the H200: head dims up to 64, no causal mask, at least
  :data:`ONE_PASS_MIN_LENGTH` queries and keys (4–7 % faster forward+backward from 4096 to 32768
  tokens, with and without given log-sum-exps); the split kernels elsewhere (slower one-pass
  causal, at head dim 128 and at ViT lengths; docs/tuning-log.md).
* ``deterministic`` (default off): on, the split kernels run whatever ``backward`` says, so
  gradients are bit-for-bit reproducible, and ``fused_gradients`` is off.
* ``fused_gradients`` (default ``"auto"``): where both log-sum-exps are given, the reduction is
  a scalar, q or k needs a gradient and the teacher needs none, ``"on"`` computes the KL and its
  gradients in one forward pass (:mod:`cl_streamkl.kernels.triton.fused`) and the backward only
  scales them; ``"off"`` runs the forward and then the backward kernels. ``"auto"`` fuses where
  it measured faster on an H100: from :data:`FUSED_MIN_LENGTH` queries and keys, head dims up
  to :data:`FUSED_MAX_HEAD_DIM` (docs/tuning-log.md, "The fused forward").
* ``fast_launch`` (default on): replay compiled kernels without Triton's per-launch binder
  (:mod:`cl_streamkl.kernels.triton.launch_cache`); off, every launch goes through
  ``kernel[grid](...)``.
* ``forward_exp2`` / ``backward_exp2`` (default ``"hardware"``): a key of
  :data:`EXP2_VARIANTS`, the share of the teacher's exponentials the forward / the dq and
  dk kernels compute with a polynomial on the FMA units (:mod:`cl_streamkl.kernels.triton.variants`).
* ``grad_after_dot`` (default on): the backward kernels multiply by the upstream gradient
  after the dot products instead of per score.

Read them with :func:`get_kernel_options`, change them for the process with
:func:`set_kernel_options`, or for a block with :func:`kernel_options`::

    with kernel_options(autotune=False, forward_exp2="poly3-eighth"):
        loss = attention_kl(q, k, q_teacher, k_teacher)

The environment gives the defaults, read once, when the options are first asked for (so that
importing the package never fails on them): ``CL_STREAMKL_AUTOTUNE``,
``CL_STREAMKL_FAST_LAUNCH``, ``CL_STREAMKL_GRAD_AFTER_DOT`` and ``CL_STREAMKL_DETERMINISTIC``
take ``1``/``0``, ``true``/``false``, ``yes``/``no`` or ``on``/``off`` (any case; empty is
unset); ``CL_STREAMKL_FORWARD_EXP2`` and ``CL_STREAMKL_BACKWARD_EXP2`` a key of
:data:`EXP2_VARIANTS`; ``CL_STREAMKL_BACKWARD`` one of :data:`BACKWARDS`; ``CL_STREAMKL_FUSED_GRADIENTS``
one of :data:`FUSED_GRADIENTS`. Any other value is
refused with a ValueError naming the variable. Nothing else in the package reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

__all__ = ["BACKWARDS", "EXP2_VARIANTS", "KernelOptions", "get_kernel_options", "kernel_options", "set_kernel_options"]

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

BACKWARDS = ("auto", "split", "onepass")
# "auto" runs the one-pass backward from this many queries and keys up (see the module docstring).
ONE_PASS_MIN_LENGTH = 4096
ONE_PASS_MAX_HEAD_DIM = 64
FUSED_GRADIENTS = ("auto", "on", "off")
# "auto" fuses from this many queries and keys up, for head dims up to FUSED_MAX_HEAD_DIM ("on": any
# length; wider heads always keep the forward and backward kernels).
FUSED_MIN_LENGTH = 4096
FUSED_MAX_HEAD_DIM = 64


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the Triton kernels run (see the module docstring for each field)."""

    autotune: bool = True
    fast_launch: bool = True
    forward_exp2: str = "hardware"
    backward_exp2: str = "hardware"
    grad_after_dot: bool = True
    backward: str = "auto"
    deterministic: bool = False
    fused_gradients: str = "auto"

    def __post_init__(self) -> None:
        for name in ("autotune", "fast_launch", "grad_after_dot", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("forward_exp2", "backward_exp2"):
            if getattr(self, name) not in EXP2_VARIANTS:
                raise ValueError(f"{name} must be one of {sorted(EXP2_VARIANTS)}, got {getattr(self, name)!r}")
        if self.backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {list(BACKWARDS)}, got {self.backward!r}")
        if self.fused_gradients not in FUSED_GRADIENTS:
            raise ValueError(f"fused_gradients must be one of {list(FUSED_GRADIENTS)}, got {self.fused_gradients!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> KernelOptions:
        """The options the ``CL_STREAMKL_*`` variables of ``environ`` (default ``os.environ``) name.

        Raises:
            ValueError: a variable holds a value it does not take (one line naming it).
        """
        environ = os.environ if environ is None else environ
        return cls(
            autotune=_switch(environ, "CL_STREAMKL_AUTOTUNE", True),
            fast_launch=_switch(environ, "CL_STREAMKL_FAST_LAUNCH", True),
            forward_exp2=_choice(environ, "CL_STREAMKL_FORWARD_EXP2", "hardware", tuple(EXP2_VARIANTS)),
            backward_exp2=_choice(environ, "CL_STREAMKL_BACKWARD_EXP2", "hardware", tuple(EXP2_VARIANTS)),
            grad_after_dot=_switch(environ, "CL_STREAMKL_GRAD_AFTER_DOT", True),
            backward=_choice(environ, "CL_STREAMKL_BACKWARD", "auto", BACKWARDS),
            deterministic=_switch(environ, "CL_STREAMKL_DETERMINISTIC", False),
            fused_gradients=_choice(environ, "CL_STREAMKL_FUSED_GRADIENTS", "auto", FUSED_GRADIENTS),
        )


# The spellings of a switch shells and CI files use; anything else is refused, not read as one of them.
_SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                 "off": False}


def _switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """The switch variable ``name`` (``default`` when unset or empty)."""
    text = environ.get(name, "").strip()
    if not text:
        return default
    value = _SWITCH_WORDS.get(text.lower())
    if value is None:
        raise ValueError(f"environment variable {name} must be 1/0, true/false, yes/no or on/off; got {text!r}")
    return value


def _choice(environ: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    """The variable ``name``, one of ``choices`` in any case (``default`` when unset or empty)."""
    text = environ.get(name, "").strip()
    if not text:
        return default
    if text.lower() not in choices:
        raise ValueError(f"environment variable {name} must be one of {', '.join(choices)}; got {text!r}")
    return text.lower()


# Read from the environment on first use (get_kernel_options), not at import.
_current: KernelOptions | None = None


def get_kernel_options() -> KernelOptions:
    """The options the launchers use now; the first call reads them from the environment.

    Raises:
        ValueError: a ``CL_STREAMKL_*`` variable holds a value it does not take (one line naming it).
    """
    global _current
    if _current is None:
        _current = KernelOptions.from_environment()
    return _current


def set_kernel_options(**fields: bool | str) -> KernelOptions:
    """Change the named :class:`KernelOptions` fields for the rest of the process; returns the previous options.

    Raises:
        TypeError: an unknown field, or a switch that is not a bool.
        ValueError: an exponential variant not in :data:`EXP2_VARIANTS`, a backward not in :data:`BACKWARDS`,
            a fused_gradients not in :data:`FUSED_GRADIENTS`,
            or (on first use) a ``CL_STREAMKL_*`` variable that holds a value it does not take.
    """
    global _current
    previous = get_kernel_options()
    _current = dataclasses.replace(previous, **fields)
    return previous


@contextlib.contextmanager
def kernel_options(**fields: bool | str) -> Iterator[KernelOptions]:
    """Within the block, launch with these :class:`KernelOptions` fields changed (not thread-safe).

    Example:
        >>> with kernel_options(autotune=False):
        ...     loss = attention_kl(q, k, q_teacher, k_teacher)
    """
    global _current
    previous = set_kernel_options(**fields)
    try:
        yield get_kernel_options()
    finally:
        _current = previous
