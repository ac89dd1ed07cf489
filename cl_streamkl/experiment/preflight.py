"""Every check of an experiment that needs no training, run before anything is written or trained.

A configuration that cannot run should fail in seconds with one clear message, not after
an hour of training, and not after its output folder was claimed (a folder holding a
``config.json`` refuses a new run). :func:`check_experiment` therefore loads the data,
builds the stream and a model, and runs one forward of two images through every
attention distillation the strategies use, with the configured backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from cl_streamkl.capture.compiled_model import compile_model
from cl_streamkl.capture.layers import LayerSpec, check_layer_spec, find_attention_modules, resolve_layer_indices
from cl_streamkl.distributed.data_parallel import DataParallel, resolve_device
from cl_streamkl.experiment.compiled_layers import compile_layers
from cl_streamkl.experiment.config import ExperimentConfig, strategy_components
from cl_streamkl.experiment.data.names import check_class_split
from cl_streamkl.experiment.data.registry import build_stream, load_splits
from cl_streamkl.experiment.data.stream import ExperienceStream, LabeledSplits
from cl_streamkl.experiment.model import build_model
from cl_streamkl.experiment.option_aliases import field_label
from cl_streamkl.experiment.template import autocast


def build_run_stream(config: ExperimentConfig, splits: LabeledSplits, seed: int) -> ExperienceStream:
    """The stream one seed trains on (class order and domain order depend on the seed)."""
    # The configuration checked the split against the dataset's classes where it knows them;
    # an image folder's are counted here, and refused in the settings' words too.
    check_class_split(config.dataset, config.scenario, config.experiences, config.first_experience_classes,
                      splits.num_classes)
    return build_stream(
        splits, n_experiences=config.experiences, seed=seed, val_fraction=config.val_fraction,
        split_seed=config.split_seed, scenario=config.scenario,
        first_experience_classes=config.first_experience_classes, image_size=config.image_size,
        domain_shift=config.domain_shift, rotation_step=config.rotation_step,
    )


def build_run_model(config: ExperimentConfig, stream: ExperienceStream, device: torch.device) -> nn.Module:
    """A freshly initialised model for ``stream`` (one head per experience in ``task``)."""
    model = build_model(
        config.model, image_size=config.image_size, patch_size=config.patch_size, in_chans=stream.in_chans,
        num_classes=stream.num_classes, model_kwargs=config.model_kwargs, pretrained_file=config.pretrained_file,
        head_sizes=stream.head_sizes, stem=config.stem,
    ).to(device)
    if config.compile_layers:
        compile_layers(model)
    if config.compile_model:
        compile_model(model)
    return model


def _forward(model: nn.Module, images: torch.Tensor, scenario: str) -> torch.Tensor:
    return model(images, 0) if scenario == "task" else model(images)


def _check_layers(layers: LayerSpec, model: nn.Module) -> None:
    """The distilled blocks against ``model``'s, named as the run's user gives them (option or key).

    The plugin names its argument ``layers=``; a model without capturable attention is left to
    the distillation's own check, which names the strategy.
    """
    try:
        num_blocks = len(find_attention_modules(model))
    except TypeError:
        num_blocks = None
    try:
        if num_blocks is None:
            check_layer_spec(layers)
        else:
            resolve_layer_indices(layers, num_blocks)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{field_label('layers')}: {err}") from err


def _check_distillation(strategy: str, name: str, plugin: object, model: nn.Module, images: torch.Tensor,
                        config: ExperimentConfig, device: torch.device) -> None:
    """Capture the model's Q/K as the plugin will and compute its penalty once (student as teacher)."""
    distiller = plugin.distiller
    try:
        plugin.check_model(model)
        with torch.no_grad(), autocast(device, config.amp):
            with distiller.student_capture(model) as capture:
                _forward(model, images, config.scenario)
            problems = [(q, k, q, k, scale, scale) for (q, k), scale in zip(capture.qk, capture.scales)]
            distiller.layer_penalties(problems)
    except (ImportError, RuntimeError, TypeError, ValueError) as err:
        raise ValueError(f"strategy {strategy!r}: {name} cannot distil {config.model}: {err}") from err


