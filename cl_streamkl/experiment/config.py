"""The fully resolved configuration of one experiment (what results.json records).

Importing this module is cheap (no torch, timm or Avalanche): the command line builds its
help from it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from cl_streamkl.experiment.data.names import DATASETS, DOMAIN_SHIFTS, EVAL_SPLITS, SCENARIOS

# What a strategy name combines with "+": "naive" or "joint" alone, or any of these (e.g. "lwf+streamkl").
STRATEGY_COMPONENTS = ("lwf", "ewc", "replay", "wa", "streamkl", "pad")
# Trains once on every experience's data together: the upper bound the others are read against.
JOINT = "joint"
ATTENTION_DISTILLATIONS = ("streamkl", "pad")
DEFAULT_STRATEGIES = ("naive", "lwf", "streamkl", "lwf+streamkl")
AMP_MODES = ("none", "bf16", "fp16")
# PAD's variants (cl_streamkl.strategies.pooled_attention.PAD_VARIANTS, named here without importing torch).
PAD_VARIANTS = ("symmetric", "asymmetric")
# Avalanche loggers --log can add (see cl_streamkl.experiment.loggers).
LOGGERS = ("tensorboard", "csv", "wandb")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MODEL = "vit_tiny_patch16_224"
# A 4-block, 64-wide ViT; with 32 px images and 8 px patches (16 tokens, each 2×2 digit pixels)
# it learns each Split-Digits experience in a few seconds on two CPU cores.
DEFAULT_MODEL_KWARGS: dict[str, Any] = {"depth": 4, "embed_dim": 64, "num_heads": 2}
# cluttered-mnist: the default canvas's side (ClutterOptions), every pixel kept.
DEFAULT_IMAGE_SIZE = {"digits": 32, "mnist5k": 32, "cifar10": 32, "cifar100": 32, "tiny-imagenet": 64,
                      "imagefolder": 64, "cluttered-mnist": 128}
# Fields that do not change what one (strategy, seed) run computes: where files live, and
# which other runs the experiment holds. A checkpoint's fingerprint leaves them out.
FINGERPRINT_EXCLUDED = ("out", "data_root", "download", "strategies", "seeds")

Layers = str | int | list[int]


@dataclass
class ExperimentConfig:
    """Every knob of a run; ``resolved()`` fills the dataset- and model-dependent defaults.

    Attributes are grouped as data, model, training, strategies, and run control. See
    ``cl-streamkl run --help`` for the meaning of each; names match the flags.
    """

    dataset: str = "digits"
    scenario: str = "class"
    data_root: str | None = None
    download: bool = False
    n_experiences: int | None = None
    val_fraction: float = 0.1
    split_seed: int = 0
    eval_split: str = "test"
    image_size: int | None = None
    in_chans: int | None = None
    first_experience_classes: int | None = None
    domain_shift: str = "rotate"
    rotation_step: float = 30.0

    model: str = DEFAULT_MODEL
    model_kwargs: dict[str, Any] | None = None
    patch_size: int = 8
    pretrained_file: str | None = None

    epochs: int = 10
    batch_size: int = 16
    eval_batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0

    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    seeds: list[int] = field(default_factory=lambda: [0])
    # StreamKL defaults chosen on Split-Digits' validation split (see README, Results).
    alpha: float = 10.0
    layers: Layers = "all"
    temperature: float = 0.5
    kl_backend: str = "auto"
    compile_teacher: bool = False
    pad_alpha: float = 1.0
    pad_variant: str = "symmetric"
    lwf_alpha: float = 1.0
    lwf_temperature: float = 2.0
    ewc_lambda: float = 100.0
    mem_size: int = 100
    mem_per_class: int = 0
    mem_batch_size: int = 0

    device: str = "auto"
    amp: str = "none"
    out: str | None = None

    def resolved(self) -> ExperimentConfig:
        """A validated copy with defaults filled in (image size, model kwargs).

        Raises:
            ValueError: any field is out of range or names something unknown.
        """
        from cl_streamkl.experiment.model import check_model_kwargs, check_model_name

        cfg = dataclasses.replace(self, strategies=list(self.strategies), seeds=list(self.seeds))
        if cfg.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {cfg.dataset!r}; choose from {', '.join(DATASETS)}")
        check_model_name(cfg.model)
        if cfg.image_size is None:
            cfg.image_size = DEFAULT_IMAGE_SIZE[cfg.dataset]
        if cfg.model_kwargs is None:
            cfg.model_kwargs = dict(DEFAULT_MODEL_KWARGS) if cfg.model == DEFAULT_MODEL else {}
        cfg.model_kwargs = dict(cfg.model_kwargs)
        check_model_kwargs(cfg.model_kwargs)
        _check_positive(cfg, "image_size", "patch_size", "epochs", "batch_size", "eval_batch_size")
        if cfg.image_size % cfg.patch_size:
            raise ValueError(
                f"image size {cfg.image_size} is not divisible by patch size {cfg.patch_size}"
            )
        if cfg.scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {SCENARIOS}; got {cfg.scenario!r}")
        if cfg.domain_shift not in DOMAIN_SHIFTS:
            raise ValueError(f"domain_shift must be one of {DOMAIN_SHIFTS}; got {cfg.domain_shift!r}")
        if cfg.first_experience_classes is not None:
            _check_positive(cfg, "first_experience_classes")
            if cfg.scenario == "domain":
                raise ValueError("first_experience_classes needs scenario 'class' or 'task': "
                                 "in 'domain' every experience holds every class")
        if not cfg.strategies:
            raise ValueError("strategies must name at least one strategy")
        components = [strategy_components(name, cfg.scenario) for name in cfg.strategies]
        if len(set(components)) != len(components):
            raise ValueError(f"strategies repeat a combination: {cfg.strategies}")
        if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
            raise ValueError(f"seeds must be distinct integers; got {cfg.seeds}")
        if cfg.eval_split not in EVAL_SPLITS:
            raise ValueError(f"eval_split must be one of {EVAL_SPLITS}; got {cfg.eval_split!r}")
        if cfg.eval_split == "val" and cfg.val_fraction <= 0:
            raise ValueError("eval_split 'val' needs val_fraction > 0")
        if cfg.amp not in AMP_MODES:
            raise ValueError(f"amp must be one of {AMP_MODES}; got {cfg.amp!r}")
        if cfg.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}; got {cfg.device!r}")
        if cfg.lr <= 0 or cfg.temperature <= 0 or cfg.lwf_temperature <= 0:
            raise ValueError("lr, temperature and lwf_temperature must be > 0")
        if min(cfg.alpha, cfg.lwf_alpha, cfg.ewc_lambda, cfg.mem_size, cfg.mem_per_class, cfg.mem_batch_size,
               cfg.pad_alpha) < 0:
            raise ValueError("alpha, lwf_alpha, ewc_lambda, mem_size, mem_per_class, mem_batch_size and pad_alpha "
                             "must be >= 0")
        if cfg.pad_variant not in PAD_VARIANTS:
            raise ValueError(f"pad_variant must be one of {PAD_VARIANTS}; got {cfg.pad_variant!r}")
        if not isinstance(cfg.compile_teacher, bool):
            raise ValueError(f"compile_teacher must be true or false; got {cfg.compile_teacher!r}")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of all fields."""
        return dataclasses.asdict(self)

    def fingerprint_json(self) -> str:
        """Canonical JSON of every field that shapes a single (strategy, seed) run.

        Leaves out :data:`FINGERPRINT_EXCLUDED` (file locations, the lists of strategies
        and seeds). A checkpoint stores it, and a resumed run continues from a checkpoint
        only when the configuration gives the same text.
        """
        fields = {k: v for k, v in self.to_dict().items() if k not in FINGERPRINT_EXCLUDED}
        return json.dumps(fields, sort_keys=True, default=repr)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExperimentConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error (a results file from elsewhere)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"configuration has unknown keys {unknown}")
        return cls(**data)


