"""A study's Markdown tables, from its reports (``cl-streamkl study --json``).

Reports of several regimes of one study sit side by side per scenario. Cells are percent,
mean ± sample std over the test seeds; paired differences are percentage points with the raw
95 % t-interval and the Holm-adjusted p-value, bold where that p-value is below 0.05. A report
whose study has not finished shows what it holds and how many units are done. A confirmatory
report adds one row per hypothesis with its verdict.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCENARIOS = ("class", "task", "domain")
TITLES = {"stream_accuracy": "stream acc", "mean_experience_accuracy": "mean exp. acc", "forgetting": "forgetting",
          "learning_accuracy": "learning acc", "task_il_accuracy": "Task-IL acc"}
PAIRED_COLUMNS = ("mean_experience_accuracy", "stream_accuracy", "forgetting")
HOLM_LEVEL = 0.05
# What every study report holds (``--json``, ``--tables``).
REPORT_KEYS = ("plan", "plan_fingerprint", "settings", "units", "scenarios")


def part_of(report: dict[str, Any], scenario: str) -> dict[str, Any]:
    """A report's scenario, or an empty one where its plan leaves the scenario out."""
    return report["scenarios"].get(scenario, {"tuning": {}, "chosen": None, "chosen_from": None, "runs": [],
                                              "table": {}, "paired": []})


def status(report: dict[str, Any]) -> str:
    """``1025 tokens: tune 40/104 units, test 0/240 units (plan 0123abcd...)``."""
    units = ", ".join(f"{part} {done}/{total} units" for part, (done, total) in report["units"].items())
    return f"{report['settings']['tokens']} tokens: {units} (plan `{report['plan_fingerprint']}`)"


def _part_order(item: tuple[str, int]) -> bool:
    """Tuning before test, whatever order the units finished in."""
    return item[0].startswith(PART_WORDS["test"])


# How the source line names a unit's part and execution, in words a reader needs no glossary for.
PART_WORDS = {"first": "shared first experiences", "tune": "validation runs", "test": "test runs"}
MODE_WORDS = {"eager": "eager", "compile-model": "whole model compiled", "compile-layers": "layers compiled"}


def executions(report: dict[str, Any]) -> str:
    """Which commits ran the report's finished units, and how: ``commit `52b3055` (70 validation runs, eager)``.

    A study resumed over several days and machines mixes commits and compile settings; each
    unit's record names its own, and the line under a table counts them so that a reader sees
    which paired comparisons ran under which (the study switches settings only between parts).
    Records written before units named their commit count as ``commit not recorded``.
    """
    runs: dict[str | None, Counter[str]] = {}
    for record in report.get("records", {}).values():
        execution = record.get("execution") or {}
        mode = ("compile-model" if execution.get("compile_model") else
                "compile-layers" if execution.get("compile_layers") else "eager")
        part = record["unit"]["part"]
        runs.setdefault(execution.get("commit"), Counter())[f"{PART_WORDS.get(part, part)}, {MODE_WORDS[mode]}"] += 1
    return ", ".join(
        f"{'commit not recorded' if commit is None else f'commit `{commit}`'} ("
        + "; ".join(f"{count} {what}" for what, count in sorted(counts.items(), key=_part_order)) + ")"
        for commit, counts in runs.items())


def _setting(setting: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}"
                     for key, value in setting.items())


def chosen_settings(reports: Sequence[dict[str, Any]], scenario: str) -> str:
    """Each regime's settings chosen on validation: ``17 tokens: lwf (lwf_alpha 4, ...); ...``."""
    parts = []
    for report in reports:
        chosen = part_of(report, scenario)["chosen"]
        text = ("not planned" if scenario not in report["scenarios"] else "tuning not finished" if chosen is None else
                "; ".join(f"{family} ({_setting(setting)})" for family, setting in chosen.items()))
        parts.append(f"{report['settings']['tokens']} tokens: {text}")
    return ". ".join(parts)


def _metrics(scenario: str) -> list[str]:
    return [*TITLES][:4] + (["task_il_accuracy"] if scenario == "class" else [])


