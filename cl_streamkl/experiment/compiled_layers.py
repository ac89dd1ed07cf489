"""Layer norms and MLPs through ``torch.compile``: the same arithmetic in fewer, fuller GPU kernels.

Why: a narrow ViT on long token sequences (the efficacy study's: 64 wide, 1025 tokens,
batch 32) spends most of its GPU time in eager kernels made for wide layers. Measured on
an H200 (torch 2.11, bf16 autocast, one training step of that model): 4.66 ms of kernels,
a third of it layer norm (its weight and bias gradient is a 64-column reduction over
32,800 rows) and a tenth the linear layers' bias gradients; the whole model compiled
needs 2.18 ms. With many runs sharing one GPU, kernel time is what limits the runs per
hour.

The whole model cannot be compiled while its Q/K are captured (hooks and a Python
``TorchFunctionMode`` run on every call), so only the pieces around attention are:
every ``nn.LayerNorm`` and every plain timm ``Mlp`` (linear, GELU, linear, no dropout).
The attention modules stay eager and are captured as before. Each compiled piece is a
module-level function of its input and its module's parameters, reached through the
module's class, so a deep copy (a frozen teacher, LwF's previous model) computes with
its own parameters and state-dict keys do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timm.layers import LayerNorm, Mlp
from torch import nn

__all__ = ["CompiledLayerNorm", "CompiledMlp", "compile_layers"]

# Exactly these classes: subclasses such as timm's LayerNorm2d permute their input first.
_PLAIN_NORMS = (nn.LayerNorm, LayerNorm)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, shape: tuple[int, ...],
                eps: float) -> torch.Tensor:
    return F.layer_norm(x, shape, weight, bias, eps)


def _mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
         approximate: str) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate), w2, b2)


@functools.cache
def _compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # Compiled on first use; every module of a kind shares one compiled function (its
    # parameters are inputs, not constants), so many blocks cost one compilation per shape.
    return torch.compile(fn)


class CompiledLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose forward runs through one shared compiled function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., *normalized_shape) → the same shape."""
        return _compiled(_layer_norm)(x, self.weight, self.bias, tuple(self.normalized_shape), self.eps)


class CompiledMlp(Mlp):
    """timm's ``Mlp`` (fc1, GELU, fc2, no dropout, no hidden norm) as one compiled function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) → (..., out_features)."""
        return _compiled(_mlp)(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                               self.act.approximate)


def _plain_mlp(module: nn.Module) -> bool:
    """A timm Mlp that computes exactly fc2(gelu(fc1(x))) in training too."""
    def no_op(layer: nn.Module) -> bool:
        return isinstance(layer, nn.Identity) or (isinstance(layer, nn.Dropout) and layer.p == 0.0)

    return (type(module) is Mlp and type(module.fc1) is nn.Linear and type(module.fc2) is nn.Linear
            and type(module.act) is nn.GELU and no_op(module.drop1) and no_op(module.norm) and no_op(module.drop2))


def compile_layers(model: nn.Module) -> int:
    """Run ``model``'s layer norms and plain MLPs through ``torch.compile``, in place.

    Each such module's class becomes :class:`CompiledLayerNorm` or :class:`CompiledMlp`;
    parameters, buffers and state-dict keys stay. Attention modules and anything else
    are left as they are, so Q/K capture works unchanged.

    Args:
        model: a timm vision transformer (or any module holding ``nn.LayerNorm`` and timm
            ``Mlp`` modules).

    Returns:
        How many modules now run compiled.

    Raises:
        ValueError: the model has no layer norm and no plain MLP to compile.
    """
    count = 0
    for module in model.modules():
        if type(module) in _PLAIN_NORMS:
            module.__class__ = CompiledLayerNorm
            count += 1
        elif _plain_mlp(module):
            module.__class__ = CompiledMlp
            count += 1
    if count == 0 and not any(isinstance(m, (CompiledLayerNorm, CompiledMlp)) for m in model.modules()):
        raise ValueError(f"compile_layers: {type(model).__name__} has no nn.LayerNorm and no plain timm Mlp "
                         "(fc1, GELU, fc2 without dropout) to compile")
    return count
