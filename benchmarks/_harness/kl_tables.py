"""Turn the raw output of the kernel benchmarks into table files of ``benchmarks/results/``.

``benchmarks/tables.py`` renders a table file (title, GPU, versions, commit, date, command,
columns, rows) into the documents. This module makes those files from what the scripts wrote:

* ``known-lse RAW.json``: ``bench_attention_kl.py --json`` with the ``triton``, ``triton_onepass``,
  ``triton_lse``, ``triton_lse_onepass`` and ``sdpa`` implementations → one row per (shape, mode).
* ``grouped-known-lse RAW.json``: ``grouped_and_exp_gpu.py --json`` → one row per (shape, mode).
* ``fused RAW.json``: ``bench_attention_kl.py --json`` with ``sdpa``, ``sdpa_fa2``, ``triton_lse_onepass``
  and ``triton_fused`` → one row per (shape, causal, mode); ``grouped-fused RAW.json``: the grouped
  rows of ``grouped_and_exp_gpu.py --json`` with the fused call; ``fused-tiles RAW.json``:
  ``fused_tiles_gpu.py --json`` → one row per (problem, tiles).
* ``checks SOURCE...``: the lines ``check_gpu.py`` prints (``NAME fwd_err=… grad_err=… ok``; the
  commit from its header line), for runs cut short before their JSON was written, and the grouped
  checks of ``grouped_and_exp_gpu.py --json`` files, the commit in a "measured at" column.

Run from the repository root::

    python benchmarks/_harness/kl_tables.py known-lse raw.json --out kernel-known-lse --env CL_STREAMKL_AUTOTUNE=0
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__:  # imported as _harness.kl_tables
    from _harness import sentences
else:  # run as a script: its own folder is on sys.path
    import sentences

RESULTS = Path(__file__).resolve().parents[1] / "results"
LINE = re.compile(r"^(?P<name>.+?) fwd_err=(?P<fwd>\S+) grad_err=(?P<grad>\S+) (?P<verdict>ok|FAIL)$")


def _number(name: str, fmt: str) -> dict[str, str]:
    return {"name": name, "align": "right", "format": fmt}


def _provenance(raw: dict[str, Any], env: Sequence[str]) -> dict[str, Any]:
    """GPU, versions, commit, date and command of a raw file (``env``: variables the command ran with)."""
    environment = raw["environment"]
    command = re.sub(r"--json \S+", "--json", raw["command"])
    return {
        "gpu": environment["device"].split(" (")[0],
        "torch": environment["torch"],
        "triton": environment["triton"],
        **({"python": environment["python"]} if "python" in environment else {}),
        "commit": environment["commit"],
        "date": raw["date"],
        "command": " ".join([*env, command]),
    }


def _shape(label: str) -> str:
    return label.replace("x", "×")


def known_lse_table(raw: dict[str, Any], env: Sequence[str]) -> dict[str, Any]:
    """Long sequences: StreamKL online and with given log-sum-exps (each backward) against SDPA."""
    times = {(row["shape"], row["mode"], row["impl"]): row for row in raw["rows"]}
    impls = ("triton", "triton_onepass", "triton_lse", "triton_lse_onepass", "sdpa")
    rows = []
    for shape, mode in dict.fromkeys((row["shape"], row["mode"]) for row in raw["rows"]):
        ms = [times[(shape, mode, impl)]["ms"] for impl in impls]
        sdpa = ms[-1]
        extra = [times[(shape, mode, impl)]["extra_bytes_per_row"] for impl in ("triton_lse", "triton_lse_onepass")]
        rows.append([_shape(shape), mode, *(round(value, 3) for value in ms),
                     *(round(value / sdpa, 2) for value in ms[:4]), *(round(value) for value in extra)])
    columns = [{"name": "shape"}, {"name": "mode"}, _number("StreamKL", ".3f"), _number("one-pass", ".3f"),
               _number("LSE given", ".3f"), _number("LSE given, one-pass", ".3f"), _number("SDPA (cuDNN)", ".3f"),
               _number("vs SDPA", ".2f"), _number("one-pass vs SDPA", ".2f"), _number("LSE given vs SDPA", ".2f"),
               _number("LSE given, one-pass vs SDPA", ".2f"), _number("LSE given extra B/row", "d"),
               _number("one-pass extra B/row", "d")]
    return {"title": "bf16 long sequences: StreamKL computing both log-sum-exps online and handed them "
                     "(split and one-pass backward) against SDPA's default backend (cuDNN), median ms",
            **_provenance(raw, env), "columns": columns, "rows": rows}


def grouped_known_lse_table(raw: dict[str, Any], env: Sequence[str]) -> dict[str, Any]:
    """All 12 blocks: grouped online and with given log-sum-exps against 12 SDPA calls, wall and kernel time."""
    blocks = raw["blocks"]
    by_key = {(row["shape"], row["mode"], row["impl"]): row for row in raw["grouped"]}
    impls = ("attention_kl_grouped", "attention_kl_grouped lse", "attention_kl_grouped lse onepass", f"sdpa x{blocks}")
    rows = []
    for shape, mode in dict.fromkeys((row["shape"], row["mode"]) for row in raw["grouped"]):
        found = [by_key[(shape, mode, impl)] for impl in impls]
        ms = [row["ms"] for row in found]
        gpu = [row["gpu_ms"] for row in found]
        rows.append([_shape(shape), mode, *(round(value, 3) for value in ms),
                     *(round(value / ms[-1], 2) for value in ms[:3]),
                     *(round(value, 3) for value in gpu), *(round(value / gpu[-1], 2) for value in gpu[:3])])
    columns = [{"name": "B×H×N×D"}, {"name": "mode"}, _number("grouped", ".3f"), _number("LSE given", ".3f"),
               _number("LSE given, one-pass", ".3f"), _number(f"{blocks} × SDPA (cuDNN)", ".3f"),
               _number("grouped / SDPA", ".2f"), _number("LSE given / SDPA", ".2f"),
               _number("one-pass / SDPA", ".2f"), _number("kernels: grouped", ".3f"),
               _number("kernels: LSE given", ".3f"), _number("kernels: LSE given, one-pass", ".3f"),
               _number("kernels: SDPA", ".3f"), _number("kernels: grouped / SDPA", ".2f"),
               _number("kernels: LSE given / SDPA", ".2f"), _number("kernels: one-pass / SDPA", ".2f")]
    return {"title": f"{blocks} blocks in one grouped call, computing both log-sum-exps online and handed them, "
                     f"against {blocks} SDPA (cuDNN) calls, bf16: median ms a call and summed kernel ms",
            **_provenance(raw, env), "columns": columns, "rows": rows}


def fused_table(raw: dict[str, Any], env: Sequence[str]) -> dict[str, Any]:
    """The fused forward (gradients in the forward pass) against forward-then-backward and SDPA."""
    times = {(row["shape"], row["causal"], row["mode"], row["impl"]): row for row in raw["rows"]}
    impls = ("triton_fused", "triton_lse_onepass", "sdpa", "sdpa_fa2")
    rows = []
    for shape, causal, mode in dict.fromkeys((row["shape"], row["causal"], row["mode"]) for row in raw["rows"]):
        found = [times[(shape, causal, mode, impl)] for impl in impls]
        ms = [row["ms"] for row in found]
        rows.append([_shape(shape) + (" causal" if causal else ""), mode, *(round(value, 3) for value in ms),
                     *(round(value / ms[2], 2) for value in ms[:2]), round(found[0]["extra_bytes_per_row"])])
    columns = [{"name": "shape"}, {"name": "mode"}, _number("fused", ".3f"), _number("forward, then backward", ".3f"),
               _number("SDPA (cuDNN)", ".3f"), _number("FA2", ".3f"), _number("fused vs SDPA", ".2f"),
               _number("forward, then backward vs SDPA", ".2f"), _number("fused extra B/row", "d")]
    return {"title": "bf16, both log-sum-exps given, mean KL: the gradients computed in the forward pass (fused) "
                     "against the forward then the one-pass backward, and attention (SDPA's default, cuDNN; FA2), "
                     "median ms",
            **_provenance(raw, env), "columns": columns, "rows": rows,
            "views": {"headline": {"columns": ["shape", "SDPA (cuDNN)", "fused", "fused vs SDPA",
                                               "forward, then backward vs SDPA"],
                                   "where": {"mode": ["fwd+bwd"], "shape": [_shape(f"{b}x12x{n}x64") for b, n in
                                                                           ((2, 4096), (1, 8192), (1, 16384),
                                                                            (1, 32768))]}}}}


def grouped_fused_table(raw: dict[str, Any], env: Sequence[str]) -> dict[str, Any]:
    """12 blocks grouped with given log-sum-exps: fused, forward then split or one-pass backward, 12 SDPA calls."""
    blocks = raw["blocks"]
    by_key = {(row["shape"], row["mode"], row["impl"]): row for row in raw["grouped"]}
    impls = ("attention_kl_grouped lse fused", "attention_kl_grouped lse", "attention_kl_grouped lse onepass",
             f"sdpa x{blocks}")
    rows = []
    for shape, mode in dict.fromkeys((row["shape"], row["mode"]) for row in raw["grouped"]):
        found = [by_key[(shape, mode, impl)] for impl in impls]
        ms, gpu = [row["ms"] for row in found], [row["gpu_ms"] for row in found]
        rows.append([_shape(shape), mode, *(round(value, 3) for value in ms),
                     *(round(value / ms[-1], 2) for value in ms[:3]), *(round(value / gpu[-1], 2) for value in gpu[:3])])
    columns = [{"name": "B×H×N×D"}, {"name": "mode"}, _number("fused", ".3f"), _number("split", ".3f"),
               _number("one-pass", ".3f"), _number(f"{blocks} × SDPA (cuDNN)", ".3f"), _number("fused / SDPA", ".2f"),
               _number("split / SDPA", ".2f"), _number("one-pass / SDPA", ".2f"),
               _number("kernels: fused / SDPA", ".2f"), _number("kernels: split / SDPA", ".2f"),
               _number("kernels: one-pass / SDPA", ".2f")]
    return {"title": f"{blocks} blocks in one grouped call, both log-sum-exps given: the gradients in the forward pass "
                     f"(fused) or after it (split, one-pass backward), against {blocks} SDPA (cuDNN) calls, bf16: "
                     "median ms a call, and ratios of summed kernel time",
            **_provenance(raw, env), "columns": columns, "rows": rows}


def fused_tiles_table(raw: dict[str, Any], env: Sequence[str]) -> dict[str, Any]:
    """The fused forward's tile sweep: each candidate's forward+backward against SDPA and forward-then-backward."""
    rows = [[_shape(row["shape"]), "{} × {}, {} warps, {} stages".format(*row["tiles"]), round(row["fused_ms"], 3),
             round(row["fused_vs_sdpa"], 2), round(row["unfused_vs_sdpa"], 2)] for row in raw["rows"]]
    columns = [{"name": "problem"}, {"name": "tiles (queries × keys)"}, _number("fused fwd+bwd ms", ".3f"),
               _number("fused vs SDPA", ".2f"), _number("forward, then backward vs SDPA", ".2f")]
    return {"title": "The fused forward's tiles swept (bf16, both log-sum-exps given, mean KL, forward+backward; "
                     "12 blocks grouped at ViT lengths), against SDPA's default backend (cuDNN) in the same process",
            **_provenance(raw, env), "columns": columns, "rows": rows}


def _log_rows(text: str) -> list[list[str]]:
    """Rows of a ``check_gpu.py`` log: the autotuner is on (its default), the commit in its header."""
    commit = re.search(r"\| commit (\S+)", text)
    rows = []
    for line in text.splitlines():
        match = LINE.match(" ".join(line.split()))
        if match:
            rows.append([match["name"], match["fwd"], match["grad"], match["verdict"], "on",
                         commit[1] if commit else "unknown"])
    return rows


def _grouped_rows(raw: dict[str, Any]) -> list[list[str]]:
    """The grouped checks with given log-sum-exps of a ``grouped_and_exp_gpu.py --json`` file."""
    environment = raw["environment"]
    return [[f"grouped {raw['blocks']} blocks {check['shape']} bf16 lse given", f"{check['kl_grouped_lse']:.2e}",
             f"{check['grad_grouped_lse']:.2e}", "ok" if check["passed"] else "FAIL",
             "on" if environment["autotune"] else "off", environment["commit"]] for check in raw["checks"]]


def check_table(sources: Sequence[Path], title: str, provenance: dict[str, Any]) -> dict[str, Any]:
    """One row per check of ``sources`` (check logs, grouped JSON files): name, errors, verdict, autotuner,
    and the commit it ran at ("measured at")."""
    rows = []
    for path in sources:
        text = path.read_text()
        rows += _grouped_rows(json.loads(text)) if path.suffix == ".json" else _log_rows(text)
    columns = [{"name": "check"}, {"name": "max KL error", "align": "right"},
               {"name": "max gradient error", "align": "right"}, {"name": "result"}, {"name": "autotuner"},
               {"name": "measured at"}]
    return {"title": title, **provenance, "columns": columns, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("known-lse", "grouped-known-lse", "fused", "grouped-fused", "fused-tiles",
                                         "checks"))
    parser.add_argument("inputs", nargs="+", type=Path, help="the raw JSON file, or check logs and grouped JSON files")
    parser.add_argument("--out", required=True, help="table file name in benchmarks/results/, without .json")
    parser.add_argument("--env", nargs="*", default=[], help="VAR=VALUE the command ran with")
    parser.add_argument("--title", help="checks: the table's title")
    parser.add_argument("--provenance", type=Path, help="checks: a raw JSON file of the same run for GPU, versions")
    parser.add_argument("--command", help="checks: the commands that printed the lines")
    args = parser.parse_args(argv)
    if args.kind == "checks":
        provenance = _provenance(json.loads(args.provenance.read_text()), [])
        del provenance["commit"]  # a column: the checks may come from several commits
        provenance["command"] = args.command
        table = check_table(args.inputs, args.title, provenance)
    else:
        raw = json.loads(args.inputs[0].read_text())
        makers = {"known-lse": known_lse_table, "grouped-known-lse": grouped_known_lse_table, "fused": fused_table,
                  "grouped-fused": grouped_fused_table, "fused-tiles": fused_tiles_table}
        table = makers[args.kind](raw, args.env)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(sentences.keep_sentence_views(path, table), indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
