"""A whole timm vision transformer through ``torch.compile``, its Q/K still captured.

Why: a narrow ViT on long token sequences (the efficacy study's: 64 wide, 1025 tokens,
batch 32) spends most of its GPU time in eager kernels made for wide layers; on an H200 one
bf16 training step takes 4.73 ms of kernels eager and 2.37 ms through :func:`compile_model`
(a plain ``torch.compile``, without Q/K: 2.29 ms). With many runs sharing one GPU, kernel time
is what limits the runs per hour: fourteen such runs train twice as fast compiled. But
:class:`~cl_streamkl.capture.QKCapture` reads Q/K with hooks and a Python
``TorchFunctionMode`` on each attention call, which ``torch.compile`` cannot see through.

So :func:`compile_model` turns the capture inside out: the model's forward becomes one
compiled function that runs the forward under a small recording mode (Dynamo traces the
mode into the graph, as for the compiled teacher of :mod:`cl_streamkl.capture.compiled`)
and returns the ``query`` and ``key`` of every ``F.scaled_dot_product_attention`` call
beside the output. Back in Python, the i-th recorded pair goes to whatever capture
listens on block i's attention module. The pairs are graph outputs, so gradients reach the
compiled backward; a capture sees the same tensors an eager forward would have made.

The compiled function is module-level and takes the model as an argument: Dynamo lifts
the weights to graph inputs, so a deep copy (a frozen teacher, LwF's previous model)
computes with its own weights and reuses the graph. Classes are swapped in place
(state-dict keys do not change); no hook is installed on any submodule, as a hook would
make Dynamo recompile.

Trust but verify: the first forward of each input signature (shapes but the batch size, dtype,
autocast, training mode, gradient mode) also runs the eager forward under the same recording mode,
without gradients and on a copy of the random-number state, and compares the Q/K.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cl_streamkl.capture.attention_lse import lse_backend
from cl_streamkl.capture.extractors import RecordQK, Removable, qk_extractor_for, register_qk_extractor
from cl_streamkl.capture.layers import find_attention_modules
from cl_streamkl.capture.recording import MATCH_RTOL, Record, SdpaRecorder, input_signature, qk_error

__all__ = ["compile_model", "compiled_model_checks", "is_compiled"]

# compiled class → the class it was made from; replayed attention class → its original.
_ORIGINAL_CLASS: dict[type, type] = {}
# What each replayed attention module passes its Q/K to, while a capture listens.
_LISTENERS: weakref.WeakKeyDictionary[nn.Module, list[RecordQK]] = weakref.WeakKeyDictionary()
# Each compiled model's input signatures already checked against its eager forward, and the
# fused backend whose log-sum-exps its compiled forward records for each (None: none).
_CHECKED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, int | None]] = weakref.WeakKeyDictionary()
# Each compiled model's attention modules in block order, found once (its structure is fixed).
_ATTENTION: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()
# The largest relative Q/K difference any check has seen (None before the first).
_WORST_CHECK: list[float | None] = [None]
# Graphs Dynamo may keep for the compiled forward (see :func:`_allow_recompiles`).
RECOMPILE_LIMIT = 32


def _recording_forward(model: nn.Module, lse_backend: int | None, *args: Any, **kwargs: Any) -> tuple[Any, list]:
    """The eager forward of ``model``'s original class under :class:`SdpaRecorder`."""
    records: list[Record] = []
    with SdpaRecorder(records, lse_backend):
        output = _ORIGINAL_CLASS[type(model)].forward(model, *args, **kwargs)
    return output, records


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    # Compiled on first use; every compiled model of an architecture shares one function
    # (weights are graph inputs), so snapshots and copies cost no recompilation.
    return torch.compile(fn)


class _Listening:
    """Handle of one capture listening on one replayed attention module."""

    def __init__(self, module: nn.Module, record: RecordQK) -> None:
        self.module, self.record = module, record
        _LISTENERS.setdefault(module, []).append(record)

    def remove(self) -> None:
        listeners = _LISTENERS.get(self.module, [])
        if self.record in listeners:
            listeners.remove(self.record)


def _replay_extractor(module: nn.Module, record: RecordQK) -> list[Removable]:
    """The extractor of a replayed attention module: its compiled model hands over the Q/K."""
    return [_Listening(module, record)]


