"""Read the score product of one attention forward from the autograd graph it built.

Watching a forward with a ``TorchFunctionMode`` (see
:mod:`cl_streamkl.capture.extractors`) sends every torch call of that forward through
Python; for a ViT-B training step that host time showed up as several milliseconds of
idle GPU. When the forward records a graph, the product is also reachable after the
fact: ``F.scaled_dot_product_attention`` leaves one backward node (flash, efficient,
cuDNN or CPU flavour) whose saved ``query``/``key`` are the very tensor objects it was
called with, and whose saved ``scale``, ``is_causal`` and ``attn_mask`` say how the
scores were formed. Walking back from the module's output to its inputs finds that node
in a few dozen steps.

:class:`GraphReadRegistry` makes this safe to use instead of the mode: a module is read
from the graph only under conditions (which parameters and inputs require grad) in which
a full watch of an earlier forward of the same module found *the same* tensor objects.
Every capture consults one registry, :data:`GRAPH_READS`; :func:`graph_reads_disabled`
turns it off for a ``with`` block.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from cl_streamkl.capture.attention_lse import lse_from_node

__all__ = [
    "GRAPH_READS", "GraphReadRegistry", "compiled_outputs", "grad_signature", "graph_reads_disabled",
    "product_from_graph", "saved_tensor_hooks_active",
]

# Between an attention module's output and its inputs there are about ten nodes plus the
# weights' accumulators; a walk that goes much further has left the module.
MAX_NODES = 256


def _tensors(values: Iterable[object]) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(_tensors(value))
    return found


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (checkpointing, ``save_on_cpu``) are active: reading a saved tensor would run them."""
    # torch.utils.checkpoint uses the same query. Where it is missing, assume hooks.
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def grad_signature(parameters: Iterable[torch.Tensor], inputs: Iterable[object]) -> tuple[bool, ...] | None:
    """Which of a module's parameters and tensor inputs require grad, or ``None``.

    ``None`` means "do not read this forward's graph":
    - Grad mode is off, so autograd records nothing.
    - Saved-tensor hooks are active: activation checkpointing, ``save_on_cpu``. Reading a
      saved tensor would run the unpack hook (a recomputation or a copy) and hand back
      another tensor.
    """
    if not torch.is_grad_enabled() or saved_tensor_hooks_active():
        return None
    return tuple(p.requires_grad for p in parameters) + tuple(t.requires_grad for t in _tensors(inputs))


def product_from_graph(
    outputs: object, inputs: Iterable[object]
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None] | None:
    """``(q, k, scale, lse)`` of the one attention product between ``inputs`` and ``outputs``.

    Args:
        outputs: the module's output (a tensor or a tuple/list holding tensors).
        inputs: the module's positional and keyword argument values.

    Returns:
        The ``query`` and ``key`` the single ``scaled_dot_product_attention`` node saved,
        its softmax scale (``D**-0.5`` when it used the default) and the log-sum-exp a fused
        backend saved ((B, H, Nq) float32, :func:`~cl_streamkl.capture.attention_lse.lse_from_node`;
        None for the math backend), or ``None`` when
        there is not exactly one such node, it had a mask or ``is_causal=True``, or the
        walk left the module.
    """
    stops = {t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None}
    pending = [t.grad_fn for t in _tensors([outputs]) if t.grad_fn is not None]
    seen: set = set()
    found = []
    while pending:
        node = pending.pop()
        if node is None or node in stops or node in seen:
            continue
        seen.add(node)
        if len(seen) > MAX_NODES:
            return None
        # Each read of a _saved_* attribute unpacks the saved tensor, so read it once.
        query = getattr(node, "_saved_query", None)
        key = getattr(node, "_saved_key", None) if query is not None else None
        if key is not None:
            found.append((node, query, key))
        pending.extend(next_node for next_node, _ in node.next_functions)
    if len(found) != 1:
        return None
    node, q, k = found[0]
    mask = getattr(node, "_saved_attn_mask", None)
    bias = getattr(node, "_saved_attn_bias", None)
    if isinstance(mask, torch.Tensor) or isinstance(bias, torch.Tensor) or getattr(node, "_saved_is_causal", False):
        return None
    scale = getattr(node, "_saved_scale", None)
    return q, k, float(scale) if scale is not None else q.shape[-1] ** -0.5, lse_from_node(node, q.size(2))


def compiled_outputs(outputs: object) -> bool:
    """Whether ``outputs`` came out of a ``torch.compile``d graph (AOTAutograd's one backward node).

    Such a graph holds no ``scaled_dot_product_attention`` node to read, on any run.
    """
    # AOTAutograd's autograd.Function; its class is made per graph, its name is fixed.
    return any(type(t.grad_fn).__name__ == "CompiledFunctionBackward" for t in _tensors([outputs]))


class GraphReadRegistry:
    """Remembers under which grad signatures each module may be read from the graph.

    Keyed weakly by module, so a dropped model leaves nothing behind.
    """

    def __init__(self) -> None:
        self._verified: weakref.WeakKeyDictionary[nn.Module, set[tuple[bool, ...]]] = weakref.WeakKeyDictionary()
        # A depth rather than a flag, so that nested disabled() blocks each restore what they found.
        self._disabled_depth = 0

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Allow nothing and verify nothing inside the ``with`` block.

        What was verified before is kept and allowed again after the block.
        """
        self._disabled_depth += 1
        try:
            yield
        finally:
            self._disabled_depth -= 1

    def allows(self, module: nn.Module, signature: tuple[bool, ...] | None) -> bool:
        """Whether a forward of ``module`` under ``signature`` may be read from the graph."""
        if self._disabled_depth or signature is None:
            return False
        return signature in self._verified.get(module, ())

    def verify(
        self,
        module: nn.Module,
        signature: tuple[bool, ...] | None,
        watched: tuple,
        outputs: object,
        inputs: Iterable[object],
    ) -> None:
        """Allow ``signature`` if the graph yields exactly what the full watch ``watched`` found."""
        if self._disabled_depth or signature is None:
            return
        read = product_from_graph(outputs, inputs)
        if read is not None and read[0] is watched[0] and read[1] is watched[1] and read[2] == watched[2]:
            self._verified.setdefault(module, set()).add(signature)

    def forget_all(self) -> None:
        """Watch every later forward of every module in full until each is verified again.

        A forward that stops matching its graph read has had its attention changed (e.g.
        ``fused_attn`` turned off), and such a change is usually made to every block alike:
        forgetting the one module only would fail the next forward at the next block.
        """
        self._verified.clear()


GRAPH_READS = GraphReadRegistry()
"""The registry every capture consults: modules whose full watch matched a read of the
autograd graph have their later forwards, under the same ``requires_grad`` settings, read
from the graph instead of watched with the (host-expensive) ``TorchFunctionMode``."""


def graph_reads_disabled() -> AbstractContextManager[None]:
    """Inside it, every capture watches forwards in full; graph reads are neither used nor learned.

    Every forward of a captured attention module inside the ``with`` block runs under the
    product watcher, also where an earlier forward was verified; and no forward inside
    verifies a module for later. For measuring or checking the full watch against the
    graph reads. Modules verified before the block are read from the graph again after
    it. Blocks nest; the switch holds for every thread.

    Example:
        >>> with graph_reads_disabled(), QKCapture(model) as cap:
        ...     logits = model(x)        # every selected block watched in full
    """
    return GRAPH_READS.disabled()
