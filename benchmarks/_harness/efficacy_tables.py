"""The project's efficacy study's own Markdown views, beside the generic tables of
:mod:`cl_streamkl.experiment.study.tables`: naive's learning accuracy, each distilling unit's
penalty, the conclusion and the goal lines, over the reports of ``benchmarks/studies/`` (one
per regime: ``benchmarks/results/efficacy-short.json``, ``-long.json``, ``-long4097.json``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from cl_streamkl.experiment.study.tables import HOLM_LEVEL, SCENARIOS, TITLES, part_of, status, strategy_table


def learning_table(reports: Sequence[dict[str, Any]], strategy: str = "naive") -> list[str]:
    """Were the experiences learned? ``strategy``'s learning accuracy per experience (the accuracy
    on it right after training on it, the accuracy matrix's diagonal), mean and lowest over the
    test seeds, per scenario and regime.

    The study's bar, checked once by the calibration on five two-class experiences, is 80 % for
    every experience; this table checks it in the study's own splits, seed by seed.
    """
    rows = []
    for scenario in SCENARIOS:
        for report in reports:
            diagonals = [[run["accuracy_matrix"][i][i] for i in range(len(run["accuracy_matrix"]))]
                         for run in part_of(report, scenario)["runs"] if run["label"] == strategy]
            if diagonals:
                rows.append((scenario, report["settings"]["tokens"], diagonals))
    if not rows:
        return [f"No test runs of {strategy} yet."]
    width = max(len(diagonal) for _, _, diagonals in rows for diagonal in diagonals)
    lines = ["| scenario | tokens | seeds | " + " | ".join(f"experience {i + 1}" for i in range(width)) + " |",
             "|---|---:|---:|" + "---:|" * width]
    for scenario, tokens, diagonals in rows:
        cells = []
        for i in range(width):
            values = [100 * diagonal[i] for diagonal in diagonals if i < len(diagonal)]
            cells.append(f"{sum(values) / len(values):.1f} (lowest {min(values):.1f})" if values else "–")
        lines.append(f"| {scenario} | {tokens} | {len(diagonals)} | " + " | ".join(cells) + " |")
    return lines


def penalty_table(reports: Sequence[dict[str, Any]], scenario: str = "task") -> list[str]:
    """How large the distillation penalty ran: each test unit's mean over its training steps of the
    weighted penalty (StreamKL: alpha × the mean KL per query row over the blocks; PAD: its
    weight × its distance), per seed, per regime and distilling strategy of ``scenario``.

    The penalty is 0 through the first experience (no teacher yet) and those steps count in the mean.
    """
    rows = []
    for report in reports:
        per_strategy: dict[str, list[tuple[int, float]]] = {}
        for record in report.get("records", {}).values():
            unit = record["unit"]
            if unit["part"] != "test" or unit["scenario"] != scenario or record.get("mean_penalty") is None:
                continue
            label = unit["strategy"] + (f" ({unit['arm']})" if unit["arm"] else "")
            per_strategy.setdefault(label, []).append((int(record["seed"]), float(record["mean_penalty"])))
        for label, values in sorted(per_strategy.items()):
            values.sort()
            rows.append(f"| {report['settings']['tokens']} | {label} | {len(values)} | "
                        + ", ".join(f"{value:.3g}" for _, value in values)
                        + f" | {statistics.median(value for _, value in values):.3g} |")
    if not rows:
        return [f"No distilling test units in {scenario} yet."]
    return ["| tokens | strategy | seeds | mean penalty per seed (seed order) | median |",
            "|---:|---|---:|---|---:|", *rows]


def conclusion(reports: Sequence[dict[str, Any]]) -> list[str]:
    """One line per scenario: the StreamKL comparisons whose Holm-adjusted p is below 0.05, per regime.

    Holm's family is every paired comparison of a regime's report, so while its test part is
    unfinished the family is smaller than it will be and the adjusted p-values are too small:
    such a regime's findings are marked interim.
    """
    lines = []
    for scenario in SCENARIOS:
        found = []
        for report in reports:
            done, total = report["units"]["test"]
            interim = f", interim: {done}/{total} test units" if done < total else ""
            for entry in part_of(report, scenario)["paired"]:
                holm = entry["p_holm"]
                if "streamkl" in entry["strategy"] and holm is not None and holm < HOLM_LEVEL:
                    found.append(f"{entry['strategy']} − {entry['baseline']} {TITLES[entry['metric']]} "
                                 f"{entry['mean_diff']:+.1f} pp (p {holm:.2g}, {report['settings']['tokens']} tok.{interim})")
        runs = any(part_of(report, scenario)["runs"] for report in reports)
        text = ("not run yet" if not runs else
                "; ".join(found) if found else "no StreamKL difference survives Holm's correction")
        lines.append(f"- {scenario}-incremental: {text}.")
    return lines


# The study's goal, fixed before its test runs: at 1025 tokens a StreamKL strategy beats the same
# strategy without it (alone, on LwF, on replay) in stream accuracy or forgetting, Holm-adjusted,
# in at least GOAL_SCENARIOS scenarios, and is nowhere significantly worse than PAD in its place;
# at 4097 tokens those gains hold in the scenarios run there. Seeds: at least GOAL_SEEDS.
GOAL_SCENARIOS = 2
GOAL_SEEDS = {"long": 8, "long4097": 5}
GOAL_TOKENS = {"long": 1025, "long4097": 4097}  # the plans of benchmarks/studies/
GOAL_METRICS = {"stream_accuracy": 1.0, "forgetting": -1.0}  # the sign of a StreamKL gain
GOAL_BASES = ("naive", "lwf", "replay")  # StreamKL alone, added to LwF, added to replay
GOAL = ("Against the study's goal (at 1025 tokens StreamKL alone, added to LwF or added to replay beats the same "
        f"strategy without it in stream accuracy or forgetting, Holm-adjusted p below {HOLM_LEVEL} over at least "
        f"{GOAL_SEEDS['long']} seeds, in at least {GOAL_SCENARIOS} scenarios, and is nowhere significantly worse "
        f"than PAD in its place; at 4097 tokens those gains hold over at least {GOAL_SEEDS['long4097']} seeds):")


# The rule, fixed before any 4097-token run, for the scenarios that regime runs: those where at 1025
# tokens one of these comparisons is a Holm-significant StreamKL gain; the fallback where none is.
DECISIVE = (("streamkl", "naive"), ("lwf+streamkl", "lwf"))
FALLBACK_SCENARIO = "task"  # where the earlier, unequally tuned study saw the effect


def _without_streamkl(strategy: str) -> str:
    """``lwf+streamkl`` → ``lwf``, ``replay+streamkl (mem200)`` → ``replay (mem200)``, ``streamkl`` → ``naive``."""
    return "naive" if strategy == "streamkl" else strategy.replace("+streamkl", "")


def _goal_comparison(entry: dict[str, Any]) -> bool:
    """Whether a paired entry is one the goal counts: StreamKL alone, on LwF or on replay against
    the same strategy without it (any metric)."""
    base = _without_streamkl(entry["strategy"])
    return ("streamkl" in entry["strategy"] and entry["baseline"] == base
            and base.partition(" ")[0] in GOAL_BASES)


def _pad_in_place(strategy: str) -> str:
    """The strategy with PAD in StreamKL's place: ``lwf+streamkl`` → ``lwf+pad``."""
    return strategy.replace("streamkl", "pad")


