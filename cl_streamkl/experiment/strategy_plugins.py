"""A strategy name becomes the list of Avalanche plugins that one training template runs.

Avalanche's LwF, EWC and replay plugins come in the versions below, which also run
data-parallel under :class:`~cl_streamkl.experiment.template.AmpSupervisedTemplate`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from avalanche.training.plugins import EWCPlugin, LwFPlugin, ReplayPlugin, SupervisedPlugin

from cl_streamkl.distributed import unwrap_data_parallel
from cl_streamkl.experiment.config import ExperimentConfig, strategy_components
from cl_streamkl.experiment.data.stream import ExperienceStream
from cl_streamkl.experiment.replay_buffer import SeededClassBuffer, SeededExperienceBuffer
from cl_streamkl.experiment.sharded_loaders import ShardedReplayDataLoader
from cl_streamkl.experiment.template import autocast


class DataParallelLwFPlugin(LwFPlugin, supports_distributed=True):
    """Avalanche's LwF, whose teacher is a copy of the module inside a ``DistributedDataParallel``.

    Avalanche deep-copies the strategy's model, which would copy the wrapper with its
    process group. In the class and domain scenarios the penalty uses the forward's own
    output, so it needs nothing else to run data-parallel.

    The penalty runs under the template's autocast (its ``amp``, "none" for a template
    without one): the previous model's forward and, with task heads, Avalanche's second
    forward of the current model then compute in the forward's precision, as the StreamKL
    plugin's teacher does, where Avalanche's ``before_backward`` would run them in float32.
    """

    def before_backward(self, strategy: Any, **kwargs: Any) -> None:
        with autocast(strategy.device, getattr(strategy, "amp", "none")):
            super().before_backward(strategy, **kwargs)

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        self.lwf.post_adapt(SimpleNamespace(model=unwrap_data_parallel(strategy.model)), strategy.experience)


class DataParallelEWCPlugin(EWCPlugin, supports_distributed=True):
    """Avalanche's EWC, declared data-parallel safe for the class and domain scenarios.

    Its penalty reaches the parameters directly, which the data-parallel forward also uses
    there, so DDP averages it with the loss's gradient. Each rank estimates the
    importances on the whole experience through the wrapped model: the same numbers on
    every rank. Parameter names carry the wrapper's ``module.`` prefix (checkpoints store
    them without it, see :func:`~cl_streamkl.experiment.plugin_state.plugin_state`).
    """


class ShardedReplayPlugin(ReplayPlugin, supports_distributed=True):
    """Avalanche's replay, whose batches (new data and replayed samples) are split over the ranks.

    The same batches as Avalanche's ``ReplayPlugin`` draws in one process; each rank loads
    its share (:class:`~cl_streamkl.experiment.sharded_loaders.ShardedReplayDataLoader`, the
    template's ``batch_shards``).
    """

    def before_training_exp(self, strategy: Any, num_workers: int = 0, shuffle: bool = True,
                            drop_last: bool = False, **kwargs: Any) -> None:
        if len(self.storage_policy.buffer) == 0:
            return  # the first experience: nothing to replay, the template's loader stays
        strategy.dataloader = ShardedReplayDataLoader(
            strategy.adapted_dataset, self.storage_policy.buffer, shards=strategy.batch_shards,
            oversample_small_tasks=True, batch_size=self.batch_size or strategy.train_mb_size,
            batch_size_mem=self.batch_size_mem or strategy.train_mb_size,
            task_balanced_dataloader=self.task_balanced_dataloader, num_workers=num_workers, shuffle=shuffle,
            drop_last=drop_last)


def build_plugins(
    strategy: str, config: ExperimentConfig, stream: ExperienceStream, seed: int
) -> dict[str, SupervisedPlugin]:
    """The plugins that make up ``strategy``, keyed by component name, in calling order.

    naive → none; lwf → :class:`DataParallelLwFPlugin`; ewc → :class:`DataParallelEWCPlugin`
    (separate penalties per experience); replay → :class:`ShardedReplayPlugin` over a
    :class:`SeededClassBuffer` (``domain``: a :class:`SeededExperienceBuffer`);
    wa → :class:`~cl_streamkl.strategies.weight_aligning.WeightAlignPlugin`;
    streamkl → :class:`~cl_streamkl.strategies.StreamKLPlugin`; pad →
    :class:`~cl_streamkl.strategies.PADPlugin`. Combinations such as ``lwf+streamkl``
    add each. Replay comes first so every plugin sees the final data loader; weight
    aligning comes before the plugins that snapshot the model after an experience, so
    their teachers are aligned.

    Args:
        strategy: a strategy name (see :func:`~cl_streamkl.experiment.config.strategy_components`).
        config: resolved configuration (hyper-parameters of every plugin).
        stream: the stream (replay indexes its training datasets).
        seed: run seed (replay draws from its own seeded generator).

    Raises:
        ValueError: unknown strategy.
    """
    components = strategy_components(strategy, config.scenario)
    plugins: dict[str, SupervisedPlugin] = {}
    if "replay" in components:
        # Every experience of the domain scenario holds every class: balance over experiences there.
        buffer = (SeededExperienceBuffer(config.mem_size, stream.train, seed) if config.scenario == "domain" else
                  SeededClassBuffer(config.mem_size, stream.train, seed, per_class=config.mem_per_class))
        plugins["replay"] = ShardedReplayPlugin(mem_size=config.mem_size, storage_policy=buffer,
                                                batch_size_mem=config.mem_batch_size or None)
    if "wa" in components:
        from cl_streamkl.strategies import WeightAlignPlugin

        plugins["wa"] = WeightAlignPlugin()
    if "lwf" in components:
        plugins["lwf"] = DataParallelLwFPlugin(alpha=config.lwf_alpha, temperature=config.lwf_temperature)
    if "ewc" in components:
        plugins["ewc"] = DataParallelEWCPlugin(ewc_lambda=config.ewc_lambda, mode="separate")
    if "streamkl" in components:
        from cl_streamkl.strategies import StreamKLPlugin

        plugins["streamkl"] = StreamKLPlugin(
            alpha=config.alpha, layers=config.layers, temperature=config.temperature,
            backend=config.kl_backend, compile_teacher=config.compile_teacher,
        )
    if "pad" in components:
        from cl_streamkl.strategies import PADPlugin

        plugins["pad"] = PADPlugin(alpha=config.pad_alpha, layers=config.layers, variant=config.pad_variant)
    return plugins
