"""Capture the queries and keys that a vision transformer's attention blocks multiply.

:class:`QKCapture` hooks the attention module of selected blocks and records, for every
forward, the exact ``q`` and ``k`` tensors whose product becomes that block's attention
scores: after qk-norm, after rotary embeddings, before the softmax scale. The tensors are
the ones the model itself uses, so they keep their autograd graph and their strides
(timm's ``q``/``k`` are strided views of one permuted ``qkv`` tensor); nothing is copied.

How a block is read is decided by an *extractor* looked up by the attention module's
exact type (see :func:`register_qk_extractor`). The built-in
:func:`attention_product_extractor` does not depend on how a particular timm release
writes ``forward``: while the attention module runs, it watches the torch calls and
picks out the one product that forms the scores, either

* ``F.scaled_dot_product_attention(q, k, v)`` (timm's fused path), or
* ``(q * scale) @ k.transpose(-2, -1)`` (timm's manual path).

Whatever qk-norm, rotary embedding or grouped-query expansion happens before that call
is therefore already applied. If neither pattern shows up, or an attention mask /
causal flag is passed (scores that ``q kᵀ`` alone does not describe), the forward fails
with an error naming the module type instead of returning wrong tensors.

Registered by default: timm's ``Attention`` (ViT, DeiT, DeiT-3), ``AttentionRope`` and
``eva.EvaAttention`` (EVA, EVA-02). Attention classes with extra score terms, such as
BEiT's relative-position bias, are deliberately not registered and are rejected with a
clear error.

Example:
    >>> with QKCapture(model, layers=[-2, -1]) as cap:
    ...     logits = model(x)
    >>> q, k = cap.qk[0]          # block len(blocks) - 2, each (B, H, N, D)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from cl_streamkl.graph_capture import GraphReadRegistry, grad_signature, product_from_graph

__all__ = [
    "LayerSpec",
    "QKCapture",
    "QKExtractor",
    "RecordQK",
    "attention_product_extractor",
    "find_attention_modules",
    "graph_reads_disabled",
    "qk_extractor_for",
    "register_qk_extractor",
    "resolve_layer_indices",
]

LayerSpec = Union[str, int, Sequence[int]]
"""Which blocks to capture: ``"all"``, an int ``n`` (the last n blocks) or a list of
block indices (negative indices count from the end), as in timm's
``forward_intermediates(indices=...)``."""

RecordQK = Callable[[torch.Tensor, torch.Tensor, float], None]
"""Called by an extractor once per forward of its module with ``(q, k, scale)``:
q (B, H, Nq, D), k (B, H, Nk, D) and the softmax scale the module applies to ``q kᵀ``."""


class _Removable(Protocol):
    def remove(self) -> None: ...


QKExtractor = Callable[[nn.Module, RecordQK], Sequence[_Removable]]
"""Installs whatever hooks it needs on one attention module so that every forward of
that module calls ``record(q, k, scale)`` exactly once, and returns handles whose
``remove()`` undoes everything (they are removed even when the forward raised)."""

_EXTRACTORS: dict[type, QKExtractor] = {}
# Modules whose full watch matched a read of the autograd graph: their later forwards
# under the same requires_grad settings skip the (host-expensive) TorchFunctionMode.
_GRAPH_READS = GraphReadRegistry()
_graph_reads_enabled = True


@contextmanager
def graph_reads_disabled() -> Iterator[None]:
    """Inside it, every capture watches forwards in full; graph reads are neither used nor learned."""
    global _graph_reads_enabled
    previous, _graph_reads_enabled = _graph_reads_enabled, False
    try:
        yield
    finally:
        _graph_reads_enabled = previous


_MUL_FUNCS = frozenset({torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul})
_MATMUL_FUNCS = frozenset({torch.Tensor.matmul, torch.Tensor.__matmul__, torch.matmul})
_TRANSPOSE_FUNCS = frozenset({torch.Tensor.transpose, torch.transpose})
_LAST_TWO_DIMS = ({-2, -1}, {2, 3})


def register_qk_extractor(attention_cls: type, extractor: QKExtractor | None = None) -> None:
    """Teach :class:`QKCapture` to read another attention class.

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
    _ensure_timm_defaults()
    _EXTRACTORS[attention_cls] = extractor


