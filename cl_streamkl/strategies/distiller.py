"""Attention distillation from a frozen teacher snapshot, independent of any CL framework.

:class:`AttentionDistiller` keeps a frozen copy of a model (the *teacher*, e.g. the model
as it was after the previous task) and turns the Q/K that the student's selected blocks
multiply into a StreamKL penalty: ``alpha`` × the mean over those blocks of
``attention_kl(q_student, k_student, q_teacher, k_teacher, reduction="mean")``.
The Avalanche plugin (:mod:`cl_streamkl.strategies.plugin`) is a thin adapter over it;
a plain PyTorch loop can use it directly:

Example:
    >>> distiller = AttentionDistiller(alpha=1.0, layers="all")
    >>> distiller.update_teacher(model)            # after finishing a task
    >>> teacher = distiller.teacher_qk(x)          # first: its GPU work overlaps the student's forward
    >>> with distiller.student_capture(model) as cap:
    ...     logits = model(x)
    >>> penalty = distiller.penalty(x, cap.qk, student_scales=cap.scales, teacher=teacher, student_lse=cap.lse)
    >>> loss = F.cross_entropy(logits, y) + penalty
    >>> loss.backward()

Data parallel: ``model`` may be a ``DistributedDataParallel`` wrapper. The student runs
through it (so its gradients, penalty included, are averaged over the ranks), its Q/K are
captured in the wrapped module's blocks, and the teacher is a snapshot of the wrapped
module that runs on each rank without the wrapper. Each rank's penalty is the mean over its
own samples, as each rank's loss is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import torch
from torch import nn

from cl_streamkl.attention_kl import attention_kl, attention_kl_grouped
from cl_streamkl.capture import CompiledQK, LayerSpec, QKCapture, TeacherQK
from cl_streamkl.capture.compiled import check_compile_options, eager_teacher_qk
from cl_streamkl.capture.compiled_model import is_compiled
from cl_streamkl.capture.layers import check_layer_spec, find_attention_modules
from cl_streamkl.distributed import unwrap_data_parallel
from cl_streamkl.kernels.validation import AttentionKLOptions
from cl_streamkl.strategies.teacher import frozen_copy, named_tensors, restore_frozen_copy

__all__ = ["AttentionDistiller", "known_lse"]


def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, Real):
        raise TypeError(f"alpha must be a real number, got {type(alpha).__name__}")
    alpha = float(alpha)
    if not math.isfinite(alpha) or alpha < 0.0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    return alpha


def known_lse(
    temperature: float,
    problems: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]],
    student_lse: Sequence[torch.Tensor | None] | None,
    teacher_lse: Sequence[torch.Tensor | None] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Both models' recorded log-sum-exps where the KL may take them, else None.

    They are the log-sum-exps of ``q kᵀ · scale`` as each model's attention formed its scores,
    so they serve only where the KL's scores are those: temperature 1 and the scales the
    capture recorded (``scale`` given, not None). Every block must have both (a fused SDPA
    call without a mask records one, eager or compiled; the math backend and manual attention
    record none), and the inputs must be on CUDA, where the recorded LSE costs
    nothing; on the CPU the kernels compute both as before.

    Args:
        temperature: the distiller's.
        problems: per block ``(q, k, q_teacher, k_teacher, scale, teacher_scale)``.
        student_lse, teacher_lse: per block the recorded log-sum-exp or None; None for all.

    Returns:
        ``(student_lse, teacher_lse)``, lists of (B, H, Nq) float32 tensors, or None.
    """
    if temperature != 1.0 or student_lse is None or teacher_lse is None:
        return None
    if len(student_lse) != len(problems) or len(teacher_lse) != len(problems):
        return None
    for (q, _, _, _, scale, teacher_scale), lse_s, lse_t in zip(problems, student_lse, teacher_lse):
        if lse_s is None or lse_t is None or scale is None or teacher_scale is None or not q.is_cuda:
            return None
    return list(student_lse), list(teacher_lse)


