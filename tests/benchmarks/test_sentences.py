"""Sentence views (benchmarks/_harness/sentences.py): prose figures picked from a result file's rows or records,
and their rendering between markers by benchmarks/tables.py."""

from __future__ import annotations

import json

import pytest

sentences = pytest.importorskip("_harness.sentences")
tables = pytest.importorskip("tables")

TABLE = {"columns": [{"name": "shape"}, {"name": "mode"}, {"name": "vs SDPA", "align": "right"}],
         "rows": [["4096", "fwd", 3.26], ["4096", "fwd+bwd", 1.33], ["8192", "fwd+bwd", 0.85],
                  ["16384", "fwd+bwd", 0.77]]}
REPORT = {"plan_fingerprint": "f", "plan": {"test_seeds": [500, 501, 502],
                                           "power": {"H1": {"seeds_for_80pct": 11}, "H2": {"seeds_for_80pct": 8}}},
          "hypotheses": [{"id": "H1", "role": "primary", "mean_diff": -16.23, "verdict": "confirmed"},
                         {"id": "H2", "role": "primary", "mean_diff": -1.2, "verdict": "not confirmed"},
                         {"id": "S1", "role": "secondary", "mean_diff": 15.4, "verdict": "confirmed"}]}


def _sentence(data, sentence, **values):
    return sentences.render_sentence(data, {"sentence": sentence, "values": values}, "[`t.json`](t.json)", "t/v")


def test_one_min_max_and_count_from_table_rows():
    long = {"mode": "fwd+bwd", "shape": ["8192", "16384"]}
    lines = _sentence(TABLE, "{low:.2f}–{high:.2f}× from 8192 tokens, {short:.2f}× at 4096 ({n} rows)",
                      low={"where": long, "column": "vs SDPA", "pick": "min"},
                      high={"where": long, "column": "vs SDPA", "pick": "max"},
                      short={"where": {"shape": "4096", "mode": "fwd+bwd"}, "column": "vs SDPA"},
                      n={"where": {"mode": "fwd+bwd"}, "pick": "count"})
    assert lines == ["0.77–0.85× from 8192 tokens, 1.33× at 4096 (3 rows)"]


def test_records_named_by_in_scale_and_a_list_of_templates():
    lines = _sentence(REPORT, ["- {confirmed} of {primary} confirmed on {seeds} seeds ({source}).",
                               "- {h1:.1f} pp less forgetting."],
                      confirmed={"in": "hypotheses", "where": {"role": "primary", "verdict": "confirmed"},
                                 "pick": "count"},
                      primary={"in": "hypotheses", "where": {"role": "primary"}, "pick": "count"},
                      seeds={"in": "plan.test_seeds", "pick": "count"},
                      h1={"in": "hypotheses", "where": {"id": "H1"}, "column": "mean_diff", "scale": -1})
    assert lines == ["- 1 of 2 confirmed on 3 seeds ([`t.json`](t.json)).", "- 16.2 pp less forgetting."]


def test_differences_shares_and_sums_of_picked_values():
    r4096, r8192 = ({"where": {"shape": shape, "mode": "fwd+bwd"}, "column": "vs SDPA"} for shape in ("4096", "8192"))
    lines = _sentence(TABLE, "{gap:.2f} apart, {share:.0%} of it, {saved:.0f} % saved, {total:.2f} in all",
                      gap={"minus": [r4096, r8192]}, share={"over": [r8192, r4096]},
                      saved={"minus": [1, {"over": [r8192, r4096]}], "scale": 100}, total={"plus": [r4096, r8192, 1]})
    assert lines == ["0.48 apart, 64% of it, 36 % saved, 3.18 in all"]


@pytest.mark.parametrize(("values", "message"), [
    ({"x": {"minus": [1]}}, "minus or over"),
    ({"x": {"over": [1, 2, 3]}}, "minus or over"),
    ({"x": {"plus": [1, 2], "minus": [1, 2]}}, "minus or over"),
    ({"x": {"over": [1, 0]}}, "divides by zero"),
    ({"x": {"minus": [1, {"where": {"mode": "fwd"}, "column": "shape"}]}}, "needs numbers"),
    ({"x": {"minus": [1, {"where": {"mode": "bwd"}, "column": "vs SDPA"}]}}, r"minus\[1\]: no record"),
])
def test_arithmetic_that_cannot_be_done_is_refused_naming_it(values, message):
    with pytest.raises(ValueError, match=message):
        _sentence(TABLE, "{x}", **values)


def test_a_mapping_of_records_is_read_with_each_key():
    seeds = {"in": "plan.power", "column": "seeds_for_80pct"}
    lines = _sentence(REPORT, "{h1} and {most} seeds", h1={**seeds, "where": {"key": "H1"}},
                      most={**seeds, "pick": "max"})
    assert lines == ["11 and 11 seeds"]


