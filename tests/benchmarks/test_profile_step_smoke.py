"""Smoke tests of benchmarks/profile_step.py on a tiny CPU ViT, and its GPU-gap arithmetic.

The CUDA tables (kernel sums, idle time, gap causes) are produced on the H200 by hand;
here the step/teacher rows run on the CPU and the trace arithmetic runs on made-up events.
"""

import json

import profile_step
import pytest


def test_cpu_run_writes_teacher_and_step_rows(tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = profile_step.main([
        "--device", "cpu", "--tiny", "--teacher", "--methods", "none", "capture", "capture-full", "torch",
        "--steps", "2", "--warmup-steps", "1", "--json", str(out),
    ])
    assert code == 0
    result = json.loads(out.read_text())
    assert [row["teacher"] for row in result["teacher"]] == ["eager-full", "eager", "compiled"]
    assert all(row["ms"] > 0 and row["first_call_s"] >= 0 for row in result["teacher"])
    assert [row["method"] for row in result["steps"]] == ["none", "capture", "capture-full", "torch"]
    assert all(row["wall_ms"] > 0 and "kernel_ms" not in row for row in result["steps"])
    assert "step 32px × 2 capture-full: wall" in capsys.readouterr().out


def test_gaps_are_the_idle_stretches_between_kernels():
    kernels = [(0.0, 10.0), (5.0, 20.0), (100.0, 110.0), (115.0, 120.0)]
    assert profile_step.gpu_gaps(kernels) == [(20.0, 100.0), (110.0, 115.0)]


def test_gap_causes_name_the_innermost_host_op_at_the_middle():
    events = [
        {"cat": "cpu_op", "name": "aten::linear", "ts": 0.0, "dur": 500.0},
        {"cat": "cpu_op", "name": "aten::addmm", "ts": 40.0, "dur": 100.0},
        {"cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 10.0},
    ]
    causes = profile_step.gap_causes(events, [(20.0, 180.0), (200.0, 230.0), (600.0, 700.0)])
    assert causes == {"aten::addmm": pytest.approx(0.16), "(no host op)": pytest.approx(0.1)}


def test_kernel_categories():
    assert profile_step.category("_attention_kl_bwd_dq_kernel") == "streamkl dq"
    assert profile_step.category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "sdpa"
    assert profile_step.category("nvjet_sm90_tst_256x128") == "gemm"
    assert profile_step.category("mystery") == "other"