def qk_extractor_for(module: nn.Module) -> QKExtractor | None:
    """The extractor registered for ``type(module)``, or ``None``."""
    _ensure_timm_defaults()
    return _EXTRACTORS.get(type(module))


def _type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class _ProductWatcher(TorchFunctionMode):
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
        self.found: list[tuple[torch.Tensor, torch.Tensor, float]] = []

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

    def _fail(self, why: str) -> RuntimeError:
        return RuntimeError(
            f"QKCapture cannot read the attention scores of {_type_name(self.module)}: {why}. "
            "Register a dedicated extractor with cl_streamkl.capture.register_qk_extractor()."
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            self._on_sdpa(args, kwargs)
        elif func in _MUL_FUNCS and len(args) == 2:
            self._on_mul(args, out)
        elif func in _TRANSPOSE_FUNCS:
            self._on_transpose(args, kwargs, out)
        elif func in _MATMUL_FUNCS and len(args) == 2:
            self._on_matmul(args)
        return out

    def _on_sdpa(self, args, kwargs) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        if bound.get("attn_mask") is not None or bound.get("is_causal", False):
            raise self._fail("it passes an attention mask or is_causal=True to scaled_dot_product_attention")
        q, k = bound["query"], bound["key"]
        scale = bound.get("scale")
        self.found.append((q, k, float(scale) if scale is not None else q.shape[-1] ** -0.5))

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

    def _on_matmul(self, args) -> None:
        a, b = args
        if id(a) in self.scaled and id(b) in self.transposed:
            self.found.append((self.scaled[id(a)][1], self.transposed[id(b)][1], self._module_scale()))

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Check the forward produced exactly one score product, record and return it."""
        found = self.found
        self._reset()
        if len(found) != 1:
            what = "no" if not found else f"{len(found)}"
            raise self._fail(
                f"{what} score products were seen in its forward (expected exactly one "
                "F.scaled_dot_product_attention(q, k, v) or (q * self.scale) @ k.transpose(-2, -1))"
            )
        q, k, scale = found[0]
        if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
            raise self._fail(
                f"the score product has q of shape {tuple(q.shape)} and k of shape {tuple(k.shape)}; "
                "expected (B, H, Nq, D) and (B, H, Nk, D)"
            )
        self.record(q, k, scale)
        return q, k, scale


class _WatcherHandle:
    """Removes the hooks of one :class:`_ProductWatcher` and leaves its mode if still active."""

    def __init__(self, watcher: _ProductWatcher, handles: list) -> None:
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


def attention_product_extractor(module: nn.Module, record: RecordQK) -> list[_Removable]:
    """The default extractor: watch the module's forward for its score product.

    Records the ``q`` and ``k`` passed to ``F.scaled_dot_product_attention`` (scale: its
    ``scale`` argument or ``D**-0.5``), or the ``q`` of ``q * module.scale`` and the ``k``
    of ``k.transpose(-2, -1)`` when the module multiplies those two. The forward raises
    ``RuntimeError`` naming the module type if it does not contain exactly one such
    product, or if it passes an attention mask / ``is_causal=True``.

    Watching costs host time on every torch call of the forward. So when a watched
    forward that recorded an autograd graph shows that graph holding the same product
    (one ``scaled_dot_product_attention`` node that saved the same ``q`` and ``k``
    objects; see :mod:`cl_streamkl.graph_capture`), later forwards of that module with
    the same ``requires_grad`` settings are read from their graph instead, unwatched;
    never under ``no_grad`` or saved-tensor hooks (activation checkpointing).

    Args:
        module: the attention module.
        record: called with ``(q, k, scale)`` after each successful forward.

    Returns:
        One handle whose ``remove()`` removes the hooks.
    """
    watcher = _ProductWatcher(module, record)
    parameters = _parameters_of(module)
    pending: dict[str, object] = {}

    def before(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = (*args, *kwargs.values())
        signature = grad_signature(parameters, inputs)
        from_graph = _graph_reads_enabled and _GRAPH_READS.allows(module, signature)
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
            watched = watcher.finish()
            if _graph_reads_enabled:
                _GRAPH_READS.verify(module, signature, watched, output, inputs)
            return
        product = product_from_graph(output, inputs)
        if product is None:
            _GRAPH_READS.forget(module)
            raise RuntimeError(
                f"QKCapture lost the attention scores of {_type_name(module)}: this forward left no single "
                "scaled_dot_product_attention node in the autograd graph, unlike earlier forwards with the "
                "same requires_grad settings (did its attention change, e.g. fused_attn?). The next "
                "forward is watched in full again; run this one again."
            )
        watcher.record(*product)

    handles = [
        module.register_forward_pre_hook(before, with_kwargs=True),
        module.register_forward_hook(after, with_kwargs=True, always_call=True),
    ]
    return [_WatcherHandle(watcher, handles)]


_DEFAULTS_REGISTERED = False


def _ensure_timm_defaults() -> None:
    """Register timm's attention classes on first use, so importing this module stays cheap.

    Defaults never replace an extractor the user registered for the same class, and
    without timm installed there are simply no defaults.
    """
    global _DEFAULTS_REGISTERED
    if _DEFAULTS_REGISTERED:
        return
    _DEFAULTS_REGISTERED = True
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


def _looks_like_attention(module: nn.Module) -> bool:
    return "attention" in type(module).__name__.lower()


def find_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module of every transformer block of ``model``, in block order.

    A model with a ``blocks`` container (timm ViT, DeiT, EVA, ...) must have exactly one
    capturable attention module per block; any other model contributes every module
    with a registered extractor, in ``model.modules()`` order.

    Args:
        model: the vision transformer.

    Returns:
        One attention module per block.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, a block has no attention module
            with a registered extractor (the message names the module type found), or
            the model has no capturable attention at all.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.Module) and len(list(blocks.children())) > 0:
        found = []
        for index, block in enumerate(blocks.children()):
            registered = [m for m in block.modules() if qk_extractor_for(m) is not None]
            if len(registered) != 1:
                if registered:
                    problem = f"{len(registered)} attention modules ({', '.join(_type_name(m) for m in registered)})"
                else:
                    others = [_type_name(m) for m in block.modules() if _looks_like_attention(m)]
                    problem = (
                        f"attention module {', '.join(others)} which has no registered Q/K extractor"
                        if others
                        else f"no attention module (block type {_type_name(block)})"
                    )
                raise TypeError(
                    f"QKCapture cannot capture block {index} of {_type_name(model)}: it has {problem}. "
                    "Attention with extra score terms (e.g. relative-position bias) cannot be captured "
                    "faithfully; for a plain q·kᵀ attention class, register it with "
                    "cl_streamkl.capture.register_qk_extractor()."
                )
            found.append(registered[0])
        return found
    found = [m for m in model.modules() if qk_extractor_for(m) is not None]
    if not found:
        others = sorted({_type_name(m) for m in model.modules() if _looks_like_attention(m)})
        detail = (
            f"its attention modules ({', '.join(others)}) have no registered Q/K extractor"
            if others
            else "it contains no attention module QKCapture knows"
        )
        raise TypeError(
            f"QKCapture cannot capture {_type_name(model)}: {detail}. Register the attention class "
            "with cl_streamkl.capture.register_qk_extractor()."
        )
    return found


def resolve_layer_indices(layers: LayerSpec, num_blocks: int) -> list[int]:
    """Absolute block indices selected by ``layers`` (timm's ``forward_intermediates`` rules).

    Args:
        layers: ``"all"``; an int ``n`` with ``1 <= n <= num_blocks`` selecting the last
            n blocks; or a non-empty list/tuple of distinct indices in
            ``[-num_blocks, num_blocks)``, negative ones counting from the end.
        num_blocks: how many blocks the model has.

    Returns:
        Sorted absolute indices.

    Raises:
        TypeError: ``layers`` has the wrong type.
        ValueError: an index or count is out of range, the list is empty or repeats a block.
    """
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be 'all', an int or a list of ints, got the string {layers!r}")
        return list(range(num_blocks))
    if isinstance(layers, bool):
        raise TypeError("layers must be 'all', an int or a list of ints, got a bool")
    if isinstance(layers, int):
        if not 1 <= layers <= num_blocks:
            raise ValueError(f"layers={layers} selects the last n blocks and needs 1 <= n <= {num_blocks}")
        return list(range(num_blocks - layers, num_blocks))
    if not isinstance(layers, (list, tuple)):
        raise TypeError(f"layers must be 'all', an int or a list of ints, got {type(layers).__name__}")
    if not layers:
        raise ValueError("layers must not be an empty list")
    resolved = []
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"layers must contain ints, got {index!r}")
        if not -num_blocks <= index < num_blocks:
            raise ValueError(f"layer index {index} is out of range for a model with {num_blocks} blocks")
        resolved.append(index % num_blocks)
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"layers {list(layers)} select the same block more than once")
    return sorted(resolved)


class _CaptureComplete(Exception):
    """Raised by a ``stop_early`` capture to end the forward; its ``with`` block swallows it."""


class QKCapture:
    """Context manager recording the Q/K each selected block's attention multiplies.

    The model and the layer selection are checked at construction; hooks exist only
    inside the ``with`` block and are removed on exit, also when the forward raises.
    When the model runs several times inside one ``with``, ``qk`` holds the last run.

    Args:
        model: a vision transformer whose blocks' attention classes have extractors
            (timm ViT/DeiT/DeiT-3/EVA/EVA-02 out of the box).
        layers: ``"all"``, an int n (the last n blocks) or a list of block indices
            (negative allowed).
        stop_early: end the model's forward as soon as every selected block's attention
            has run, skipping the rest (later blocks, the MLP of the last one, the head),
            and leave the ``with`` block at once: for a teacher whose output is not
            needed. Statements after the forward inside the ``with`` do not run.

    Attributes:
        block_indices: resolved absolute block indices, ascending.
        attention_modules: the attention module of each selected block.

    Raises:
        TypeError: the model has no capturable attention (see :func:`find_attention_modules`).
        ValueError: the layer selection does not fit the model.
    """

    def __init__(self, model: nn.Module, layers: LayerSpec = "all", *, stop_early: bool = False) -> None:
        modules = find_attention_modules(model)
        self.stop_early = stop_early
        self.model = model
        self.block_indices: list[int] = resolve_layer_indices(layers, len(modules))
        self.attention_modules: list[nn.Module] = [modules[i] for i in self.block_indices]
        self._records: list[tuple[torch.Tensor, torch.Tensor, float] | None] = [None] * len(self.block_indices)
        self._handles: list[_Removable] = []

    def _recorder(self, slot: int) -> RecordQK:
        def record(q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
            self._records[slot] = (q, k, scale)

        return record

    @property
    def active(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._handles)

    def __enter__(self) -> QKCapture:
        if self._handles:
            raise RuntimeError("this QKCapture is already active; it cannot be entered twice")
        self.clear()
        try:
            for slot, module in enumerate(self.attention_modules):
                extractor = qk_extractor_for(module)
                if extractor is None:
                    raise TypeError(f"no Q/K extractor is registered for {_type_name(module)} any more")
                self._handles.extend(extractor(module, self._recorder(slot)))
            if self.stop_early:
                # Registered after the extractors' hooks, so it runs once they have recorded.
                self._handles.extend(
                    module.register_forward_hook(self._stop_if_complete) for module in self.attention_modules
                )
        except BaseException:
            self.remove_hooks()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> bool:
        self.remove_hooks()
        return exc_type is _CaptureComplete

    def _stop_if_complete(self, _module: nn.Module, _args: tuple, _output: object) -> None:
        if all(record is not None for record in self._records):
            raise _CaptureComplete

    def remove_hooks(self) -> None:
        """Remove every hook this capture installed (idempotent); recorded tensors are kept."""
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            handle.remove()

    def clear(self) -> None:
        """Drop the recorded tensors (and the autograd graph they keep alive)."""
        self._records = [None] * len(self.block_indices)

    def _complete_records(self) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        missing = [self.block_indices[i] for i, rec in enumerate(self._records) if rec is None]
        if missing:
            raise RuntimeError(
                f"no Q/K was captured for blocks {missing}: run the model inside the `with QKCapture(...)` block"
            )
        return self._records  # type: ignore[return-value]

    @property
    def qk(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(q, k), ...]`` per selected block: q (B, H, Nq, D), k (B, H, Nk, D).

        Exactly the tensors the block multiplies (views with the model's strides and
        autograd graph). Raises ``RuntimeError`` if a selected block has not run.
        """
        return [(q, k) for q, k, _ in self._complete_records()]

    @property
    def scales(self) -> list[float]:
        """The softmax scale each selected block applies to ``q kᵀ`` (timm: ``D**-0.5``)."""
        return [scale for _, _, scale in self._complete_records()]

    def __repr__(self) -> str:
        return f"QKCapture(blocks={self.block_indices}, active={self.active})"