def attention_heads(model: nn.Module) -> list[int | None]:
    """Heads of each block's attention module (``None`` where the module has no ``num_heads``).

    Q/K projections of the same shape split into another number of heads give other
    attention maps, so a saved teacher is only restored into a model with these counts.
    """
    heads = [getattr(module, "num_heads", None) for module in find_attention_modules(model)]
    return [head if isinstance(head, int) and not isinstance(head, bool) else None for head in heads]


def _on_cuda(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters lives on a CUDA device."""
    return any(tensor.is_cuda for tensor in module.parameters())


def _auto_compiles(teacher: nn.Module) -> bool:
    """Whether ``compile_teacher="auto"`` compiles ``teacher``.

    Only on CUDA, where the compiled teacher measured faster at 197–4097 tokens; not a
    snapshot of a :func:`~cl_streamkl.capture.compile_model` student, which runs compiled
    already (and :class:`~cl_streamkl.capture.CompiledQK` refuses it), nor a model with
    ``nn.MultiheadAttention``, whose fused eval path makes no SDPA call for the compiled
    capture to collect (its first call would only fail and fall back).
    """
    if not _on_cuda(teacher) or is_compiled(teacher):
        return False
    return not any(isinstance(module, nn.MultiheadAttention) for module in find_attention_modules(teacher))


class AttentionDistiller:
    """StreamKL attention distillation from a frozen teacher snapshot.

    Args:
        alpha: weight of the penalty, >= 0.
        layers: blocks to distil: ``"all"``, an int n (the last n blocks) or a list of
            block indices (negative allowed), as in timm's ``forward_intermediates``.
        temperature: softmax temperature of both attention distributions, > 0.
        backend: ``attention_kl`` backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        compile_teacher: run the teacher's forward through ``torch.compile``
            (:class:`~cl_streamkl.capture.CompiledQK`): ``True``, or a mapping of
            ``torch.compile`` keyword arguments. The compiled forward skips everything
            the selected Q/K do not need; its first call per input shape is checked
            against the eager capture. Needs attention that calls
            ``F.scaled_dot_product_attention`` once per block in block order (timm's
            fused attention). ``"auto"`` (default): compiled for a teacher on CUDA, falling
            back to the eager teacher with a warning where its first call fails; eager on
            the CPU, for ``nn.MultiheadAttention`` models and for a model
            :func:`~cl_streamkl.capture.compile_model` compiled already (its snapshots run
            compiled). ``False``: eager. An execution choice: not part of
            :meth:`state_dict`.

    Attributes:
        teacher_updates: how many times :meth:`update_teacher` has run (restored by
            :meth:`load_state_dict`).

    Raises:
        TypeError / ValueError: an argument has the wrong type or value.
    """

    state_format = "cl_streamkl.AttentionDistiller/1"

    def __init__(
        self,
        alpha: float = 1.0,
        layers: LayerSpec = "all",
        temperature: float = 1.0,
        backend: str = "auto",
        compile_teacher: bool | str | Mapping[str, Any] = "auto",
    ) -> None:
        self.alpha = _check_alpha(alpha)
        auto = isinstance(compile_teacher, str) and compile_teacher == "auto"
        self.compile_options = {} if auto else check_compile_options(compile_teacher)
        # What repr shows: "auto", or whether the teacher runs compiled.
        self.compile_teacher: bool | str = "auto" if auto else self.compile_options is not None
        # Checked here, once: a bad temperature or backend fails at construction.
        self.temperature = AttentionKLOptions(temperature=temperature, backend=backend).temperature
        self.backend = backend
        self.layers: LayerSpec = check_layer_spec(layers)
        self.teacher_updates = 0
        self._teacher: nn.Module | None = None
        self._compiled_teacher: CompiledQK | None = None
        self._pending_teacher: dict[str, torch.Tensor] | None = None
        # Attention heads per block of the model the teacher was taken from.
        self._teacher_heads: list[int | None] | None = None

    @property
    def teacher(self) -> nn.Module | None:
        """The frozen snapshot, or ``None`` before the first :meth:`update_teacher`."""
        return self._teacher

    @property
    def restore_pending(self) -> bool:
        """Whether a loaded teacher waits for :meth:`attach` to get its module structure."""
        return self._pending_teacher is not None

    def validate(self, model: nn.Module) -> list[int]:
        """Check that ``model`` (or the module in its data-parallel wrapper) can be distilled; return the block indices.

        Raises:
            TypeError: ``model`` has no capturable attention.
            ValueError: ``layers`` does not fit the model's number of blocks.
        """
        return QKCapture(model, self.layers).block_indices

    def update_teacher(self, model: nn.Module) -> nn.Module:
        """Replace the teacher by a frozen snapshot of ``model``.

        The old teacher is released before copying, so at most one snapshot is alive.
        The snapshot is a deep copy taken without ``model``'s hooks, in ``eval()`` mode,
        with every parameter ``requires_grad=False``, on ``model``'s device. Of a
        ``DistributedDataParallel`` wrapper, the wrapped module is copied.

        Returns:
            The new teacher.
        """
        model = unwrap_data_parallel(model)
        self.validate(model)
        self._set_teacher(None)
        self._pending_teacher = None
        self._set_teacher(frozen_copy(model))
        self._teacher_heads = attention_heads(model)
        self.teacher_updates += 1
        return self._teacher

    def student_capture(self, model: nn.Module) -> QKCapture:
        """A :class:`QKCapture` of ``model`` for the selected layers (enter it around the forward).

        ``model`` may be a ``DistributedDataParallel`` wrapper: run the forward through it.
        """
        return QKCapture(model, self.layers)

    def _set_teacher(self, teacher: nn.Module | None) -> None:
        self._teacher = teacher
        self._compiled_teacher = None
        if teacher is None or self.compile_options is None:
            return
        auto = self.compile_teacher == "auto"
        if not auto or _auto_compiles(teacher):
            self._compiled_teacher = CompiledQK(teacher, self.layers, self.compile_options, fallback=auto)

    def teacher_qk(self, x: Any) -> TeacherQK:
        """Run the teacher on ``x`` under ``torch.no_grad()`` and return its Q/K.

        The forward stops once every selected block's attention has run (the teacher's
        output is never needed), so distilling early blocks costs only that far. With
        ``compile_teacher`` it is the compiled forward, which prunes the same work.

        Raises:
            RuntimeError: there is no teacher, or the compiled teacher's first-call check
                against the eager capture failed.
        """
        teacher = self._require_teacher()
        if self._compiled_teacher is not None:
            return self._compiled_teacher(x)
        return eager_teacher_qk(teacher, self.layers, x)

    def penalty(
        self,
        x: Any,
        student_qk: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        student_scales: Sequence[float] | None = None,
        teacher: TeacherQK | None = None,
        student_lse: Sequence[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """``alpha`` × mean over layers of KL(P_teacher ‖ P_student) on the batch ``x``.

        Args:
            x: the input the student was run on (anything the teacher's forward accepts).
            student_qk: ``capture.qk`` of :meth:`student_capture`: per selected block,
                q (B, H, N, D) and k (B, H, N, D) with their autograd graph.
            student_scales: ``capture.scales``; ``None`` means ``D**-0.5`` per block.
            teacher: :meth:`teacher_qk` of this ``x``, already run; ``None`` runs it now.
                Running the teacher *before* the student's forward is faster on a GPU:
                the student's forward is host-bound (the GPU waits for each launch), and
                with the teacher's kernels still queued it no longer waits. The
                Avalanche plugin does this.
            student_lse: ``capture.lse`` of the same capture as ``student_scales``: the
                log-sum-exps of the student's attention. Where :func:`known_lse` finds both
                models' usable, the kernels take one exponential per score instead of two;
                elsewhere they are ignored.

        Returns:
            A 0-dim float32 tensor differentiable w.r.t. the student's Q/K; a zero tensor
            (on ``x``'s device) when there is no teacher yet or ``alpha`` is 0.

        Raises:
            RuntimeError: a loaded teacher was not attached to a model yet.
            TypeError: ``teacher`` is not a :class:`TeacherQK`.
            ValueError: ``student_qk`` does not match the selected layers.
        """
        if teacher is not None and not isinstance(teacher, TeacherQK):
            raise TypeError(f"teacher must be the TeacherQK of teacher_qk(x) or None, got {type(teacher).__name__}")
        if self._pending_teacher is not None:
            raise RuntimeError("a teacher was loaded by load_state_dict(); call attach(model) before penalty()")
        if self._teacher is None or self.alpha == 0.0:
            device = x.device if isinstance(x, torch.Tensor) else None
            return torch.zeros((), dtype=torch.float32, device=device)
        if teacher is None:
            teacher = self.teacher_qk(x)
        teacher_qk, teacher_scales = teacher.qk, teacher.scales
        if len(student_qk) != len(teacher_qk):
            raise ValueError(
                f"student_qk has {len(student_qk)} blocks but the layer selection {self.layers!r} gives "
                f"{len(teacher_qk)}; pass capture.qk of student_capture()"
            )
        if student_scales is None:
            student_scales = [None] * len(student_qk)
        elif len(student_scales) != len(student_qk):
            raise ValueError(f"student_scales has {len(student_scales)} entries, expected {len(student_qk)}")
        problems = []
        for (q, k), (q_t, k_t), scale, teacher_scale in zip(student_qk, teacher_qk, student_scales, teacher_scales):
            # Under autocast the teacher may have run in another precision than the student did.
            if q_t.dtype != q.dtype:
                q_t, k_t = q_t.to(q.dtype), k_t.to(q.dtype)
            problems.append((q, k, q_t, k_t, scale, teacher_scale))
        if type(self).layer_penalties is not AttentionDistiller.layer_penalties:
            # A subclass with penalties of its own (PooledAttentionDistiller) takes the problems alone.
            return self.alpha * self.layer_penalties(problems).mean()
        given = known_lse(self.temperature, problems, student_lse, teacher.lse)
        return self.alpha * self.layer_penalties(problems, given).mean()

    def layer_penalties(
        self,
        problems: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]],
        lse: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """One unweighted penalty per distilled block: the mean KL over its query rows.

        Blocks of one shape and dtype (every block of a ViT) go to
        :func:`~cl_streamkl.attention_kl_grouped`: one kernel launch for all of them and
        one for each backward kernel. Blocks that differ are computed one by one.

        Args:
            problems: per block ``(q, k, q_teacher, k_teacher, scale, teacher_scale)``,
                the Q/K as in :meth:`penalty`, scales ``None`` for ``D**-0.5``.
            lse: :func:`known_lse` of these problems: per block the student's and the
                teacher's log-sum-exps, or None (the kernels compute both).

        Returns:
            (L,) float32 tensor.
        """
        options = {"temperature": self.temperature, "reduction": "mean", "backend": self.backend}
        student_lse, teacher_lse = lse if lse is not None else (None, None)
        signatures = {tuple((t.shape, t.dtype, t.device) for t in problem[:4]) for problem in problems}
        if len(signatures) == 1:
            return attention_kl_grouped([problem[:4] for problem in problems],
                                        scales=[problem[4] for problem in problems],
                                        teacher_scales=[problem[5] for problem in problems],
                                        lse=student_lse, lse_teacher=teacher_lse, **options)
        given = list(zip(student_lse, teacher_lse)) if lse is not None else [(None, None)] * len(problems)
        return torch.stack([
            attention_kl(q, k, q_t, k_t, scale=scale, teacher_scale=teacher_scale, lse=lse_s, lse_teacher=lse_t,
                         **options)
            for (q, k, q_t, k_t, scale, teacher_scale), (lse_s, lse_t) in zip(problems, given)
        ])

    def _require_teacher(self) -> nn.Module:
        if self._teacher is None:
            raise RuntimeError("there is no teacher yet; call update_teacher(model) first")
        return self._teacher

    def attach(self, model: nn.Module) -> None:
        """Validate ``model`` and rebuild a teacher loaded by :meth:`load_state_dict`.

        The teacher gets ``model``'s structure (a frozen copy) and then, bit for bit, the
        saved parameters and buffers.

        Raises:
            TypeError / ValueError: as :meth:`validate`, or the saved teacher's tensor
                names, shapes or dtypes, or its attention heads per block, do not match
                ``model``.
        """
        model = unwrap_data_parallel(model)
        self.validate(model)
        if self._pending_teacher is None:
            return
        teacher = restore_frozen_copy(model, self._pending_teacher)
        heads, saved = attention_heads(model), self._teacher_heads
        if saved is not None and (len(saved) != len(heads) or any(
                a is not None and b is not None and a != b for a, b in zip(saved, heads))):
            raise ValueError(
                f"the saved teacher comes from a model with {saved} attention heads per block but this model has "
                f"{heads}: its queries and keys would be split into other heads; restore it into the same architecture"
            )
        self._set_teacher(teacher)
        self._pending_teacher = None

    def _config(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "layers": list(self.layers) if isinstance(self.layers, (list, tuple)) else self.layers,
            "temperature": self.temperature,
            "backend": self.backend,
        }

    def state_dict(self) -> dict[str, Any]:
        """Configuration, counters, the teacher's parameters and buffers and its heads per block.

        Only plain containers, numbers, strings and tensors, so
        ``torch.load(path, weights_only=True)`` reads it back. Tensors are shared with
        the teacher, not cloned (the teacher never changes).
        """
        if self._pending_teacher is not None:
            teacher_tensors: dict[str, torch.Tensor] | None = dict(self._pending_teacher)
        elif self._teacher is not None:
            teacher_tensors = dict(named_tensors(self._teacher))
        else:
            teacher_tensors = None
        return {
            "format": self.state_format,
            "config": self._config(),
            "teacher_updates": self.teacher_updates,
            "teacher": teacher_tensors,
            "teacher_heads": None if teacher_tensors is None else self._teacher_heads,
        }

    def load_state_dict(self, state: dict[str, Any], model: nn.Module | None = None) -> None:
        """Restore from :meth:`state_dict`.

        Without ``model`` the teacher's tensors are kept until :meth:`attach` supplies
        the module structure (the Avalanche plugin attaches when training starts).

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: ``state`` is not a distiller state, or was saved with another
                alpha/layers/temperature/backend (the penalty would differ silently).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if state.get("format") != self.state_format:
            raise ValueError(f"state is not a {type(self).__name__} state (format {state.get('format')!r})")
        if state["config"] != self._config():
            raise ValueError(
                f"state was saved with {state['config']} but this distiller has {self._config()}; "
                f"construct it with the same {', '.join(self._config())}"
            )
        teacher = state["teacher"]
        if teacher is not None and not (
            isinstance(teacher, dict) and all(isinstance(t, torch.Tensor) for t in teacher.values())
        ):
            raise ValueError("state['teacher'] must be None or a dict of tensors")
        self.teacher_updates = int(state["teacher_updates"])
        self._set_teacher(None)
        self._pending_teacher = dict(teacher) if teacher is not None else None
        # States written before head counts were recorded restore without this check.
        heads = state.get("teacher_heads")
        self._teacher_heads = None if heads is None else [None if h is None else int(h) for h in heads]
        if model is not None:
            self.attach(model)

    def __repr__(self) -> str:
        return (
            f"AttentionDistiller(alpha={self.alpha}, layers={self.layers!r}, temperature={self.temperature}, "
            f"backend={self.backend!r}, compile_teacher={self.compile_teacher!r}, "
            f"teacher_updates={self.teacher_updates})"
        )
