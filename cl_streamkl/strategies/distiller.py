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
    >>> logits, penalty = distiller.forward(model, x)   # the student's forward, captured, and its penalty
    >>> loss = F.cross_entropy(logits, y) + penalty
    >>> loss.backward()

The teacher is called as the student is: ``distiller.forward(model, x, task_labels)`` runs
``model(x, task_labels)`` and the teacher with the same arguments.

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

from cl_streamkl.capture import CompiledQK, LayerSpec, QKCapture, TeacherQK
from cl_streamkl.capture.compiled import check_compile_options
from cl_streamkl.capture.layers import check_layer_spec
from cl_streamkl.distributed import unwrap_data_parallel
from cl_streamkl.kernels.validation import AttentionKLOptions
from cl_streamkl.strategies.block_penalties import Problem, block_problems, kl_per_block, known_lse
from cl_streamkl.strategies.teacher import check_snapshot_fits, frozen_copy, named_tensors, restore_frozen_copy
from cl_streamkl.strategies.teacher_forward import (
    attention_heads,
    auto_compiles,
    check_forward_call,
    eager_teacher_qk,
)

__all__ = ["AttentionDistiller"]


def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, Real):
        raise TypeError(f"alpha must be a real number, got {type(alpha).__name__}")
    alpha = float(alpha)
    if not math.isfinite(alpha) or alpha < 0.0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha}")
    return alpha


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

        It records every run of the blocks (``every_run``), as the teacher does: a
        ``MultiTaskModule`` runs them once per task label in the batch. ``model`` may be a
        ``DistributedDataParallel`` wrapper: run the forward through it.
        """
        return QKCapture(model, self.layers, every_run=True)

    def _set_teacher(self, teacher: nn.Module | None) -> None:
        self._teacher = teacher
        self._compiled_teacher = None
        if teacher is None or self.compile_options is None:
            return
        auto = self.compile_teacher == "auto"
        if not auto or auto_compiles(teacher):
            self._compiled_teacher = CompiledQK(teacher, self.layers, self.compile_options, fallback=auto)

    def teacher_qk(self, x: Any, *args: Any, **kwargs: Any) -> TeacherQK:
        """Run the teacher as ``teacher(x, *args, **kwargs)`` under ``torch.no_grad()``; return its Q/K.

        Pass the extra arguments the student's forward gets (task labels for a
        ``MultiTaskModule``). The forward stops once every selected block's attention has
        run on all of ``x`` (the teacher's output is never needed), so distilling early
        blocks costs only that far. With ``compile_teacher`` and no extra arguments it is
        the compiled forward, which prunes the same work; a call with extra arguments runs
        eager.

        Raises:
            RuntimeError: there is no teacher, or the compiled teacher's first-call check
                against the eager capture failed.
            TypeError: the teacher's forward does not take these arguments.
        """
        teacher = self._require_teacher()
        check_forward_call(teacher, args, kwargs)
        if self._compiled_teacher is not None and not args and not kwargs:
            return self._compiled_teacher(x)
        return eager_teacher_qk(teacher, self.layers, x, args, kwargs)

    def forward(self, model: nn.Module, x: Any, *args: Any, **kwargs: Any) -> tuple[Any, torch.Tensor]:
        """Run the student ``model(x, *args, **kwargs)`` under capture; return its output and the penalty.

        The one call of a training step: the teacher runs first with the same arguments
        (its GPU work overlaps the student's launch-bound forward), then the student under
        :meth:`student_capture`, then :meth:`penalty` with both models' log-sum-exps where
        they are usable and every block in one grouped launch. A teacher loaded by
        :meth:`load_state_dict` is first rebuilt from ``model`` (:meth:`attach`).

        Args:
            model: the student (or its ``DistributedDataParallel`` wrapper).
            x: its input, e.g. images (B, 3, S, S).
            *args, **kwargs: the rest of the student's forward arguments (task labels).

        Returns:
            ``(model's output, penalty)``; the penalty as :meth:`penalty` returns it (zero
            before the first :meth:`update_teacher`).

        Raises:
            TypeError / ValueError: as :meth:`attach`, when a loaded teacher does not fit ``model``.
            ValueError: ``model`` was moved to another device or cast to another dtype after
                :meth:`update_teacher`.
        """
        if self._pending_teacher is not None:
            self.attach(model)
        teacher = None
        if self._distils():
            check_snapshot_fits(self._teacher, unwrap_data_parallel(model))
            teacher = self.teacher_qk(x, *args, **kwargs)
        capture = self.student_capture(model)
        with capture:
            output = model(x, *args, **kwargs)
        penalty = self.penalty(x, capture, teacher=teacher, forward_args=args, forward_kwargs=kwargs)
        capture.clear()
        return output, penalty

    def _distils(self) -> bool:
        """Whether the next penalty is computed (a teacher, a weight above 0)."""
        return self._teacher is not None and self._pending_teacher is None and self.alpha > 0.0

    def penalty(
        self,
        x: Any,
        capture: QKCapture | TeacherQK,
        *,
        teacher: TeacherQK | None = None,
        forward_args: Sequence[Any] = (),
        forward_kwargs: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """``alpha`` × mean over layers of KL(P_teacher ‖ P_student) on the batch ``x``.

        Both models' recorded log-sum-exps are used where :func:`known_lse` finds them
        valid (one exponential per score instead of two), and blocks of one shape go to
        one grouped launch.

        Args:
            x: the input the student was run on (what the teacher's forward takes first).
            capture: the :meth:`student_capture` entered around the student's forward,
                whole: per selected block its q (B, H, N, D), k (B, H, N, D) with their
                autograd graph, scales and log-sum-exps. (A :class:`TeacherQK` of the
                student's Q/K serves too.)
            teacher: :meth:`teacher_qk` of this ``x``, already run; ``None`` runs it now,
                with ``forward_args`` and ``forward_kwargs``. Running the teacher *before*
                the student's forward is faster on a GPU: the student's forward is
                host-bound, and with the teacher's kernels still queued the GPU no longer
                waits. :meth:`forward` and the Avalanche plugin do this.
            forward_args, forward_kwargs: the student's extra forward arguments, for a
                teacher run here.

        Returns:
            A 0-dim float32 tensor differentiable w.r.t. the student's Q/K; a zero tensor
            (on ``x``'s device) when there is no teacher yet or ``alpha`` is 0.

        Raises:
            RuntimeError: a loaded teacher was not attached to a model yet.
            TypeError: ``capture`` is not a capture, or ``teacher`` not a :class:`TeacherQK`.
            ValueError: ``capture`` does not match the selected layers or the teacher's samples.
        """
        if teacher is not None and not isinstance(teacher, TeacherQK):
            raise TypeError(f"teacher must be the TeacherQK of teacher_qk(x) or None, got {type(teacher).__name__}")
        if self._pending_teacher is not None:
            raise RuntimeError("a teacher was loaded by load_state_dict(); call attach(model) (or forward(model, "
                               "...), which attaches it) before penalty()")
        if not self._distils():
            device = x.device if isinstance(x, torch.Tensor) else None
            return torch.zeros((), dtype=torch.float32, device=device)
        if teacher is None:
            teacher = self.teacher_qk(x, *forward_args, **dict(forward_kwargs or {}))
        problems = block_problems(capture, teacher, self.layers)
        if type(self).layer_penalties is not AttentionDistiller.layer_penalties:
            # A subclass with penalties of its own (PooledAttentionDistiller) takes the problems alone.
            return self.alpha * self.layer_penalties(problems).mean()
        given = known_lse(self.temperature, problems, capture.lse, teacher.lse)
        return self.alpha * self.layer_penalties(problems, given).mean()

    def layer_penalties(
        self, problems: Sequence[Problem], lse: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    ) -> torch.Tensor:
        """One unweighted penalty per distilled block: the mean KL over its query rows.

        Args:
            problems: per block ``(q, k, q_teacher, k_teacher, scale, teacher_scale)``,
                the Q/K as in :meth:`penalty`, scales ``None`` for ``D**-0.5``.
            lse: :func:`known_lse` of these problems: per block the student's and the
                teacher's log-sum-exps, or None (the kernels compute both).

        Returns:
            (L,) float32 tensor (:func:`kl_per_block`: one grouped launch for blocks of one shape).
        """
        return kl_per_block(problems, lse, self.temperature, self.backend)

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
