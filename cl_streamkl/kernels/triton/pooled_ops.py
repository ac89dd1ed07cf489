"""Launchers, custom ops and the autograd Function of the pooled-attention kernels (:mod:`.pooled`).

The launchers allocate the outputs and pass strides, so timm's q/k views need no copy. Tiles are
fixed per kernel (:func:`pooled_tiles`), never autotuned: each kernel is one plain loop whose
shape does not change with the sequence length, and one compile per (dtype, head dim, variant)
keeps a first call to seconds. As for the StreamKL kernels, ``torch.library`` custom ops with
fake implementations let ``torch.compile(fullgraph=True)`` trace through, and eager calls take the
cheaper ``autograd.Function``; :func:`pooled_attention_triton` picks.
"""

from __future__ import annotations

import torch

from cl_streamkl.kernels.pooled_reference import PooledAttention
from cl_streamkl.kernels.triton.common import INTERPRETING
from cl_streamkl.kernels.triton.launch import LOG2_E, device_guard, dot_precision, empty_gradient_for
from cl_streamkl.kernels.triton.launch_cache import KernelLauncher
from cl_streamkl.kernels.triton.pooled import (
    _pooled_bwd_dk_kernel,
    _pooled_bwd_dq_kernel,
    _pooled_keys_kernel,
    _pooled_rows_kernel,
)
from cl_streamkl.kernels.triton.tuning import block_dim
from cl_streamkl.kernels.validation import refuse_double_backward

__all__ = ["POOLED_LAUNCHERS", "launch_pooled_backward", "launch_pooled_forward", "pooled_attention_triton",
           "pooled_tiles"]

POOLED_LAUNCHERS = {
    name: KernelLauncher(kernel, replay=not INTERPRETING)
    for name, kernel in (("rows", _pooled_rows_kernel), ("keys", _pooled_keys_kernel),
                         ("backward_dq", _pooled_bwd_dq_kernel), ("backward_dk", _pooled_bwd_dk_kernel))
}
# (BLOCK_M, BLOCK_N, warps, stages) per kernel on the GPU, 2-byte inputs and head dims up to 128:
# the row pass is a FlashAttention forward without values (its tiles); the key-side pass keeps a
# 128-key tile and walks the queries; the backward kernels take the StreamKL backward's tiles.
_GPU_TILES = {"rows": (128, 64, 8, 3), "keys": (64, 128, 8, 3), "backward_dq": (64, 64, 4, 2),
              "backward_dk": (64, 64, 4, 2)}
# float32 inputs and wide heads: smaller tiles, as for the StreamKL kernels (shared memory).
_SMALL_GPU_TILES = (64, 32, 4, 2)


def pooled_tiles(kernel: str, head_dim: int, element_size: int) -> dict[str, int]:
    """BLOCK_M, BLOCK_N (and on the GPU num_warps, num_stages) of one pooled kernel.

    Args:
        kernel: a key of :data:`POOLED_LAUNCHERS`.
        head_dim: D.
        element_size: bytes per input element.
    """
    if INTERPRETING:
        return {"BLOCK_M": 16, "BLOCK_N": 16}
    small = head_dim > 128 or element_size == 4
    block_m, block_n, warps, stages = _SMALL_GPU_TILES if small else _GPU_TILES[kernel]
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def _strides3(tensor: torch.Tensor) -> tuple[int, int, int]:
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def _launch(name: str, args: tuple, q: torch.Tensor, squared: bool, length: int, block: str) -> None:
    constants = {"SQUARED": squared, "DOT_PRECISION": dot_precision(q.dtype), "BLOCK_D": block_dim(q.size(-1))}
    POOLED_LAUNCHERS[name](args, constants, pooled_tiles(name, q.size(-1), q.element_size()),
                           length=length, batch_heads=q.size(0) * q.size(1), block=block)


