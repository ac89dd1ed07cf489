"""The plain sentences a run's summary opens with."""

from __future__ import annotations

from cl_streamkl.experiment.findings import findings
from cl_streamkl.experiment.summary import summary_markdown, summary_text

SUMMARY = {name: {"seeds": [0, 1, 2], "average_forgetting": {"mean": value, "std": 0.01}}
           for name, value in (("naive", 0.30), ("lwf", 0.17), ("streamkl", 0.09), ("lwf+streamkl", 0.02))}


def _pair(strategy, baseline, low, high, n=3):
    return {"strategy": strategy, "baseline": baseline, "metric": "forgetting", "mean_diff": (low + high) / 2,
            "ci95": [low, high], "n": n}


def test_each_pair_says_whether_its_interval_rules_out_no_effect():
    lines = findings(SUMMARY, [_pair("streamkl", "naive", -0.30, -0.12), _pair("lwf+streamkl", "lwf", -0.3, 0.1)])
    assert lines[0] == ("streamkl forgets 9.0 % of what it had learned, naive 30.0 %: -21.0 points over 3 seeds, "
                        "95 % interval [-30.0, -12.0] (the whole interval is below zero: less forgetting, beyond "
                        "these seeds' noise).")
    assert "the interval holds zero: these seeds cannot tell the two apart" in lines[1]
    assert lines[2] == "streamkl alone forgets 9.0 %, lwf alone 17.0 %: streamkl forgets less here."


def test_one_seed_asks_for_more_and_other_metrics_are_left_to_the_table():
    one = {**_pair("streamkl", "naive", -0.2, -0.2, n=1), "ci95": [None, None]}
    other = {**_pair("streamkl", "naive", 0.1, 0.2), "metric": "stream_accuracy"}
    lines = findings({k: v for k, v in SUMMARY.items() if k != "lwf"}, [one, other])
    assert lines == ["streamkl forgets 9.0 % of what it had learned, naive 30.0 %: -20.0 points over 1 seed "
                     "(1 seed: give --seeds 0 1 2 for an interval)."]


def test_the_summary_opens_with_them():
    summary = {name: {**entry, **{key: None for key in ("final_average_accuracy", "backward_transfer",
                                                        "learning_accuracy", "final_task_il_accuracy")},
                      "wall_time_s": {"mean": 1.0, "std": 0.0}, "peak_memory_mb": {"mean": 1.0, "std": 0.0}}
               for name, entry in SUMMARY.items()}
    paired = [_pair("streamkl", "naive", -0.30, -0.12)]
    text = summary_text("digits, task-incremental", summary, paired, "task")
    assert text.splitlines()[2:4] == ["What this run shows:", "- " + findings(summary, paired)[0]]
    assert "- " + findings(summary, paired)[0] in summary_markdown("digits", summary, paired, "task")
    assert "What this run shows" not in summary_text("digits", {"naive": summary["naive"]}, [], "task")
