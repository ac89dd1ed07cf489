"""Render the Markdown tables of README.md and docs/ from the result files in benchmarks/results/.

A document asks for a table between two marker comments::

    <!-- table:kernel-long-bf16 -->
    ...generated...
    <!-- /table -->

The name is a result file's stem (``benchmarks/results/kernel-long-bf16.json``), optionally
with one of the views the file defines (``kernel-long-bf16/headline``: some of its columns and
rows). The exploratory efficacy study's tables draw on its reports side by side (those of
``efficacy-short.json``, ``efficacy-long.json`` and ``efficacy-long4097.json`` that exist):
``efficacy/summary``, ``efficacy/learning`` (naive's learning accuracy per experience),
``efficacy/task-penalty`` (each distilling unit's mean penalty), ``efficacy/<scenario>``,
``efficacy/<scenario>-paired`` and ``efficacy/<scenario>-tuning``. A study report
(``cl-streamkl study --json``, e.g. ``confirm-1025.json``) has the views ``hypotheses``,
``verdicts``, ``<scenario>``, ``<scenario>-paired``, ``<scenario>-tuning`` and ``<scenario>-forgetting`` (one sentence:
each strategy's mean forgetting, for prose that quotes it). Under each table a line names the
file it comes from, the GPU, versions, commit and date.

Prose that quotes a figure asks for a *sentence view* the same way
(``<!-- table:kernel-fused/long -->``): a view holding ``sentence``, a ``str.format`` template
(or a list of them, one a line), and ``values``, each picked from the file's rows (or, with
``in``, from a list of records such as a study report's ``hypotheses``) by ``where``, ``column``
and ``pick`` (one, min, max, count), or combined by ``plus``, ``minus`` and ``over``. It renders
the sentence alone, no source line: it stands by the table it quotes, or links the file with
``{source}``. ``_harness/sentences.py`` documents the format.

A table file holds ``title``, ``gpu``, ``torch``, ``triton`` and where known ``python``,
``timm``, ``avalanche``, ``commit`` (or a ``commit`` column), ``date`` and ``command``;
``columns`` (``name``, ``align`` "right" for numbers, ``format`` a Python format spec for
numeric cells) and ``rows`` (one list of cells per row; text cells are written as they are).

Run from the repository root::

    python benchmarks/tables.py            # rewrite every table in place
    python benchmarks/tables.py --check    # exit 1 naming every table that differs from its file
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _harness import efficacy_tables, sentences
from cl_streamkl.experiment.study import tables as study_tables

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
EFFICACY_REPORTS = ("efficacy-short.json", "efficacy-long.json", "efficacy-long4097.json")
EFFICACY_VIEWS = ("", "paired", "tuning")
MARKED = re.compile(r"(<!-- table:(?P<name>[\w./-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.DOTALL)


def documents(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _link(target: Path, document: Path) -> str:
    return Path(os.path.relpath(target, document.parent)).as_posix()


def _cell(value: Any, column: dict[str, Any]) -> str:
    if value is None:  # a measurement the row's kind does not make
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "format" in column:
        return format(value, column["format"])
    return str(value)


def markdown_table(columns: Sequence[dict[str, Any]], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table: text columns left-aligned, ``align: right`` columns right-aligned."""
    lines = ["| " + " | ".join(column["name"] for column in columns) + " |",
             "|" + "|".join("---:" if column.get("align") == "right" else "---" for column in columns) + "|"]
    lines += ["| " + " | ".join(_cell(value, column) for value, column in zip(row, columns)) + " |" for row in rows]
    return lines


def _select(table: dict[str, Any], view: dict[str, Any]) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """A view's columns (by name, in its order) of the rows whose cells match its ``where``."""
    names = [column["name"] for column in table["columns"]]
    wanted = [names.index(name) for name in view.get("columns", names)]
    where = {names.index(name): allowed for name, allowed in view.get("where", {}).items()}
    rows = [row for row in table["rows"] if all(row[index] in allowed for index, allowed in where.items())]
    return [table["columns"][index] for index in wanted], [[row[index] for index in wanted] for row in rows]


def provenance(table: dict[str, Any], source: str, with_command: bool) -> str:
    """The line under a table: its file, GPU and versions, commit and date, and the command."""
    versions = ", ".join(f"{name} {table[key]}" for key, name in (
        ("torch", "torch"), ("triton", "triton"), ("timm", "timm"), ("avalanche", "avalanche-lib"),
        ("python", "Python")) if key in table)
    commit = f"commit `{table['commit']}`" if "commit" in table else "commit per row"
    line = f"Source: {source}; {table['gpu']}, {versions}; {commit}, {table['date']}."
    if with_command and table.get("command"):
        line += f" Command: `{table['command']}`."
    return line


def _sources(names: Sequence[str], reports: Sequence[dict[str, Any]], document: Path, results: Path) -> str:
    files = " and ".join(f"[`{name}`]({_link(results / name, document)})" for name in names)
    environments = "; ".join(
        f"{report['settings']['tokens']} tokens: {report['environment']['device']}, torch "
        f"{report['environment']['torch']}, triton {report['environment']['triton']}, "
        f"{study_tables.executions(report) or 'commit `' + str(report['environment']['commit']) + '`'}, "
        f"{report['date']}" for report in reports)
    return f"Source: {files} ({environments})."


