"""A strategy name becomes the list of Avalanche plugins that one training template runs."""

from __future__ import annotations

from avalanche.training.plugins import EWCPlugin, LwFPlugin, ReplayPlugin, SupervisedPlugin

from cl_streamkl.data.stream import ExperienceStream
from cl_streamkl.experiment.config import ExperimentConfig, strategy_components
from cl_streamkl.experiment.replay_buffer import SeededExperienceBuffer


def build_plugins(
    strategy: str, config: ExperimentConfig, stream: ExperienceStream, seed: int
) -> dict[str, SupervisedPlugin]:
    """The plugins that make up ``strategy``, keyed by component name, in calling order.

    naive → none; lwf → ``LwFPlugin``; ewc → ``EWCPlugin`` (separate penalties per
    experience); replay → ``ReplayPlugin`` over a :class:`SeededExperienceBuffer`;
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
        buffer = SeededExperienceBuffer(config.mem_size, stream.train, seed)
        plugins["replay"] = ReplayPlugin(mem_size=config.mem_size, storage_policy=buffer)
    if "wa" in components:
        from cl_streamkl.strategies import WeightAlignPlugin

        plugins["wa"] = WeightAlignPlugin()
    if "lwf" in components:
        plugins["lwf"] = LwFPlugin(alpha=config.lwf_alpha, temperature=config.lwf_temperature)
    if "ewc" in components:
        plugins["ewc"] = EWCPlugin(ewc_lambda=config.ewc_lambda, mode="separate")
    if "streamkl" in components:
        from cl_streamkl.strategies import StreamKLPlugin

        plugins["streamkl"] = StreamKLPlugin(
            alpha=config.alpha, layers=config.layers, temperature=config.temperature,
            backend=config.kl_backend, compile_teacher=config.compile_teacher,
        )
    if "pad" in components:
        from cl_streamkl.strategies import PADPlugin

        plugins["pad"] = PADPlugin(alpha=config.pad_alpha, layers=config.layers)
    return plugins
