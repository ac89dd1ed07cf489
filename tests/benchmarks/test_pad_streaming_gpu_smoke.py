"""Smoke test of benchmarks/pad_streaming_gpu.py: its --smoke mode on tiny CPU problems.

The script is run for real on an H200; this keeps its checks, its table and its JSON file from
breaking in between.
"""

import json

import pad_streaming_gpu as script


def test_smoke_run_checks_times_and_writes_json(tmp_path, capsys):
    out = tmp_path / "pad.json"
    assert script.main(["--smoke", "--json", str(out)]) == 0
    assert "streamed against materialised penalty" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["gpu"].startswith("cpu") and payload["command"].startswith("python")
    assert len(payload["checks"]) == 5 and all(check["passed"] for check in payload["checks"])
    assert [row[:2] for row in payload["rows"]] == [["1×2×17×16", "fwd"], ["1×2×17×16", "fwd+bwd"]]
    assert len(payload["rows"][0]) == len(payload["columns"])
    assert payload["penalty_differences"]["1×2×17×16"] < 1e-5
