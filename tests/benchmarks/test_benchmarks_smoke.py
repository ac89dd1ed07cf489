"""Smoke tests of the GPU benchmark harness on tiny CPU problems (torch/eager/SDPA paths only).

The harness is run for real on the H200 by hand; these tests keep its code paths from
breaking in between: row measurement for every mode, ratios, OOM rows, the correctness
check, the table and the JSON file; and every script stays a leaf that runs as
``python benchmarks/<script>.py``.
"""

import ast
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import bench_attention_kl as bench
import pytest
import torch
from _harness import kl_checks, kl_workloads
from _harness.options import parse_shape

CPU = torch.device("cpu")
BENCHMARKS = Path(bench.__file__).resolve().parent
SCRIPTS = sorted(path.stem for path in BENCHMARKS.glob("*.py"))
TINY = kl_workloads.Problem(1, 2, 48, 16, torch.bfloat16)


@pytest.mark.parametrize("impl", ["torch", "eager"])
@pytest.mark.parametrize("mode", kl_workloads.MODES)
def test_measure_row_times_every_mode(impl, mode):
    inputs = kl_workloads.make_inputs(TINY, CPU)
    row = bench.measure_row(kl_workloads.make_workload(impl, TINY, inputs), impl, TINY, mode, CPU)
    assert row.ms > 0 and math.isfinite(row.ms)
    assert row.tflops == pytest.approx(TINY.flops(impl, mode) / (row.ms * 1e-3) / 1e12)
    assert row.extra_mib is None  # peak memory is a CUDA-only measurement
    assert (row.impl, row.mode, row.shape, row.dtype) == (impl, mode, "1x2x48x16", "bf16")
    assert all(t.grad is None for t in (inputs["q"], inputs["k"]))


def test_flop_counts_follow_the_docstring():
    problem = kl_workloads.Problem(2, 3, 64, 16, torch.bfloat16)
    base = problem.batch * problem.heads * problem.seq**2 * problem.head_dim
    assert problem.flops("triton", "fwd") == 4 * base
    assert problem.flops("eager", "fwd+bwd") == 12 * base
    assert problem.flops("sdpa", "bwd") == 10 * base
    causal = kl_workloads.Problem(2, 3, 64, 16, torch.bfloat16, causal=True)
    assert causal.flops("torch", "bwd") == 4 * base


def test_benchmark_problem_fills_ratios_and_reports_oom(monkeypatch):
    real_measure = bench.measure_row

    def measure_or_oom(workload, impl, problem, mode, device, warmup_ms, rep_ms, gpu_time):
        if impl == "eager" and mode == "fwd+bwd":
            raise torch.OutOfMemoryError("simulated")
        return real_measure(workload, impl, problem, mode, device, warmup_ms, rep_ms, gpu_time)

    monkeypatch.setattr(bench, "measure_row", measure_or_oom)
    rows = bench.benchmark_problem(TINY, ["torch", "eager", "sdpa", "sdpa_fa2"], kl_workloads.MODES, CPU)
    by_key = {(row.impl, row.mode): row for row in rows}
    assert len(by_key) == 12

    oom = by_key["eager", "fwd+bwd"]
    assert oom.oom and "OOM" in bench.format_row(oom)
    assert by_key["torch", "fwd+bwd"].speedup_vs_eager is None

    sdpa, torch_fwd, eager_fwd = by_key["sdpa", "fwd"], by_key["torch", "fwd"], by_key["eager", "fwd"]
    # the default backend is the one SDPA picks by itself (on the CPU: flash or math)
    assert sdpa.backend in ("flash", "efficient", "math", "cudnn")
    assert by_key["sdpa_fa2", "fwd"].backend in ("flash", "efficient", "math")
    assert sdpa.ratio_to_sdpa == pytest.approx(1.0) and by_key["sdpa_fa2", "fwd"].ratio_to_fa2 == pytest.approx(1.0)
    assert torch_fwd.ratio_to_sdpa == pytest.approx(torch_fwd.ms / sdpa.ms)
    assert torch_fwd.ratio_to_fa2 == pytest.approx(torch_fwd.ms / by_key["sdpa_fa2", "fwd"].ms)
    assert torch_fwd.speedup_vs_eager == pytest.approx(eager_fwd.ms / torch_fwd.ms)
    assert torch_fwd.speedup_vs_compiled is None


