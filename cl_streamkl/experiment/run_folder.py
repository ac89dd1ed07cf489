"""The run folder as the command line claims it: one run per folder, and the command that continues one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from cl_streamkl.experiment.files import OutputWriteError

if TYPE_CHECKING:
    from cl_streamkl.distributed.data_parallel import DataParallel

def continue_with(out_dir: Path | str, world_size: int) -> str:
    """The command that resumes the run in ``out_dir`` with ``world_size`` processes."""
    return (f"torchrun --nproc_per_node {world_size} -m cl_streamkl run --resume {out_dir}" if world_size > 1
            else f"cl-streamkl run --resume {out_dir}")


def after_lost_peer(out: str | None, world_size: int) -> str:
    """What to do once a peer is lost: resume the run if its folder holds one, else start again."""
    from cl_streamkl.experiment.config_file import CONFIG_FILE

    if out is not None and (Path(out) / CONFIG_FILE).exists():
        return f"stop any process of the run still running, then continue with: {continue_with(out, world_size)}"
    return "nothing was written; stop any process of the run still running and start it again"


# What a run writes in its folder besides config.json, the result files and the loggers' folders
# (each named as its logger): plots and checkpoints.
_RUN_NAMES = ("average_accuracy.png", "checkpoints")
_RUN_PATTERNS = ("accuracy_matrix_*.png",)


def refuse_used_folder(out_dir: Path, resume: bool) -> None:
    """A new run needs a folder that holds no run and nothing the run would overwrite.

    Other files (a scheduler's log, notes) may share the folder; ``--resume`` continues a run.

    Raises:
        ValueError: ``out_dir`` is, or lies under, a file; or, unless ``resume``, it holds a run
            or a file or folder of a name the run writes.
    """
    from cl_streamkl.experiment.config import LOGGERS
    from cl_streamkl.experiment.config_file import CONFIG_FILE
    from cl_streamkl.experiment.outputs import RESULTS_FILE, RUNS_CSV, SUMMARY_CSV, SUMMARY_MD

    blocking = next((p for p in (out_dir, *out_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"--out {out_dir}: {blocking} is a file, not a folder")
    if resume or not out_dir.is_dir():
        return
    if (out_dir / CONFIG_FILE).exists():
        raise ValueError(f"{str(out_dir)!r} already holds a run; pass --resume {out_dir} or another --out")
    names = (RESULTS_FILE, RUNS_CSV, SUMMARY_CSV, SUMMARY_MD, *_RUN_NAMES, *LOGGERS)
    taken = sorted({name for name in names if (out_dir / name).exists()}
                   | {p.name for pattern in _RUN_PATTERNS for p in out_dir.glob(pattern)})
    if taken:
        raise ValueError(f"{str(out_dir)!r} holds {', '.join(taken)}, which a new run would overwrite; "
                         "pass another --out or move them")


@contextmanager
def claimed_folder(out_dir: Path, resume: bool, data_parallel: DataParallel) -> Iterator[None]:
    """Hold the run folder's lock (rank 0) for the block; every rank stops if it is in use.

    Raises:
        FolderInUseError: another run holds the folder.
        ValueError: a new run's folder already holds a run.
        OutputWriteError: the folder cannot be created.
    """
    from cl_streamkl.experiment.run_lock import run_folder_lock

    with ExitStack() as stack:
        refusal = None
        if data_parallel.is_main:
            try:
                stack.enter_context(run_folder_lock(out_dir))
                refuse_used_folder(out_dir, resume)
            except (ValueError, OutputWriteError) as err:
                refusal = err
        refusal = data_parallel.broadcast(refusal)
        if refusal is not None:
            raise refusal
        yield
