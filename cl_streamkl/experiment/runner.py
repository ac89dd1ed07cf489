"""The run loop: every (seed, strategy) pair trained experience by experience, checkpointed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from avalanche.benchmarks.scenarios.dataset_scenario import DatasetExperience
from avalanche.benchmarks.scenarios.generic_scenario import EagerCLStream
from avalanche.benchmarks.scenarios.task_aware import with_task_labels
from avalanche.benchmarks.utils.utils import concat_datasets
from avalanche.training.plugins.clock import Clock
from torch import nn

from cl_streamkl.distributed.data_parallel import DataParallel, resolve_device
from cl_streamkl.experiment.checkpoint import (
    RunIdentity,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)
from cl_streamkl.experiment.config import JOINT, ExperimentConfig
from cl_streamkl.experiment.data.stream import ExperienceStream, LabeledSplits
from cl_streamkl.experiment.evaluation import accuracy_per_experience
from cl_streamkl.experiment.loggers import build_evaluator, build_loggers, close_loggers
from cl_streamkl.experiment.memory import PeakMemory
from cl_streamkl.experiment.lr_schedule import LRSchedulePlugin
from cl_streamkl.experiment.plugin_state import load_plugin_state, plugin_state
from cl_streamkl.experiment.preflight import build_run_model, build_run_stream, check_experiment
from cl_streamkl.experiment.progress import ProgressPlugin
from cl_streamkl.experiment.run_result import RunResult
from cl_streamkl.experiment.strategy_plugins import build_plugins
from cl_streamkl.experiment.template import AmpSupervisedTemplate

__all__ = ["RunResult", "checkpoint_path", "chance_accuracy", "resolve_device", "run_experiment"]

Log = Callable[[str], None]
AfterExperience = Callable[[int, int], None]
"""Called after each trained experience's checkpoint with (experiences trained so far, of how many)."""
# An experience counts as learned once its accuracy right after training reaches this
# multiple of chance; below it the table's forgetting and transfer mean little.
LEARNED_OVER_CHANCE = 1.5


def checkpoint_path(out_dir: Path, strategy: str, seed: int) -> Path:
    return out_dir / "checkpoints" / f"{strategy}-seed{seed}.pt"


def chance_accuracy(stream: ExperienceStream, experience: int) -> float:
    """Accuracy of guessing among ``experience``'s own classes: what a model that learned nothing of it reaches.

    One over the experience's classes: in ``task`` its head's; in ``class`` too, since a
    shared head that always predicts one of the new classes, as training on them alone
    teaches it, scores that much right after training; in ``domain`` every class.
    """
    return 1.0 / len(stream.experience_classes[experience])


def _experiences(datasets: Sequence[Any], stream_name: str, task_labels: bool) -> list[DatasetExperience]:
    """Experiences of a named stream (Avalanche's metrics name their values after it)."""
    experiences = [DatasetExperience(dataset=dataset, current_experience=i) for i, dataset in enumerate(datasets)]
    if task_labels:
        # Avalanche's forward passes the minibatch's task labels to the model only for
        # experiences that declare theirs.
        experiences = [with_task_labels(experience) for experience in experiences]
    return list(EagerCLStream(stream_name, experiences))