def launch_pooled_forward(
    q: torch.Tensor, k: torch.Tensor, scale: float, squared: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the row pass, then the key-side pass.

    Args:
        q: (B, H, Nq, D); k: (B, H, Nk, D); unit stride in D, any other strides.
        scale: softmax scale (natural units).
        squared: pool P² rather than P.

    Returns:
        per_key (B, H, Nk), per_row (B, H, Nq) and the base-2 log-sum-exps (B, H, Nq), float32
        contiguous.
    """
    batch, heads, n_q, head_dim = q.shape
    n_k = k.size(2)
    per_row = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    lse = torch.empty_like(per_row)
    per_key = torch.empty((batch, heads, n_k), dtype=torch.float32, device=q.device)
    sizes = (heads, n_q, n_k, head_dim, scale * LOG2_E)
    with device_guard(q):
        _launch("rows", (q, k, per_row, lse, *_strides3(q), *_strides3(k), *sizes), q, squared, n_q, "BLOCK_M")
        _launch("keys", (q, k, lse, per_key, *_strides3(q), *_strides3(k), *sizes), q, squared, n_k, "BLOCK_N")
    return per_key, per_row, lse


def launch_pooled_backward(
    grad_per_key: torch.Tensor, grad_per_row: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    per_row: torch.Tensor, lse: torch.Tensor, scale: float, squared: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the dq kernel (with the row reduction), then the dk kernel.

    Args:
        grad_per_key: upstream gradient of per_key, (B, H, Nk), any strides.
        grad_per_row: upstream gradient of per_row, (B, H, Nq), any strides.
        q, k, per_row, lse, scale, squared: the forward's inputs, outputs and options.

    Returns:
        dq and dk, each in its input's dtype and layout.
    """
    batch, heads, n_q, head_dim = q.shape
    n_k = k.size(2)
    grad_per_key, grad_per_row = grad_per_key.float(), grad_per_row.float()
    grad_q, grad_k = empty_gradient_for(q), empty_gradient_for(k)
    delta = torch.empty_like(lse)
    strides = (*_strides3(q), *_strides3(k), *_strides3(grad_per_key), *_strides3(grad_per_row))
    sizes = (heads, n_q, n_k, head_dim, scale * LOG2_E, scale)
    with device_guard(q):
        _launch("backward_dq", (q, k, lse, per_row, grad_per_key, grad_per_row, delta, grad_q,
                                *strides, *_strides3(grad_q), *sizes), q, squared, n_q, "BLOCK_M")
        _launch("backward_dk", (q, k, lse, grad_per_key, grad_per_row, delta, grad_k,
                                *strides, *_strides3(grad_k), *sizes), q, squared, n_k, "BLOCK_N")
    return grad_q, grad_k


@torch.library.custom_op("cl_streamkl::pooled_attention_fwd", mutates_args=())
def pooled_attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, scale: float, squared: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Custom op around :func:`launch_pooled_forward`."""
    return launch_pooled_forward(q, k, scale, squared)


@pooled_attention_fwd_op.register_fake
def _pooled_attention_fwd_fake(q, k, scale, squared):
    per_row = q.new_empty(q.shape[:3], dtype=torch.float32)
    return k.new_empty(k.shape[:3], dtype=torch.float32), per_row, torch.empty_like(per_row)


@torch.library.custom_op("cl_streamkl::pooled_attention_bwd", mutates_args=())
def pooled_attention_bwd_op(
    grad_per_key: torch.Tensor, grad_per_row: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    per_row: torch.Tensor, lse: torch.Tensor, scale: float, squared: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom op around :func:`launch_pooled_backward`."""
    return launch_pooled_backward(grad_per_key, grad_per_row, q, k, per_row, lse, scale, squared)


@pooled_attention_bwd_op.register_fake
def _pooled_attention_bwd_fake(grad_per_key, grad_per_row, q, k, per_row, lse, scale, squared):
    return empty_gradient_for(q), empty_gradient_for(k)


def _upstream(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    # An output the loss does not use hands back no gradient: zero, expanded (no memory).
    return like.new_zeros(()).expand(like.shape) if grad is None else grad


def _setup_context(ctx, inputs, output):
    q, k, scale, squared = inputs
    per_key, per_row, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, per_key, per_row, lse)
    ctx.options = (scale, squared)


def _op_backward(ctx, grad_per_key, grad_per_row, _grad_lse):
    q, k, per_key, per_row, lse = ctx.saved_tensors
    grad_q, grad_k = pooled_attention_bwd_op(
        _upstream(grad_per_key, per_key), _upstream(grad_per_row, per_row), q, k, per_row, lse, *ctx.options)
    return grad_q, grad_k, None, None


pooled_attention_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


class _PooledAttentionFunction(torch.autograd.Function):
    """Eager twin of the custom op: same launchers, less dispatch."""

    @staticmethod
    def forward(ctx, q, k, scale, squared):
        per_key, per_row, lse = launch_pooled_forward(q, k, scale, squared)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, per_key, per_row, lse)
        ctx.options = (scale, squared)
        return per_key, per_row

    @staticmethod
    def backward(ctx, grad_per_key, grad_per_row):
        refuse_double_backward()
        q, k, per_key, per_row, lse = ctx.saved_tensors
        grad_q, grad_k = launch_pooled_backward(
            _upstream(grad_per_key, per_key), _upstream(grad_per_row, per_row), q, k, per_row, lse, *ctx.options)
        return grad_q, grad_k, None, None


def pooled_attention_triton(q: torch.Tensor, k: torch.Tensor, scale: float, squared: bool) -> PooledAttention:
    """per_key (B, H, Nk) and per_row (B, H, Nq), float32, through the pooled kernels.

    Inputs are validated by the caller (:func:`cl_streamkl.pooled_attention`).
    """
    if torch.compiler.is_compiling():
        per_key, per_row, _ = pooled_attention_fwd_op(q, k, scale, squared)
        return PooledAttention(per_key, per_row)
    return PooledAttention(*_PooledAttentionFunction.apply(q, k, scale, squared))
