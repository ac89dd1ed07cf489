"""Smoke tests of the end-to-end distillation benchmark with a tiny ViT on the CPU.

The full run (ViT-B/16 at 224/512/1024 px) happens on the H200 by hand; these tests keep
the script's pieces and its training steps (``_harness.vit_training``) honest: the batch
search, the eager (b) penalty against the distiller's, OOM handling, the table, the plot
and the JSON file.
"""

import json
import time

import e2e_distillation as e2e
import pytest
import torch
from _harness import batch_search, penalty_check
from _harness import vit_training as training
from _harness.options import describe_teacher

CPU = torch.device("cpu")
TINY = training.TINY_MODEL_KWARGS


class Probe:
    """A ``fits`` callable with a known limit that records which batches were tried."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tried: list[int] = []

    def __call__(self, batch: int) -> bool:
        self.tried.append(batch)
        return batch <= self.limit


FAR = float("inf")


@pytest.mark.parametrize(
    "limit, start, known_fit, known_fail, cap, expected",
    [
        (37, 4, 0, None, 1000, (37, True)),  # doubling past the limit, then bisection
        (37, 4, 4, None, 1000, (37, True)),  # a start already known to fit is not probed again
        (5, 64, 0, None, 1000, (5, True)),  # the start fails: halve first
        (5, 30, 2, 64, 1000, (5, True)),  # known bounds bracket the search
        (0, 4, 0, None, 1000, (0, True)),  # even one does not fit
        (1000, 8, 0, None, 50, (50, False)),  # the cap fits: only a lower bound
        (50, 8, 0, None, 50, (50, False)),
        (60, 500, 0, None, 50, (50, False)),  # a start beyond the cap probes the cap
        (60, 8, 80, 90, 50, (50, False)),  # known bounds beyond the cap are clipped to it
    ],
)
def test_largest_batch_brackets_then_bisects(limit, start, known_fit, known_fail, cap, expected):
    probe = Probe(limit)
    result = batch_search.largest_batch(probe, start, cap, FAR, known_fit=known_fit, known_fail=known_fail)
    assert result == expected
    assert len(probe.tried) == len(set(probe.tried))
    assert known_fit not in probe.tried and known_fail not in probe.tried


def test_largest_batch_finds_every_small_limit():
    # Below SEARCH_PRECISION batches the search is exact; it must end for every input.
    for limit in range(25):
        for start in (1, 3, 7, 30):
            for cap in (1, 5, 16, 24):
                probe = Probe(limit)
                expected = (cap, False) if limit >= cap else (limit, True)
                assert batch_search.largest_batch(probe, start, cap, FAR) == expected, (limit, start, cap)
                assert len(probe.tried) <= 2 * cap.bit_length() + 1


def test_largest_batch_stops_within_precision():
    probe = Probe(1000)
    batch, exact = batch_search.largest_batch(probe, 900, 10**6, FAR)
    assert exact and 1000 - 1000 // batch_search.SEARCH_PRECISION <= batch <= 1000
    assert len(probe.tried) <= 8


def test_largest_batch_past_deadline_is_a_lower_bound():
    probe = Probe(100)
    assert batch_search.largest_batch(probe, 30, 1000, time.perf_counter() - 1, known_fit=8) == (8, False)
    assert probe.tried == []


def test_eager_distiller_matches_streaming_penalty():
    torch.manual_seed(0)
    model = training.build_model(training.DEFAULT_MODEL, TINY, 48, CPU)
    eager = training.build_distiller("eager", alpha=0.5)
    streaming = training.build_distiller("torch", alpha=0.5)
    for distiller in (eager, streaming):
        distiller.update_teacher(model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.2)
    images, _ = training.random_batch(2, 48, model.num_classes, CPU)
    penalties = []
    for distiller in (eager, streaming):
        with distiller.student_capture(model) as capture:
            model(images)
        penalties.append(distiller.penalty(images, capture))
    assert penalties[0] > 1e-3
    torch.testing.assert_close(penalties[0], penalties[1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("method", ["none", "eager", "torch", "teacher"])
def test_trainer_step_updates_the_student(method):
    trainer = training.build_trainer(method, training.DEFAULT_MODEL, TINY, 32, alpha=1.0, device=CPU)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    images, labels = training.random_batch(2, 32, trainer.num_classes, CPU)
    loss = trainer.step(images, labels)
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    if method != "none":
        assert all(not p.requires_grad for p in trainer.distiller.teacher.parameters())


def test_teacher_only_runs_the_teacher_and_adds_nothing():
    trainer = training.build_trainer("teacher", training.DEFAULT_MODEL, TINY, 32, alpha=1.0, device=CPU)
    teacher_calls = []
    trainer.distiller.teacher.blocks[0].register_forward_hook(lambda *_: teacher_calls.append(1))
    images, labels = training.random_batch(2, 32, trainer.num_classes, CPU)
    loss = trainer.step(images, labels)
    plain = training.build_trainer("none", training.DEFAULT_MODEL, TINY, 32, alpha=1.0, device=CPU)
    torch.testing.assert_close(loss, plain.step(images, labels))
    assert teacher_calls == [1]


def test_batch_fits_turns_oom_into_false(monkeypatch):
    trainer = training.build_trainer("none", training.DEFAULT_MODEL, TINY, 32, alpha=1.0, device=CPU)
    assert batch_search.batch_fits(trainer, 2, 32, steps=1)

    def out_of_memory(images, labels):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(trainer, "step", out_of_memory)
    assert not batch_search.batch_fits(trainer, 2, 32, steps=1)


def test_check_penalties_compares_methods_and_reference():
    check = penalty_check.check_penalties(["none", "eager", "torch"], training.DEFAULT_MODEL, TINY, 48, 2, 1.0, 0.05, CPU)
    assert set(check.values) == {"eager", "torch"}
    assert check.tokens == 10 and check.reference > 0
    for value in check.values.values():
        assert value == pytest.approx(check.reference, rel=0.05)
    assert check.passed and "float64" in penalty_check.format_check(check)


def test_table_marks_oom_and_lower_bounds():
    results = [
        e2e.Result(224, 197, "none", 4, 10.0, 1.0, 100, True),
        e2e.Result(224, 197, "eager", 4, None, None, 3, True),
        e2e.Result(224, 197, "triton", 4, 15.0, 1.2, 90, False),
    ]
    lines = e2e.format_table(results).splitlines()
    assert len(lines) == 4
    assert "OOM" in lines[2]
    assert ">=90" in lines[3] and "1.50" in lines[3] and "30.0" in lines[3]


def test_main_writes_json_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "e2e.json", tmp_path / "e2e.png"
    argv = [
        "--device", "cpu", "--tiny", "--image-sizes", "32", "--methods", "none", "eager", "torch",
        "--steps", "1", "--warmup-steps", "0", "--probe-steps", "1", "--max-batch", "4",
        "--check-rtol", "0.05", "--json", str(out), "--plot", str(plot), "--commit", "abc123",
    ]
    assert e2e.main(argv) == 0
    printed = capsys.readouterr().out
    assert "commit abc123" in printed and "penalty check 32px" in printed
    payload = json.loads(out.read_text())
    assert [r["method"] for r in payload["results"]] == ["none", "eager", "torch"]
    assert all(r["step_ms"] > 0 and r["max_batch"] == 4 for r in payload["results"])
    assert payload["penalty_checks"][0]["passed"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_flags_are_rejected():
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device", "cpu", "--image-sizes", "300"])  # no default batch for 300 px
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device", "cpu", "--tiny", "--model-kwargs", "[1, 2]"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--device", "cpu", "--tiny", "--compile-teacher", "fastest"])


@pytest.mark.parametrize(
    ("flags", "option", "described"),
    [
        ([], False, "eager"),
        (["--compile-teacher"], True, "torch.compile"),
        (["--compile-teacher", "reduce-overhead"], {"mode": "reduce-overhead"}, "torch.compile mode=reduce-overhead"),
    ],
)
def test_compile_teacher_flag_becomes_the_distillers_option(flags, option, described):
    args = e2e.parse_args(["--device", "cpu", "--tiny", *flags])
    assert args.compile_teacher == option
    assert describe_teacher(args.compile_teacher) == described
    distiller = training.build_distiller("triton", 1.0, args.compile_teacher)
    assert distiller.compile_options == ({} if option is True else option or None)
