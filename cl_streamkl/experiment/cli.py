"""``cl-streamkl`` command line: ``cl-streamkl run`` trains and compares continual-learning strategies.

Only light modules are imported here, so ``--help`` and argument errors answer at once (no
Avalanche, timm or matplotlib: those are imported once the arguments are checked).

The run's settings are the fields of :class:`~cl_streamkl.experiment.config.ExperimentConfig`,
each declared there with its flag; this module adds the options that control a run but do
not change its results (``--config``, ``--resume``, ``--log``, ...).

Started by torchrun (``torchrun --nproc_per_node N -m cl_streamkl run ...``), every process
runs this command: the run is data-parallel, and rank 0 alone prints and writes files.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
import typing
import warnings
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cl_streamkl.distributed.data_parallel import DIST_TIMEOUT_S
from cl_streamkl.distributed.lost_peers import LostPeerError
from cl_streamkl.experiment.config import LOGGERS, ExperimentConfig, Flag, describe_model, flags
from cl_streamkl.experiment.data.errors import DataError
from cl_streamkl.experiment.files import OutputWriteError
from cl_streamkl.experiment.interrupts import exit_status, sigterm_raises, stopped_by
from cl_streamkl.experiment.library_warnings import own_warnings_through
from cl_streamkl.experiment.option_aliases import DEPRECATED_OPTIONS, DeprecatedOption, flag_name
from cl_streamkl.experiment.option_parser import OptionParser
from cl_streamkl.experiment.run_folder import after_lost_peer, claimed_folder, continue_with, refuse_used_folder
from cl_streamkl.kernels.config import get_kernel_options

if TYPE_CHECKING:
    from cl_streamkl.distributed.data_parallel import DataParallel

_DESCRIPTION = """\
Continual-learning experiments with StreamKL attention distillation on vision transformers:
class-incremental (new classes, one shared head), task-incremental (new classes with task
labels, one head per experience) and domain-incremental (all classes under a new input
shift) streams."""

_EXAMPLES = """\
examples:
  cl-streamkl run                                    # task-incremental Split-Digits, 3 seeds, offline on the CPU
  cl-streamkl run --seeds 0 1 2 3 4                  # mean ± std and paired intervals over five seeds
  cl-streamkl run --scenario class --strategies naive replay replay+streamkl --streamkl-alpha 2 --streamkl-layers 2
  cl-streamkl run --scenario domain --dataset mnist5k   # rotated MNIST digits, one shared head
  cl-streamkl run --scenario class --first-experience-classes 4 --experiences 4
  cl-streamkl run --dataset cifar100 --data-root ~/data --image-size 128 --patch-size 4 \\
      --model vit_small_patch16_224 --pretrained-file vit_small.pth --device cuda --amp bf16
  cl-streamkl run --dataset cluttered-mnist --patch-size 4 --stem conv --lr-schedule cosine --epochs 30 \\
      --device cuda --amp bf16                       # 1025 tokens: 28 px digits on cluttered 128 px canvases
  cl-streamkl run --resume runs/20250101-120000      # continue an interrupted run in its folder
  cl-streamkl run --config runs/20250101-120000/config.json --seeds 3 4   # same settings, other seeds
  cl-streamkl run --config settings.yaml             # settings as YAML or JSON, keys named as the flags
  cl-streamkl run --strategies joint naive streamkl --log tensorboard csv
  torchrun --nproc_per_node 4 -m cl_streamkl run --scenario class --device cuda --batch-size 256   # 4 GPUs

The first example is the main job: about two minutes on a 2-core CPU (README.md, "Set up").
StreamKL's plugin (StreamKLPlugin) defaults to alpha 1 and temperature 1; this command's
--streamkl-alpha 100 is the weight the efficacy study chose in the task scenario, and its
--streamkl-temperature 1 the plugin's and the study's choice (the kernels then reuse the models'
log-sum-exps). --alpha, --temperature and --layers, the earlier names, still work with a warning.
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


class _Parser(OptionParser):
    """The parser whose errors print as the command's others do (rank-aware under torchrun)."""

    def report(self, message: str) -> None:
        _print_error(message)


def _version() -> str:
    try:
        return metadata.version("cl-streamkl")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        from cl_streamkl import __version__

        return __version__


