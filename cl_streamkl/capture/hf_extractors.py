"""Read Hugging Face ``transformers`` vision transformers for :class:`~cl_streamkl.capture.QKCapture`.

``transformers`` (4.48 and later, 5.x; CLIP's eager attention after 4.51) splits q and k into
heads inside one attention module per encoder layer (``ViTAttention``, ``CLIPAttention``, ...;
``ViTSelfAttention`` in 4.x) and hands them to the attention function
``config._attn_implementation`` names:

* ``"sdpa"``: ``F.scaled_dot_product_attention(q, k, v, attn_mask=None, scale=scaling)``, read
  as the timm fused path is (with its log-sum-exp, and from the autograd graph once verified);
* ``"eager"``: ``softmax(torch.matmul(q, k.transpose(-1, -2)) * scaling)``, the product before
  its scale, which :class:`ScaledProductWatcher` reads besides the timm spellings.

So the q and k recorded are the module's own tensors, with their strides and autograd graph to
the projections (and to any LoRA adapter on them), and the scale is the one the forward applied.
Nothing is patched in ``transformers``: the attention classes are registered in the extractor
registry of :mod:`cl_streamkl.capture.extractors` when a model from one of :data:`FAMILIES` is
first captured, so importing this module never imports ``transformers``.

Attention whose scores are more than ``scale · q kᵀ`` is refused at construction, by name and
reason (:func:`check_faithful`): Swin's windows with their relative-position bias, BEiT's and
Data2Vec-vision's relative-position biases, ViTDet's decomposed relative positions and windows.
A KL over q and k alone would compare other distributions than the models attend with.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

from cl_streamkl.capture.extractors import (
    ProductWatcher,
    Removable,
    qualified_type_name,
    register_default_extractor,
    watch_score_products,
)
from cl_streamkl.capture.hooks import RecordQK

__all__ = ["FAMILIES", "ScaledProductWatcher", "attention_without_sdpa", "check_faithful", "encoder_blocks",
           "hf_attention_extractor", "is_hf_model", "register_hf_attention"]

FAMILIES: dict[str, str] = {
    "transformers.models.vit.modeling_vit": "ViT",
    "transformers.models.deit.modeling_deit": "DeiT",
    "transformers.models.dinov2.modeling_dinov2": "Dinov2",
    "transformers.models.clip.modeling_clip": "CLIP",
    "transformers.models.siglip.modeling_siglip": "Siglip",
}
"""The modeling modules whose attention is read, and their class-name prefix."""

_MUL_FUNCS = frozenset({torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul})
_DIV_FUNCS = frozenset({torch.Tensor.div, torch.Tensor.__truediv__, torch.div})

_WINDOWS = "attends within (shifted) windows and adds a relative-position bias to q kᵀ"
_RELATIVE_BIAS = ("adds a relative-position bias to q kᵀ (use_relative_position_bias or "
                  "use_shared_relative_position_bias in its config)")
_VITDET = ("adds decomposed relative-position terms to q kᵀ or attends within windows "
           "(use_relative_position_embeddings, window_size in its config)")


def _always(_config: object) -> bool:
    return True


def _relative_bias(config: object) -> bool:
    # Unknown config: assume the bias, as these classes are built for it.
    return config is None or bool(getattr(config, "use_relative_position_bias", True)
                                  or getattr(config, "use_shared_relative_position_bias", True))


def _vitdet_extras(config: object) -> bool:
    return config is None or bool(getattr(config, "use_relative_position_embeddings", True)
                                  or getattr(config, "window_size", 1))


# modeling module → (whether a model's config makes its scores more than q kᵀ, why)
_UNFAITHFUL: dict[str, tuple[Callable[[object], bool], str]] = {
    "transformers.models.swin.modeling_swin": (_always, _WINDOWS),
    "transformers.models.swinv2.modeling_swinv2": (_always, _WINDOWS),
    "transformers.models.donut.modeling_donut_swin": (_always, _WINDOWS),
    "transformers.models.maskformer.modeling_maskformer_swin": (_always, _WINDOWS),
    "transformers.models.swin2sr.modeling_swin2sr": (_always, _WINDOWS),
    "transformers.models.beit.modeling_beit": (_relative_bias, _RELATIVE_BIAS),
    "transformers.models.data2vec.modeling_data2vec_vision": (_relative_bias, _RELATIVE_BIAS),
    "transformers.models.vitdet.modeling_vitdet": (_vitdet_extras, _VITDET),
}


class ScaledProductWatcher(ProductWatcher):
    """A :class:`~cl_streamkl.capture.extractors.ProductWatcher` that also reads ``(q @ kᵀ) * scale``.

    ``transformers``' eager attention multiplies ``q`` by ``k.transpose(-1, -2)`` first and
    scales the product after (``* scaling``; ``/ sqrt(d)`` in older releases). The float the
    product meets first is therefore its softmax scale; anything else it meets first (a
    tensor, an added mask) fails the forward. After the scale, the base class checks that
    the scores meet nothing but a softmax.
    """

    remedy = ("QKCapture reads transformers' vision attention with attn_implementation 'eager' or 'sdpa' and "
              "no attention mask.")

    def _reset(self) -> None:
        super()._reset()
        # (q @ kᵀ, q, k) of an eager product not yet scaled
        self.unscaled: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        unscaled = self.unscaled
        if unscaled is not None and any(value is unscaled[0] for value in (*args, *kwargs.values())):
            if getattr(func, "__name__", None) != "__get__":  # __get__: .shape, .dtype
                return self._on_unscaled_use(func, args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    def _on_matmul(self, args, out) -> None:
        a, b = args
        if id(b) in self.transposed and id(a) not in self.scaled and isinstance(a, torch.Tensor) and a.dim() == 4:
            self.unscaled = (out, a, self.transposed[id(b)][1])
            return
        super()._on_matmul(args, out)

    def _on_unscaled_use(self, func, args, kwargs) -> torch.Tensor:
        product, q, k = self.unscaled
        self.unscaled = None
        out = func(*args, **kwargs)
        other = args[1] if len(args) == 2 and args[0] is product else args[0] if len(args) == 2 else None
        number = isinstance(other, (int, float)) and not isinstance(other, bool) and other != 0
        if func in _MUL_FUNCS and number and not kwargs:
            scale = float(other)
        elif func in _DIV_FUNCS and number and not kwargs and args[0] is product:
            scale = 1.0 / float(other)
        else:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise self._fail(f"its product q kᵀ meets {name} before a scale by a number, so q, k and a scale "
                             "do not describe its scores")
        self.found.append((q, k, scale, None))
        self.scores = out
        return out


def hf_attention_extractor(module: nn.Module, record: RecordQK) -> list[Removable]:
    """The extractor registered for the attention classes of :data:`FAMILIES`.

    Watches the forward with :class:`ScaledProductWatcher`: the SDPA call, or the eager
    ``(q @ kᵀ) * scaling``, must be the forward's one score product, without a mask.

    Args:
        module: the attention module of one encoder layer.
        record: called with ``(q, k, scale)`` or ``(q, k, scale, lse)`` after each forward.

    Returns:
        One handle whose ``remove()`` removes the hooks.
    """
    return watch_score_products(ScaledProductWatcher(module, record))


def is_hf_model(model: nn.Module) -> bool:
    """Whether any module of ``model`` is defined in ``transformers``."""
    return any(type(module).__module__.startswith("transformers.") for module in model.modules())


def _score_classes(modeling: object, prefix: str) -> list[type]:
    """The classes of one modeling module that form the scores: ``*SelfAttention`` where it exists (4.x)."""
    inner = [f"{prefix}SelfAttention", f"{prefix}SdpaSelfAttention"]
    outer = [f"{prefix}Attention", f"{prefix}SdpaAttention"]
    for names in (inner, outer):
        found = [getattr(modeling, name) for name in names if isinstance(getattr(modeling, name, None), type)]
        if found:
            return found
    return []


def register_hf_attention(model: nn.Module) -> None:
    """Register :func:`hf_attention_extractor` for the attention classes of ``model``'s :data:`FAMILIES`.

    Only the modeling modules ``model`` is built from are looked at (they are imported
    already); an extractor the user registered for a class stays.
    """
    for name in {type(module).__module__ for module in model.modules()} & FAMILIES.keys():
        for cls in _score_classes(sys.modules[name], FAMILIES[name]):
            register_default_extractor(cls, hf_attention_extractor)


def check_faithful(model: nn.Module) -> None:
    """Refuse a ``transformers`` model whose attention scores are more than ``scale · q kᵀ``.

    Raises:
        TypeError: one line naming the model, its attention class and what its scores add.
    """
    for module in model.modules():
        rule = _UNFAITHFUL.get(type(module).__module__)
        if rule is None or "attention" not in type(module).__name__.lower():
            continue
        unfaithful, why = rule
        config = getattr(module, "config", None)
        config = getattr(model, "config", None) if config is None else config
        if unfaithful(config):
            raise TypeError(
                f"QKCapture cannot capture {qualified_type_name(model)}: its attention {type(module).__name__} {why}, "
                "so q and k do not give its attention maps and a KL over them would be wrong."
            )


def _is_layer_list(name: str, module: nn.Module) -> bool:
    """A ``layer`` / ``layers`` ModuleList each of whose items holds an attention module."""
    return (isinstance(module, nn.ModuleList) and name.rpartition(".")[2] in ("layer", "layers") and len(module) > 0
            and all(any("attention" in type(m).__name__.lower() for m in item.modules()) for item in module))


def encoder_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The layers of ``model``'s one transformer encoder (its ``layer`` / ``layers`` list), or None.

    ``ViTModel.layers`` in transformers 5, ``vit.encoder.layer`` in 4.x, ``vision_model.encoder.layers``
    (CLIP, SigLIP).

    Raises:
        TypeError: ``model`` holds several encoders (CLIP's text and vision towers).
    """
    found = [(name, module) for name, module in model.named_modules() if _is_layer_list(name, module)]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise TypeError(f"QKCapture captures one transformer encoder; {qualified_type_name(model)} holds "
                        f"{len(found)} ({names}): pass the module holding the one to distil, e.g. model.vision_model")
    return list(found[0][1].children()) if found else None


def attention_without_sdpa(modules: Iterable[nn.Module]) -> str | None:
    """The ``attn_implementation`` of the first ``transformers`` attention module that does not run SDPA, or None.

    Such attention (``"eager"``, ``"flash_attention_2"``, ...) makes no
    ``F.scaled_dot_product_attention`` call for a compiled teacher to record. None also for
    modules that are not ``transformers``' or do not keep their config.
    """
    for module in modules:
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if type(module).__module__.startswith("transformers.") and isinstance(implementation, str) \
                and implementation != "sdpa":
            return implementation
    return None

