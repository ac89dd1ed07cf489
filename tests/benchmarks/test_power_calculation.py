"""benchmarks/power_calculation.py and its paired-t power: the noncentral t where scipy's is finite, the
confirmatory plan's registered seed counts, and the committed calculations rebuilt from the committed reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import power_calculation as script
import pytest
import yaml
from _harness.power import detectable_effect, paired_t_power, seeds_for_power
from scipy import stats

from cl_streamkl.experiment.study.files import read_mapping

ROOT = Path(__file__).resolve().parents[2]
STUDIES, RESULTS = ROOT / "benchmarks" / "studies", ROOT / "benchmarks" / "results"


@pytest.mark.parametrize("effect, seeds, alpha", [(0.7, 3, 0.025), (0.7, 10, 0.025), (-0.5, 30, 0.05 / 3),
                                                  (1.2, 6, 0.05)])
def test_power_is_the_noncentral_t_tail(effect, seeds, alpha):
    df, shift = seeds - 1, abs(effect) * np.sqrt(seeds)
    critical = stats.t.ppf(1 - alpha / 2, df)
    expected = stats.nct.sf(critical, df, shift) + stats.nct.cdf(-critical, df, shift)
    assert paired_t_power(effect, 1.0, seeds, alpha) == pytest.approx(expected, rel=1e-6)


def test_strong_effects_have_the_power_a_simulation_gives():
    """Large noncentralities, where some scipy versions' nct returns NaN: against simulated paired t tests."""
    rng = np.random.default_rng(0)
    for seeds in (3, 4, 5):
        differences = rng.normal(-9.23, 2.38, size=(200_000, seeds))
        t = differences.mean(1) / (differences.std(1, ddof=1) / np.sqrt(seeds))
        simulated = np.mean(np.abs(t) > stats.t.ppf(1 - 0.0125, seeds - 1))
        assert paired_t_power(-9.23, 2.38, seeds, 0.025) == pytest.approx(simulated, abs=0.005)
    assert paired_t_power(0.0, 1.0, 10, 0.05) == pytest.approx(0.05, abs=1e-6)
    with pytest.raises(ValueError, match="seeds >= 2, sd > 0"):
        paired_t_power(1.0, 0.0, 10, 0.05)


def test_the_registered_confirmatory_plans_seed_counts_are_reproduced():
    power = read_mapping(STUDIES / "confirm-1025.yaml")["power"]
    for name, row in power["hypotheses"].items():
        assert seeds_for_power(row["effect_pp"], row["sd_pp"], 0.05 / 3) == row["seeds_for_80pct"], name
        assert paired_t_power(row["effect_pp"], row["sd_pp"], 12, 0.05 / 3) == pytest.approx(row["power_at_12"],
                                                                                              abs=0.005)
    effect = detectable_effect(2.0, 12, 0.05 / 3)
    assert paired_t_power(effect, 2.0, 12, 0.05 / 3) == pytest.approx(0.8, abs=1e-5)
    assert seeds_for_power(0.0, 1.0, 0.05) is None and seeds_for_power(0.01, 1.0, 0.05, most=50) is None


@pytest.mark.parametrize("name, reports, extra", [
    ("confirm-pad-1025", ["efficacy-long.json", "confirm-1025.json"],
     ["--proxy", "H3=replay+streamkl:replay", "S3=replay+streamkl:replay", "--most-seeds", "40"]),
    ("confirm-4097", ["efficacy-long4097.json"], ["--least-seeds", "5", "--most-seeds", "40"])])
def test_the_committed_calculations_are_rebuilt_from_the_committed_reports(tmp_path, name, reports, extra, capsys):
    out = tmp_path / "power.json"
    assert script.main([str(STUDIES / f"{name}.yaml"), "--reports", *[str(RESULTS / r) for r in reports], *extra,
                        "--json", str(out)]) == 0
    rebuilt, committed = json.loads(out.read_text()), json.loads((RESULTS / f"power-{name}.json").read_text())
    assert rebuilt["recommended_seeds"] == committed["recommended_seeds"]
    assert rebuilt["planned_seeds"] == committed["planned_seeds"] == len(read_mapping(STUDIES / f"{name}.yaml")[
        "test_seeds"]) == read_mapping(STUDIES / f"{name}.yaml")["power"]["seeds"]
    for new, old in zip(rebuilt["hypotheses"], committed["hypotheses"], strict=True):
        assert (new["id"], new["seeds_needed"], new["n_data"]) == (old["id"], old["seeds_needed"], old["n_data"])
        assert new["effect_pp"] == pytest.approx(old["effect_pp"]) and new["sd_pp"] == pytest.approx(old["sd_pp"])
    # The plan's power key quotes the calculation.
    quoted = read_mapping(STUDIES / f"{name}.yaml")["power"]["hypotheses"]
    for row in committed["hypotheses"]:
        assert quoted[row["id"]]["seeds_for_80pct"] == row["seeds_needed"]
        assert quoted[row["id"]]["sd_pp"] == pytest.approx(row["sd_pp"], abs=0.005)
        assert quoted[row["id"]]["data_seeds"] == row["n_data"]
    assert "recommended" in capsys.readouterr().out


def test_a_pair_no_report_ran_needs_a_proxy_and_bad_input_is_one_line(tmp_path, capsys):
    plan = STUDIES / "confirm-pad-1025.yaml"
    with pytest.raises(SystemExit, match="H3: fewer than two seeds of replay\\+lwf\\+streamkl - replay\\+lwf at 1025 "
                                         "tokens in --reports; give a --proxy"):
        script.main([str(plan), "--reports", str(RESULTS / "efficacy-long.json")])
    with pytest.raises(SystemExit, match="--proxy 'H9=a:b': expected ID=STRATEGY:BASELINE"):
        script.main([str(plan), "--reports", str(RESULTS / "efficacy-long.json"), "--proxy", "H9=a:b"])
    not_a_report = tmp_path / "x.json"
    not_a_report.write_text("{}")
    assert script.main([str(plan), "--reports", str(not_a_report)]) == 2
    assert capsys.readouterr().err.strip() == f"power_calculation: error: --reports {not_a_report} is not a study " \
                                              "report (report.json)"
    untested = tmp_path / "plan.yaml"
    untested.write_text(yaml.safe_dump({"settings": {}, "test_seeds": [1, 2]}))
    with pytest.raises(SystemExit, match="the plan has no hypotheses"):
        script.main([str(untested), "--reports", str(RESULTS / "efficacy-long.json")])
