"""Issue 42.3: one results.json schema for every method (plumbing.results), in strict JSON; the user's own
numbers as a table (R@1/5/10 both ways, zero-shot top-1). The methods' end-to-end tests check their files with
conftest's results_files_are_strict_json; here the schema's pieces on hand-made numbers."""
import json
import math

import pytest

import common
from plumbing.flags import Config
import eval as evaluation
from plumbing import results


def strict(text):
    def refuse(name):
        raise ValueError(name)
    return json.loads(text, parse_constant=refuse)


def test_results_json_is_strict_json_with_null_and_a_reason(tmp_path):
    """json.dumps wrote bare NaN (a DNS step without classes, a one-seed std), which JSON.parse, jq and Go
    refuse: now null, the record says why, 'non_finite' lists each place; restore=True reads the NaN back."""
    doc = results.document("dns", results.staged([
        {"task": "a", "metric": "acc", "value": float("nan")},
        {"task": "a", "metric": "i2t_R@1", "value": 12.5}], "task 1", {"acc": "no classes"}),
        summary={"bwt": float("-inf"), "rows": [[1.0, float("nan")]]})
    common.write_results(tmp_path, doc, Config())
    saved = strict((tmp_path / "results.json").read_text())
    assert saved["records"][0]["value"] is None and saved["records"][0]["reason"] == "no classes"
    assert saved["records"][1] == {"task": "a", "metric": "i2t_R@1", "value": 12.5, "stage": "task 1"}
    assert saved["summary"] == {"bwt": None, "rows": [[1.0, None]]} and saved["config"]["lr"] == Config().lr
    assert {tuple(p["at"]): p["was"] for p in saved["non_finite"]} == {
        ("records", 0, "value"): "nan", ("summary", "bwt"): "-inf", ("summary", "rows", 0, 1): "nan"}
    back = results.from_json((tmp_path / "results.json").read_text(), restore=True)
    assert math.isnan(back["records"][0]["value"]) and back["summary"]["bwt"] == float("-inf")
    assert "non_finite" not in back
    with pytest.raises(ValueError):
        results.from_json('{"x": NaN}')  # strict, as JSON.parse
    assert math.isnan(results.from_json('{"x": NaN}', strict=False)["x"])  # files written before


def test_a_record_without_a_given_reason_gets_one():
    text = results.to_json({"records": [{"task": "t", "metric": "top1", "value": float("nan"), "stage": "base"}]})
    assert strict(text)["records"][0]["reason"] == "nan (not a finite number)"


def test_a_task_sequence_keeps_its_nan_through_a_resume(tmp_path):
    """common.run_continual's continual.json is strict too, and a resumed sequence reads the NaN of a metric that
    does not apply (DNS's accuracy on a step without classes) back as NaN, not None."""
    tasks = [common.Task("one", "x", "x"), common.Task("two", "x", "x")]
    scores = iter([1.0, 2.0, 3.0])

    def evaluate():
        return {"per_task": {"acc": [float("nan"), next(scores)]}, "scalars": {}}

    def learn(i, task, task_out, resume):
        return {"stopped_at": 1} if i == 1 and not resume else {"steps": 1}
    args = (evaluate, lambda p: p.write_text("s"), lambda p: None)
    assert "stopped_at" in common.run_continual(tmp_path, tasks, learn, *args, log=lambda m: None)
    strict((tmp_path / "continual.json").read_text())
    summary = common.run_continual(tmp_path, tasks, lambda *a: {"steps": 1}, *args, resume=True, log=lambda m: None)
    R = summary["matrices"]["acc"]
    assert [r[1] for r in R] == [1.0, 2.0, 3.0] and all(math.isnan(r[0]) for r in R)