# Components whose penalty reaches parameters the data-parallel forward did not use: in the
# task scenario LwF runs the model a second time for every head, and EWC pulls every head
# toward its anchor, while the forward uses only the batch's own head. DDP reduces each
# gradient once per step and cannot take those.
TASK_SCENARIO_SINGLE_PROCESS = ("lwf", "ewc")


def check_data_parallel(config: ExperimentConfig, loggers: Sequence[str], world_size: int) -> None:
    """Refuse what a run of ``world_size`` processes cannot do (nothing for one process).

    Raises:
        ValueError: ``--log`` (Avalanche's metrics would count one rank's samples), LwF or
            EWC in the task scenario, or a global batch smaller than the number of ranks.
    """
    if world_size == 1:
        return
    if loggers:
        raise ValueError(f"--log {' '.join(loggers)} needs a single process: Avalanche's metrics count one rank's "
                         f"samples only; drop --log, or run without torchrun")
    if config.scenario == "task":
        for strategy in config.strategies:
            refused = sorted(strategy_components(strategy, config.scenario) & set(TASK_SCENARIO_SINGLE_PROCESS))
            if refused:
                raise ValueError(
                    f"strategy {strategy!r} cannot run data-parallel in the task scenario: {refused[0]}'s penalty "
                    "reaches task heads the batch does not use, which DistributedDataParallel cannot reduce; "
                    "run it in a single process")
    if config.batch_size < world_size:
        raise ValueError(f"--batch-size {config.batch_size} is the global batch, split over {world_size} processes: "
                         f"it must be at least {world_size}")


def check_experiment(config: ExperimentConfig, loggers: Sequence[str] = (),
                     data_parallel: DataParallel | None = None) -> LabeledSplits:
    """Run every check that needs no training; return the loaded data for the run.

    In order: what a data-parallel run cannot do (:func:`check_data_parallel`), the
    loggers are available, the device exists, the data loads, the stream splits
    (experiences the classes divide into, the first experience's classes, enough samples
    per domain), the model builds, a forward under the configured precision runs, and for
    each attention distillation (``streamkl``, ``pad``) the selected layers exist, their
    attention scores can be read, and the penalty computes with the configured backend,
    temperature and scale.

    Args:
        config: resolved configuration.
        loggers: names given to ``--log``.
        data_parallel: this process's place in a data-parallel run (its device is used);
            default: a single process on ``config.device``.

    Returns:
        The dataset's splits (pass them to :func:`~cl_streamkl.experiment.runner.run_experiment`).

    Raises:
        ValueError: the first check that fails, in one line.
    """
    from cl_streamkl.experiment.loggers import check_loggers
    from cl_streamkl.experiment.strategy_plugins import build_plugins
    from cl_streamkl.strategies.plugin import AttentionDistillationPlugin

    check_data_parallel(config, loggers, 1 if data_parallel is None else data_parallel.world_size)
    check_loggers(loggers)
    device = resolve_device(config.device) if data_parallel is None else data_parallel.device
    splits = load_splits(config.dataset, data_root=config.data_root, image_size=config.image_size,
                         download=config.download, in_chans=config.in_chans, split_seed=config.split_seed,
                         clutter=config.clutter_options())
    stream = build_run_stream(config, splits, config.seeds[0])
    model = build_run_model(config, stream, device)
    model.eval()
    train = stream.train[0]
    images = torch.stack([train[i][0] for i in range(min(2, len(train)))]).to(device)
    try:
        with torch.no_grad(), autocast(device, config.amp):
            _forward(model, images, config.scenario)
    except RuntimeError as err:
        raise ValueError(f"{config.model} cannot run on {device} with --amp {config.amp}: {err}") from err
    if any(strategy_components(s, config.scenario) & {"streamkl", "pad"} for s in config.strategies):
        _check_layers(config.layers, model)
    for strategy in config.strategies:
        for name, plugin in build_plugins(strategy, config, stream, config.seeds[0]).items():
            if isinstance(plugin, AttentionDistillationPlugin):
                _check_distillation(strategy, name, plugin, model, images, config, device)
    return splits