class _Run:
    """One (strategy, seed) run: model, template and plugins, plus its checkpoint file.

    Data parallel: every rank builds the same run (same seed, same model); the template
    trains the model wrapped in DistributedDataParallel, while evaluation, checkpoints and
    snapshots use the module itself. Rank 0 alone writes the checkpoint.
    """

    def __init__(self, config: ExperimentConfig, stream: ExperienceStream, strategy: str, seed: int,
                 data_parallel: DataParallel, show_progress: bool, loggers: Sequence[Any] = ()) -> None:
        self.config, self.stream, self.strategy, self.seed = config, stream, strategy, seed
        self.data_parallel = data_parallel
        self.device = data_parallel.device
        self.identity = RunIdentity(strategy, seed, config.fingerprint_json())
        self.joint = strategy == JOINT
        task_labels = stream.scenario == "task"
        # joint: one training run on the union of every experience's data.
        train = [concat_datasets(list(stream.train))] if self.joint else stream.train
        self.train_experiences = _experiences(train, "train", task_labels)
        self.eval_experiences = _experiences(stream.eval_datasets(config.eval_split), config.eval_split, task_labels)
        seed_everything(seed)
        self.model = self.new_model()
        # The task scenario's model has a head per task, and a batch uses only its own.
        train_model = data_parallel.wrap(self.model, find_unused_parameters=task_labels)
        # What the strategy's model puts before parameter names (EWC's state leaves it out).
        self.parameter_prefix = "module." if train_model is not self.model else ""
        optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.plugins = build_plugins(strategy, config, stream, seed)
        distiller = self.plugins.get("streamkl", self.plugins.get("pad"))
        self.progress = ProgressPlugin(f"{strategy} seed {seed}", len(self.train_experiences),
                                       penalty_source=distiller, enabled=show_progress, data_parallel=data_parallel)
        self.loggers = list(loggers)
        # Stateless (it reads the iteration of the experience), so it is not checkpointed.
        schedule = ([LRSchedulePlugin(config.lr_schedule, config.lr, config.warmup_epochs)]
                    if config.lr_schedule != "constant" or config.warmup_epochs else [])
        evaluator = {"evaluator": build_evaluator(self.loggers, penalty="streamkl" in self.plugins)} if self.loggers else {}
        self.template = AmpSupervisedTemplate(
            model=train_model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(),
            train_mb_size=config.batch_size, train_epochs=config.epochs,
            eval_mb_size=config.eval_batch_size, device=self.device, amp=config.amp, data_parallel=data_parallel,
            plugins=[*self.plugins.values(), *schedule, self.progress], **evaluator,
        )
        self.clock = next(p for p in self.template.plugins if isinstance(p, Clock))

    def new_model(self) -> nn.Module:
        return build_run_model(self.config, self.stream, self.device)

    def state(self, result: RunResult, steps_done: int, rank_rng: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The checkpoint's content; ``rank_rng``: every rank's random-number state (data parallel)."""
        scaler = self.template.scaler
        return {
            "experiences_done": steps_done,
            "finished": steps_done == len(self.train_experiences),
            "model": self.model.state_dict(),
            # Without Adam's moments: every experience starts with fresh ones (train() below) and
            # a checkpoint is written only between experiences, so they would never be read.
            "optimizer": {"state": {}, "param_groups": self.template.optimizer.state_dict()["param_groups"]},
            "scaler": None if scaler is None else scaler.state_dict(),
            "plugins": {name: plugin_state(p, self.parameter_prefix) for name, p in self.plugins.items()},
            "clock": plugin_state(self.clock),
            "rng": rng_state() if rank_rng is None else rank_rng[0],
            "rank_rng": rank_rng,
            "result": asdict(result),
        }

    def restore(self, state: dict[str, Any]) -> tuple[RunResult, int]:
        """Load a verified checkpoint into this freshly built run; returns (result so far, next step)."""
        self.model.load_state_dict(state["model"])
        self.template.optimizer.load_state_dict(state["optimizer"])
        # Avalanche resets the optimizer state on a strategy's first experience unless it
        # already knows which parameters it optimizes, as after an uninterrupted experience.
        self.template.optimized_param_id = dict(self.template.model.named_parameters())
        if self.template.scaler is not None and state["scaler"] is not None:
            self.template.scaler.load_state_dict(state["scaler"])
        for name, plugin in self.plugins.items():
            load_plugin_state(plugin, state["plugins"][name], self.new_model, self.parameter_prefix, self.device)
        load_plugin_state(self.clock, state["clock"], self.new_model)
        result = RunResult(**state["result"])
        self.progress.penalties = list(result.penalties)
        # Last: rebuilding teachers above consumed random numbers. Each rank continues its
        # own random numbers; with another number of processes, all take rank 0's.
        rank_rng = state.get("rank_rng")
        same_world = rank_rng is not None and len(rank_rng) == self.data_parallel.world_size
        set_rng_state(rank_rng[self.data_parallel.rank] if same_world else state["rng"])
        return result, int(state["experiences_done"])

    def adopt_first_experience(self, state: dict[str, Any], result: RunResult, ckpt: Path) -> RunResult:
        """Start from a first experience trained once for every strategy of a seed (``state``:
        its verified checkpoint), then run this strategy's end-of-experience work on that model.

        The shared model and random numbers are loaded, and the template goes through the first
        experience with no epoch: the plugins' callbacks run as after training (LwF and StreamKL
        keep the model as their teacher, EWC computes its importances, replay fills its buffer),
        on the same weights in every strategy. The first row of the accuracy matrix is the shared
        run's. The checkpoint written after it makes the run resumable from here.
        """
        self.model.load_state_dict(state["model"])
        set_rng_state(state["rng"])
        epochs = self.template.train_epochs
        self.template.train_epochs = 0
        try:
            self.template.train(self.train_experiences[0], eval_streams=[], reset_optimizer_state=True)
        finally:
            self.template.train_epochs = epochs
        shared = RunResult(**state["result"])
        result.accuracy_matrix = shared.accuracy_matrix[:1]
        result.task_il_matrix = shared.task_il_matrix[:1]
        result.wall_time_s, result.peak_memory_mb = shared.wall_time_s, shared.peak_memory_mb
        if self.data_parallel.is_main:
            save_checkpoint(ckpt, self.state(result, 1, None), self.identity)
        return result

    def _report_to_loggers(self) -> None:
        """Avalanche's evaluation of every experience, for the loggers; the run's random numbers are untouched."""
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self.template.eval(self.eval_experiences)

    def _warn_unlearned(self, row: list[float], experiences: Sequence[int], warn: Log | None) -> None:
        for j in experiences:
            chance = chance_accuracy(self.stream, j)
            if warn is not None and row[j] < LEARNED_OVER_CHANCE * chance:
                warn(f"{self.strategy} seed {self.seed} did not learn experience {j + 1}: {100 * row[j]:.1f} % "
                     f"accuracy right after training it, chance is {100 * chance:.1f} %; forgetting means little "
                     f"here (train longer with --epochs, or change --lr)")

    def train(self, result: RunResult, first_step: int, ckpt: Path, eval_sets: list, log: Log | None,
              warn: Log | None, after_experience: AfterExperience | None = None) -> RunResult:
        n = self.stream.n_experiences
        steps = len(self.train_experiences)
        scenario = self.stream.scenario
        data_parallel = self.data_parallel
        for step in range(first_step, steps):
            with PeakMemory(self.device) as memory:
                start = time.perf_counter()
                # Every strategy starts each experience with fresh Adam moments, so no optimizer
                # statistics of earlier classes carry over (the same for all strategies).
                self.template.train(self.train_experiences[step], eval_streams=[], reset_optimizer_state=True)
                row, task_row = accuracy_per_experience(
                    self.model, eval_sets, batch_size=self.config.eval_batch_size, device=self.device,
                    amp=self.config.amp, task_heads=scenario == "task",
                    class_sets=self.stream.experience_classes if scenario == "class" else None,
                    data_parallel=data_parallel)
                result.wall_time_s += time.perf_counter() - start
            result.peak_memory_mb = max(result.peak_memory_mb, data_parallel.all_max(memory.peak_mb))
            trained = range(n) if self.joint else [step]
            result.accuracy_matrix += [row] * len(trained)
            if task_row:
                result.task_il_matrix += [task_row] * len(trained)
            result.penalties = list(self.progress.penalties)
            if self.loggers:
                self._report_to_loggers()
            rank_rng = data_parallel.gather(rng_state()) if data_parallel.distributed else None
            if data_parallel.is_main:
                save_checkpoint(ckpt, self.state(result, step + 1, rank_rng), self.identity)
            if log is not None:
                done = len(result.accuracy_matrix)
                seen = sum(row[:done]) / done
                label = f"all {n} exps" if self.joint else f"exp {step + 1}/{n}"
                log(f"{self.strategy:>16} seed {self.seed}  {label}  avg acc {seen:.3f}  ({result.wall_time_s:.1f} s)")
            self._warn_unlearned(row, trained, warn)
            if after_experience is not None:
                after_experience(step + 1, steps)
        return result


def _finished_results(config: ExperimentConfig, out_dir: Path) -> dict[tuple[str, int], RunResult | None]:
    """Every checkpoint of ``out_dir`` verified before anything trains: (strategy, seed) → result if finished.

    Raises:
        CheckpointError: a checkpoint is unreadable, damaged, or of another run.
    """
    found: dict[tuple[str, int], RunResult | None] = {}
    fingerprint = config.fingerprint_json()
    for seed in config.seeds:
        for strategy in config.strategies:
            ckpt = checkpoint_path(out_dir, strategy, seed)
            if ckpt.exists():
                state = load_checkpoint(ckpt, RunIdentity(strategy, seed, fingerprint))
                found[(strategy, seed)] = RunResult(**state["result"]) if state["finished"] else None
    return found


def run_experiment(
    config: ExperimentConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    show_progress: bool = True,
    log: Log | None = None,
    warn: Log | None = None,
    splits: LabeledSplits | None = None,
    loggers: Sequence[str] = (),
    data_parallel: DataParallel | None = None,
    after_experience: AfterExperience | None = None,
    first_experience: dict[str, Any] | None = None,
) -> list[RunResult]:
    """Train every strategy on every seed of a continual stream (``config.scenario``).

    After each experience the run's checkpoint ``out_dir/checkpoints/<strategy>-seed<s>.pt``
    is replaced atomically. With ``resume=True`` every checkpoint is verified first
    (checksum, strategy, seed, configuration); then finished runs are read back and
    unfinished ones continue after their last complete experience, giving the same
    results as an uninterrupted run.

    Data parallel: every rank of the run calls this with the same arguments; each trains
    on its share of every batch (see
    :class:`~cl_streamkl.experiment.template.AmpSupervisedTemplate`), and the results are
    those of the whole batches, the same on every rank. Rank 0 alone writes checkpoints;
    every rank reads them to resume. Pass ``show_progress``, ``log`` and ``warn`` on
    rank 0 only.

    Args:
        config: resolved configuration (see :meth:`ExperimentConfig.resolved`).
        out_dir: run folder (checkpoints go in its ``checkpoints/``).
        resume: continue from checkpoints found in ``out_dir``.
        show_progress: show tqdm bars while training.
        log: called with one line per finished experience (the CLI prints them).
        warn: called with one line for each experience not learned (accuracy right
            after training it below 1.5 × its own chance, :func:`chance_accuracy`).
        splits: data checked and loaded by
            :func:`~cl_streamkl.experiment.preflight.check_experiment` (run here when None).
        loggers: Avalanche loggers to feed (see :mod:`cl_streamkl.experiment.loggers`).
        data_parallel: this process's place in a data-parallel run (from
            :func:`~cl_streamkl.distributed.data_parallel.start_data_parallel`); default:
            a single process on ``config.device``.
        after_experience: called after each trained experience's checkpoint is written, with
            (experiences of this run trained so far, experiences it trains); an exception it
            raises ends the run there, resumable from that checkpoint.
        first_experience: the verified checkpoint of a first experience trained once, from
            which a run with no checkpoint of its own starts (see
            :meth:`_Run.adopt_first_experience`); one seed and one process only.

    Returns:
        One :class:`RunResult` per (seed, strategy), seeds outermost.

    Raises:
        ValueError: a check of :func:`~cl_streamkl.experiment.preflight.check_experiment` failed.
        CheckpointError: a checkpoint to resume from is unusable.
        OutputWriteError: a checkpoint cannot be written (the previous one is kept).
    """
    out_dir = Path(out_dir)
    if first_experience is not None and (len(config.seeds) != 1 or data_parallel is not None
                                         or JOINT in config.strategies):
        raise ValueError("a shared first experience starts runs of one seed in one process, not joint training")
    if data_parallel is None:
        data_parallel = DataParallel(device=resolve_device(config.device))
    if splits is None:
        splits = check_experiment(config, loggers, data_parallel)
    finished = _finished_results(config, out_dir) if resume else {}
    results = []
    for seed in config.seeds:
        stream = build_run_stream(config, splits, seed)
        eval_sets = stream.eval_datasets(config.eval_split)
        for strategy in config.strategies:
            if finished.get((strategy, seed)) is not None:
                results.append(finished[(strategy, seed)])
                continue
            ckpt = checkpoint_path(out_dir, strategy, seed)
            run_loggers = build_loggers(loggers, out_dir, strategy, seed, config, resume=(strategy, seed) in finished)
            try:
                run = _Run(config, stream, strategy, seed, data_parallel, show_progress, run_loggers)
                result = RunResult(strategy, seed, list(stream.class_order), [],
                                   eval_sizes=[len(dataset) for dataset in eval_sets])
                first = 0
                if (strategy, seed) in finished:
                    result, first = run.restore(load_checkpoint(ckpt, run.identity))
                elif first_experience is not None:
                    result, first = run.adopt_first_experience(first_experience, result, ckpt), 1
                results.append(run.train(result, first, ckpt, eval_sets, log, warn, after_experience))
            finally:
                close_loggers(run_loggers)
    return results
