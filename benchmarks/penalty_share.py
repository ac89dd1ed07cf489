"""The StreamKL penalty's share of the loss, across alpha, token counts and depths, on the CPU.

Why: ``StreamKLPlugin(alpha=1.0)`` adds a penalty a user cannot see next to a cross-entropy
near 2; the study chose alpha 100 (task scenario) and 1 (class scenario, with replay). This
script trains short two-experience runs of bundled digits (``cl-streamkl run``'s stream and
model: a timm ViT, one head per task in the task scenario) with Avalanche's Naive strategy
(plus replay in the class scenario) and :class:`~cl_streamkl.strategies.StreamKLPlugin`, and
records in the second experience, per step, alpha × penalty and its share of the loss it is
added to (``plugin.last_share``). Rows: scenario, alpha, tokens, depth; each row's median and
largest share and the median penalty over alpha (the KL itself).

Run from the repository root::

    python benchmarks/penalty_share.py --json benchmarks/results/penalty-share-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from avalanche.training import Naive
from avalanche.training.plugins import EvaluationPlugin, ReplayPlugin, SupervisedPlugin

from _harness.report import (add_json_flag, describe_environment, environment_line, run_settings, table_header,
                             write_json)
from cl_streamkl.experiment.config import ExperimentConfig
from cl_streamkl.experiment.data import load_splits
from cl_streamkl.experiment.data.benchmark import avalanche_benchmark
from cl_streamkl.experiment.preflight import build_run_model, build_run_stream
from cl_streamkl.strategies import StreamKLPlugin

COLUMNS = [
    {"name": "scenario"}, {"name": "alpha", "align": "right", "format": "g"},
    {"name": "tokens", "align": "right", "format": "d"}, {"name": "depth", "align": "right", "format": "d"},
    {"name": "steps", "align": "right", "format": "d"},
    {"name": "task loss (median)", "align": "right", "format": ".3g"},
    {"name": "penalty / alpha (median)", "align": "right", "format": ".2e"},
    {"name": "share of loss (median)", "align": "right", "format": ".2%"},
    {"name": "share of loss (max)", "align": "right", "format": ".2%"},
]


class ShareLog(SupervisedPlugin):
    """Per step of the last experience: the loss before the penalty, the penalty and its share."""

    def __init__(self, plugin: StreamKLPlugin) -> None:
        super().__init__()
        self.plugin, self.steps = plugin, []

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self.steps = []

    def after_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        penalty, share = self.plugin.last_penalty, self.plugin.last_share
        if share > 0:
            self.steps.append((penalty / share - penalty, penalty, share))


def run_one(scenario: str, alpha: float, image_size: int, patch_size: int, depth: int, args) -> list[Any]:
    """One two-experience run; the row of its second experience."""
    config = ExperimentConfig(
        dataset="digits", scenario=scenario, experiences=2, image_size=image_size, patch_size=patch_size,
        model_kwargs={"depth": depth, "embed_dim": args.dim, "num_heads": 2}, epochs=args.epochs,
        batch_size=args.batch_size, lr=1e-3, device="cpu", strategies=["naive"], seeds=[0],
    )
    torch.manual_seed(args.seed)
    stream = build_run_stream(config, load_splits("digits", data_root=None, image_size=image_size), args.seed)
    model = build_run_model(config, stream, torch.device("cpu"))
    plugin = StreamKLPlugin(alpha=alpha, backend="torch")
    log = ShareLog(plugin)
    plugins: list[SupervisedPlugin] = [plugin, log]
    if scenario == "class":
        plugins.insert(0, ReplayPlugin(mem_size=args.mem_size))
    strategy = Naive(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=config.lr),
                     criterion=torch.nn.CrossEntropyLoss(), train_mb_size=config.batch_size,
                     train_epochs=config.epochs, device="cpu", plugins=plugins,
                     evaluator=EvaluationPlugin(loggers=[]))
    for experience in avalanche_benchmark(stream).train_stream:
        strategy.train(experience)
    losses, penalties, shares = zip(*log.steps)
    tokens = (image_size // patch_size) ** 2 + 1
    return [scenario, alpha, tokens, depth, len(shares), statistics.median(losses),
            statistics.median(penalties) / alpha, statistics.median(shares), max(shares)]


# scenario:alpha:image/patch:depth. Every alpha of interest (the plugin's 1, the CLI's 10, the study's
# 100 in the task scenario and 1 in the class scenario) at 17 tokens and depth 2; the study's settings
# across 5, 17 and 65 tokens and depths 1 and 4.
DEFAULT_RUNS = (
    [f"{scenario}:{alpha}:16/4:2" for scenario in ("task", "class") for alpha in (1, 10, 100)]
    + [f"{scenario}:{alpha}:{shape}:{depth}" for scenario, alpha in (("task", 100), ("class", 1))
       for shape in ("16/8", "16/4", "32/4") for depth in (1, 4)]
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, metavar="SCENARIO:ALPHA:IMAGE/PATCH:DEPTH",
                        help="runs to make (default: every alpha at 17 tokens, the study's across lengths and depths)")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--mem-size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None, help="what to report as the commit (default: git's)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    environment = describe_environment(torch.device("cpu"), args.commit)
    print(environment_line(environment))
    rows = []
    for spec in args.runs:
        scenario, alpha, shape, depth = spec.split(":")
        image_size, patch_size = (int(part) for part in shape.split("/"))
        start = time.perf_counter()
        rows.append(run_one(scenario, float(alpha), image_size, patch_size, int(depth), args))
        print(" | ".join(f"{cell:{column.get('format', '')}}" for cell, column in zip(rows[-1], COLUMNS)),
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    if args.json is not None:
        write_json(args.json, {"title": "StreamKL penalty's share of the loss (second experience, digits, CPU)",
                               **table_header(environment), "settings": run_settings(args), "columns": COLUMNS,
                               "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