def _significant(entry: dict[str, Any], regime: str, sign: float) -> bool:
    """A paired entry with enough seeds whose Holm-adjusted p is below the level, its
    difference of the given sign (1: StreamKL's favour, -1: against it)."""
    holm = entry.get("p_holm")
    return (entry["metric"] in GOAL_METRICS and entry["n"] >= GOAL_SEEDS[regime] and holm is not None
            and holm < HOLM_LEVEL and sign * GOAL_METRICS[entry["metric"]] * entry["mean_diff"] > 0)


def decisive_scenarios(report: dict[str, Any]) -> list[str]:
    """The scenarios a costlier regime runs, chosen from a finished ``report`` by the fixed rule.

    Those where streamkl − naive or lwf+streamkl − lwf (:data:`DECISIVE`) differs in stream
    accuracy or forgetting in StreamKL's favour with a Holm-adjusted p below :data:`HOLM_LEVEL`
    over at least the goal's seeds; :data:`FALLBACK_SCENARIO` when none does.

    Raises:
        ValueError: the report's test part is unfinished (its Holm family is not final yet).
    """
    done, total = report["units"]["test"]
    if done < total:
        raise ValueError(f"the report's test part is unfinished ({done}/{total} units), so its Holm-adjusted "
                         "p-values are not final")
    chosen = [scenario for scenario in SCENARIOS
              if any((entry["strategy"], entry["baseline"]) in DECISIVE and _significant(entry, report["regime"], 1)
                     for entry in part_of(report, scenario)["paired"])]
    return chosen or [FALLBACK_SCENARIO]


def _finding(entry: dict[str, Any]) -> str:
    return (f"{entry['strategy']} − {entry['baseline']} {TITLES[entry['metric']]} {entry['mean_diff']:+.1f} pp "
            f"(p {entry['p_holm']:.2g}, {entry['n']} seeds)")


