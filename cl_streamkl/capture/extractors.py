"""How one attention block is read: the Q/K extractor registry and the built-in product watcher.

How a block is read is decided by an *extractor* looked up by the attention module's
exact type (see :func:`register_qk_extractor`). The built-in
:func:`attention_product_extractor` does not depend on how a particular timm release
writes ``forward``: while the attention module runs, it watches the torch calls and
picks out the one product that forms the scores, either

* ``F.scaled_dot_product_attention(q, k, v)`` (timm's fused path), or
* ``(q * scale) @ k.transpose(-2, -1)`` (timm's manual path).

Whatever qk-norm, rotary embedding or grouped-query expansion happens before that call
is therefore already applied. If neither pattern shows up, or the scores are not just
``q kᵀ`` (an attention mask or causal flag passed to ``scaled_dot_product_attention``, or
manual scores that meet anything but a softmax, such as timm's additive mask for
``attn_mask`` / ``is_causal``), the forward fails with an error naming the module type
instead of returning wrong tensors.

Registered by default: timm's ``Attention`` (ViT, DeiT, DeiT-3), ``AttentionRope`` and
``eva.EvaAttention`` (EVA, EVA-02), and ``nn.MultiheadAttention`` (torchvision's
``VisionTransformer``; read by :mod:`cl_streamkl.capture.multihead`). ``transformers``'
attention classes are registered by :mod:`cl_streamkl.capture.hf_extractors` when a model
using them is first captured. Attention classes with extra score terms, such as BEiT's
relative-position bias, are deliberately not registered and are rejected with a clear error.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

# GRAPH_READS is looked up through its module at each forward, so a registry swapped in
# there (tests start from a fresh one) is the one every capture uses.
from cl_streamkl.capture import graph_reads
from cl_streamkl.capture.attention_lse import attention_with_lse, lse_from_node
from cl_streamkl.capture.graph_reads import (
    compiled_outputs, grad_signature, product_from_graph, saved_tensor_hooks_active,
)
from cl_streamkl.capture.hooks import QKExtractor, RecordQK, Removable, qualified_type_name
from cl_streamkl.capture.multihead import multihead_attention_extractor

__all__ = [
    "ProductWatcher",
    "QKExtractor",
    "RecordQK",
    "Removable",
    "attention_product_extractor",
    "qk_extractor_for",
    "qualified_type_name",
    "register_default_extractor",
    "register_qk_extractor",
    "watch_score_products",
]

_EXTRACTORS: dict[type, QKExtractor] = {}

_MUL_FUNCS = frozenset({torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul})
_MATMUL_FUNCS = frozenset({torch.Tensor.matmul, torch.Tensor.__matmul__, torch.matmul})
_TRANSPOSE_FUNCS = frozenset({torch.Tensor.transpose, torch.transpose})
_LAST_TWO_DIMS = ({-2, -1}, {2, 3})
_SOFTMAX_FUNCS = frozenset({torch.Tensor.softmax, torch.softmax, F.softmax})
# Calls that read a tensor's metadata, never its values: manual scores may meet these
# before the softmax (timm builds its causal mask with ``scores.new_full``).
_METADATA_FUNCS = frozenset({
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.new_full, torch.Tensor.new_zeros,
    torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_tensor,
})


def register_qk_extractor(attention_cls: type, extractor: QKExtractor | None = None) -> None:
    """Teach :class:`~cl_streamkl.capture.QKCapture` to read another attention class.

    Lookup is by exact type, so a subclass that changes how scores are formed is never
    read with its parent's rules by accident; register each class you use.

    Args:
        attention_cls: the attention ``nn.Module`` subclass.
        extractor: how to read it. ``None`` uses :func:`attention_product_extractor`,
            which fits any module whose ``forward`` forms its scores with
            ``F.scaled_dot_product_attention(q, k, v)`` or ``(q * scale) @
            k.transpose(-2, -1)``. Otherwise a callable ``extractor(module, record)``
            that installs hooks making every forward call ``record(q, k, scale)`` once,
            returning handles with ``remove()``.

    Raises:
        TypeError: ``attention_cls`` is not an ``nn.Module`` subclass or ``extractor`` is
            not callable.

    Example:
        >>> class MyAttention(nn.Module):
        ...     def forward(self, x):
        ...         q, k, v = self.qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
        ...         return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        >>> register_qk_extractor(MyAttention)
    """
    if not (isinstance(attention_cls, type) and issubclass(attention_cls, nn.Module)):
        raise TypeError(f"attention_cls must be an nn.Module subclass, got {attention_cls!r}")
    if extractor is None:
        extractor = attention_product_extractor
    if not callable(extractor):
        raise TypeError(f"extractor must be callable, got {type(extractor).__name__}")
    _ensure_defaults()
    _EXTRACTORS[attention_cls] = extractor


def register_default_extractor(attention_cls: type, extractor: QKExtractor) -> None:
    """Register ``extractor`` for ``attention_cls`` unless the user registered one already (built-in defaults)."""
    _ensure_defaults()
    _EXTRACTORS.setdefault(attention_cls, extractor)


def qk_extractor_for(module: nn.Module) -> QKExtractor | None:
    """The extractor registered for ``type(module)``, or ``None``."""
    _ensure_defaults()
    return _EXTRACTORS.get(type(module))


class ProductWatcher(TorchFunctionMode):
    """Finds the score product inside one forward of one attention module.

    Entered by a forward pre-hook and left by an always-called forward hook, so it only
    sees the torch calls of that forward. It remembers which tensors are ``x * scale``
    and ``k.transpose(-2, -1)`` results (holding references so ids stay valid until the
    forward ends) and records the first product that combines them.
    """

    def __init__(self, module: nn.Module, record: RecordQK) -> None:
        super().__init__()
        self.module = module
        self.record = record
        self.active = False
        self._reset()

    def _reset(self) -> None:
        self.scaled: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.transposed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # (q, k, scale, lse or None) of each score product seen
        self.found: list[tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]] = []
        # Manual scores not yet passed to a softmax: anything else they meet first (a mask
        # added, a bias, a masked_fill) makes them more than q kᵀ.
        self.scores: torch.Tensor | None = None

    def start(self) -> None:
        self._reset()
        self.__enter__()
        self.active = True

    def stop(self) -> None:
        if self.active:
            self.active = False
            self.__exit__(None, None, None)

    def _module_scale(self) -> float | None:
        scale = getattr(self.module, "scale", None)
        return float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None

    # What the error of a forward it cannot read suggests (a subclass for a known library says otherwise).
    remedy = "Register a dedicated extractor with cl_streamkl.capture.register_qk_extractor()."

    def _fail(self, why: str) -> RuntimeError:
        return RuntimeError(
            f"QKCapture cannot read the attention scores of {qualified_type_name(self.module)}: {why}. {self.remedy}"
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.scores is not None:
            self._check_scores_use(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self._on_sdpa(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _MUL_FUNCS and len(args) == 2:
            self._on_mul(args, out)
        elif func in _TRANSPOSE_FUNCS:
            self._on_transpose(args, kwargs, out)
        elif func in _MATMUL_FUNCS and len(args) == 2:
            self._on_matmul(args, out)
        return out

    def _check_scores_use(self, func, args, kwargs) -> None:
        scores = self.scores
        if not any(value is scores for value in (*args, *kwargs.values())):
            return
        if func in _SOFTMAX_FUNCS:
            self.scores = None
        elif func not in _METADATA_FUNCS and getattr(func, "__name__", None) != "__get__":  # __get__: .shape, .dtype
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise self._fail(
                f"its scores q kᵀ pass through {name} before the softmax (an attention mask, "
                "is_causal or a bias), so q and k alone do not describe them"
            )

    def _on_sdpa(self, func, args, kwargs) -> torch.Tensor:
        """Run the SDPA call (with its log-sum-exp where one is to be had) and note its q, k, scale, lse."""
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        if bound.get("attn_mask") is not None or bound.get("is_causal", False):
            raise self._fail("it passes an attention mask or is_causal=True to scaled_dot_product_attention")
        q, k = bound["query"], bound["key"]
        scale = bound.get("scale")
        # Without gradients (a frozen teacher) the fused backend is asked for the LSE it would skip.
        with_lse = None if bound.get("enable_gqa") else attention_with_lse(
            q, k, bound["value"], bound.get("dropout_p", 0.0), scale)
        if with_lse is not None:
            out, lse = with_lse
        else:
            out = func(*args, **kwargs)
            lse = _saved_lse(out, q)
        self.found.append((q, k, float(scale) if scale is not None else q.shape[-1] ** -0.5, lse))
        return out

    def _on_mul(self, args, out) -> None:
        scale = self._module_scale()
        a, b = args
        if scale is None or not isinstance(out, torch.Tensor):
            return
        if isinstance(a, torch.Tensor) and isinstance(b, float) and b == scale:
            self.scaled[id(out)] = (out, a)
        elif isinstance(b, torch.Tensor) and isinstance(a, float) and a == scale:
            self.scaled[id(out)] = (out, b)

    def _on_transpose(self, args, kwargs, out) -> None:
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 4:
            return
        dims = {*args[1:3], *kwargs.values()}
        if dims in _LAST_TWO_DIMS:
            self.transposed[id(out)] = (out, args[0])

    def _on_matmul(self, args, out) -> None:
        a, b = args
        if id(a) in self.scaled and id(b) in self.transposed:
            self.found.append((self.scaled[id(a)][1], self.transposed[id(b)][1], self._module_scale(), None))
            self.scores = out

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]:
        """Check the forward produced exactly one score product, record and return it (q, k, scale, lse)."""
        found = self.found
        self._reset()
        if len(found) != 1:
            what = "no" if not found else f"{len(found)}"
            raise self._fail(
                f"{what} score products were seen in its forward (expected exactly one "
                "F.scaled_dot_product_attention(q, k, v) or (q * self.scale) @ k.transpose(-2, -1))"
            )
        q, k, scale, lse = found[0]
        if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
            raise self._fail(
                f"the score product has q of shape {tuple(q.shape)} and k of shape {tuple(k.shape)}; "
                "expected (B, H, Nq, D) and (B, H, Nk, D)"
            )
        self.record(q, k, scale, lse)
        return q, k, scale, lse


def _saved_lse(out: object, q: torch.Tensor) -> torch.Tensor | None:
    """The LSE the SDPA node on ``out`` saved for this very ``q``; None without one (or without a graph)."""
    node = getattr(out, "grad_fn", None)
    # Under saved-tensor hooks a read would run the unpack hook (a recomputation or a copy).
    if node is None or saved_tensor_hooks_active() or getattr(node, "_saved_query", None) is not q:
        return None
    return lse_from_node(node, q.size(2))


class _WatcherHandle:
    """Removes the hooks of one :class:`ProductWatcher` and leaves its mode if still active."""

    def __init__(self, watcher: ProductWatcher, handles: list) -> None:
        self.watcher = watcher
        self.handles = handles

    def remove(self) -> None:
        self.watcher.stop()
        for handle in self.handles:
            handle.remove()
        self.handles = []


_PARAMETERS: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = weakref.WeakKeyDictionary()


def _parameters_of(module: nn.Module) -> list[nn.Parameter]:
    # Listing parameters walks every submodule; captures are entered once per step, so cache.
    # A module whose parameters are swapped later only loses the graph fast path's
    # signature match (a forward it cannot read raises), never gets wrong Q/K.
    if module not in _PARAMETERS:
        _PARAMETERS[module] = list(module.parameters())
    return _PARAMETERS[module]


def attention_product_extractor(module: nn.Module, record: RecordQK) -> list[Removable]:
    """The default extractor: watch the module's forward for its score product.

    Records the ``q`` and ``k`` passed to ``F.scaled_dot_product_attention`` (scale: its
    ``scale`` argument or ``D**-0.5``), or the ``q`` of ``q * module.scale`` and the ``k``
    of ``k.transpose(-2, -1)`` when the module multiplies those two. The forward raises
    ``RuntimeError`` naming the module type if it does not contain exactly one such
    product, if it passes an attention mask / ``is_causal=True`` to
    ``scaled_dot_product_attention``, or if its manual scores meet anything but a softmax
    first (timm's non-fused path adds the mask of ``attn_mask`` / ``is_causal`` there).

    Watching costs host time on every torch call of the forward. So when a watched
    forward that recorded an autograd graph shows that graph holding the same product
    (one ``scaled_dot_product_attention`` node that saved the same ``q`` and ``k``
    objects; see :mod:`cl_streamkl.capture.graph_reads`), later forwards of that module
    with the same ``requires_grad`` settings are read from their graph instead,
    unwatched; never under ``no_grad``, saved-tensor hooks (activation checkpointing) or
    :func:`~cl_streamkl.capture.graph_reads_disabled`.

    Args:
        module: the attention module.
        record: called with ``(q, k, scale)`` after each successful forward.

    Returns:
        One handle whose ``remove()`` removes the hooks.
    """
    return watch_score_products(ProductWatcher(module, record))


def watch_score_products(watcher: ProductWatcher) -> list[Removable]:
    """Hook ``watcher.module`` so each forward is watched by ``watcher`` (or read from its graph).

    What :func:`attention_product_extractor` installs, for a watcher of any
    :class:`ProductWatcher` subclass (one that also knows other spellings of the product).

    Returns:
        One handle whose ``remove()`` removes the hooks.
    """
    module = watcher.module
    parameters = _parameters_of(module)
    pending: dict[str, object] = {}

    def before(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = (*args, *kwargs.values())
        signature = grad_signature(parameters, inputs)
        from_graph = graph_reads.GRAPH_READS.allows(module, signature)
        pending.update(inputs=inputs, signature=signature, from_graph=from_graph)
        if not from_graph:
            watcher.start()

    def after(_module: nn.Module, _args: tuple, _kwargs: dict, output: object) -> None:
        watcher.stop()
        # With always_call=True this also runs when the forward raised (output is None), even
        # when an earlier pre-hook raised before ours ran; then only leaving the mode matters
        # and the original error propagates.
        inputs, signature = pending.pop("inputs", ()), pending.pop("signature", None)
        from_graph = pending.pop("from_graph", False)
        if output is None:
            return
        if not from_graph:
            graph_reads.GRAPH_READS.verify(module, signature, watcher.finish(), output, inputs)
            return
        product = product_from_graph(output, inputs)
        if product is None:
            graph_reads.GRAPH_READS.forget_all()
            raise RuntimeError(_lost_scores_message(module, output))
        watcher.record(*product)

    handles = [
        module.register_forward_pre_hook(before, with_kwargs=True),
        module.register_forward_hook(after, with_kwargs=True, always_call=True),
    ]
    return [_WatcherHandle(watcher, handles)]


def _lost_scores_message(module: nn.Module, output: object) -> str:
    """Why a verified module's forward could not be read from its graph, and what to do."""
    name = qualified_type_name(module)
    if compiled_outputs(output):
        # Running it again only trades the graph read for a watch that splits Dynamo's graph at
        # every attention call; compile_model records Q/K inside the compiled forward instead.
        return (f"QKCapture cannot read the attention scores of {name} from a torch.compile'd forward: its "
                "autograd graph holds one compiled node, not the attention call. Compile the model with "
                "cl_streamkl.capture.compile_model(model) instead of torch.compile, or capture the eager model.")
    return (f"QKCapture lost the attention scores of {name}: this forward left no single "
            "scaled_dot_product_attention node in the autograd graph, unlike earlier forwards with the "
            "same requires_grad settings (did its attention change, e.g. fused_attn?). Every block's "
            "next forward is watched in full again; run this forward again.")


_DEFAULTS_REGISTERED = False


def _ensure_defaults() -> None:
    """Register the default extractors on first use, so importing this module stays cheap.

    ``nn.MultiheadAttention`` (torchvision's ViT) gets
    :func:`~cl_streamkl.capture.multihead.multihead_attention_extractor`; timm's attention
    classes, when timm is installed, get :func:`attention_product_extractor`. Defaults
    never replace an extractor the user registered for the same class.
    """
    global _DEFAULTS_REGISTERED
    if _DEFAULTS_REGISTERED:
        return
    _DEFAULTS_REGISTERED = True
    _EXTRACTORS.setdefault(nn.MultiheadAttention, multihead_attention_extractor)
    try:
        import timm.layers
        import timm.models.eva
        import timm.models.vision_transformer
    except ImportError:
        return
    candidates = [
        getattr(timm.models.vision_transformer, "Attention", None),  # defined here in older timm 1.0.x
        getattr(timm.layers, "Attention", None),
        getattr(timm.layers, "AttentionRope", None),
        getattr(timm.models.eva, "EvaAttention", None),
    ]
    for cls in candidates:
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            _EXTRACTORS.setdefault(cls, attention_product_extractor)