@pytest.mark.parametrize(
    "shape, checked",
    [
        ((32, 12, 197, 64), (1, 2, 197, 64)),
        ((4, 12, 1025, 64), (1, 2, 1025, 64)),  # the timed length: same tiles, same ragged tail
        ((1, 12, 4097, 64), (1, 1, 4097, 64)),
        ((1, 12, 32768, 64), (1, 1, 16384, 64)),  # float64 (N, N) maps would not fit
    ],
)
def test_checks_keep_the_timed_length(shape, checked):
    problem = kl_workloads.Problem(*shape, torch.bfloat16, causal=True)
    assert kl_checks.checked_problem(problem) == kl_workloads.Problem(*checked, torch.bfloat16, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_check_problem_agrees_with_float64(causal):
    problem = kl_workloads.Problem(2, 3, 40, 16, torch.float32, causal)
    results = kl_checks.check_problem(problem, ["torch", "eager", "compiled", "sdpa"], CPU)
    assert [r.impl for r in results] == ["torch", "eager"]
    assert all(r.checked_shape == "1x2x40x16" for r in results)
    assert all(r.passed and max(r.kl, r.dq, r.dk) < 1e-5 for r in results)


def test_check_fails_on_a_wrong_kl(monkeypatch):
    monkeypatch.setattr(
        kl_checks, "eager_attention_kl", lambda q, k, qt, kt, **_: (q @ k.transpose(-2, -1)).float().sum(-1)
    )
    (result,) = kl_checks.check_problem(TINY, ["eager"], CPU)
    assert not result.passed and "FAIL" in bench.format_checks([result])


def test_parse_shape_rejects_bad_text():
    assert parse_shape("8x12x1024x64") == (8, 12, 1024, 64)
    for text in ("8x12x1024", "8x12x0x64", "axbxcxd"):
        with pytest.raises(Exception, match="BxHxNxD"):
            parse_shape(text)


def test_build_problems_adds_extras_once():
    problems = bench.build_problems(
        [(1, 2, 64, 16)], [torch.bfloat16, torch.float32], [(1, 2, 64, 16)], [(1, 2, 32, 16)], causal=False
    )
    assert [(p.label, p.dtype_name, p.causal) for p in problems] == [
        ("1x2x64x16", "bf16", False),
        ("1x2x64x16", "fp32", False),
        ("1x2x32x16", "bf16", True),
    ]


def test_main_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = [
        "--device", "cpu", "--shapes", "1x2x32x16", "--fp32-shapes", "--causal-shapes", "1x1x24x16",
        "--impls", "torch", "eager", "sdpa", "--modes", "fwd", "fwd+bwd", "--json", str(out),
        "--commit", "abc123",
    ]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "commit abc123" in printed[0]
    assert printed[1] == bench.format_table_header()
    payload = json.loads(out.read_text())
    assert len(payload["rows"]) == 2 * 3 * 2
    assert len(payload["checks"]) == 2 * 2
    assert {row["shape"] for row in payload["rows"]} == {"1x2x32x16", "1x1x24x16"}
    assert payload["environment"]["commit"] == "abc123"


def test_gpu_speedup_over_compiled_uses_gpu_times_of_the_same_mode():
    def row(impl, mode, ms, gpu_ms):
        return bench.Row(impl, mode, "1x1x8x8", "bf16", False, ms, None, None, None, None, gpu_ms=gpu_ms)

    rows = [
        row("triton", "fwd+bwd", 0.7, 0.1),
        row("compiled", "fwd+bwd", 1.4, 0.8),
        row("triton", "fwd", 0.1, 0.05),
        row("eager", "fwd", 0.4, None),
    ]
    bench.add_ratios(rows)
    assert rows[0].speedup_vs_compiled == pytest.approx(2.0)
    assert rows[0].gpu_speedup_vs_compiled == pytest.approx(8.0)
    assert rows[2].gpu_speedup_vs_compiled is None  # no compiled row in this mode
    assert "8.00" in bench.format_row(rows[0])


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_leaves(script):
    tree = ast.parse((BENCHMARKS / f"{script}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert not imported & set(SCRIPTS), "scripts import _harness and the package, never another script"
    importlib.import_module(script)


def test_a_script_runs_as_a_file_from_the_repository_root(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--shapes", "1x1x16x8", "--fp32-shapes", "--causal-shapes", "--impls", "torch",
            "--modes", "fwd", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_attention_kl.py", *argv],
        cwd=BENCHMARKS.parent, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert [row["impl"] for row in json.loads(out.read_text())["rows"]] == ["torch"]
