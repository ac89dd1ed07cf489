"""Avalanche adapter: :class:`StreamKLPlugin` over :class:`AttentionDistiller`.

Each callback does one thing:

* ``before_training``: validate the model against the layer selection and the way the
  strategy calls it, and rebuild a teacher restored by :meth:`StreamKLPlugin.load_state_dict`;
* ``before_forward``: run the teacher on ``strategy.mb_x`` as ``avalanche_forward`` runs the
  model (with the task labels for a ``MultiTaskModule``; first, so its GPU work overlaps the
  student's launch-bound forward) and hook the student's attention;
* ``after_forward``: unhook, so the student runs once and its Q/K keep their graph;
* ``before_backward``: add the penalty to ``strategy.loss`` and note its share of that loss;
* ``after_training_exp``: warn once if the penalty stayed below :data:`QUIET_SHARE` of the
  loss through the experience; snapshot the model as the next teacher.

The strategy's model may be wrapped in ``DistributedDataParallel`` (a data-parallel run):
the student's forward runs through the wrapper, the Q/K are captured in the wrapped
module's blocks, the teacher is a snapshot of the wrapped module on each rank, and the
penalty is each rank's own (its gradient is averaged over the ranks with the loss's).

Example:
    >>> plugin = StreamKLPlugin(alpha=1.0, layers="all")
    >>> strategy = Naive(model=vit, optimizer=opt, criterion=nn.CrossEntropyLoss(),
    ...                  plugins=[plugin], evaluator=EvaluationPlugin(
    ...                      loss_metrics(epoch=True), streamkl_penalty_metrics(epoch=True),
    ...                      loggers=[InteractiveLogger()]))
    >>> for experience in benchmark.train_stream:
    ...     strategy.train(experience)
    >>> torch.save(plugin.state_dict(), "streamkl.pt")
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from avalanche.models.utils import is_multi_task_module
from avalanche.training.plugins import SupervisedPlugin
from torch import nn

from cl_streamkl.capture import LayerSpec, QKCapture, TeacherQK
from cl_streamkl.distributed import unwrap_data_parallel
from cl_streamkl.strategies.distiller import AttentionDistiller
from cl_streamkl.strategies.pooled_attention import PooledAttentionDistiller
from cl_streamkl.strategies.teacher import check_snapshot_fits
from cl_streamkl.strategies.teacher_forward import check_forward_call

if TYPE_CHECKING:
    from avalanche.training.templates import SupervisedTemplate

__all__ = ["QUIET_SHARE", "AttentionDistillationPlugin", "PADPlugin", "StreamKLPlugin"]

# Below this share of the loss through a whole experience, the penalty is reported as too weak to matter.
QUIET_SHARE = 0.01


def _version(minibatch: object) -> int:
    """A tensor's in-place version counter (0 for inputs that are not tensors)."""
    return getattr(minibatch, "_version", 0)


def _forward_args(strategy: SupervisedTemplate) -> tuple:
    """The arguments after ``mb_x`` that ``avalanche_forward`` gives the strategy's model."""
    return (strategy.mb_task_id,) if is_multi_task_module(strategy.model) else ()