def _shown(value: Any) -> str | None:
    """A default as the help shows it (None: not shown)."""
    if value is None or value is False:
        return None
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _add_setting(group: argparse._ArgumentGroup, field: dataclasses.Field, flag: Flag, hint: Any,
                 default: Any) -> None:
    """One configuration field's option; its value stays unset unless given (the default is in the help)."""
    kwargs: dict[str, Any] = {"dest": field.name, "default": argparse.SUPPRESS}
    base = hint
    if typing.get_origin(base) in (typing.Union, types.UnionType):  # X | None: an option given is an X
        base = next(arg for arg in typing.get_args(base) if arg is not type(None))
    if typing.get_origin(base) is list:  # one value per word (nargs)
        base = typing.get_args(base)[0]
    if base is bool:
        kwargs["action"] = "store_true"
    else:
        kwargs["type"] = flag.type or base
        if flag.nargs:
            kwargs["nargs"] = flag.nargs
        if flag.choices is not None:  # checked with suggestions by ExperimentConfig.resolved
            kwargs["metavar"] = "{" + ",".join(map(str, flag.choices)) + "}"
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
    shown = flag.default_help if flag.default_help is not None else _shown(default)
    kwargs["help"] = flag.help + (f" (default: {shown})" if shown else "")
    group.add_argument(flag_name(field.name), **kwargs)
    for old_name in (old for old, name in DEPRECATED_OPTIONS.items() if name == field.name):
        group.add_argument(old_name, **{**kwargs, "help": argparse.SUPPRESS, "action": DeprecatedOption,
                                        "replacement": flag_name(field.name), "warn": _print_warning})


def build_parser(defaults: ExperimentConfig | None = None) -> argparse.ArgumentParser:
    """The ``cl-streamkl`` argument parser (sub-command ``run``).

    Args:
        defaults: the values the help shows for options not given (``--config``'s file);
            the built-in defaults when None.
    """
    return _parsers(defaults)[0]


