"""Sentence views: prose that quotes figures, rendered by ``benchmarks/tables.py`` from a result file.

A sentence view sits in a result file's ``views`` beside the table views::

    "fused-long": {
      "sentence": "Forward and backward together cost {low:.2f}–{high:.2f}× cuDNN's time.",
      "values": {
        "low": {"where": {"mode": "fwd+bwd", "shape": ["1×12×8192×64", "1×12×16384×64"]},
                "column": "fused vs SDPA", "pick": "min"},
        "high": {"where": {"mode": "fwd+bwd", "shape": ["1×12×8192×64", "1×12×16384×64"]},
                 "column": "fused vs SDPA", "pick": "max"}
      }
    }

``sentence`` is a template (``str.format``: each ``{name:spec}`` one of ``values``, ``{source}``
the file's name linked from the document), or a list of templates rendered one a line (bullets).
Each value picks from the file's records: a table file's rows (cells keyed by column name), or
the list of objects that ``in`` names by dotted keys (``"hypotheses"``, ``"plan.test_seeds"``) in
any other file, such as a study report; a mapping of objects there (``"plan.power.hypotheses"``)
is read as its objects, each with its key under ``key``. ``where`` keeps the records whose field
equals a value or lies in a list; ``pick`` is ``"one"`` (the default: exactly one record must
match), ``"min"``, ``"max"`` (of numbers) or ``"count"`` (how many match; no ``column``);
``scale`` multiplies a number (``-1`` quotes a reduction as a positive amount). A value may
instead combine others, so that prose quotes a difference or a share the table does not print:
``{"minus": [a, b]}`` (a − b), ``{"over": [a, b]}`` (a / b) or ``{"plus": [a, b, ...]}``, each
operand a value or a number, and ``scale`` multiplies the result (``100`` for a percentage).
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PICKS = ("one", "min", "max", "count")
ARITHMETIC = {"plus": lambda operands: sum(operands), "minus": lambda operands: operands[0] - operands[1],
              "over": lambda operands: operands[0] / operands[1]}


def _records(data: Mapping[str, Any], spec: Mapping[str, Any], label: str) -> list[Any]:
    """A table file's rows as ``{column: cell}``, or the list that ``spec['in']`` names."""
    if "in" not in spec:
        if "columns" not in data:
            raise ValueError(f"{label}: this file has no table rows; name a list of records with 'in'")
        names = [column["name"] for column in data["columns"]]
        return [dict(zip(names, row)) for row in data["rows"]]
    found: Any = data
    for key in spec["in"].split("."):
        if not isinstance(found, Mapping) or key not in found:
            raise ValueError(f"{label}: 'in' names {spec['in']!r}, which the file lacks (at {key!r})")
        found = found[key]
    if isinstance(found, Mapping) and all(isinstance(record, Mapping) for record in found.values()):
        return [{"key": key, **record} for key, record in found.items()]
    if not isinstance(found, list):
        raise ValueError(f"{label}: 'in' names {spec['in']!r}, which is neither a list nor a mapping of objects")
    return found


def _matches(record: Any, where: Mapping[str, Any], label: str) -> bool:
    for field, wanted in where.items():
        if not isinstance(record, Mapping) or field not in record:
            raise ValueError(f"{label}: 'where' names {field!r}, which the records lack")
        if record[field] not in (wanted if isinstance(wanted, list) else [wanted]):
            return False
    return True


def pick(data: Mapping[str, Any], spec: Mapping[str, Any], label: str) -> Any:
    """One value of a sentence view: the cell, minimum, maximum or count its ``spec`` asks for.

    Raises:
        ValueError: naming ``label`` (the view and value): no record matches, ``pick: one`` matches
            several, or a field, column or pick is unknown.
    """
    how = spec.get("pick", "one")
    if how not in PICKS:
        raise ValueError(f"{label}: 'pick' is one of {', '.join(PICKS)}, not {how!r}")
    chosen = [record for record in _records(data, spec, label) if _matches(record, spec.get("where", {}), label)]
    if how == "count":
        return _scaled(len(chosen), spec, label)
    if not chosen:
        raise ValueError(f"{label}: no record matches {dict(spec.get('where', {}))}")
    if how == "one" and len(chosen) > 1:
        raise ValueError(f"{label}: {len(chosen)} records match {dict(spec.get('where', {}))}; "
                         "narrow 'where' or pick min or max")
    column = spec.get("column")
    if column is None or any(not isinstance(record, Mapping) or column not in record for record in chosen):
        raise ValueError(f"{label}: 'column' must name a field of the records, not {column!r}")
    cells = [record[column] for record in chosen]
    if how != "one" and not all(_is_number(cell) for cell in cells):
        raise ValueError(f"{label}: {how} of {column!r} needs numbers, not {cells}")
    return _scaled({"one": cells[0], "min": min(cells), "max": max(cells)}[how], spec, label)


