"""Smoke test of the teacher-variants benchmark with a tiny ViT on the CPU (the full run is on the H200)."""

import json

import pytest
import teacher_variants_gpu as variants


def test_a_tiny_run_times_every_variant_interleaved_and_checks_each_penalty(tmp_path, capsys) -> None:
    path = tmp_path / "variants.json"
    argv = ["--device", "cpu", "--tiny", "--variants", "none", "eager", "eager-online", "t-eager",
            "--rounds", "2", "--steps", "1", "--warmup-steps", "0", "--json", str(path)]
    assert variants.main(argv) == 0
    payload = json.loads(path.read_text())
    results = {r["variant"]: r for r in payload["results"]}
    assert set(results) == {"none", "eager", "eager-online", "t-eager"}
    for result in results.values():
        assert len(result["step_ms"]) == len(result["host_ms"]) == 2  # one step in each of two rounds
        assert 0 < result["median_host_ms"] <= result["median_ms"] * 1.5
    for variant in ("eager", "eager-online"):  # the distilling variants' penalties, against float64
        penalty, reference = results[variant]["penalty"], results[variant]["penalty_reference"]
        assert reference > 0 and abs(penalty - reference) <= 1e-2 * reference
    assert results["none"]["penalty"] is None and results["t-eager"]["penalty"] is None
    # The file is a table for benchmarks/tables.py: one row per variant, (a) at ratio 1.
    assert len(payload["rows"]) == 4 and len(payload["columns"]) == len(payload["rows"][0])
    assert payload["rows"][0][1] == "(a) no distillation" and payload["rows"][0][4] == 1.0
    table = capsys.readouterr().out
    assert "eager-online" in table and "x (a)" in table


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be positive"),
    (["--image-sizes", "40"], "--batches is needed"),
    (["--image-sizes", "32", "48", "--batches", "2"], "--batches needs one value per image size"),
])
def test_bad_options_are_refused_in_one_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        variants.parse_args(["--device", "cpu", "--tiny", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