def _check_positive(cfg: ExperimentConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")


def strategy_components(name: str, scenario: str = "class") -> frozenset[str]:
    """The components a strategy name combines: ``"lwf+streamkl"`` → ``{"lwf", "streamkl"}``.

    ``"naive"`` (alone) has none; ``"joint"`` (alone) is ``{"joint"}``. Order does not
    matter (``"streamkl+lwf"`` is the same strategy).

    Raises:
        ValueError: an unknown or repeated component, ``naive`` or ``joint`` combined
            with others, both attention distillations at once, or weight aligning
            (``wa``, a correction of one shared head over all classes) outside scenario
            ``class``.
    """
    parts = name.split("+")
    if name == "naive":
        return frozenset()
    if name == JOINT:
        return frozenset({JOINT})
    if JOINT in parts:
        raise ValueError(f"strategy {name!r}: joint trains once on every experience's data together, the upper "
                         "bound of the others; it does not combine with other components")
    unknown = [part for part in parts if part not in STRATEGY_COMPONENTS]
    if unknown:
        raise ValueError(f"unknown strategy component {unknown[0]!r} in {name!r}; use 'naive', 'joint' or combine "
                         f"{', '.join(STRATEGY_COMPONENTS)} with '+'")
    if len(set(parts)) != len(parts):
        raise ValueError(f"strategy {name!r} repeats a component")
    if set(ATTENTION_DISTILLATIONS) <= set(parts):
        raise ValueError(f"strategy {name!r} combines both attention distillations; choose streamkl or pad")
    if "wa" in parts and scenario != "class":
        raise ValueError(f"strategy {name!r}: weight aligning corrects one head shared by all classes, "
                         f"so it needs scenario 'class' (got {scenario!r})")
    return frozenset(parts)
