"""Where does attention distillation reduce forgetting? The efficacy study, in one command.

For each scenario (class-, task- and domain-incremental) the study

1. tunes StreamKL's hyper-parameters on the validation split: every setting of a small
   grid (alpha, layers, temperature) trains ``streamkl`` and ``lwf+streamkl`` on the
   sweep seeds, and the setting with the highest mean validation accuracy of the two
   wins (ties: the first in grid order);
2. runs every strategy of the scenario once on the test split with that setting, over
   the test seeds (a seed fixes class or domain order and initialisation), and reports
   mean ± std per strategy and, for every strategy holding ``streamkl`` or ``pad``, the
   paired difference to the same strategy without it (95 % t-interval over seeds).

Two regimes: ``short`` (32 px images, 8 px patches: 17 tokens; the CPU can run it) and
``long`` (128 px, 4 px patches: 1025 tokens, on a GPU with bf16 autocast). Each
(scenario, strategy, seed) run is one task for a pool of worker processes; on one GPU the
workers share the device (a tiny ViT leaves it mostly idle). Finished runs are kept
under ``--out`` and skipped when the command is started again, so an interrupted study
resumes. The tables go to ``--json`` (committed under ``benchmarks/results/``) and are
printed as Markdown last.

Run from the repository root with the package installed::

    python benchmarks/efficacy.py --regime short --device cpu --workers 2
    python benchmarks/efficacy.py --regime long --device cuda --workers 14
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _harness.efficacy_tables import SCENARIOS, side_by_side
from _harness.report import add_json_flag, write_json

SWEEP_STRATEGIES = ("streamkl", "lwf+streamkl")
SWEEP_BASELINES = ("naive", "lwf")
# (alpha, layers, temperature); the first is the CLI's default.
# The long regime's grid leaves out the last-block setting for want of GPU time.
SWEEP_GRIDS = {
    "short": ((10.0, "all", 0.5), (1.0, "all", 1.0), (100.0, "all", 1.0), (1.0, 1, 1.0)),
    "long": ((10.0, "all", 0.5), (1.0, "all", 1.0), (100.0, "all", 1.0)),
}
REGIMES: dict[str, dict[str, Any]] = {
    "short": {"dataset": "mnist5k", "image_size": 32, "patch_size": 8, "epochs": 10, "batch_size": 32,
              "amp": "none"},
    "long": {"dataset": "mnist5k", "image_size": 128, "patch_size": 4, "epochs": 10, "batch_size": 32,
             "amp": "bf16"},
}
# Class and task: 6 classes first (the teacher's attention has seen more than two), then 2 + 2.
# Domain: four rotations 45 degrees apart, every class in each.
SCENARIO_OPTIONS: dict[str, dict[str, Any]] = {
    "class": {"experiences": 3, "first_experience_classes": 6},
    "task": {"experiences": 3, "first_experience_classes": 6},
    "domain": {"experiences": 4, "domain_shift": "rotate", "rotation_step": 45.0},
}
STRATEGIES: dict[str, dict[str, tuple[str, ...]]] = {
    "short": {
        "class": ("naive", "streamkl", "pad", "lwf", "lwf+streamkl", "lwf+pad", "wa", "wa+streamkl",
                  "replay", "replay+streamkl", "ewc", "ewc+streamkl"),
        "task": ("naive", "streamkl", "pad", "lwf", "lwf+streamkl", "lwf+pad", "replay", "replay+streamkl",
                 "ewc", "ewc+streamkl"),
        "domain": ("naive", "streamkl", "pad", "lwf", "lwf+streamkl", "lwf+pad", "replay", "replay+streamkl",
                   "ewc", "ewc+streamkl"),
    },
    # PAD materialises (B, H, N, N) attention maps: short token counts only.
    "long": {
        "class": ("naive", "streamkl", "lwf", "lwf+streamkl", "wa", "wa+streamkl", "replay", "replay+streamkl"),
        "task": ("naive", "streamkl", "lwf", "lwf+streamkl"),
        "domain": ("naive", "streamkl", "lwf", "lwf+streamkl"),
    },
}


@dataclasses.dataclass(frozen=True)
class Unit:
    """One run: a strategy on one seed of one scenario, with one StreamKL setting."""

    phase: str
    scenario: str
    strategy: str
    seed: int
    setting: tuple[float, str | int, float]

    @property
    def name(self) -> str:
        alpha, layers, temperature = self.setting
        return (f"{self.phase}-{self.scenario}-{self.strategy}-seed{self.seed}"
                f"-a{alpha:g}-l{layers}-t{temperature:g}")


def unit_config(unit: Unit, regime: str, device: str, out: Path) -> Any:
    from cl_streamkl.experiment.config import ExperimentConfig

    alpha, layers, temperature = unit.setting
    return ExperimentConfig(
        **REGIMES[regime], **SCENARIO_OPTIONS[unit.scenario], scenario=unit.scenario,
        strategies=[unit.strategy], seeds=[unit.seed], eval_split="val" if unit.phase == "sweep" else "test",
        alpha=alpha, layers=layers, temperature=temperature, device=device, out=str(out),
    ).resolved()


@functools.lru_cache(maxsize=None)
def _splits(dataset: str, image_size: int, split_seed: int) -> Any:
    """Each worker loads (and resizes) a dataset once for all its units."""
    from cl_streamkl.experiment.data import load_splits

    return load_splits(dataset, data_root=None, image_size=image_size, split_seed=split_seed)


def _init_worker(threads: int, gpus: int, counter: Any) -> None:
    import warnings

    with counter.get_lock():
        index = counter.value
        counter.value += 1
    if gpus > 1:
        # Before CUDA is initialised: worker i drives GPU i mod gpus.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
    import torch

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")


def run_unit(unit: Unit, regime: str, device: str, root: str) -> dict[str, Any]:
    """Train one unit (or read it back when done) and return its RunResult as a dict."""
    from cl_streamkl.experiment.runner import run_experiment

    record = Path(root) / "units" / f"{unit.name}.json"
    if record.is_file():
        return json.loads(record.read_text())
    out = Path(root) / "runs" / unit.name
    start = time.perf_counter()
    config = unit_config(unit, regime, device, out)
    splits = _splits(config.dataset, config.image_size, config.split_seed)
    result = run_experiment(config, out, resume=out.exists(), show_progress=False, splits=splits)[0]
    payload = {**dataclasses.asdict(result), "process_s": time.perf_counter() - start}
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(payload) + "\n")
    return payload


class InProcess(concurrent.futures.Executor):
    """``--workers 0``: every unit in this process, one after the other (tests, debugging)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(fn(*args, **kwargs))
        return future


