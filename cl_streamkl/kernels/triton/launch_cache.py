"""Replay compiled Triton kernels without the per-launch autotuner and argument binder.

At ViT sizes (197 tokens, B·H in the hundreds) one StreamKL kernel runs for tens of
microseconds, while ``kernel[grid](...)`` spends a comparable time in Python: the
autotuner rebuilds dictionaries of the ~45 arguments and the JIT binder specialises
each of them. :class:`KernelLauncher` does that work once per distinct argument
signature and afterwards calls the compiled kernel's launcher directly.

The cache key holds every integer argument's exact value, every tensor's dtype and
16-byte alignment, the compile-time constants and the device: at least as fine as
anything Triton specialises a kernel on (integer values equal to 1 or divisible by
16, pointer alignment, dtypes), so a replayed kernel is always the one Triton itself
would have picked, autotuned configuration included.

The ``fast_launch`` switch of :mod:`cl_streamkl.kernels.config` turns the replay off (every
launch goes through ``kernel[grid](...)``); the Triton CPU interpreter never replays.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton.runtime.autotuner import Autotuner

from cl_streamkl.kernels.config import get_kernel_options

# Distinct (shape, stride, alignment) signatures kept per kernel; a training run
# sees a handful (the last, smaller batch of an epoch adds one).
MAX_ENTRIES = 256


def _programs(length: int, tile: int, batch_heads: int) -> int:
    return -(-length // tile) * batch_heads


def signature_key(args: Sequence[Any], constants: tuple) -> tuple:
    """Cache key of one launch: exact scalar values, tensor dtypes and alignment, device.

    Args:
        args: the kernel's runtime arguments in signature order (tensors, ints, floats).
        constants: the compile-time constants passed by keyword, in a fixed order.

    Raises:
        TypeError: an argument is neither a tensor nor an int, float or bool.
    """
    key: list[Any] = [constants]
    for value in args:
        if isinstance(value, torch.Tensor):
            key.append((value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, float):
            # Triton passes floats as fp32 values and never specialises on them.
            key.append(float)
        elif isinstance(value, int):
            key.append(value)
        else:
            raise TypeError(f"cannot launch a Triton kernel with an argument of type {type(value).__name__}")
    return tuple(key)


class KernelLauncher:
    """Launches one (possibly autotuned) Triton kernel over a 1-D grid of tiles × (batch, head).

    Args:
        kernel: a ``triton.jit`` function or a ``triton.autotune`` wrapper of one,
            whose compile-time constants all follow its runtime arguments. Launches that
            pass their tiles (``options``) run the function under the wrapper.
        replay: whether to replay compiled kernels (False under the CPU interpreter).
    """

    def __init__(self, kernel, replay: bool) -> None:
        self.kernel = kernel
        self.untuned = kernel.fn if isinstance(kernel, Autotuner) else kernel
        self.replay = replay
        self._compiled: dict[tuple, tuple[Callable, int, tuple]] = {}

    def __call__(
        self,
        args: Sequence[Any],
        constants: dict[str, Any],
        options: dict[str, Any],
        length: int,
        batch_heads: int,
        block: str,
    ) -> None:
        """Launch over ``cdiv(length, tile) * batch_heads`` programs, tile = the ``block`` constant.

        Args:
            args: runtime arguments in signature order.
            constants: compile-time constants other than the tile sizes.
            options: tile sizes, warps and stages when not autotuned; empty otherwise.
            length: rows (or keys) the grid covers per (batch, head).
            batch_heads: B·H.
            block: name of the tile-size constant along ``length`` ("BLOCK_M" or "BLOCK_N").
        """
        if not (self.replay and get_kernel_options().fast_launch):
            self._launch_through_triton(args, constants, options, length, batch_heads, block)
            return
        # The tiles passed (if any) are part of the key: other tiles are another compiled kernel.
        key = (args[0].device.index, block, length, batch_heads, tuple(options.values()),
               signature_key(args, tuple(constants.values())))
        entry = self._compiled.get(key)
        if entry is None:
            # This first launch goes through Triton (compiling or autotuning as needed).
            entry = self._compile(args, constants, options, length, batch_heads, block)
            if entry is None:
                self.replay = False
            else:
                if len(self._compiled) >= MAX_ENTRIES:
                    self._compiled.clear()
                self._compiled[key] = entry
            return
        runner_for_grid, tile, constant_tail = entry
        runner_for_grid((_programs(length, tile, batch_heads), 1, 1))(*args, *constant_tail)

    def _chosen(self, options: dict[str, Any]):
        # Launches that pass their tiles skip the autotuner (the autotune switch is off).
        return self.untuned if options else self.kernel

    def _launch_through_triton(self, args, constants, options, length, batch_heads, block):
        """``kernel[grid](...)``: bind, specialise, compile or autotune if needed, launch.

        Returns what Triton returns: the compiled kernel that ran (None under the interpreter).
        """
        return self._chosen(options)[lambda meta: (_programs(length, meta[block], batch_heads),)](
            *args, **constants, **options
        )

    def _compile(self, args, constants, options, length, batch_heads, block):
        """Launch once through Triton (compiling or autotuning as needed); return what replays it."""
        compiled = self._launch_through_triton(args, constants, options, length, batch_heads, block)
        kernel = self._chosen(options)
        chosen = getattr(kernel, "best_config", None)
        values = {**constants, **options, **(chosen.kwargs if chosen is not None else {})}
        names = kernel.arg_names[len(args):]
        if not hasattr(compiled, "__getitem__") or block not in values or any(n not in values for n in names):
            # An unfamiliar Triton API: stay correct through kernel[grid](...), only slower.
            warnings.warn(
                f"cl_streamkl: cannot replay compiled {getattr(kernel, '__name__', kernel)!r} "
                "with this Triton version; launching through the JIT instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        return compiled.__getitem__, values[block], tuple(values[name] for name in names)