class AttentionDistillationPlugin(SupervisedPlugin, supports_distributed=True):
    """Avalanche adapter over an :class:`AttentionDistiller`: the callbacks and the state.

    First experience: no penalty. After every training experience the model is
    snapshotted as a frozen teacher; on every later training iteration the teacher runs
    under ``torch.no_grad()`` on ``strategy.mb_x`` and the distiller's penalty is added
    to ``strategy.loss`` before backward. :class:`StreamKLPlugin` and :class:`PADPlugin`
    choose the distiller.

    Args:
        distiller: does the work (teacher snapshot, Q/K capture, penalty).
    """

    state_format = "cl_streamkl.AttentionDistillationPlugin/2"
    # Version 1 also held the last penalty, which differs between data-parallel ranks; it loads without it.
    previous_state_format = "cl_streamkl.AttentionDistillationPlugin/1"

    def __init__(self, distiller: AttentionDistiller) -> None:
        super().__init__()
        self.distiller = distiller
        self._capture: QKCapture | None = None
        # The teacher's Q/K of this iteration, the minibatch it ran on and that
        # minibatch's in-place version counter.
        self._teacher_run: tuple[TeacherQK, object, int] | None = None
        self._last_penalty: torch.Tensor | float = 0.0
        self._last_share: torch.Tensor | float = 0.0
        # The largest share of this experience so far (None: no penalty computed yet).
        self._top_share: torch.Tensor | None = None
        self._warned = False

    @property
    def teacher(self) -> nn.Module | None:
        """The frozen snapshot of the model after the last training experience."""
        return self.distiller.teacher

    @property
    def last_penalty(self) -> float:
        """The penalty of the last training iteration (0.0 while there is no teacher)."""
        # Kept as a tensor until read so training does not sync the device every step.
        if isinstance(self._last_penalty, torch.Tensor):
            self._last_penalty = float(self._last_penalty)
        return self._last_penalty

    @property
    def last_share(self) -> float:
        """The last penalty over the loss it was added to (0.0 while there is no teacher).

        That loss is the strategy's criterion plus whatever plugins listed before this one
        added (LwF, EWC), as ``strategy.loss`` holds it when this plugin adds its penalty.
        """
        if isinstance(self._last_share, torch.Tensor):
            self._last_share = float(self._last_share)
        return self._last_share

    def check_model(self, model: nn.Module) -> list[int]:
        """Raise now if ``model`` cannot be distilled; return the selected block indices."""
        return self.distiller.validate(model)

    def before_training(self, strategy: SupervisedTemplate, *args: Any, **kwargs: Any) -> None:
        self.distiller.attach(strategy.model)
        # The teacher is called as avalanche_forward calls the model: refuse a model it cannot be, now.
        task_labels = (None,) if is_multi_task_module(strategy.model) else ()
        check_forward_call(unwrap_data_parallel(strategy.model), task_labels)

    def before_training_exp(self, strategy: SupervisedTemplate, *args: Any, **kwargs: Any) -> None:
        self._top_share = None

    def before_forward(self, strategy: SupervisedTemplate, *args: Any, **kwargs: Any) -> None:
        self._close_capture()
        if self.distiller.teacher is not None:
            if self.distiller.alpha > 0.0:
                check_snapshot_fits(self.distiller.teacher, unwrap_data_parallel(strategy.model))
                # Teacher first: its queued GPU work keeps the device busy while the host
                # issues the student's (launch-bound) forward.
                teacher = self.distiller.teacher_qk(strategy.mb_x, *_forward_args(strategy))
                self._teacher_run = (teacher, strategy.mb_x, _version(strategy.mb_x))
            self._capture = self.distiller.student_capture(strategy.model)
            self._capture.__enter__()

    def after_forward(self, strategy: SupervisedTemplate, *args: Any, **kwargs: Any) -> None:
        if self._capture is not None:
            self._capture.remove_hooks()

    def before_backward(self, strategy: SupervisedTemplate, *args: Any, **kwargs: Any) -> None:
        capture = self._capture
        if capture is None:
            self._last_penalty = self._last_share = 0.0
            return
        self._capture = None
        teacher, ran_on, version = self._teacher_run or (None, None, 0)
        self._teacher_run = None
        if strategy.mb_x is not ran_on or _version(ran_on) != version:
            # Another plugin replaced or edited the minibatch after our before_forward:
            # the teacher must see what the student saw, so penalty() runs it again.
            teacher = None
        penalty = self.distiller.penalty(strategy.mb_x, capture, teacher=teacher, forward_args=_forward_args(strategy))
        capture.clear()
        self._last_penalty = penalty.detach()
        if self.distiller.alpha > 0.0:
            # Before the addition, which changes strategy.loss in place.
            loss = strategy.loss.detach().abs().clamp_min(torch.finfo(torch.float32).tiny)
            self._last_share = self._last_penalty / loss
            top = self._top_share
            self._top_share = self._last_share if top is None else torch.maximum(top, self._last_share)
        strategy.loss += penalty

    def after_training_iteration(self, strategy: SupervisedTemplate, *args: Any, **kwargs: Any) -> None:
        self._close_capture()

    def after_training_exp(self, strategy: SupervisedTemplate, *args: Any, **kwargs: Any) -> None:
        self._close_capture()
        self._warn_if_quiet(strategy)
        self.distiller.update_teacher(strategy.model)

    def _warn_if_quiet(self, strategy: SupervisedTemplate) -> None:
        """Warn (once per plugin) when alpha × penalty stayed below QUIET_SHARE of the loss all experience."""
        top, self._top_share = self._top_share, None
        if self._warned or top is None or float(top) >= QUIET_SHARE:
            return
        self._warned = True
        experience = getattr(getattr(strategy, "experience", None), "current_experience", "?")
        warnings.warn(
            f"{type(self).__name__}: alpha × penalty stayed below {QUIET_SHARE:.0%} of the loss through experience "
            f"{experience} (counted from 0, as Avalanche does; at most {float(top):.2e} of it) with "
            f"alpha={self.distiller.alpha:g}: if forgetting "
            "stays as without the plugin, raise alpha (docs/plugins.md, How to choose alpha)",
            RuntimeWarning, stacklevel=2)

    def after_training(self, strategy: SupervisedTemplate, *args: Any, **kwargs: Any) -> None:
        self._close_capture()

    def _close_capture(self) -> None:
        self._teacher_run = None
        if self._capture is not None:
            self._capture.remove_hooks()
            self._capture.clear()
            self._capture = None

    def state_dict(self) -> dict[str, Any]:
        """Teacher snapshot (parameters and buffers), configuration and counters.

        Plain dicts, numbers, strings and tensors only: save with ``torch.save`` and
        read back with ``torch.load(path, weights_only=True)``. The same on every rank of a
        data-parallel run (the last penalty, which each rank computes on its own samples,
        is not part of it).
        """
        return {"format": self.state_format, "distiller": self.distiller.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`.

        The teacher is rebuilt when the plugin next sees the strategy's model (at the
        start of ``strategy.train``), from that model's structure and the saved tensors,
        bit for bit. Call :meth:`attach` to rebuild it earlier.

        ``last_penalty`` reads 0.0 until the next training iteration. States of the
        previous format (which also held the last penalty) load as well.

        Raises:
            TypeError / ValueError: ``state`` is not a StreamKLPlugin state or was saved
                with another configuration.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if state.get("format") not in (self.state_format, self.previous_state_format):
            raise ValueError(f"state is not a {type(self).__name__} state (format {state.get('format')!r})")
        self._close_capture()
        self.distiller.load_state_dict(state["distiller"])
        self._last_penalty = self._last_share = 0.0

    def attach(self, model: nn.Module) -> None:
        """Validate ``model`` and rebuild a restored teacher from its structure now."""
        self.distiller.attach(model)


class StreamKLPlugin(AttentionDistillationPlugin, supports_distributed=True):
    """Distil the previous experience's attention into the current model (StreamKL).

    The penalty is ``alpha × mean_layers attention_kl(q_s, k_s, q_t, k_t,
    temperature=..., reduction="mean")``.

    Args:
        alpha: penalty weight, >= 0.
        layers: ``"all"``, an int n (the last n blocks) or a list of block indices.
        temperature: softmax temperature, > 0.
        backend: ``attention_kl`` backend (``"auto"``, ``"triton"``, ``"torch"``).
        compile_teacher: ``"auto"`` (default: compiled on CUDA, eager on the CPU), ``True``,
            ``False`` or a mapping of ``torch.compile`` keyword arguments (see
            :class:`~cl_streamkl.strategies.distiller.AttentionDistiller`).

    Raises:
        TypeError / ValueError: bad arguments here; a model without capturable
            attention or a layer index out of range when training starts.
    """

    state_format = "cl_streamkl.StreamKLPlugin/2"
    previous_state_format = "cl_streamkl.StreamKLPlugin/1"

    def __init__(
        self,
        alpha: float = 1.0,
        layers: LayerSpec = "all",
        temperature: float = 1.0,
        backend: str = "auto",
        compile_teacher: bool | str | Mapping[str, Any] = "auto",
    ) -> None:
        super().__init__(AttentionDistiller(
            alpha=alpha, layers=layers, temperature=temperature, backend=backend, compile_teacher=compile_teacher
        ))

    def __repr__(self) -> str:
        d = self.distiller
        return (
            f"StreamKLPlugin(alpha={d.alpha}, layers={d.layers!r}, temperature={d.temperature}, "
            f"backend={d.backend!r}, compile_teacher={d.compile_teacher!r})"
        )


class PADPlugin(AttentionDistillationPlugin, supports_distributed=True):
    """Pooled attention distillation (Pelosin et al. 2022), the published variant StreamKL is compared with.

    The penalty is ``alpha ×`` the mean over the selected blocks of
    :func:`~cl_streamkl.strategies.pooled_attention.pooled_attention_distance`.

    Args:
        alpha: penalty weight, >= 0.
        layers: ``"all"``, an int n (the last n blocks) or a list of block indices.
        compile_teacher: as for :class:`StreamKLPlugin`.
        streaming: True: pool the attention without materialising the maps; False:
            materialise them; "auto" (default): stream when a map would hold more than
            :data:`~cl_streamkl.strategies.pooled_attention.STREAMING_THRESHOLD` entries.
        variant: ``"symmetric"`` or ``"asymmetric"`` (the authors' headline variant, see
            :mod:`~cl_streamkl.strategies.pooled_attention`).
    """

    state_format = "cl_streamkl.PADPlugin/2"
    previous_state_format = "cl_streamkl.PADPlugin/1"

    def __init__(self, alpha: float = 1.0, layers: LayerSpec = "all",
                 compile_teacher: bool | str | Mapping[str, Any] = "auto", streaming: bool | str = "auto",
                 variant: str = "asymmetric") -> None:
        super().__init__(PooledAttentionDistiller(alpha=alpha, layers=layers, compile_teacher=compile_teacher,
                                                  streaming=streaming, variant=variant))

    def __repr__(self) -> str:
        d = self.distiller
        return (f"PADPlugin(alpha={d.alpha}, layers={d.layers!r}, variant={d.variant!r}, "
                f"compile_teacher={d.compile_teacher!r}, streaming={d.streaming!r})")
