"""The Q/K of a frozen model's blocks from one ``torch.compile``'d, gradient-free forward.

:class:`QKCapture` reads Q/K with hooks and a ``TorchFunctionMode`` that runs in Python
on every call, which ``torch.compile`` cannot see through. A distillation *teacher* is
frozen, runs without gradients and only its Q/K are needed, so it is the ideal compile
target: :class:`CompiledQK` compiles one function that runs the model under a small
recording mode (Dynamo traces the mode into the graph) and returns the ``query`` and
``key`` of every ``F.scaled_dot_product_attention`` call. The model's output is never
returned, so the compiler drops everything the selected Q/K do not depend on: the head,
the last block's attention and MLP, and every block after the last selected one.

Trust but verify: the first call for each input signature (shape, dtype, device,
autocast state) also runs the eager :class:`QKCapture` and compares. The compiled
function maps the i-th attention call of the forward to block i, which holds for timm's
ViT/DeiT/EVA but not for every model; the comparison turns a mismatch (or attention that
does not call ``F.scaled_dot_product_attention``) into a ``RuntimeError`` instead of a
wrong penalty.

Example:
    >>> teacher_qk = CompiledQK(frozen_copy(model), layers="all")
    >>> with torch.autocast("cuda", dtype=torch.bfloat16):
    ...     result = teacher_qk(images)
    >>> q, k = result.qk[0]            # block 0, each (B, H, N, D)
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cl_streamkl.capture.attention_lse import lse_backend
from cl_streamkl.capture.compiled_model import is_compiled
from cl_streamkl.capture.context import QKCapture
from cl_streamkl.capture.hf_extractors import attention_without_sdpa
from cl_streamkl.capture.layers import LayerSpec, find_attention_modules, resolve_layer_indices
from cl_streamkl.capture.recording import MATCH_RTOL, Record, SdpaRecorder, input_signature, qk_error

# Compiled and eager log-sum-exps of one block differ by the rounding of their Q/K; any
# difference is harmless to the KL (its forward renormalises the teacher's rows by σ), so
# this bound only catches an LSE that belongs to other scores.
LSE_MATCH_ATOL = 0.5

__all__ = ["CompiledQK", "TeacherQK", "check_compile_options", "eager_teacher_qk"]


@dataclass(frozen=True)
class TeacherQK:
    """Q/K of the selected blocks of one forward.

    Attributes:
        qk: per selected block (ascending), q (B, H, Nq, D) and k (B, H, Nk, D).
        scales: the softmax scale each of those blocks applies to ``q kᵀ``.
        lse: per block the (B, H, Nq) log-sum-exp of its score rows where the forward recorded
            one (:attr:`QKCapture.lse`; the compiled forward's fused attention op), else None;
            None for the whole list when none was recorded.
    """

    qk: list[tuple[torch.Tensor, torch.Tensor]]
    scales: list[float]
    lse: list[torch.Tensor | None] | None = None


def check_compile_options(compile_teacher: object) -> dict[str, Any] | None:
    """Normalise a ``compile_teacher`` argument to ``torch.compile`` keyword arguments.

    Args:
        compile_teacher: ``False`` (eager teacher), ``True`` (``torch.compile``'s
            defaults) or a mapping of ``torch.compile`` keyword arguments, e.g.
            ``{"mode": "max-autotune-no-cudagraphs"}``.

    Returns:
        ``None`` for an eager teacher, else the keyword arguments.

    Raises:
        TypeError: not a bool or a mapping, or a key ``torch.compile`` does not take.
    """
    if isinstance(compile_teacher, bool):
        return {} if compile_teacher else None
    if not isinstance(compile_teacher, Mapping):
        raise TypeError(
            "compile_teacher must be a bool, \"auto\" or a mapping of torch.compile keyword arguments, "
            f"got {type(compile_teacher).__name__}"
        )
    accepted = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(str(key) for key in compile_teacher if key not in accepted)
    if unknown:
        raise TypeError(f"compile_teacher has keys torch.compile does not take: {unknown}; it takes {sorted(accepted)}")
    return dict(compile_teacher)


def _recorded_qk(
    model: nn.Module, x: torch.Tensor, block_indices: tuple[int, ...], lse_backend: int | None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], int]:
    """The recorded (query, key, lse) of the blocks ``block_indices``, and how many calls there were.

    A module-level function taking the model as an argument: Dynamo lifts the weights to
    graph inputs, so every teacher of one architecture reuses one compiled graph instead
    of spending the per-function recompile limit on each new snapshot. ``lse_backend`` is
    a constant to Dynamo: each value traces its own graph.
    """
    records: list[Record] = []
    with SdpaRecorder(records, lse_backend):
        model(x)
    # Only the selected Q/K (and LSEs) leave the graph, so the compiler prunes the rest.
    return [(records[i][0], records[i][1], records[i][4]) for i in block_indices if i < len(records)], len(records)


def _capture_lse_backend(capture: QKCapture) -> int | None:
    """The backend whose log-sum-exp the compiled forward can record for this teacher, or None.

    On CUDA only where the eager capture got an LSE for every selected block (so this torch's
    op takes the arguments); on the CPU where its flash kernel runs (its LSE is free).
    """
    if not capture.qk:
        return None
    q, k = capture.qk[0]
    if q.is_cuda and any(lse is None for lse in capture.lse):
        return None
    # The value has the key's shape in the attention this class compiles (one SDPA call per block).
    return lse_backend(q, k, k, capture.scales[0])


def eager_teacher_qk(model: nn.Module, layers: LayerSpec, x: torch.Tensor) -> TeacherQK:
    """The selected blocks' Q/K, scales and LSEs of an eager, gradient-free forward that stops early."""
    capture = QKCapture(model, layers, stop_early=True)
    with torch.no_grad(), capture:
        model(x)
    return TeacherQK(qk=capture.qk, scales=capture.scales, lse=capture.lse)


class CompiledQK:
    """Q/K of selected blocks from a ``torch.compile``'d forward of a frozen model.

    Always runs under ``torch.no_grad()``: the Q/K carry no autograd graph. The model must
    not change afterwards (compiled code may hold derived copies of its weights); build a
    new ``CompiledQK`` for a new model.

    Args:
        model: a vision transformer whose attention calls
            ``F.scaled_dot_product_attention`` once per block, in block order (timm ViT,
            DeiT, DeiT-3, EVA with fused attention).
        layers: ``"all"``, an int n (the last n blocks) or a list of block indices.
        compile_options: keyword arguments for ``torch.compile`` (``None``: defaults).
            With ``{"mode": "reduce-overhead"}`` the forward replays as CUDA graphs and
            the returned Q/K live in the graph's memory: the next call overwrites them,
            so use (or clone) them before calling again.
        fallback: where the first call of an input signature fails (compiling, or the check
            against the eager capture), warn once and run the eager capture from then on,
            instead of raising.

    Attributes:
        block_indices: resolved absolute block indices, ascending.
        eager_fallback: None, or why this teacher runs eager after all (``fallback``).
        max_check_error: the largest relative difference between compiled and eager Q/K
            seen by the first-call checks so far (``None`` before the first call).

    Raises:
        TypeError: the model has no capturable attention, or bad ``compile_options``.
        ValueError: the model runs compiled already (:func:`~cl_streamkl.capture.compile_model`).
        ValueError: without ``fallback``, a ``transformers`` model whose attention is not SDPA
            (with ``fallback`` it runs eager from the start, with a warning).
        ValueError: the layer selection does not fit the model.
    """

    def __init__(self, model: nn.Module, layers: LayerSpec = "all", compile_options: Mapping[str, Any] | None = None,
                 *, fallback: bool = False):
        options = check_compile_options(dict(compile_options) if compile_options is not None else True)
        if is_compiled(model):
            raise ValueError(f"CompiledQK: {type(model).__name__} is compiled by compile_model already; capture its "
                             "Q/K with QKCapture (compile_teacher=False)")
        self.model = model
        self.layers = layers
        attention = find_attention_modules(model)
        self.num_blocks = len(attention)
        self.block_indices = resolve_layer_indices(layers, self.num_blocks)
        self.max_check_error: float | None = None
        self.fallback = fallback
        self.eager_fallback: str | None = None
        implementation = attention_without_sdpa(attention)
        if implementation is not None:
            # Known before compiling: its forward makes no SDPA call for the compiled capture to record.
            why = (f"{type(model).__name__}'s attention runs attn_implementation={implementation!r}, not 'sdpa', "
                   "so its forward makes no F.scaled_dot_product_attention call to record")
            if not fallback:
                raise ValueError(f"CompiledQK: {why}; build it with attn_implementation='sdpa' or use the eager "
                                 "teacher (compile_teacher=False)")
            self.eager_fallback = why
            warnings.warn(f"compiled teacher unavailable, running it eager ({why})", RuntimeWarning, stacklevel=2)
        self._scales: list[float] | None = None
        # Checked input signatures → the backend whose log-sum-exp the compiled forward records.
        self._lse_backends: dict[tuple, int | None] = {}
        self._compiled = torch.compile(_recorded_qk, **options)

    def __call__(self, x: torch.Tensor) -> TeacherQK:
        """Run the compiled forward on ``x`` (checked against eager on a new signature).

        Args:
            x: the model's input, e.g. images (B, 3, S, S).

        Returns:
            The selected blocks' Q/K and scales, and their log-sum-exps where the model's
            attention runs a fused backend that computes one (CUDA; the CPU's flash kernel).

        Raises:
            TypeError: ``x`` is not a tensor.
            RuntimeError: on a first call, the compiled Q/K do not match the eager
                capture (the message says how).
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"CompiledQK needs a tensor input, got {type(x).__name__}")
        with torch.no_grad():
            if self.eager_fallback is not None:
                return eager_teacher_qk(self.model, self.layers, x)
            signature = input_signature(x)
            if signature in self._lse_backends:
                backend = self._lse_backends[signature]
                recorded, _ = self._compiled(self.model, x, tuple(self.block_indices), backend)
            else:
                # A new signature: the eager capture first, which also picks the LSE's backend.
                eager = QKCapture(self.model, self.layers, stop_early=True)
                with eager:
                    self.model(x)
                backend = _capture_lse_backend(eager)
                try:
                    recorded, calls = self._compiled(self.model, x, tuple(self.block_indices), backend)
                    self._check_against_eager(eager, recorded, calls)
                except Exception as error:
                    if not self.fallback:
                        raise
                    self.eager_fallback = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
                    warnings.warn(f"compiled teacher unavailable, running it eager ({self.eager_fallback})",
                                  RuntimeWarning, stacklevel=2)
                    return TeacherQK(qk=eager.qk, scales=eager.scales, lse=eager.lse)
                self._lse_backends[signature] = backend
        lse = [record[2] for record in recorded]
        return TeacherQK(qk=[(q, k) for q, k, _ in recorded], scales=list(self._scales),
                         lse=lse if backend is not None else None)

    def _check_against_eager(self, capture: QKCapture, recorded: list, calls: int) -> None:
        model_name = type(self.model).__name__
        if calls < self.num_blocks:
            raise RuntimeError(
                f"compiled teacher: {model_name} made {calls} F.scaled_dot_product_attention calls for "
                f"{self.num_blocks} attention blocks; CompiledQK needs attention that calls it once per block "
                "(timm: fused attention). Use the eager teacher (compile_teacher=False)."
            )
        errors = []
        for block, (q, k, lse), (q_eager, k_eager), lse_eager in zip(
            self.block_indices, recorded, capture.qk, capture.lse
        ):
            if q.shape != q_eager.shape or k.shape != k_eager.shape:
                raise RuntimeError(
                    f"compiled teacher: block {block} gave q {tuple(q.shape)}, k {tuple(k.shape)} but the eager "
                    f"capture q {tuple(q_eager.shape)}, k {tuple(k_eager.shape)}; the model's attention calls do "
                    "not run in block order. Use the eager teacher (compile_teacher=False)."
                )
            errors.append((block, qk_error(q, k, q_eager, k_eager)))
            if lse is not None and lse_eager is not None:
                gap = float((lse.double() - lse_eager.double()).abs().max())
                if not gap <= LSE_MATCH_ATOL:
                    raise RuntimeError(
                        f"compiled teacher: block {block}'s log-sum-exps differ from the eager capture's by up to "
                        f"{gap:.3g} (allowed {LSE_MATCH_ATOL}). Use the eager teacher (compile_teacher=False)."
                    )
        worst_block, worst = max(errors, key=lambda item: item[1])
        if not worst <= MATCH_RTOL:
            raise RuntimeError(
                f"compiled teacher: block {worst_block}'s Q/K differ from the eager capture by {worst:.2e} "
                f"(relative; allowed {MATCH_RTOL}); the model's attention calls do not run in block order. "
                "Use the eager teacher (compile_teacher=False)."
            )
        self.max_check_error = max(worst, self.max_check_error or 0.0)
        self._scales = capture.scales

    def __repr__(self) -> str:
        return f"CompiledQK(blocks={self.block_indices}, checked_signatures={len(self._lse_backends)})"