def _signature(model: nn.Module, args: tuple, kwargs: dict) -> tuple:
    # Any batch size: its graph is dynamic in the batch dimension.
    inputs = tuple(input_signature(value, batch=False) for value in (*args, *kwargs.values())
                   if isinstance(value, torch.Tensor))
    return inputs, model.training, torch.is_grad_enabled()


def _eager_records(model: nn.Module, args: tuple, kwargs: dict) -> list[Record]:
    """The recorded attention calls of an eager forward without gradients, the random state kept."""
    devices = [value.device for value in (*args, *kwargs.values())
               if isinstance(value, torch.Tensor) and value.device.type == "cuda"]
    with torch.no_grad(), torch.random.fork_rng(devices=devices[:1]):
        return _recording_forward(model, None, *args, **kwargs)[1]


def _records_lse_backend(records: list[Record]) -> int | None:
    """The fused backend whose op the compiled forward runs in SDPA's place, keeping its LSE."""
    if not records or not all(plain for _, _, _, plain, _ in records):
        return None
    q, k, scale, _, _ = records[0]
    return lse_backend(q, k, k, scale)


def _check_against_eager(model: nn.Module, records: list, eager: list) -> None:
    name = _ORIGINAL_CLASS[type(model)].__name__
    if len(eager) != len(records):
        raise RuntimeError(f"compile_model: the compiled {name} made {len(records)} attention calls, its eager "
                           f"forward {len(eager)}; run it without --compile-model")
    worst = 0.0
    for block, ((q, k, *_), (q_eager, k_eager, *_)) in enumerate(zip(records, eager)):
        if q.shape != q_eager.shape or k.shape != k_eager.shape:
            raise RuntimeError(f"compile_model: block {block} of the compiled {name} gave q {tuple(q.shape)}, "
                               f"its eager forward q {tuple(q_eager.shape)}; run it without --compile-model")
        worst = max(worst, qk_error(q, k, q_eager, k_eager))
    if not worst <= MATCH_RTOL:
        raise RuntimeError(f"compile_model: the compiled {name}'s Q/K differ from its eager forward's by {worst:.2e} "
                           f"(relative; allowed {MATCH_RTOL}); run it without --compile-model")
    _WORST_CHECK[0] = max(worst, _WORST_CHECK[0] or 0.0)


def _compiled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a compiled model: one compiled call, then each block's Q/K to its listeners."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            # Batches of every size (eval sets' last batches, replay's larger ones) share one
            # graph from the start, so a run needs one graph per mode only (training, a
            # teacher's and evaluation's no-grad forwards, baselines' forwards outside
            # autocast; see _allow_recompiles).
            torch._dynamo.maybe_mark_dynamic(value, 0)
    signature = _signature(self, args, kwargs)
    checked = _CHECKED.setdefault(self, {})
    eager = None
    if signature not in checked:
        # A new signature: the eager forward first, which also picks the backend of the LSEs.
        eager = _eager_records(self, args, kwargs)
        backend = _records_lse_backend(eager)
    else:
        backend = checked[signature]
    output, records = _compiled(_recording_forward)(self, backend, *args, **kwargs)
    attention = _ATTENTION.get(self)
    if attention is None:
        attention = _ATTENTION[self] = find_attention_modules(self)
    if len(records) != len(attention):
        raise RuntimeError(f"compile_model: {_ORIGINAL_CLASS[type(self)].__name__} made {len(records)} "
                           f"F.scaled_dot_product_attention calls for {len(attention)} attention blocks; Q/K cannot "
                           "be told apart")
    if not all(plain for _, _, _, plain, _ in records):
        raise RuntimeError(f"compile_model: {_ORIGINAL_CLASS[type(self)].__name__}'s attention passes a mask or "
                           "is_causal to F.scaled_dot_product_attention, so its scores are not just q kᵀ")
    if eager is not None:
        _check_against_eager(self, records, eager)
        checked[signature] = backend
    for module, (q, k, scale, _, lse) in zip(attention, records):
        for record in list(_LISTENERS.get(module, ())):
            record(q, k, scale, lse)
    return output