def _pair_numbers(entries: list[dict[str, Any]]) -> str:
    """One pair's entries (same strategy and baseline) in words: each metric's difference, 95 %
    interval and Holm's p, then the seeds."""
    first = entries[0]
    metrics = ", ".join(f"{TITLES[e['metric']]} {e['mean_diff']:+.1f} pp [{e['ci95'][0]:+.1f}, {e['ci95'][1]:+.1f}] "
                        f"(p {e['p_holm']:.2g})" for e in entries)
    return f"{first['strategy']} − {first['baseline']}: {metrics}, {first['n']} seeds"


def _both_metrics(entry: dict[str, Any], report: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    """``entry`` and its pair's entries in the other goal metrics, in :data:`GOAL_METRICS`' order."""
    pair = (entry["strategy"], entry["baseline"])
    same = {e["metric"]: e for e in part_of(report, scenario)["paired"] if (e["strategy"], e["baseline"]) == pair}
    return [same[metric] for metric in GOAL_METRICS if metric in same]


def _closest(entry: dict[str, Any], best: dict[str, Any] | None) -> bool:
    """Whether ``entry`` (a goal metric, in StreamKL's favour, with a Holm p) is nearer a gain
    than ``best``: the smaller Holm-adjusted p, then the larger difference."""
    if entry["metric"] not in GOAL_METRICS or entry.get("p_holm") is None:
        return False
    if GOAL_METRICS[entry["metric"]] * entry["mean_diff"] <= 0:
        return False
    key = (entry["p_holm"], -abs(entry["mean_diff"]))
    return best is None or key < (best["p_holm"], -abs(best["mean_diff"]))


def _gains(entries: Iterable[tuple[str, dict[str, Any]]], regime: str
           ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """Of (scenario, goal comparison) pairs: per scenario the significant StreamKL gains, and the
    entry nearest to one (:func:`_closest`) among the rest."""
    found: dict[str, list[dict[str, Any]]] = {}
    nearest: dict[str, dict[str, Any]] = {}
    for scenario, entry in entries:
        if _significant(entry, regime, 1):
            found.setdefault(scenario, []).append(entry)
        elif _closest(entry, nearest.get(scenario)):
            nearest[scenario] = entry
    return found, nearest


def _comparisons(entries: dict[str, list[dict[str, Any]]]) -> set[tuple[str, str, str, str]]:
    """Paired entries by scenario as (scenario, strategy, baseline, metric): what two regimes share."""
    return {(scenario, e["strategy"], e["baseline"], e["metric"])
            for scenario, listed in entries.items() for e in listed}


def _against(entries: Iterable[tuple[str, dict[str, Any]]], report: dict[str, Any]) -> list[str]:
    """The goal's comparisons and those against PAD in StreamKL's place that go against StreamKL
    in a goal metric with a 95 % interval excluding 0, Holm-significant or not: per pair, both
    metrics in words (:func:`_pair_numbers`)."""
    pairs: dict[tuple[str, str, str], dict[str, Any]] = {}
    for scenario, entry in entries:
        if not (_goal_comparison(entry) or entry["baseline"] == _pad_in_place(entry["strategy"])):
            continue
        if entry["metric"] not in GOAL_METRICS or entry["n"] < GOAL_SEEDS[report["regime"]]:
            continue
        low, high = entry["ci95"]
        if GOAL_METRICS[entry["metric"]] * entry["mean_diff"] < 0 and (low > 0 or high < 0):
            pairs.setdefault((scenario, entry["strategy"], entry["baseline"]), entry)
    return [f"{scenario}: {_pair_numbers(_both_metrics(entry, report, scenario))}"
            for (scenario, _, _), entry in pairs.items()]


def goal(reports: Sequence[dict[str, Any]]) -> list[str]:
    """The study's goal, judged from the 1025- and 4097-token reports: one line each, and PAD.

    A regime whose test part is unfinished is judged on what it holds, marked interim.
    """
    by_regime = {report["regime"]: report for report in reports}
    lines = []
    gains: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for regime in GOAL_SEEDS:
        tokens = GOAL_TOKENS[regime]
        report = by_regime.get(regime)
        done, total = (0, 0) if report is None else report["units"]["test"]
        if not done:
            lines.append(f"- {tokens} tokens: not run yet.")
            continue
        interim = f" (interim: {done}/{total} test units)" if done < total else ""
        paired = [(scenario, entry) for scenario in SCENARIOS for entry in part_of(report, scenario)["paired"]]
        found, nearest = _gains([(scenario, entry) for scenario, entry in paired if _goal_comparison(entry)], regime)
        worse = [(scenario, entry) for scenario, entry in paired
                 if entry["baseline"] == _pad_in_place(entry["strategy"]) and _significant(entry, regime, -1)]
        gains[regime] = found
        where = "; ".join(f"{scenario}: " + ", ".join(_finding(e) for e in entries)
                          for scenario, entries in found.items()) or "none"
        # Where it is not so, the numbers: each scenario's goal comparison nearest to a gain, in
        # both goal metrics (a pair that forgets less may also score lower).
        missed = [f"{scenario}: {_pair_numbers(_both_metrics(entry, report, scenario))}"
                  for scenario, entry in nearest.items() if scenario not in found]
        if missed:
            where += ". Nearest to a gain where none is significant: " + "; ".join(missed)
        if regime == "long":
            verdict = "so far" if interim else "met" if len(found) >= GOAL_SCENARIOS else "not met"
            need = f"{len(found)} of the {GOAL_SCENARIOS} scenarios needed, {verdict}"
        else:
            # Only the comparisons this regime makes: its plan runs a few strategies (no replay).
            tested = _comparisons({scenario: part_of(report, scenario)["paired"] for scenario in SCENARIOS})
            wanted = tested & _comparisons(gains.get("long", {}))
            held = _comparisons(found)
            need = (f"{len(wanted & held)} of the {len(wanted)} gains seen at 1025 tokens that it tests hold" if wanted
                    else "no gain seen at 1025 tokens among the comparisons it makes")
        against_pad = ("Significantly worse than PAD: " + "; ".join(f"{scenario}: {_finding(e)}" for scenario, e in worse)
                       if worse else "Nowhere significantly worse than PAD")
        # What goes against StreamKL, said as plainly as its gains, uncorrected intervals included.
        against = _against(paired, report)
        against_text = (" Against StreamKL, with a 95 % interval excluding 0: " + "; ".join(against) + "."
                        if against else "")
        lines.append(f"- {tokens} tokens{interim}: StreamKL gains ({need}): {where}. {against_pad}.{against_text}")
    return lines


def goal_family(reports: Sequence[dict[str, Any]]) -> list[str]:
    """The 1025-token verdict with Holm's family narrowed to the goal's own comparisons, once that
    regime's test part has finished: one line, or none.

    The study fixed its family (every paired entry of the report) before its test runs; a reader
    may ask whether so broad a family alone sinks the gains. This is that check, chosen after the
    test runs, so a sensitivity reading, never the verdict: Holm over the goal's comparisons in
    its two metrics, each scenario's gains, and where a scenario has none its smallest adjusted p
    in StreamKL's favour.
    """
    from cl_streamkl.experiment.statistics import holm_adjust

    report = next((report for report in reports if report["regime"] == "long"), None)
    if report is None or report["units"]["test"][0] < report["units"]["test"][1]:
        return []
    family = [(scenario, entry) for scenario in SCENARIOS for entry in part_of(report, scenario)["paired"]
              if _goal_comparison(entry) and entry["metric"] in GOAL_METRICS and entry.get("p_value") is not None]
    adjusted = holm_adjust([entry["p_value"] for _, entry in family])
    found, nearest = _gains([(scenario, {**entry, "p_holm": p}) for (scenario, entry), p in zip(family, adjusted)],
                            "long")
    where = "; ".join(f"{scenario}: " + ", ".join(_finding(e) for e in entries) for scenario, entries in found.items())
    missed = "; ".join(f"{scenario}: {_finding(entry)}" for scenario, entry in nearest.items() if scenario not in found)
    met = len(found) >= GOAL_SCENARIOS
    met_before = len(_gains(family, "long")[0]) >= GOAL_SCENARIOS
    hinges = "does not hinge" if met == met_before else "hinges"
    return [f"- The 1025-token verdict {hinges} on the family's breadth: with Holm over only the goal's "
            f"{len(family)} comparisons (a check chosen after the test runs), StreamKL gains in {len(found)} of the "
            f"{GOAL_SCENARIOS} scenarios needed ({'met' if met else 'not met'}): {where or 'none'}"
            + (f". Smallest adjusted p elsewhere: {missed}" if missed else "") + "."]


def summary(reports: Sequence[dict[str, Any]]) -> list[str]:
    """README's section: how far each regime is (while one is unfinished), per scenario stream accuracy
    and forgetting per strategy, then the conclusion."""
    statuses = "; ".join(status(report) for report in reports)
    if not any(part["runs"] for report in reports for part in report["scenarios"].values()):
        return [f"The study has not been run at these settings yet ({statuses})."]
    unfinished = any(done < total for report in reports for done, total in report["units"].values())
    # A dash in a table is then a unit not run yet: the status line says how far each regime is.
    lines = [f"Status: {statuses}.", ""] if unfinished else []
    for scenario in SCENARIOS:
        lines += [f"**{scenario}-incremental**", "",
                  *strategy_table(reports, scenario, ("stream_accuracy", "forgetting")), ""]
    return lines + conclusion(reports) + ["", GOAL, "", *goal(reports), *goal_family(reports)]
