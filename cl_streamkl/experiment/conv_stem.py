"""Early convolutions in place of a ViT's patch projection (Xiao et al. 2021, "Early Convolutions Help
Transformers See Better"), the kind of ViT that PAD (Pelosin et al. 2022) distils.

A patch projection sees each patch alone; a digit that lands anywhere on a large canvas
straddles patches at every offset. 3×3 stride-2 convolutions with batch norm and ReLU see
across patch borders and halve the side each, and a 1×1 convolution projects to the width of
the transformer, so the same token grid comes out: (S / patch)² tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def stem_convolutions(patch_size: int) -> int:
    """How many 3×3 stride-2 convolutions shrink a side by ``patch_size`` (2 for 4-px patches).

    Raises:
        ValueError: ``patch_size`` is not a power of two of at least 2.
    """
    if patch_size < 2 or patch_size & (patch_size - 1):
        raise ValueError(f"--stem conv halves the side per convolution, so patch_size must be a power of two "
                         f"of at least 2; got {patch_size}")
    return int(math.log2(patch_size))


class ConvStem(nn.Module):
    """Stride-2 3×3 convolutions (batch norm, ReLU), then a 1×1 projection: timm's ``embed_layer``.

    Pass the class as ``embed_layer`` to timm's ``VisionTransformer`` (vit_*, deit_*
    models); it takes the arguments timm gives a ``PatchEmbed`` and exposes the same
    ``img_size``, ``patch_size``, ``grid_size`` and ``num_patches``. The channels double
    from convolution to convolution up to ``embed_dim`` (``embed_dim / 2``, ``embed_dim``
    for 4-px patches).

    Args:
        img_size: side S of the square input images.
        patch_size: side of the area one token covers: a power of two; log2 of it
            convolutions.
        in_chans: image channels.
        embed_dim: token width D.
        norm_layer: applied to the tokens, as in ``PatchEmbed`` (timm's ``embed_norm_layer``).
        bias: bias of the 1×1 projection (the convolutions before batch norm have none).
        dynamic_img_pad: must be False: the grid is fixed by ``img_size``.
        output_fmt: must be None or "NLC" (timm's ``dynamic_img_size`` asks for others).
        device: where the parameters are made.
        dtype: the parameters' dtype.
        **ignored: ``PatchEmbed`` arguments that change nothing here (``flatten``,
            ``strict_img_size``).

    Raises:
        ValueError: a size that is not a multiple of a power-of-two patch, or a dynamic
            image size.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        norm_layer: Callable[[int], nn.Module] | None = None,
        bias: bool = True,
        dynamic_img_pad: bool = False,
        output_fmt: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **ignored: object,
    ) -> None:
        super().__init__()
        img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        patch_size = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
        if dynamic_img_pad or output_fmt not in (None, "NLC"):
            raise ValueError("--stem conv needs a fixed image size (no dynamic_img_size or dynamic_img_pad)")
        if patch_size[0] != patch_size[1]:
            raise ValueError(f"--stem conv needs square patches; got {patch_size}")
        if img_size[0] % patch_size[0] or img_size[1] % patch_size[1]:
            raise ValueError(f"image size {img_size} is not divisible by patch size {patch_size[0]}")
        convolutions = stem_convolutions(patch_size[0])
        factory = {"device": device, "dtype": dtype}
        layers: list[nn.Module] = []
        channels = in_chans
        for index in range(convolutions):
            out_channels = max(embed_dim >> (convolutions - 1 - index), 1)
            layers += [nn.Conv2d(channels, out_channels, 3, stride=2, padding=1, bias=False, **factory),
                       nn.BatchNorm2d(out_channels, **factory), nn.ReLU(inplace=True)]
            channels = out_channels
        self.convolutions = nn.Sequential(*layers)
        self.proj = nn.Conv2d(channels, embed_dim, 1, bias=bias, **factory)
        self.norm = norm_layer(embed_dim, **factory) if norm_layer else nn.Identity()
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = (img_size[0] // patch_size[0], img_size[1] // patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    def feat_ratio(self, as_scalar: bool = True) -> int | tuple[int, int]:
        """How much smaller the token grid's side is than the image's (timm's feature-info API)."""
        return self.patch_size[0] if as_scalar else self.patch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) images → (B, (S / patch)², D) tokens, row by row as timm's ``PatchEmbed``."""
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"input size {tuple(x.shape[-2:])} does not match the stem's {self.img_size}")
        tokens = self.proj(self.convolutions(x)).flatten(2).transpose(1, 2)
        return self.norm(tokens)