def _is_number(cell: Any) -> bool:
    return isinstance(cell, (int, float)) and not isinstance(cell, bool)


def _scaled(number: Any, spec: Mapping[str, Any], label: str) -> Any:
    """``number`` times ``spec['scale']``, where the spec has one (which needs a number)."""
    if "scale" not in spec:
        return number
    if not _is_number(number) or not _is_number(spec["scale"]):
        raise ValueError(f"{label}: scale multiplies numbers, not {number!r} by {spec['scale']!r}")
    return number * spec["scale"]


def value(data: Mapping[str, Any], spec: Mapping[str, Any] | float, label: str) -> Any:
    """A value of a sentence view: a number, a :func:`pick`, or ``plus``, ``minus`` or ``over`` of values.

    Raises:
        ValueError: naming ``label``: an operation without its operands, or a value that cannot be picked.
    """
    if _is_number(spec):
        return spec
    operations = [name for name in ARITHMETIC if name in spec]
    if not operations:
        return pick(data, spec, label)
    operands = spec[operations[0]]
    if len(operations) > 1 or not isinstance(operands, list) or len(operands) < 2 or (
            operations[0] != "plus" and len(operands) != 2):
        raise ValueError(f"{label}: one of plus (two or more values), minus or over (two values) per value")
    numbers = [value(data, operand, f"{label}, {operations[0]}[{index}]") for index, operand in enumerate(operands)]
    if not all(_is_number(number) for number in numbers):
        raise ValueError(f"{label}: {operations[0]} needs numbers, not {numbers}")
    if operations[0] == "over" and numbers[1] == 0:
        raise ValueError(f"{label}: over divides by zero")
    return _scaled(ARITHMETIC[operations[0]](numbers), spec, label)


def is_sentence(view: Mapping[str, Any]) -> bool:
    """Whether a result file's view is a sentence view (rather than some columns and rows)."""
    return "sentence" in view


def render_sentence(data: Mapping[str, Any], view: Mapping[str, Any], source: str, label: str) -> list[str]:
    """The lines of a sentence view, its values picked from ``data`` (a result file's contents).

    Args:
        data: the result file's JSON.
        view: the view: ``sentence`` (a template, or a list of them) and ``values``.
        source: the Markdown link to the file from the document, for ``{source}``.
        label: the marker's name, for errors.

    Raises:
        ValueError: naming ``label``: a template names a value the view lacks, a value goes unused,
            a value cannot be made (see :func:`value`) or does not fit its format spec.
    """
    templates = view["sentence"] if isinstance(view["sentence"], list) else [view["sentence"]]
    specs: Mapping[str, Any] = view.get("values", {})
    named = {field for template in templates for _, field, _, _ in string.Formatter().parse(template) if field}
    if named - set(specs) - {"source"}:
        raise ValueError(f"{label}: the sentence names {sorted(named - set(specs) - {'source'})}, "
                         "which 'values' lacks")
    if set(specs) - named:
        raise ValueError(f"{label}: values {sorted(set(specs) - named)} are not in the sentence")
    values = {name: value(data, spec, f"{label}, value {name!r}") for name, spec in specs.items()}
    try:
        return [template.format(source=source, **values) for template in templates]
    except (ValueError, TypeError) as error:  # a format spec that does not fit its value
        raise ValueError(f"{label}: {error}") from None


def keep_sentence_views(path: Path, table: dict[str, Any]) -> dict[str, Any]:
    """``table`` with the sentence views of the result file it replaces at ``path``, where it lacks them.

    A sentence view is the documents' wiring, not a measurement: a rerun that rewrites the file keeps
    it, and ``tables.py --check`` then says whether the new rows still give it every value.
    """
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):  # no earlier file, or none that is JSON: nothing to keep
        return table
    views = old.get("views") if isinstance(old, dict) else None
    kept = {name: view for name, view in (views if isinstance(views, dict) else {}).items()
            if isinstance(view, Mapping) and is_sentence(view) and name not in table.get("views", {})}
    return {**table, "views": {**table.get("views", {}), **kept}} if kept else table