def _parsers(defaults: ExperimentConfig | None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and its ``run`` sub-parser.

    The run's settings come from :func:`~cl_streamkl.experiment.config.flags`, one option
    per configuration field, unset in the parsed namespace unless given.
    """
    parser = _Parser(prog="cl-streamkl", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = commands.add_parser(
        "run", help="train and compare strategies on a class-, task- or domain-incremental stream",
        description="Train every strategy on a class-, task- or domain-incremental stream, print a "
                    "comparison table (Class-IL, Task-IL or Domain-IL accuracy, forgetting, backward transfer, "
                    "learning accuracy, time, peak memory) with paired differences over seeds, and write "
                    "results.json, CSV files, summary.md, plots and checkpoints to --out. Every check that "
                    "needs no training runs before anything is written.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands.add_parser("study", help="tune, test and report a study that a plan file describes (see study --help)")
    d = ExperimentConfig() if defaults is None else defaults
    hints = typing.get_type_hints(ExperimentConfig)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for field, flag in flags():
        if flag.group not in groups:
            groups[flag.group] = run.add_argument_group(flag.group)
        _add_setting(groups[flag.group], field, flag, hints[field.name], getattr(d, field.name))

    control = groups["run control"]
    control.add_argument("--config", metavar="FILE",
                         help="start from the settings of a file: a run's config.json (or results.json), or JSON "
                              "or YAML (.yaml, .yml) with the flags' names as keys (experiences, batch_size, ...); "
                              "options given alongside override the file's values (its --out is not reused)")
    control.add_argument("--resume", metavar="DIR",
                         help="continue the run in DIR, wherever the folder now is, with its saved configuration "
                              "(no other options but --log, --no-progress and --dist-timeout); its checkpoints are "
                              "verified first")
    control.add_argument("--log", action="extend", nargs="+", choices=LOGGERS, default=[], metavar="LOGGER",
                         help=f"also report to Avalanche loggers, repeatable: {', '.join(LOGGERS)} (files under "
                              "--out; wandb needs the wandb package and a login, or WANDB_MODE=offline)")
    control.add_argument("--no-progress", action="store_true", help="hide progress bars")
    control.add_argument("--dist-timeout", type=_timeout_seconds, default=DIST_TIMEOUT_S, metavar="SECONDS",
                         help="under torchrun: how long a process waits for the others before it fails, so one "
                              "that died or hangs stops the run, > 0 and at most a week (default: %(default)g)")
    return parser, run


# The longest --dist-timeout: a week (one process group's collective waits no longer than that).
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600


def _timeout_seconds(text: str) -> float:
    """``--dist-timeout``'s value: a number of seconds, > 0 and at most :data:`MAX_DIST_TIMEOUT_S`."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds; got {text!r}") from None
    if not 0 < seconds <= MAX_DIST_TIMEOUT_S:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0 and at most {MAX_DIST_TIMEOUT_S:,} seconds (a week); got {text}")
    return seconds


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration fields given on the command line (the parser leaves the others unset)."""
    names = {f.name for f in dataclasses.fields(ExperimentConfig)}
    given = {name: value for name, value in vars(args).items() if name in names}
    if "model_kwargs" in given:
        given["model_kwargs"] = dict(given["model_kwargs"])
    return given


def _config_from_args(args: argparse.Namespace, base: ExperimentConfig | None = None) -> ExperimentConfig:
    """``base`` (default: the built-in defaults) with the options given on the command line."""
    return dataclasses.replace(base or ExperimentConfig(), **_given(args))


def _file_defaults(argv: Sequence[str]) -> ExperimentConfig | None:
    """The configuration named by ``--config`` (its ``out`` dropped), or None."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return None
    from cl_streamkl.experiment.config_file import read_config_file

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        config = read_config_file(Path(known.config))
    for warning in caught:
        _print_warning(str(warning.message))
    return dataclasses.replace(config, out=None)


def _resolve(args: argparse.Namespace, base: ExperimentConfig | None) -> ExperimentConfig:
    """The run's checked configuration: DIR/config.json for ``--resume DIR`` (working in DIR), else the options.

    Raises:
        ValueError: ``--resume`` with settings, a folder that is no run, or any bad value.
    """
    if args.resume is None:
        return _config_from_args(args, base).resolved()
    given = sorted(_given(args)) + (["config"] if args.config else [])
    if given:
        raise ValueError("--resume takes its configuration from DIR/config.json; drop "
                         + ", ".join(flag_name(name) for name in given))
    from cl_streamkl.experiment.config_file import read_config

    # The folder's saved "out" is where it was made; the run continues where it is now.
    return dataclasses.replace(read_config(args.resume), out=args.resume).resolved()


def _run(args: argparse.Namespace, config: ExperimentConfig) -> int:
    """Join the data-parallel run if torchrun started this process, name the folder, and run."""
    # Avalanche makes a logger as it is imported, which it refuses on ranks other than 0
    # once a process group exists: the run's modules are imported before joining one.
    import cl_streamkl.experiment.runner  # noqa: F401
    from cl_streamkl.distributed.data_parallel import start_data_parallel, stop_data_parallel

    try:
        data_parallel = start_data_parallel(config.device, args.dist_timeout)
    except LostPeerError as err:
        raise LostPeerError(f"{err}; {after_lost_peer(config.out, int(os.environ.get('WORLD_SIZE', '1')))}") from err
    try:
        if config.out is None:
            # Rank 0's clock names the folder: the ranks' clocks may tick apart.
            config.out = data_parallel.broadcast(str(Path("runs") / time.strftime("%Y%m%d-%H%M%S")))
        return _run_processes(args, config, args.resume is not None, data_parallel)
    except LostPeerError as err:
        raise LostPeerError(f"{err}; {after_lost_peer(config.out, data_parallel.world_size)}") from err
    finally:
        stop_data_parallel(data_parallel)


# The exit status of a data-parallel run that lost one of its processes.
LOST_PEER_STATUS = 3


def _run_processes(args: argparse.Namespace, config: ExperimentConfig, resume: bool,
                   data_parallel: DataParallel) -> int:
    """The run on every process of it (one, or each of torchrun's); rank 0 prints and writes."""
    from cl_streamkl.experiment.outputs import write_config
    from cl_streamkl.experiment.preflight import check_experiment

    out_dir = Path(config.out)
    refuse_used_folder(out_dir, resume)
    main_rank, world_size = data_parallel.is_main, data_parallel.world_size
    # Everything that needs no training is checked before the folder is claimed. Rank 0
    # goes first: it alone downloads missing data.
    with data_parallel.main_first():
        splits = check_experiment(config, args.log, data_parallel)
    if main_rank:  # after the checks, so that a run refused is one error line and nothing else
        processes = f", {world_size} processes" if world_size > 1 else ""
        print(f"cl-streamkl run: {config.dataset} ({config.scenario}-incremental), {describe_model(config)}, "
              f"strategies {', '.join(config.strategies)}, seeds {config.seeds}, eval on {config.eval_split}"
              f"{processes} -> {out_dir}")
    with claimed_folder(out_dir, resume, data_parallel):
        if main_rank and not resume:
            write_config(out_dir, config)
        return _train_and_report(args, config, resume, data_parallel, splits)


def _train_and_report(args: argparse.Namespace, config: ExperimentConfig, resume: bool,
                      data_parallel: DataParallel, splits: Any) -> int:
    """Train every run (continuing from checkpoints when resuming), then print and write the results."""
    from tqdm.auto import tqdm

    from cl_streamkl.experiment.outputs import environment, write_results
    from cl_streamkl.experiment.plots import write_plots
    from cl_streamkl.experiment.runner import run_experiment
    from cl_streamkl.experiment.statistics import paired_comparisons
    from cl_streamkl.experiment.summary import summarize, summary_text

    out_dir = Path(config.out)
    main_rank, world_size = data_parallel.is_main, data_parallel.world_size
    resume_command = continue_with(out_dir, world_size)
    env = environment(world_size) if main_rank else None  # the code and libraries the run starts with

    def warn(message: str) -> None:
        tqdm.write(f"cl-streamkl: warning: {message}", file=sys.stderr)

    try:
        # DistributedDataParallel's steps reduce gradients inside the training loop.
        with data_parallel.peers_checked("training"), own_warnings_through(warn if main_rank else None):
            results = run_experiment(
                config, out_dir, resume=resume, show_progress=main_rank and not args.no_progress,
                log=tqdm.write if main_rank else None, warn=warn if main_rank else None,
                splits=splits, loggers=args.log, data_parallel=data_parallel)
        if not main_rank:
            return 0
        summary = summarize(results)
        paired = paired_comparisons(results, config.scenario)
        title = (f"{config.dataset}, {config.scenario}-incremental: {len(results[0].accuracy_matrix)} experiences, "
                 f"{config.eval_split} split")
        files = write_results(out_dir, config, results, summary, env, paired, title)
        files += write_plots(summary, out_dir, title, config.scenario)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (interrupts.Terminated)
        if main_rank:
            print(f"\n{stopped_by(interrupt)}; continue with: {resume_command}", file=sys.stderr)
        return exit_status(interrupt)
    except OutputWriteError as err:
        raise OutputWriteError(f"{err}; once it can be written, continue with: {resume_command}") from err
    except DataError as err:
        raise DataError(f"{err}; then continue with: {resume_command}") from err
    print("\n" + summary_text(title, summary, paired, config.scenario))
    print("\nwrote " + ", ".join(str(p) for p in files))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cl-streamkl`` script.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        Exit status: 0 on success; 1 when a file cannot be written (read-only folder, full
        disk); 2 for invalid arguments, data, configuration or checkpoints, or a run
        folder in use; 3 when another process of a data-parallel run is lost (died, hung
        past ``--dist-timeout``); 130 when interrupted (Ctrl-C) and 143 when terminated
        (SIGTERM, as a scheduler stops a job), both with the ``--resume`` command once
        training has started. Errors are one line on stderr.
    """
    quiet_third_party_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["study"]:  # its own options: a plan file, not one run's settings
        from cl_streamkl.experiment.study.command import main as study

        return study(argv[1:])
    try:
        base = _file_defaults(argv)
        args = build_parser(base).parse_args(argv)
        # Checked before the run's heavy modules are imported: a misspelt value answers at once.
        config = _resolve(args, base)
        get_kernel_options()  # the kernels' CL_STREAMKL_* switches, read on first use: refused here if misspelt
    except SystemExit as exit_:  # argparse has printed its message already
        return int(exit_.code or 0)
    except ValueError as err:
        _print_error(err)
        return 2
    try:
        with sigterm_raises():
            return _run(args, config)
    except KeyboardInterrupt as interrupt:  # before training started: nothing to continue
        if _rank() == "0":
            print(f"\n{stopped_by(interrupt)}", file=sys.stderr)
        return exit_status(interrupt)
    except ValueError as err:
        _print_error(err)
        return 2
    except LostPeerError as err:
        _print_error(err)
        return LOST_PEER_STATUS
    except (OutputWriteError, OSError) as err:
        _print_error(err)
        return 1


def _rank() -> str:
    """This process's rank under torchrun ("0" otherwise), known before any process group exists."""
    return os.environ.get("RANK", "0")


def _print_error(error: Exception | str) -> None:
    """The one-line error message; under torchrun every rank reports, ranks other than 0 naming themselves."""
    rank = _rank()
    print(f"cl-streamkl: error{'' if rank == '0' else f' (rank {rank})'}: {error}", file=sys.stderr)


def _print_warning(message: str) -> None:
    if _rank() == "0":
        print(f"cl-streamkl: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
