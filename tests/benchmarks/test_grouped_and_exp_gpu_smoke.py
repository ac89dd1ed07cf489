"""Smoke test of benchmarks/grouped_and_exp_gpu.py: its --smoke mode on tiny CPU problems.

The script is run for real on an H200; this keeps its three parts (correctness, grouped
timing, kernel variants), the tables and the JSON file from breaking in between.
"""

import json
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import grouped_and_exp_gpu as script  # noqa: E402


def test_smoke_run_checks_times_and_writes_json(tmp_path, capsys):
    out = tmp_path / "grouped_and_exp.json"
    assert script.main(["--smoke", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(c) kernel variants" in printed.split("(b)")[-1]  # the tables come last
    payload = json.loads(out.read_text())
    assert payload["environment"]["device"].startswith("cpu")
    (check,) = payload["checks"]
    assert check["passed"] and check["grouped_vs_separate"] == 0.0
    assert {(row["impl"], row["mode"]) for row in payload["grouped"]} == {
        (impl, mode)
        for impl in ("attention_kl x2", "attention_kl_grouped", "attention_kl_grouped lse",
                     "attention_kl_grouped lse onepass", "attention_kl_grouped lse fused", "sdpa x2")
        for mode in ("fwd", "fwd+bwd")
    }
    assert check["kl_grouped_lse"] < 1e-4 and check["grad_grouped_lse"] < 2e-2
    variants = {row["variant"]: row for row in payload["variants"]}
    assert list(variants) == script.SMOKE["variants"]
    assert variants["hardware"]["speedup_fwd_bwd"] == 1.0
    assert all(row["kl_err"] < 1e-4 and row["dq_err"] < 2e-2 for row in variants.values())