def run_all(units: Sequence[Unit], pool: concurrent.futures.Executor, regime: str, device: str, root: Path
            ) -> dict[Unit, dict[str, Any]]:
    futures = {pool.submit(run_unit, unit, regime, device, str(root)): unit for unit in units}
    done: dict[Unit, dict[str, Any]] = {}
    for count, future in enumerate(concurrent.futures.as_completed(futures), 1):
        unit = futures[future]
        done[unit] = future.result()
        print(f"[{count}/{len(units)}] {unit.name}: final acc "
              f"{_final_accuracy(done[unit]):.3f} ({done[unit].get('process_s', 0):.0f} s)", flush=True)
    return done


def _final_accuracy(record: dict[str, Any]) -> float:
    last = record["accuracy_matrix"][-1]
    return sum(last) / len(last)


def _as_results(records: Sequence[dict[str, Any]]) -> list[Any]:
    from cl_streamkl.experiment.runner import RunResult

    fields = {f.name for f in dataclasses.fields(RunResult)}
    return [RunResult(**{k: v for k, v in record.items() if k in fields}) for record in records]


def choose_setting(scenario: str, grid: Sequence[tuple], sweep: dict[Unit, dict[str, Any]]
                   ) -> tuple[list[dict[str, Any]], tuple]:
    """Sweep records per setting and the chosen one (highest mean validation accuracy)."""
    rows = []
    for setting in grid:
        runs = {u: r for u, r in sweep.items() if u.scenario == scenario and u.setting == setting}
        per_strategy = {}
        for strategy in SWEEP_STRATEGIES:
            values = [_final_accuracy(r) for u, r in runs.items() if u.strategy == strategy]
            per_strategy[strategy] = 100 * sum(values) / len(values)
        rows.append({"alpha": setting[0], "layers": setting[1], "temperature": setting[2],
                     "val_final_avg_acc": per_strategy,
                     "objective": sum(per_strategy.values()) / len(per_strategy)})
    best = max(range(len(rows)), key=lambda i: (rows[i]["objective"], -i))
    baselines = {}
    for strategy in SWEEP_BASELINES:
        values = [_final_accuracy(r) for u, r in sweep.items() if u.scenario == scenario and u.strategy == strategy]
        baselines[strategy] = 100 * sum(values) / len(values)
    for row in rows:
        row["val_baselines"] = baselines
    return rows, grid[best]


