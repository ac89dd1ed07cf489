"""How many seeds a confirmatory plan needs: each hypothesis's paired-t power from the committed per-seed data.

For every hypothesis of a plan file (read as written: its ``settings_from`` reports need not
exist yet) this pools the per-seed differences (strategy − baseline, percentage points, on the
hypothesis's metric) that the given study reports hold for the same pair, scenario and arm at
the plan's token count, and gives their mean and standard deviation, the seeds a paired
two-sided t test needs for ``--power`` at the Bonferroni level of its family (``alpha / m``,
Holm's first step, ``m`` the hypotheses of its role), and, at the plan's own seed count, the
power, the power were the effect two thirds as large, and the smallest effect it detects.

A pair no report ran is given a ``--proxy``: another pair of the same scenario (and arm, unless
the proxy names one) whose differences stand in for it (named in the output). The recommended seed count is the largest
that a primary hypothesis needs, at least ``--least-seeds``; a primary hypothesis needing more
than ``--most-seeds`` (what the device time allows) is left out of that maximum and reported as
underpowered, with its power at the count chosen.

Usage (from the repository root):
    python benchmarks/power_calculation.py benchmarks/studies/confirm-4097.yaml \\
        --reports benchmarks/results/efficacy-long4097.json \\
        --json benchmarks/results/power-confirm-4097.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from _harness.power import detectable_effect, paired_t_power, seeds_for_power
from _harness.report import write_json
from cl_streamkl._provenance import git_commit
from cl_streamkl.experiment.statistics import mean_std
from cl_streamkl.experiment.study.files import read_mapping
from cl_streamkl.experiment.study.plan import tokens

ALPHA = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path, help="a confirmatory plan file (its hypotheses and test seeds are read)")
    parser.add_argument("--reports", nargs="+", type=Path, required=True,
                        help="study reports (report.json) whose per-seed runs are pooled")
    parser.add_argument("--proxy", nargs="*", default=[], metavar="ID=STRATEGY:BASELINE[@ARM]",
                        help="a stand-in pair, same scenario (and arm unless @ARM), for a hypothesis no report ran")
    parser.add_argument("--power", type=float, default=0.8, help="target power (default %(default)s)")
    parser.add_argument("--least-seeds", type=int, default=2, help="recommend at least this many seeds")
    parser.add_argument("--most-seeds", type=int, default=1000,
                        help="primary hypotheses needing more seeds are reported as underpowered, not followed")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the calculation to PATH")
    parser.add_argument("--commit", help="commit to record (default: git rev-parse)")
    args = parser.parse_args(argv)
    if not 0 < args.power < 1:
        parser.error("--power must lie between 0 and 1")
    if not 2 <= args.least_seeds <= args.most_seeds:
        parser.error("--least-seeds must be >= 2 and <= --most-seeds")
    return args


def _proxies(entries: list[str], ids: list[str]) -> dict[str, tuple[str, str, str | None]]:
    """``--proxy`` entries as ID → (strategy, baseline, arm or None for the hypothesis's own)."""
    proxies = {}
    for entry in entries:
        name, _, pair = entry.partition("=")
        pair, at, arm = pair.partition("@")
        strategy, _, baseline = pair.partition(":")
        if name not in ids or not strategy or not baseline:
            raise SystemExit(f"--proxy {entry!r}: expected ID=STRATEGY:BASELINE[@ARM] with ID one of {', '.join(ids)}")
        proxies[name] = (strategy, baseline, arm if at else None)
    return proxies


def differences(report: dict[str, Any], scenario: str, arm: str, strategy: str, baseline: str,
                metric: str) -> dict[int, float]:
    """Per test seed that ran both, ``100 * (strategy - baseline)`` on ``metric`` (empty if the pair never ran)."""
    runs = report.get("scenarios", {}).get(scenario, {}).get("runs", [])
    by = {(run["strategy"], run["seed"]): run[metric] for run in runs if run["arm"] == arm}
    seeds = sorted({seed for _, seed in by})
    return {seed: 100 * (by[(strategy, seed)] - by[(baseline, seed)]) for seed in seeds
            if (strategy, seed) in by and (baseline, seed) in by}


def calculate(plan: dict[str, Any], reports: dict[str, dict[str, Any]], proxies: dict[str, tuple[str, str, str | None]],
              power: float, least: int, most: int) -> dict[str, Any]:
    """The power calculation of ``plan``'s hypotheses from ``reports`` (name → study report)."""
    hypotheses = plan.get("hypotheses") or []
    if not hypotheses:
        raise SystemExit("the plan has no hypotheses")
    length = tokens(plan["settings"])
    family = {role: sum(h["role"] == role for h in hypotheses) for role in ("primary", "secondary")}
    rows = []
    for hypothesis in hypotheses:
        strategy, baseline, arm = proxies.get(hypothesis["id"], (hypothesis["strategy"], hypothesis["baseline"], None))
        arm = hypothesis["arm"] if arm is None else arm
        sources = []
        for name, report in reports.items():
            if report["plan"]["tokens"] != length:
                continue
            values = differences(report, hypothesis["scenario"], arm, strategy, baseline,
                                 hypothesis["metric"])
            if values:
                sources.append({"report": name, "seeds": list(values), "differences": list(values.values())})
        pooled = [value for source in sources for value in source["differences"]]
        if len(pooled) < 2:
            raise SystemExit(f"{hypothesis['id']}: fewer than two seeds of {strategy} - {baseline} at {length} "
                             "tokens in --reports; give a --proxy")
        effect, sd = mean_std(pooled)
        level = ALPHA / family[hypothesis["role"]]
        pair = f"{strategy} - {baseline}" + (f" ({arm or 'no arm'})" if arm != hypothesis["arm"] else "")
        rows.append({**hypothesis, "data_pair": pair,
                     "proxy": hypothesis["id"] in proxies, "sources": sources, "n_data": len(pooled),
                     "effect_pp": effect, "sd_pp": sd, "alpha": level,
                     "seeds_needed": seeds_for_power(effect, sd, level, power)})
    needs = [r["seeds_needed"] for r in rows if r["role"] == "primary"]
    recommended = max([least] + [n for n in needs if n is not None and n <= most])
    planned = len(plan["test_seeds"])
    for row in rows:
        row["underpowered"] = row["seeds_needed"] is None or row["seeds_needed"] > planned
        row["at_planned"] = {"seeds": planned, **_at(row, planned, power)}
    return {"plan": plan.get("regime"), "tokens": length, "target_power": power, "family_sizes": family,
            "recommended_seeds": recommended, "planned_seeds": planned, "hypotheses": rows}


def _at(row: dict[str, Any], seeds: int, power: float) -> dict[str, float]:
    return {"power": paired_t_power(row["effect_pp"], row["sd_pp"], seeds, row["alpha"]),
            "power_two_thirds_effect": paired_t_power(2 * row["effect_pp"] / 3, row["sd_pp"], seeds, row["alpha"]),
            "detectable_effect_pp": detectable_effect(row["sd_pp"], seeds, row["alpha"], power)}


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['plan']} ({result['tokens']} tokens): recommended {result['recommended_seeds']} seeds, "
          f"the plan has {result['planned_seeds']}")
    for row in result["hypotheses"]:
        at = row["at_planned"]
        print(f"  {row['id']:3s} {row['role']:9s} {row['metric']:16s} {row['data_pair']:34s} n={row['n_data']:2d} "
              f"{row['effect_pp']:+6.2f} sd {row['sd_pp']:5.2f}  alpha {row['alpha']:.4f}  needs "
              f"{row['seeds_needed'] or '>1000'}  power at {at['seeds']}: {at['power']:.2f} "
              f"(2/3 effect {at['power_two_thirds_effect']:.2f}; detects {at['detectable_effect_pp']:.1f} pp)"
              + ("  [proxy]" if row["proxy"] else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = read_mapping(args.plan)
        reports = {path.name: json.loads(path.read_text()) for path in args.reports}
    except (OSError, ValueError) as err:
        print(f"power_calculation: error: {err}", file=sys.stderr)
        return 2
    for path in args.reports:
        if not isinstance(reports[path.name], dict) or not {"plan", "scenarios"} <= set(reports[path.name]):
            print(f"power_calculation: error: --reports {path} is not a study report (report.json)", file=sys.stderr)
            return 2
    ids = [h["id"] for h in plan.get("hypotheses") or []]
    result = calculate(plan, reports, _proxies(args.proxy, ids), args.power, args.least_seeds, args.most_seeds)
    print_table(result)
    if args.json:
        write_json(args.json, {"commit": args.commit or git_commit(short=True, mark_dirty=True) or "unknown",
                               "plan_file": args.plan.name, "method": (
                                   "paired t, two-sided, at the Bonferroni level alpha/m of the hypothesis's family "
                                   "(Holm's first step); effect and SD of the pooled per-seed differences; "
                                   "noncentral t"), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
