"""The run loop: every (seed, strategy) pair trained experience by experience, checkpointed."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from avalanche.benchmarks.scenarios.dataset_scenario import DatasetExperience
from avalanche.benchmarks.scenarios.task_aware import with_task_labels
from avalanche.training.plugins.clock import Clock
from torch import nn

from cl_streamkl.data.registry import build_stream, load_splits
from cl_streamkl.data.stream import ExperienceStream, LabeledSplits
from cl_streamkl.experiment.checkpoint import (
    load_checkpoint, rng_state, save_checkpoint, seed_everything, set_rng_state,
)
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.evaluation import accuracy_per_experience
from cl_streamkl.experiment.accuracy_matrix import (
    average_accuracy_per_experience, average_forgetting, backward_transfer, final_average_accuracy,
    learning_accuracy,
)
from cl_streamkl.experiment.model import build_model
from cl_streamkl.experiment.plugin_state import load_plugin_state, plugin_state
from cl_streamkl.experiment.progress import ProgressPlugin
from cl_streamkl.experiment.strategy_plugins import build_plugins
from cl_streamkl.experiment.template import AmpSupervisedTemplate

Log = Callable[[str], None]


@dataclass
class RunResult:
    """Outcome of one strategy on one seed.

    Attributes:
        accuracy_matrix: (T, T) nested list, ``[i][j]`` = accuracy on experience j after
            training experience i, as the scenario measures it: Class-IL accuracy (one
            head, all classes) in ``class``, Task-IL accuracy (experience j's own head)
            in ``task``, accuracy under experience j's input shift in ``domain``.
        task_il_matrix: ``class`` only: (T, T) like ``accuracy_matrix`` but each
            prediction restricted to the evaluated experience's classes (Task-IL
            accuracy of the shared head); empty in other scenarios.
        penalties: attention-distillation penalty (StreamKL or PAD) after every training
            iteration (empty without one).
        wall_time_s: training plus evaluation time, summed across the runs of a resumed experiment.
        peak_memory_mb: CUDA peak allocated memory on GPU; on CPU the process's peak
            resident set size so far (an upper bound shared by earlier runs).
    """

    strategy: str
    seed: int
    class_order: list[int]
    accuracy_matrix: list[list[float]]
    task_il_matrix: list[list[float]] = field(default_factory=list)
    penalties: list[float] = field(default_factory=list)
    wall_time_s: float = 0.0
    peak_memory_mb: float = 0.0

    def metrics(self) -> dict[str, Any]:
        """The derived metrics: average accuracies, forgetting, BWT, learning accuracy."""
        return {
            "average_accuracy": average_accuracy_per_experience(self.accuracy_matrix),
            "final_average_accuracy": final_average_accuracy(self.accuracy_matrix),
            "average_forgetting": average_forgetting(self.accuracy_matrix),
            "backward_transfer": backward_transfer(self.accuracy_matrix),
            "learning_accuracy": learning_accuracy(self.accuracy_matrix),
            "final_task_il_accuracy": (final_average_accuracy(self.task_il_matrix)
                                       if self.task_il_matrix else None),
            "mean_penalty": (sum(self.penalties) / len(self.penalties)) if self.penalties else None,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **self.metrics()}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; ``"cuda"`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    return torch.device(device)


def checkpoint_path(out_dir: Path, strategy: str, seed: int) -> Path:
    return out_dir / "checkpoints" / f"{strategy}-seed{seed}.pt"


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class _Run:
    """One (strategy, seed) run: model, template and plugins, plus its checkpoint file."""

    def __init__(self, config: ExperimentConfig, stream: ExperienceStream, strategy: str,
                 seed: int, device: torch.device, show_progress: bool) -> None:
        self.config, self.stream, self.strategy, self.seed = config, stream, strategy, seed
        self.device = device
        seed_everything(seed)
        self.model = self.new_model()
        optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr,
                                     weight_decay=config.weight_decay)
        self.plugins = build_plugins(strategy, config, stream, seed)
        distiller = self.plugins.get("streamkl", self.plugins.get("pad"))
        self.progress = ProgressPlugin(f"{strategy} seed {seed}", stream.n_experiences,
                                       penalty_source=distiller,
                                       enabled=show_progress)
        self.template = AmpSupervisedTemplate(
            model=self.model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(),
            train_mb_size=config.batch_size, train_epochs=config.epochs,
            eval_mb_size=config.eval_batch_size, device=device, amp=config.amp,
            plugins=[*self.plugins.values(), self.progress],
        )
        self.clock = next(p for p in self.template.plugins if isinstance(p, Clock))

    def new_model(self) -> nn.Module:
        cfg = self.config
        return build_model(
            cfg.model, image_size=cfg.image_size, patch_size=cfg.patch_size,
            in_chans=self.stream.in_chans, num_classes=self.stream.num_classes,
            model_kwargs=cfg.model_kwargs, pretrained_file=cfg.pretrained_file,
            head_sizes=self.stream.head_sizes,
        ).to(self.device)

    def state(self, result: RunResult, experiences_done: int) -> dict[str, Any]:
        scaler = self.template.scaler
        return {
            "strategy": self.strategy, "seed": self.seed,
            "experiences_done": experiences_done,
            "finished": experiences_done == self.stream.n_experiences,
            "model": self.model.state_dict(),
            "optimizer": self.template.optimizer.state_dict(),
            "scaler": None if scaler is None else scaler.state_dict(),
            "plugins": {name: plugin_state(p) for name, p in self.plugins.items()},
            "clock": plugin_state(self.clock),
            "rng": rng_state(),
            "result": asdict(result),
        }

    def restore(self, state: dict[str, Any]) -> tuple[RunResult, int]:
        """Load a checkpoint into this freshly built run; returns (result so far, next experience)."""
        if state["strategy"] != self.strategy or state["seed"] != self.seed:
            raise ValueError(f"checkpoint is for {state['strategy']} seed {state['seed']}, "
                             f"not {self.strategy} seed {self.seed}")
        self.model.load_state_dict(state["model"])
        self.template.optimizer.load_state_dict(state["optimizer"])
        # Avalanche resets the optimizer state on a strategy's first experience unless it
        # already knows which parameters it optimizes, as after an uninterrupted experience.
        self.template.optimized_param_id = dict(self.model.named_parameters())
        if self.template.scaler is not None and state["scaler"] is not None:
            self.template.scaler.load_state_dict(state["scaler"])
        for name, plugin in self.plugins.items():
            load_plugin_state(plugin, state["plugins"][name], self.new_model)
        load_plugin_state(self.clock, state["clock"], self.new_model)
        result = RunResult(**state["result"])
        self.progress.penalties = list(result.penalties)
        # Last: rebuilding teachers above consumed random numbers.
        set_rng_state(state["rng"])
        return result, int(state["experiences_done"])

    def train(self, result: RunResult, first_experience: int, ckpt: Path, eval_sets: list,
              log: Log | None) -> RunResult:
        n = self.stream.n_experiences
        for exp_id in range(first_experience, n):
            start = time.perf_counter()
            # Every strategy starts each experience with fresh Adam moments, so no optimizer
            # statistics of earlier classes carry over (the same for all strategies).
            experience = DatasetExperience(dataset=self.stream.train[exp_id], current_experience=exp_id)
            if self.stream.scenario == "task":
                # Avalanche's forward passes the minibatch's task labels to the model only
                # for experiences that declare theirs.
                experience = with_task_labels(experience)
            self.template.train(experience, eval_streams=[], reset_optimizer_state=True)
            scenario = self.stream.scenario
            row, task_row = accuracy_per_experience(
                self.model, eval_sets, batch_size=self.config.eval_batch_size, device=self.device,
                amp=self.config.amp, task_heads=scenario == "task",
                class_sets=self.stream.experience_classes if scenario == "class" else None)
            result.accuracy_matrix.append(row)
            if task_row:
                result.task_il_matrix.append(task_row)
            result.penalties = list(self.progress.penalties)
            result.wall_time_s += time.perf_counter() - start
            result.peak_memory_mb = max(result.peak_memory_mb, _peak_memory_mb(self.device))
            save_checkpoint(ckpt, self.state(result, exp_id + 1))
            if log is not None:
                seen = sum(row[: exp_id + 1]) / (exp_id + 1)
                log(f"{self.strategy:>16} seed {self.seed}  exp {exp_id + 1}/{n}  "
                    f"avg acc {seen:.3f}  ({result.wall_time_s:.1f} s)")
        return result


def run_experiment(
    config: ExperimentConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    show_progress: bool = True,
    log: Log | None = None,
    splits: LabeledSplits | None = None,
) -> list[RunResult]:
    """Train every strategy on every seed of a continual stream (``config.scenario``).

    After each experience the run's checkpoint ``out_dir/checkpoints/<strategy>-seed<s>.pt``
    is replaced atomically. With ``resume=True`` finished runs are read back from their
    checkpoints and unfinished ones continue after their last complete experience,
    giving the same results as an uninterrupted run.

    Args:
        config: resolved configuration (see :meth:`ExperimentConfig.resolved`).
        out_dir: run folder (checkpoints go in its ``checkpoints/``).
        resume: continue from checkpoints found in ``out_dir``.
        show_progress: show tqdm bars while training.
        log: called with one line per finished experience (the CLI prints them).
        splits: already loaded data (otherwise loaded from ``config``).

    Returns:
        One :class:`RunResult` per (seed, strategy), seeds outermost.
    """
    out_dir = Path(out_dir)
    device = resolve_device(config.device)
    if splits is None:
        splits = load_splits(config.dataset, data_root=config.data_root, image_size=config.image_size,
                             download=config.download, in_chans=config.in_chans,
                             split_seed=config.split_seed)
    results = []
    for seed in config.seeds:
        stream = build_stream(
            splits, n_experiences=config.n_experiences, seed=seed, val_fraction=config.val_fraction,
            split_seed=config.split_seed, scenario=config.scenario,
            first_experience_classes=config.first_experience_classes, image_size=config.image_size,
            domain_shift=config.domain_shift, rotation_step=config.rotation_step,
        )
        eval_sets = stream.eval_datasets(config.eval_split)
        for strategy in config.strategies:
            ckpt = checkpoint_path(out_dir, strategy, seed)
            state = load_checkpoint(ckpt) if resume and ckpt.is_file() else None
            if state is not None and state["finished"]:
                results.append(RunResult(**state["result"]))
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            run = _Run(config, stream, strategy, seed, device, show_progress)
            result, first = RunResult(strategy, seed, list(stream.class_order), []), 0
            if state is not None:
                result, first = run.restore(state)
            results.append(run.train(result, first, ckpt, eval_sets, log))
    return results