def scenario_table(scenario: str, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per strategy mean ± std (percent) of the study's metrics, and the paired differences."""
    from cl_streamkl.experiment.statistics import paired_comparisons
    from cl_streamkl.experiment.summary import summarize

    results = _as_results(records)
    summary = summarize(results)
    table = {}
    for strategy, entry in summary.items():
        row = {}
        for name, key in (("final_avg_acc", "final_average_accuracy"), ("forgetting", "average_forgetting"),
                          ("learning_acc", "learning_accuracy"), ("task_il_acc", "final_task_il_accuracy")):
            if entry[key] is not None:
                row[name] = [100 * entry[key]["mean"], 100 * entry[key]["std"]]
        row["wall_time_s"] = [entry["wall_time_s"]["mean"], entry["wall_time_s"]["std"]]
        row["seeds"] = entry["seeds"]
        table[strategy] = row
    return {"table": table, "paired": paired_comparisons(results, scenario, scale=100.0)}


def markdown(report: dict[str, Any]) -> str:
    """Every scenario's table and paired differences as Markdown."""
    lines = []
    for scenario, part in report["scenarios"].items():
        chosen = part["chosen"]
        lines += [f"### {scenario}-incremental ({report['settings']['tokens']} tokens; StreamKL alpha "
                  f"{chosen['alpha']:g}, layers {chosen['layers']}, T {chosen['temperature']:g})", ""]
        columns = [("final_avg_acc", "final avg acc (%)"), ("forgetting", "forgetting (%)"),
                   ("learning_acc", "learning acc (%)")]
        if scenario == "class":
            columns.append(("task_il_acc", "Task-IL acc (%)"))
        lines.append("| strategy | " + " | ".join(title for _, title in columns) + " |")
        lines.append("|---|" + "---:|" * len(columns))
        for strategy, row in part["table"].items():
            cells = [f"{row[key][0]:.1f} ± {row[key][1]:.1f}" for key, _ in columns]
            lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
        lines += ["", "| paired difference | final avg acc (pp) | forgetting (pp) |", "|---|---:|---:|"]
        pairs: dict[tuple[str, str], dict[str, str]] = {}
        for entry in part["paired"]:
            low, high = entry["ci95"]
            interval = "" if low is None else f" [{low:+.1f}, {high:+.1f}]"
            pairs.setdefault((entry["strategy"], entry["baseline"]), {})[entry["metric"]] = (
                f"{entry['mean_diff']:+.1f}{interval}")
        for (strategy, baseline), cells in pairs.items():
            lines.append(f"| {strategy} − {baseline} | {cells.get('final_avg_acc', '-')} | "
                         f"{cells.get('forgetting', '-')} |")
        busy = sum(part["worker_time_s"].values()) / 60
        lines += ["", f"Compute: {busy:.0f} worker-minutes (sweep {part['worker_time_s']['sweep'] / 60:.0f}, "
                      f"test {part['worker_time_s']['test'] / 60:.0f}); each run is one worker process.", ""]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", choices=tuple(REGIMES))
    parser.add_argument("--tables", nargs="+", type=Path, metavar="REPORT",
                        help="print the side-by-side tables of these reports (one per regime) and exit")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="worker processes; 0 runs every unit in this process")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: %(default)s)")
    parser.add_argument("--gpus", type=int, default=1, help="spread the workers over this many GPUs")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="test seeds")
    parser.add_argument("--sweep-seeds", nargs="+", type=int, help="validation seeds of the sweep "
                        "(default: 100 101 for short, 100 for long)")
    parser.add_argument("--epochs", type=int, help="override the regime's epochs (for a quick check)")
    parser.add_argument("--strategies", nargs="+", help="override the regime's strategies (for a quick check)")
    parser.add_argument("--out", type=Path, help="folder for the runs (default: runs/efficacy-<regime>)")
    add_json_flag(parser, "write the report as JSON")
    parser.add_argument("--commit", help="commit to record when the tree has no .git (default: git rev-parse)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tables:
        print(side_by_side([json.loads(path.read_text()) for path in args.tables]))
        return 0
    if args.regime is None:
        print("efficacy.py: --regime is required (or --tables to print finished reports)", file=sys.stderr)
        return 2
    if args.epochs is not None:
        REGIMES[args.regime]["epochs"] = args.epochs
    root = args.out or Path("runs") / f"efficacy-{args.regime}"
    args.sweep_seeds = args.sweep_seeds or ([100, 101] if args.regime == "short" else [100])
    settings = {**REGIMES[args.regime], "tokens": (REGIMES[args.regime]["image_size"]
                                                   // REGIMES[args.regime]["patch_size"]) ** 2 + 1}
    import torch

    from _harness.report import describe_environment

    environment = describe_environment(torch.device(args.device), args.commit)
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    report: dict[str, Any] = {"regime": args.regime, "settings": settings, "environment": environment,
                              "workers": args.workers, "gpus": args.gpus if args.device == "cuda" else 0, "date": time.strftime("%Y-%m-%d"),
                              "seeds": args.seeds, "sweep_seeds": args.sweep_seeds, "scenarios": {}}
    counter = context.Value("i", 0)
    pool = (InProcess() if args.workers == 0 else
            concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context, initializer=_init_worker,
                                                   initargs=(args.threads, args.gpus, counter)))
    with pool:
        grid = SWEEP_GRIDS[args.regime]
        sweep_units = [Unit("sweep", scenario, strategy, seed, setting)
                       for scenario in args.scenarios for setting in grid
                       for strategy in SWEEP_STRATEGIES for seed in args.sweep_seeds]
        sweep_units += [Unit("sweep", scenario, strategy, seed, grid[0])
                        for scenario in args.scenarios for strategy in SWEEP_BASELINES for seed in args.sweep_seeds]
        sweep = run_all(sweep_units, pool, args.regime, args.device, root)
        sweep_time = time.perf_counter() - start
        chosen = {}
        for scenario in args.scenarios:
            rows, chosen[scenario] = choose_setting(scenario, grid, sweep)
            report["scenarios"][scenario] = {"options": SCENARIO_OPTIONS[scenario], "sweep": rows,
                                             "chosen": dict(zip(("alpha", "layers", "temperature"),
                                                                chosen[scenario]))}
        test_units = [Unit("test", scenario, strategy, seed, chosen[scenario])
                      for scenario in args.scenarios
                      for strategy in (args.strategies or STRATEGIES[args.regime][scenario])
                      for seed in args.seeds]
        test = run_all(test_units, pool, args.regime, args.device, root)
    for scenario in args.scenarios:
        records = [test[u] for u in test_units if u.scenario == scenario]
        part = report["scenarios"][scenario]
        part.update(scenario_table(scenario, records))
        # Seconds the workers spent on this scenario's runs (a resumed study counts earlier starts too).
        part["worker_time_s"] = {phase: sum(r.get("process_s", 0.0) for u, r in runs.items() if u.scenario == scenario)
                                 for phase, runs in (("sweep", sweep), ("test", test))}
    # This start's wall time; a resumed study's earlier starts are not in it.
    report["wall_time_s"] = time.perf_counter() - start
    report["sweep_wall_time_s"] = sweep_time
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, report)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
