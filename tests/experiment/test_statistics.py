"""Paired differences over seeds against a hand computation, and which pairs get compared."""

from __future__ import annotations

import pytest

from cl_streamkl.experiment.run_result import RunResult
from cl_streamkl.experiment.accuracy_matrix import stream_accuracy
from cl_streamkl.experiment.statistics import (
    comparison_pairs, format_paired, holm_adjust, mean_std, paired_comparisons, paired_t_test, t_interval,
)


def test_t_interval_by_hand():
    # differences 1, 2, 3, 6: mean 3, sample std sqrt(14/3), t(0.975, 3) = 3.182446
    mean, low, high = t_interval([1.0, 2.0, 3.0, 6.0])
    half = 3.182446305284263 * (14 / 3) ** 0.5 / 2
    assert mean == 3.0 and low == pytest.approx(3.0 - half) and high == pytest.approx(3.0 + half)
    assert t_interval([2.5]) == (2.5, None, None)
    with pytest.raises(ValueError):
        t_interval([])
    assert mean_std([1.0, 3.0]) == pytest.approx((2.0, 2 ** 0.5))


def test_comparison_pairs():
    strategies = ["naive", "lwf", "streamkl", "lwf+streamkl", "pad", "streamkl+replay", "lwf+pad"]
    assert comparison_pairs(strategies) == [
        ("streamkl", "naive"), ("streamkl", "pad"), ("lwf+streamkl", "lwf"), ("lwf+streamkl", "lwf+pad"),
        ("pad", "naive"), ("lwf+pad", "lwf"),
    ]
    assert comparison_pairs(["streamkl"]) == []


def _result(strategy: str, seed: int, final: float, first: float = 0.9) -> RunResult:
    # two experiences: forgetting = first - final accuracy on experience 0
    return RunResult(strategy, seed, [0, 1], [[first, 0.0], [final, 1.0]])


def test_paired_comparisons_by_hand():
    naive = {0: 0.10, 1: 0.20, 2: 0.30}
    streamkl = {0: 0.15, 1: 0.30, 2: 0.32}     # differences on experience 0: 5, 10, 2 pp
    results = [_result("naive", s, v) for s, v in naive.items()]
    results += [_result("streamkl", s, v) for s, v in streamkl.items()]
    results.append(_result("streamkl", 9, 0.5))  # no naive run with seed 9: left out of the pairs
    entries = {e["metric"]: e for e in paired_comparisons(results, scale=100.0)}
    final = entries["mean_experience_accuracy"]
    assert (final["strategy"], final["baseline"], final["n"]) == ("streamkl", "naive", 3)
    # final average accuracy = (acc on exp 0 + 1.0) / 2, so its differences are halved: 2.5, 5, 1
    mean, low, high = t_interval([2.5, 5.0, 1.0])
    assert final["mean_diff"] == pytest.approx(mean) == pytest.approx(8.5 / 3)
    assert final["ci95"] == [pytest.approx(low), pytest.approx(high)]
    forgetting = entries["forgetting"]
    assert forgetting["mean_diff"] == pytest.approx(-17 / 3)  # less forgetting is negative
    # no Task-IL matrix and no evaluation sizes recorded
    assert set(entries) == {"mean_experience_accuracy", "forgetting", "learning_accuracy"}
    assert final["seeds"] == [0, 1, 2] and final["differences"] == pytest.approx([2.5, 5.0, 1.0])
    # t = mean / (sd / sqrt(3)) with sd = sqrt(49/12): t = 17/7; on 2 degrees of freedom the
    # two-sided p is 1 - t / sqrt(t^2 + 2)
    t = 17 / 7
    assert final["p_value"] == pytest.approx(1 - t / (t * t + 2) ** 0.5)
    fractions = {e["metric"]: e for e in paired_comparisons(results)}  # the default unit, as results.json holds
    assert fractions["mean_experience_accuracy"]["mean_diff"] == pytest.approx(final["mean_diff"] / 100)
    text = format_paired(list(fractions.values()))
    assert f"{final['mean_diff']:+6.1f} pp" in text
    assert "streamkl - naive  mean_experience_accuracy" in text and "(n=3)" in text and "learning" not in text


def test_paired_t_test_edge_cases():
    assert paired_t_test([1.0]) is None
    assert paired_t_test([2.0, 2.0]) == 0.0 and paired_t_test([0.0, 0.0, 0.0]) == 1.0


def test_holm_adjust_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.06
    assert holm_adjust([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # values above 1 are capped; untested entries stay out of the family
    assert holm_adjust([0.5, None, 0.2]) == [pytest.approx(0.5), None, pytest.approx(0.4)]
    assert holm_adjust([0.6, 0.7]) == [pytest.approx(1.0), pytest.approx(1.0)]
    assert holm_adjust([]) == []


def test_stream_accuracy_weighs_experiences_by_their_samples():
    matrix = [[0.9, 0.0], [0.5, 1.0]]
    assert stream_accuracy(matrix, [100, 300]) == pytest.approx((50 + 300) / 400)
    sized = RunResult("naive", 0, [0, 1], matrix, eval_sizes=[100, 300])
    assert sized.metrics()["stream_accuracy"] == pytest.approx(0.875)
    assert sized.metrics()["final_average_accuracy"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="sizes"):
        stream_accuracy(matrix, [1])