def _efficacy(view: str, document: Path, results: Path) -> list[str]:
    names = [name for name in EFFICACY_REPORTS if (results / name).is_file()]
    if not names:
        raise ValueError(f"table 'efficacy/{view}': no efficacy report ({', '.join(EFFICACY_REPORTS)})")
    reports = [json.loads((results / name).read_text()) for name in names]
    scenario, _, kind = view.partition("-")
    if view == "summary":
        lines = efficacy_tables.summary(reports)
    elif view == "learning":
        lines = efficacy_tables.learning_table(reports)
    elif view == "task-penalty":
        lines = efficacy_tables.penalty_table(reports, "task")
    elif kind == "paired":
        lines = study_tables.paired_table(reports, scenario)
    elif kind == "tuning":
        lines = [line for report in reports for line in [*study_tables.tuning_table(report, scenario), ""]][:-1]
    else:
        lines = [f"Chosen on validation: {study_tables.chosen_settings(reports, scenario)}.", "",
                 *study_tables.strategy_table(reports, scenario)]
    return lines + ["", _sources(names, reports, document, results)]


def _study(report: dict[str, Any], view: str, source: str) -> list[str]:
    """A study report's views: ``hypotheses``, ``verdicts`` (one sentence per primary hypothesis),
    ``<scenario>`` (mean ± std per strategy), ``<scenario>-paired``, ``<scenario>-tuning`` (the
    validation runs per setting) and ``<scenario>-forgetting``."""
    scenario, _, kind = view.partition("-")
    if view == "hypotheses":
        lines = study_tables.hypotheses_table(report)
    elif view == "verdicts":
        lines = study_tables.verdict_lines(report)
    elif scenario in report["scenarios"] and kind == "forgetting":
        lines = [forgetting_sentence(report, scenario)]
    elif scenario in report["scenarios"] and kind == "tuning":
        lines = study_tables.tuning_table(report, scenario)
    elif scenario in report["scenarios"] and kind in ("", "paired"):
        lines = (study_tables.paired_table([report], scenario) if kind else
                 study_tables.strategy_table([report], scenario))
    else:
        raise ValueError(f"study report {source}: views are hypotheses, verdicts, "
                         "<scenario>[-paired|-tuning|-forgetting]")
    environment = report["environment"]
    return lines + ["", f"Source: {source} ({environment['device']}, torch {environment['torch']}, triton "
                        f"{environment['triton']}, {study_tables.executions(report)}, {report['date']})."]


def forgetting_sentence(report: dict[str, Any], scenario: str) -> str:
    """One sentence: each tested strategy's mean forgetting in ``scenario``, lowest first."""
    table = study_tables.part_of(report, scenario)["table"]
    if not table:
        raise ValueError(f"study report: no test runs in scenario {scenario!r}")
    ranked = sorted(table.items(), key=lambda item: item[1]["forgetting"][0])
    seeds = len(ranked[0][1]["seeds"])
    means = ", ".join(f"{label} {row['forgetting'][0]:.1f} %" for label, row in ranked)
    return (f"Forgetting in the {scenario} scenario at {report['settings']['tokens']} tokens, mean over {seeds} "
            f"seeds, lowest first: {means}.")


def _efficacy_view(view: str) -> bool:
    """Whether ``efficacy/view`` names an efficacy table (see the module's docstring)."""
    scenario, _, kind = view.partition("-")
    return (view in ("summary", "learning", "task-penalty")
            or (scenario in study_tables.SCENARIOS and kind in EFFICACY_VIEWS))


def render(name: str, document: Path, results: Path = RESULTS) -> str:
    """The generated text between a ``<!-- table:name -->`` marker and its end, for ``document``.

    Raises:
        ValueError: no result file or view of that name.
    """
    stem, _, view = name.partition("/")
    if stem == "efficacy":
        if not _efficacy_view(view):
            raise ValueError(f"table {name!r}: efficacy tables are efficacy/summary, efficacy/learning, "
                             "efficacy/task-penalty and efficacy/<class|task|domain>[-paired|-tuning]")
        return "\n".join(_efficacy(view, document, results)) + "\n"
    path = results / f"{stem}.json"
    if not path.is_file():
        raise ValueError(f"table {name!r}: no result file {path.relative_to(results.parent.parent)}")
    table = json.loads(path.read_text())
    source = f"[`{path.name}`]({_link(path, document)})"
    if view and sentences.is_sentence(table.get("views", {}).get(view, {})):
        return "\n".join(sentences.render_sentence(table, table["views"][view], source, name)) + "\n"
    if "plan_fingerprint" in table:  # a study report (cl-streamkl study --json)
        return "\n".join(_study(table, view, source)) + "\n"
    if view and view not in table.get("views", {}):
        raise ValueError(f"table {name!r}: {path.name} has no view {view!r}")
    columns, rows = _select(table, table["views"][view]) if view else (table["columns"], table["rows"])
    return "\n".join(markdown_table(columns, rows) + ["", provenance(table, source, not view)]) + "\n"


def regenerate(document: Path, results: Path = RESULTS) -> str:
    """``document``'s text with every marked table rendered afresh."""
    return MARKED.sub(lambda m: m.group(1) + render(m.group("name"), document, results) + m.group(4),
                      document.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a document's table differs from its result file")
    args = parser.parse_args(argv)
    stale = []
    for document in documents():
        try:
            text = regenerate(document)
        except ValueError as error:
            print(f"{document.relative_to(ROOT)}: {error}", file=sys.stderr)
            return 2
        if text != document.read_text():
            stale.append(document)
            if not args.check:
                document.write_text(text)
    for document in stale:
        if args.check:
            print(f"{document.relative_to(ROOT)}: differs from benchmarks/results/", file=sys.stderr)
        else:
            print(f"{document.relative_to(ROOT)}: rewritten from benchmarks/results/")
    if args.check and stale:
        print("run: python benchmarks/tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