def _subclass(cls: type, prefix: str, namespace: dict[str, Any]) -> type:
    for made, original in _ORIGINAL_CLASS.items():
        if original is cls and made.__name__.startswith(prefix):
            return made
    made = type(f"{prefix}{cls.__name__}", (cls,), {"__module__": __name__, **namespace})
    _ORIGINAL_CLASS[made] = cls
    return made


def _fused_timm_attention(module: nn.Module) -> bool:
    from timm.models.vision_transformer import Attention

    return type(module) is Attention and bool(getattr(module, "fused_attn", False))


def _allow_recompiles() -> None:
    """Raise Dynamo's per-function graph limit to :data:`RECOMPILE_LIMIT` (never lower it).

    The compiled forward has one graph per mode it meets: training; a frozen teacher's and
    evaluation's no-grad forwards (parameters that do or do not require gradients, train or
    eval mode); baselines that forward outside autocast (EWC's importances); a last batch
    below a size the graph was specialised for. One strategy needs 2 to 7 of them, but a
    process that trains several one after another (the efficacy study's workers) met 9 on a CPU, past Dynamo's default of 8, after which every new mode runs the
    forward eagerly: still right, but slow.
    """
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def compile_model(model: nn.Module) -> int:
    """Run each timm ``VisionTransformer`` inside ``model`` as one compiled forward, Q/K captured.

    In place: the vision transformer's class becomes a compiled subclass and each of its
    attention modules a subclass that :class:`~cl_streamkl.capture.QKCapture` reads from
    the compiled forward's outputs (values, gradients and state-dict keys as before). Heads
    or wrappers around it stay eager. Everything else that reads the model (a frozen teacher,
    LwF's previous model: deep copies) stays compiled and computes with its own weights.
    Dynamo's per-function graph limit is raised to :data:`RECOMPILE_LIMIT` for the process
    (:func:`_allow_recompiles`: a forward meets one graph per mode).

    Args:
        model: a timm ``VisionTransformer`` or a module holding one (the task-incremental
            :class:`~cl_streamkl.experiment.task_heads.MultiHeadViT`), whose attention is
            timm's ``Attention`` with fused attention (``F.scaled_dot_product_attention``).

    Returns:
        How many vision transformers now run compiled.

    Raises:
        ValueError: ``model`` holds no timm vision transformer, or one whose attention is
            not timm's fused ``Attention`` (the message names the class).
    """
    from timm.models.vision_transformer import VisionTransformer

    found = [module for module in model.modules() if isinstance(module, VisionTransformer)]
    if not found:
        raise ValueError(f"compile_model: {type(model).__name__} holds no timm VisionTransformer")
    count = 0
    for vit in found:
        if type(vit) in _ORIGINAL_CLASS:
            continue
        attention = [module for module in vit.modules() if qk_extractor_for(module) is not None]
        unfit = [type(module).__name__ for module in attention if not _fused_timm_attention(module)]
        if not attention or unfit:
            raise ValueError(f"compile_model: {type(vit).__name__}'s attention must be timm's Attention with fused "
                             f"attention (F.scaled_dot_product_attention); found {unfit or 'none'}")
        dropout = sorted({type(m).__name__ for m in vit.modules() if isinstance(m, nn.Dropout) and m.p > 0})
        if dropout:
            # Dropout draws other masks compiled than eager: the first-call check could not compare.
            raise ValueError(f"compile_model: {type(vit).__name__} has dropout ({', '.join(dropout)} with p > 0); "
                             "build it without dropout or run it eager")
        for module in attention:
            # The class attribute marks the attention of a compiled model (QKCapture reads it too).
            replayed = _subclass(type(module), "Replayed", {"replays_compiled_forward": True})
            register_qk_extractor(replayed, _replay_extractor)
            module.__class__ = replayed
        vit.__class__ = _subclass(type(vit), "Compiled", {"forward": _compiled_forward})
        count += 1
    _allow_recompiles()
    return count


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` holds a vision transformer that :func:`compile_model` compiled."""
    return any(type(module) in _ORIGINAL_CLASS and not getattr(module, "replays_compiled_forward", False)
               for module in model.modules())


def compiled_model_checks() -> float | None:
    """The largest relative Q/K difference between a compiled model and its eager forward
    seen by the first-call checks so far in this process (None before the first)."""
    return _WORST_CHECK[0]