@pytest.mark.parametrize(("data", "sentence", "values", "message"), [
    (TABLE, "{x}", {"x": {"where": {"mode": "fwd+bwd"}, "column": "vs SDPA"}}, "3 records match"),
    (TABLE, "{x}", {"x": {"where": {"mode": "bwd"}, "column": "vs SDPA"}}, "no record matches"),
    (TABLE, "{x}", {"x": {"where": {"dtype": "bf16"}, "column": "vs SDPA", "pick": "min"}}, "'dtype'"),
    (TABLE, "{x}", {"x": {"where": {"mode": "fwd"}, "column": "vs FA2"}}, "'column'"),
    (TABLE, "{x}", {"x": {"where": {"mode": "fwd"}, "column": "vs SDPA", "pick": "mean"}}, "'pick'"),
    (TABLE, "{x} {y}", {"x": {"where": {"mode": "fwd"}, "column": "vs SDPA"}}, r"\['y'\]"),
    (TABLE, "{x}", {"x": {"where": {"mode": "fwd"}, "column": "vs SDPA"}, "y": {"pick": "count"}},
     "not in the sentence"),
    (TABLE, "{x:.2f}", {"x": {"where": {"mode": "fwd"}, "column": "shape"}}, "t/v"),
    (REPORT, "{x}", {"x": {"where": {"id": "H1"}, "column": "mean_diff"}}, "'in'"),
    (TABLE, "{x}", {"x": {"where": {"mode": "fwd+bwd"}, "column": "shape", "pick": "max"}}, "needs numbers"),
    (TABLE, "{x}", {"x": {"where": {"mode": "fwd"}, "column": "shape", "scale": -1}}, "scale multiplies"),
    (REPORT, "{x}", {"x": {"in": "plan.seeds", "pick": "count"}}, "plan.seeds"),
    (REPORT, "{x}", {"x": {"in": "plan_fingerprint", "pick": "count"}}, "neither a list"),
])
def test_a_view_that_cannot_be_rendered_is_refused_naming_it(data, sentence, values, message):
    with pytest.raises(ValueError, match=message) as refused:
        _sentence(data, sentence, **values)
    assert "t/v" in str(refused.value)


def test_tables_renders_a_sentence_view_between_markers_and_check_sees_an_edit(tmp_path):
    results, docs = tmp_path / "benchmarks" / "results", tmp_path / "docs"
    results.mkdir(parents=True)
    docs.mkdir()
    table = {**TABLE, "gpu": "G", "torch": "t", "triton": "r", "commit": "c", "date": "d",
             "views": {"long": {"sentence": "Fused costs {r:.2f}× attention's time ({source}).",
                                "values": {"r": {"where": {"shape": "8192", "mode": "fwd+bwd"},
                                                 "column": "vs SDPA"}}}}}
    (results / "fused.json").write_text(json.dumps(table))
    page = docs / "page.md"
    page.write_text("- claim:\n<!-- table:fused/long -->\n<!-- /table -->\n")
    page.write_text(tables.regenerate(page, results))
    assert page.read_text() == ("- claim:\n<!-- table:fused/long -->\n"
                                "Fused costs 0.85× attention's time "
                                "([`fused.json`](../benchmarks/results/fused.json)).\n"
                                "<!-- /table -->\n")
    page.write_text(page.read_text().replace("0.85×", "0.58×"))
    assert tables.regenerate(page, results) != page.read_text()


def test_a_rerun_keeps_the_sentence_views_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "fused.json"
    sentence = {"sentence": "{r}", "values": {"r": {"where": {"shape": "8192"}, "column": "vs SDPA"}}}
    path.write_text(json.dumps({**TABLE, "views": {"long": sentence, "headline": {"columns": ["shape"]},
                                                   "mine": {"sentence": "old"}}}))
    rerun = {**TABLE, "views": {"headline": {"columns": ["mode"]}, "mine": {"sentence": "new"}}}
    kept = sentences.keep_sentence_views(path, rerun)
    assert kept["views"] == {"headline": {"columns": ["mode"]}, "mine": {"sentence": "new"}, "long": sentence}
    assert sentences.keep_sentence_views(tmp_path / "absent.json", rerun) is rerun
    (tmp_path / "list.json").write_text("[1, 2]")
    assert sentences.keep_sentence_views(tmp_path / "list.json", rerun) is rerun


def test_write_json_keeps_the_sentence_views_of_the_file_it_replaces(tmp_path):
    report = pytest.importorskip("_harness.report")
    path = tmp_path / "result.json"
    sentence = {"sentence": "{n} rows", "values": {"n": {"pick": "count"}}}
    report.write_json(path, {**TABLE, "views": {"count": sentence}})
    report.write_json(path, {**TABLE, "rows": TABLE["rows"][:1]})
    written = json.loads(path.read_text())
    assert written["rows"] == TABLE["rows"][:1] and written["views"] == {"count": sentence}
