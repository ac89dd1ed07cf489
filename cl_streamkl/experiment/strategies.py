"""Strategy factory: a strategy name becomes a list of Avalanche plugins on one template."""

from __future__ import annotations

from typing import Any

from avalanche.training.plugins import EWCPlugin, LwFPlugin, ReplayPlugin, SupervisedPlugin

from cl_streamkl.data.stream import ClassIncrementalStream
from cl_streamkl.experiment.config import ExperimentConfig, strategy_components
from cl_streamkl.experiment.replay_buffer import SeededExperienceBuffer


def build_plugins(
    strategy: str, config: ExperimentConfig, stream: ClassIncrementalStream, seed: int
) -> dict[str, SupervisedPlugin]:
    """The plugins that make up ``strategy``, keyed by component name.

    naive → none; lwf → ``LwFPlugin``; ewc → ``EWCPlugin`` (separate penalties per
    experience); replay → ``ReplayPlugin`` over a :class:`SeededExperienceBuffer`;
    streamkl → ``cl_streamkl.strategies.StreamKLPlugin``. Combinations such as
    ``lwf+streamkl`` add both. Replay comes before the others so every plugin sees
    the final data loader.

    Args:
        strategy: one of :data:`~cl_streamkl.experiment.config.STRATEGIES`.
        config: resolved configuration (hyper-parameters of every plugin).
        stream: the stream (replay indexes its training datasets).
        seed: run seed (replay draws from its own seeded generator).

    Raises:
        ValueError: unknown strategy.
    """
    components = strategy_components(strategy)
    plugins: dict[str, SupervisedPlugin] = {}
    if "replay" in components:
        buffer = SeededExperienceBuffer(config.mem_size, stream.train, seed)
        plugins["replay"] = ReplayPlugin(mem_size=config.mem_size, storage_policy=buffer)
    if "lwf" in components:
        plugins["lwf"] = LwFPlugin(alpha=config.lwf_alpha, temperature=config.lwf_temperature)
    if "ewc" in components:
        plugins["ewc"] = EWCPlugin(ewc_lambda=config.ewc_lambda, mode="separate")
    if "streamkl" in components:
        plugins["streamkl"] = _streamkl_plugin(config)
    return plugins


def _streamkl_plugin(config: ExperimentConfig) -> Any:
    from cl_streamkl.strategies import StreamKLPlugin

    return StreamKLPlugin(
        alpha=config.alpha, layers=config.layers, temperature=config.temperature,
        backend=config.kl_backend, compile_teacher=config.compile_teacher,
    )