def strategy_table(reports: Sequence[dict[str, Any]], scenario: str, metrics: Sequence[str] | None = None
                   ) -> list[str]:
    """Mean ± std per strategy and regime (``–`` where a regime has no runs of it)."""
    metrics = list(metrics or _metrics(scenario))
    tables = [part_of(report, scenario)["table"] for report in reports]
    if not any(tables):
        return ["No test runs yet: " + "; ".join(status(report) for report in reports) + "."]
    header = [f"{TITLES[m]}, {r['settings']['tokens']} tok." for r in reports for m in metrics]
    lines = ["| strategy | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for label in dict.fromkeys(label for table in tables for label in table):
        cells = []
        for table in tables:
            row = table.get(label, {})
            cells += [f"{row[m][0]:.1f} ± {row[m][1]:.1f}" if m in row else "–" for m in metrics]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _difference(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "–"
    low, high = entry["ci95"]
    text = f"{entry['mean_diff']:+.1f}" + ("" if low is None else f" [{low:+.1f}, {high:+.1f}]")
    if entry["p_holm"] is None:
        return text
    text += f" p {entry['p_holm']:.2g}"
    return f"**{text}**" if entry["p_holm"] < HOLM_LEVEL else text


def paired_table(reports: Sequence[dict[str, Any]], scenario: str, metrics: Sequence[str] = PAIRED_COLUMNS
                 ) -> list[str]:
    """Paired differences (with − without) per regime: mean [raw 95 % CI] and Holm-adjusted p."""
    parts = [part_of(report, scenario)["paired"] for report in reports]
    if not any(parts):
        return ["No paired differences yet."]
    header = [f"{TITLES[m]}, {r['settings']['tokens']} tok." for r in reports for m in metrics]
    lines = ["| paired difference (pp, 95 % CI, Holm p) | " + " | ".join(header) + " |",
             "|---|" + "---:|" * len(header)]
    for strategy, baseline in dict.fromkeys((e["strategy"], e["baseline"]) for part in parts for e in part):
        cells = []
        for part in parts:
            entries = {e["metric"]: e for e in part if (e["strategy"], e["baseline"]) == (strategy, baseline)}
            cells += [_difference(entries.get(m)) for m in metrics]
        lines.append(f"| {strategy} − {baseline} | " + " | ".join(cells) + " |")
    return lines


def _listed(value: str | list[str]) -> list[str]:
    return value if isinstance(value, list) else [value]


def tuning_table(report: dict[str, Any], scenario: str) -> list[str]:
    """Every validation setting of every method: per-seed and mean validation accuracy, the choice in bold."""
    seeds = report["plan"]["val_seeds"]
    part = part_of(report, scenario)
    if part["chosen_from"] is not None or scenario not in report["scenarios"]:
        return [] if part["chosen_from"] is None else [
            f"{report['settings']['tokens']} tokens: settings taken from plan "
            + " and ".join(f"`{fp}`" for fp in _listed(part["chosen_from"])) + ", not tuned."]
    lines = [f"| method ({report['settings']['tokens']} tokens) | setting | "
             + " | ".join(f"seed {s}" for s in seeds) + " | mean |", "|---|---|" + "---:|" * (len(seeds) + 1)]
    for family, table in part["tuning"].items():
        for row in table["rows"]:
            values = [row["per_seed"][str(s)] for s in seeds] + [row["mean"]]
            cells = ["–" if v is None else f"{v:.1f}" for v in values]
            setting = _setting(row["setting"])
            if row["setting"] == table["chosen"]:
                setting = f"**{setting}**"
            lines.append(f"| {family} | {setting} | " + " | ".join(cells) + " |")
    return lines


def side_by_side(reports: Sequence[dict[str, Any]]) -> str:
    """Per scenario: settings chosen, the strategy table, the paired table, each report's tuning table."""
    lines = ["Status: " + "; ".join(status(report) for report in reports) + ".", ""]
    for report in reports:
        verdicts = hypotheses_table(report)
        lines += verdicts + [""] if verdicts else []
    for scenario in SCENARIOS:
        if not any(scenario in report["scenarios"] for report in reports):
            continue
        lines += [f"**{scenario}-incremental** (chosen on validation: {chosen_settings(reports, scenario)})", ""]
        lines += strategy_table(reports, scenario) + [""] + paired_table(reports, scenario) + [""]
        for report in reports:
            tuning = tuning_table(report, scenario)
            lines += tuning + [""] if tuning else []
    return "\n".join(lines)


def hypotheses_table(report: dict[str, Any]) -> list[str]:
    """A confirmatory report's verdicts: one row per hypothesis, with learning accuracy and the final
    accuracy on earlier experiences (strategy − baseline) beside it."""
    entries = report.get("hypotheses") or []
    if not entries:
        return []
    lines = ["| hypothesis | role | scenario | comparison | metric (claimed) | seeds | difference, pp [95 % CI] | "
             "Holm p | verdict | learning acc. diff | earlier-exp. final acc. diff |",
             "|---|---|---|---|---|---:|---:|---:|---|---:|---:|"]
    for e in entries:
        arm = f" ({e['arm']})" if e["arm"] else ""
        low, high = e["ci95"]
        diff = "–" if e["mean_diff"] is None else f"{e['mean_diff']:+.1f}" + (
            "" if low is None else f" [{low:+.1f}, {high:+.1f}]")
        beside = [f"{e['beside'][m]['mean_diff']:+.1f}" if m in e["beside"] else "–"
                  for m in ("learning_accuracy", "earlier_final_accuracy")]
        p = "–" if e.get("p_holm") is None else f"{e['p_holm']:.2g}"
        verdict = f"**{e['verdict']}**" if e["verdict"] == "confirmed" else e["verdict"]
        lines.append(f"| {e['id']} | {e['role']} | {e['scenario']} | {e['strategy']}{arm} − {e['baseline']}{arm} | "
                     f"{TITLES.get(e['metric'], e['metric'])} ({e['direction']}) | {len(e['seeds'])} | {diff} | {p} | "
                     f"{verdict} | {beside[0]} | {beside[1]} |")
    return lines


def _comparison_text(entry: dict[str, Any]) -> str:
    arm = f" ({entry['arm']})" if entry["arm"] else ""
    return f"{entry['strategy']}{arm} − {entry['baseline']}{arm}"


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """One plain sentence per primary hypothesis, its secondary beside it: verdict, effect, interval."""
    entries = report.get("hypotheses") or []
    secondary = {(e["scenario"], e["arm"], e["strategy"], e["baseline"]): e for e in entries if e["role"] == "secondary"}
    lines = []
    for e in entries:
        if e["role"] != "primary" or e["mean_diff"] is None:
            continue
        low, high = e["ci95"]
        line = (f"- **{e['verdict'].capitalize()}** ({e['id']}, {e['scenario']} scenario, {_comparison_text(e)}): "
                f"{TITLES.get(e['metric'], e['metric'])} {e['mean_diff']:+.1f} pp [{low:+.1f}, {high:+.1f}], "
                f"Holm p {e['p_holm']:.2g}, {len(e['seeds'])} seeds")
        other = secondary.get((e["scenario"], e["arm"], e["strategy"], e["baseline"]))
        if other is not None and other["mean_diff"] is not None:
            low, high = other["ci95"]
            line += (f"; {TITLES.get(other['metric'], other['metric'])} {other['mean_diff']:+.1f} pp "
                     f"[{low:+.1f}, {high:+.1f}] ({other['verdict']})")
        if "learning_accuracy" in e["beside"]:
            line += f"; learning acc {e['beside']['learning_accuracy']['mean_diff']:+.1f} pp (not tested)"
        lines.append(line + ".")
    return lines


def tables_of(paths: Sequence[Path]) -> str:
    """:func:`side_by_side` of the reports at ``paths`` (``--tables``).

    Raises:
        StudyFileError: a file is unreadable or no complete study report (a key its tables
            read is missing or of another type); one line naming it.
    """
    from cl_streamkl.experiment.study.files import StudyFileError, read_json

    reports = []
    for path in paths:
        report = read_json(path, "--tables")
        if not set(REPORT_KEYS) <= set(report):
            raise StudyFileError(f"--tables {path} is not a study report (cl-streamkl study's report.json)")
        try:
            side_by_side([report])
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            reason = f"it lacks the key {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
            raise StudyFileError(f"--tables {path} is not a complete study report ({reason})") from None
        reports.append(report)
    return side_by_side(reports)