def test_the_own_table_shows_every_recall_and_top1_per_stage_and_task():
    recs = [{"task": "mine.jsonl", "metric": m, "value": v, "text_mode": "truncate"}
            for m, v in (("i2t_R@1", 10.0), ("i2t_R@5", 30.0), ("i2t_R@10", 50.0), ("t2i_R@10", 40.0),
                         ("align", 0.1))]
    recs += [{"task": "imagefolder:pets", "metric": "top1", "value": 61.0, "text_mode": "prompt-ensemble"}]
    table = results.own_table(results.staged(recs, "base") + results.staged(recs[:1], "tuned"), title="Yours")
    lines = table.splitlines()
    assert lines[0] == "Yours" and lines[2] == "| stage | task | i2t_R@1 | i2t_R@5 | i2t_R@10 | t2i_R@10 | top1 |"
    assert "| base | mine.jsonl | 10.0 | 30.0 | 50.0 | 40.0 |  |" in lines
    assert "| base | imagefolder:pets |  |  |  |  | 61.0 |" in lines and "| tuned | mine.jsonl | 10.0 |" in table
    # Long-CLIP: one task through two windows: a window column, a row each
    two = [dict(recs[0], stage="tuned", window=w, value=float(w)) for w in (77, 248)]
    assert "| stage | task | window | i2t_R@1 |" in results.own_table(two)
    assert "| tuned | mine.jsonl | 248 | 248.0 |" in results.own_table(two)
    assert results.own_table([]) == ""


def test_a_task_sequence_gives_records_of_every_cell_and_a_table_of_its_ends():
    summary = {"matrices": {"i2t_R@1": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]},
               "scalars": [{"synthetic-color_top1": 50.0, "u.jsonl/i2t_R@10": 9.0}, {}, {"synthetic-color_top1": 40.0}]}
    recs = results.continual_records(summary, ["day", "night"])
    assert {(r["task"], r["stage"], r["value"]) for r in recs if r["metric"] == "i2t_R@1"} == {
        ("day", "base", 1.0), ("night", "base", 2.0), ("day", "task 1", 3.0), ("night", "task 1", 4.0),
        ("day", "task 2", 5.0), ("night", "task 2", 6.0)}
    assert {"task": "synthetic-color", "metric": "top1", "value": 40.0, "stage": "task 2"} in recs
    assert {"task": "u.jsonl", "metric": "i2t_R@10", "value": 9.0, "stage": "base"} in recs
    table = results.sequence_table(summary, ["day", "night"])
    assert "task 1" not in table and "| task 2 | night | 6.0 |" in table and "| base | synthetic-color |" in table
    doc = results.of_sequence("cclip", summary, [common.Task("day", "a", "b"), "night"])
    assert doc["continual"]["tasks"] == ["day", "night"] and doc["records"] == recs


def test_tables_show_r_at_10():
    """Issue 42.3: the tables showed R@1 (eval.py) or R@1 / R@5 (m2-Mix's Table 1), never R@10."""
    from plumbing import published
    recs = [{"task": "t", "metric": m, "value": 1.0, "text_mode": "truncate", "model": "FT"}
            for m in results.RECALLS]
    assert "i2t_R@10" in evaluation.results_table(recs) and "t2i_R@10" in evaluation.results_table(recs)
    assert "| method | i2t_R@1 | i2t_R@5 | i2t_R@10 | t2i_R@1 | t2i_R@5 | t2i_R@10 |" in published.m2mix_table1(recs)


def test_an_erclip_results_file_from_before_the_schema_is_still_read(tmp_path):
    """longclip.py --erclip-results reads erclip.py's file in the schema and in the layout before it."""
    from papers.longclip_data import read_erclip_results
    rec = {"task": "urban1k", "metric": "i2t_R@1", "value": 50.0}
    (tmp_path / "old.json").write_text(json.dumps({"variant": "M+P", "base": [], "tuned": [rec],
                                                   "config": {"lambda_p": 1.0}}))
    common.write_results(tmp_path / "new", results.document("erclip", results.staged([rec], "tuned"),
                                                            variant="M+P"), Config())
    assert read_erclip_results(tmp_path / "old.json") == ("M+P", [dict(rec, stage="tuned")], 1.0)
    (tmp_path / "new" / "results.json").write_text((tmp_path / "new" / "results.json").read_text().replace(
        '"config": {', '"config": {"lambda_p": 1.0, '))
    assert read_erclip_results(tmp_path / "new" / "results.json") == ("M+P", [dict(rec, stage="tuned")], 1.0)
