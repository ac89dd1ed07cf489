"""``--log``: Avalanche's TensorBoard, CSV and W&B loggers for each (strategy, seed) run.

Each run gets its own loggers, fed by an ``EvaluationPlugin`` that reports the training
loss and accuracy per epoch, the StreamKL penalty per epoch (strategies with
``streamkl``), and the loss and accuracy on every experience's evaluation data after each
training experience. Files go under the run folder:

- ``tensorboard/<strategy>-seed<s>/``: event files (``tensorboard --logdir <out>/tensorboard``);
- ``csv/<strategy>-seed<s>/training_results.csv`` and ``eval_results.csv`` (a cell the run has
  no value for is empty: ``val_accuracy`` and ``val_loss``, as runs validate nothing while
  training, and ``forgetting`` before an experience was trained);
- ``wandb/``: W&B's local files; one W&B run per (strategy, seed), grouped by the run folder's
  name, in project ``$WANDB_PROJECT`` (default ``cl-streamkl``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from avalanche.logging import CSVLogger, TensorboardLogger, WandBLogger

from cl_streamkl.experiment.config import LOGGERS, ExperimentConfig

_CSV_FILES = ("training_results.csv", "eval_results.csv")


class RunCSVLogger(CSVLogger):
    """Avalanche's CSV logger, with empty cells where the run has no value (Avalanche writes 0).

    ``forgetting`` holds Avalanche's experience forgetting (reported by
    :func:`build_evaluator`): accuracy on the experience right after training it minus now.
    """

    def __init__(self, log_folder: str) -> None:
        super().__init__(log_folder=log_folder)
        self.val_acc = self.val_loss = None  # until a validation within training reports them

    def _val_to_str(self, m_val: Any) -> str:
        return "" if m_val is None else super()._val_to_str(m_val)

    def after_eval_exp(self, strategy: Any, metric_values: list[Any], **kwargs: Any) -> None:
        if self.in_train_phase:  # validation within training: Avalanche records it for the next training row
            super().after_eval_exp(strategy, metric_values, **kwargs)
            return
        super(CSVLogger, self).after_eval_exp(strategy, metric_values, **kwargs)
        found: dict[str, Any] = dict.fromkeys(("Top1_Acc_Exp", "Loss_Exp", "ExperienceForgetting"))
        for value in metric_values:
            prefix = value.name.split("/", 1)[0]
            if prefix in found:
                found[prefix] = value.value
        self.print_eval_metrics(strategy.experience.current_experience, self.training_exp_id, *found.values())


class ScalarWandBLogger(WandBLogger):
    """Avalanche's W&B logger, for the scalar metrics these runs report.

    Avalanche 0.6's ``log_single_metric`` refers to ``wandb.viz``, which recent wandb
    releases no longer have; numbers need none of it.
    """

    def log_single_metric(self, name: str, value: Any, x_plot: int) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.step = x_plot
            self.wandb.log({name: value}, step=x_plot)


def _wandb_credentials() -> bool:
    """Whether W&B finds credentials, asked in a separate process.

    ``wandb.login`` finds them as a run would (key, settings files, ``.netrc``, identity
    token), but a failed look-up leaves the process's W&B client unable to start even a
    disabled run, so it runs elsewhere. Silent, because its "logged in as" message asks the
    server for the account's name: without a network that wait can outlast the timeout and
    read as missing credentials.
    """
    code = "import sys, wandb; sys.exit(0 if wandb.login(verify=False, prompt=False) else 1)"
    env = {**os.environ, "WANDB_SILENT": "true"}
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def check_loggers(names: Sequence[str]) -> None:
    """Raise ValueError for an unknown logger, or one whose package or credentials are missing.

    W&B needs a login (``wandb login``, ``WANDB_API_KEY`` or a ``.netrc`` entry) unless
    ``WANDB_MODE`` is ``offline`` or ``disabled``; the check reads the credentials W&B would
    use, without contacting the server.
    """
    unknown = sorted(set(names) - set(LOGGERS))
    if unknown:
        raise ValueError(f"unknown logger {unknown[0]!r}; choose from {', '.join(LOGGERS)}")
    if "wandb" in names:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError("--log wandb needs the wandb package: pip install wandb (or drop --log wandb)") from None
        if os.environ.get("WANDB_MODE") not in ("offline", "disabled", "dryrun") and not _wandb_credentials():
            raise ValueError("--log wandb needs W&B credentials: run 'wandb login' or set WANDB_API_KEY (or set "
                             "WANDB_MODE=offline to keep the logs in the run folder)")


def _csv_logger(folder: Path, resume: bool) -> RunCSVLogger:
    """A :class:`RunCSVLogger`, keeping the rows written before an interruption (it truncates its files)."""
    earlier = {}
    for name in _CSV_FILES:
        path = folder / name
        if resume and path.is_file():
            earlier[name] = path.read_text().splitlines(keepends=True)[1:]
    logger = RunCSVLogger(log_folder=str(folder))
    for name, handle in zip(_CSV_FILES, (logger.training_file, logger.eval_file)):
        handle.writelines(earlier.get(name, []))
        handle.flush()
    return logger


def build_loggers(names: Sequence[str], out_dir: Path, strategy: str, seed: int, config: ExperimentConfig,
                  resume: bool = False) -> list[Any]:
    """One Avalanche logger per name in ``names`` for the run (strategy, seed)."""
    run_name = f"{strategy}-seed{seed}"
    loggers = []
    for name in dict.fromkeys(names):
        if name == "tensorboard":
            loggers.append(TensorboardLogger(tb_log_dir=out_dir / "tensorboard" / run_name))
        elif name == "csv":
            loggers.append(_csv_logger(out_dir / "csv" / run_name, resume))
        elif name == "wandb":
            # A run id of our own (Avalanche's default calls a helper newer wandb releases lack),
            # fixed per folder and run so that --resume continues the same W&B run.
            run_id = hashlib.sha256(f"{out_dir.resolve()}/{run_name}".encode()).hexdigest()[:16]
            loggers.append(ScalarWandBLogger(
                project_name=os.environ.get("WANDB_PROJECT", "cl-streamkl"), run_name=f"{out_dir.name}/{run_name}",
                dir=str(out_dir), save_code=False, config={**config.to_dict(), "strategy": strategy, "seed": seed},
                params={"group": out_dir.name, "id": run_id, "resume": "allow"},
            ))
        else:
            raise ValueError(f"unknown logger {name!r}; choose from {', '.join(LOGGERS)}")
    return loggers


def build_evaluator(loggers: Sequence[Any], penalty: bool) -> Any:
    """The ``EvaluationPlugin`` that reports loss, accuracy, forgetting and (``penalty``) the StreamKL penalty."""
    from avalanche.evaluation.metrics import accuracy_metrics, forgetting_metrics, loss_metrics
    from avalanche.training.plugins import EvaluationPlugin

    from cl_streamkl.strategies import streamkl_penalty_metrics

    metrics = [accuracy_metrics(epoch=True, experience=True), loss_metrics(epoch=True, experience=True),
               forgetting_metrics(experience=True)]
    if penalty:
        metrics.append(streamkl_penalty_metrics(epoch=True))
    return EvaluationPlugin(*metrics, loggers=list(loggers))


def close_loggers(loggers: Sequence[Any]) -> None:
    """Flush and close every logger's files (and finish a W&B run)."""
    for logger in loggers:
        if hasattr(logger, "writer"):
            logger.writer.close()
        elif hasattr(logger, "wandb"):
            logger.wandb.finish()
        elif hasattr(logger, "close"):
            logger.close()
