"""The benchmark script: its reference implementations agree with ours, and a section runs."""
import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench  # noqa: E402

import common  # noqa: E402
from plumbing import models  # noqa: E402
import lab  # noqa: E402


def test_dense_reference_equals_chunked_retrieval():
    g = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(40, 16, generator=g), dim=-1)
    t2i = torch.arange(40).repeat_interleave(5)
    txt = F.normalize(img[t2i] + torch.randn(200, 16, generator=g), dim=-1)
    assert bench.dense_retrieval(img, txt, t2i) == common.retrieval_metrics(img, txt, t2i, max_chunk_scores=300)


RECORD_FIELDS = {"name", "value", "baseline", "ratio", "goal", "met", "device", "torch"}
FLOOR_FIELDS = {"floor_seconds", "extra_seconds", "ratio_to_floor", "floor_goal", "floor_met", "flops",
                "baseline_flops", "extra_flops"}


def test_steps_section_writes_floors(tmp_path):
    """On the tiny backbone: every step record has the floor fields,
    ratio_to_floor = step / (plain + extra work), and the floors account for
    the methods' work: ERCLIP's and m2/m3-Mix's step FLOPs are the plain
    step's plus the extra work's (C-CLIP's also carry LoRA's adapters)."""
    models.register_tiny(lab.TINY_CFG)
    out = tmp_path / "results.json"
    bench.RECORDS.clear()
    bench.bench_steps(True, models.TINY_NAME, batch=4, repeat=1)
    bench.write_records(out)
    recs = {r["name"].split(" vs ")[0].removeprefix("step "): r for r in json.loads(out.read_text())}
    assert sorted(recs) == sorted(list(bench.METHOD_STEPS)[:bench.QUICK_STEPS])
    for name, r in recs.items():
        assert RECORD_FIELDS | FLOOR_FIELDS <= set(r), name
        assert r["floor_seconds"] == pytest.approx(r["baseline"] + r["extra_seconds"], rel=1e-12)
        # issue 75.4: the ratios are the medians of per-round ratios over >= 5 interleaved rounds, spread beside
        assert len(r["round_ratios"]) == len(r["round_ratios_to_floor"]) == bench.ROUNDS >= 5
        assert r["ratio_to_floor"] == statistics.median(r["round_ratios_to_floor"])
        assert r["ratio"] == statistics.median(r["round_ratios"])
        assert list(r["ratio_to_floor_spread"]) == [min(r["round_ratios_to_floor"]), max(r["round_ratios_to_floor"])]
        assert r["spread"][0] <= r["value"] <= r["spread"][1]
        assert r["floor_met"] == (r["ratio_to_floor"] <= r["floor_goal"] == bench.FLOOR_GOAL)
        assert r["extra_seconds"] > 0 and r["extra_flops"] > 0 and r["baseline_flops"] > 0
        floor_flops = r["baseline_flops"] + r["extra_flops"]
        if name.startswith("C-CLIP"):
            assert r["flops"] > floor_flops
        else:
            assert r["flops"] == pytest.approx(floor_flops, rel=0.02), name
    erclip = recs["ERCLIP M+P (6 sentences/caption)"]
    assert erclip["goal"] is None and erclip["met"] is None  # the retired goal: below the floor
    assert erclip["extra_flops"] > erclip["baseline_flops"]  # 6 sentences a caption and the teacher
    assert recs["m2-Mix"]["goal"] == 1.1


def test_dns_projection_records(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "DNS_DIMS", (64,))
    monkeypatch.setattr(bench, "DNS_BATCHES", (8, 256))
    out = tmp_path / "results.json"
    bench.RECORDS.clear()
    bench.main(["--quick", "--only", "dns", "--out", str(out)])
    recs = json.loads(out.read_text())
    steps = [r for r in recs if r["name"].startswith("DNS step")]
    assert len(steps) == 2 and all(r["goal"] is None and r["met"] is None for r in steps)  # retired goals
    proj = [r for r in recs if r["name"].startswith("DNS projection")]
    assert len(proj) == 3 * 2 * 2  # forms x batches x ranks
    for r in proj:
        assert RECORD_FIELDS <= set(r) and r["flops"] > 0 and r["step_seconds"] > 0
        assert (r["goal"] == 1.5) == r["chosen"] and r["share_of_step"] == pytest.approx(r["value"] / r["step_seconds"])
    picks = [r["name"] for r in proj if r["chosen"]]
    assert len(picks) == 4  # one form per (batch, rank); by hand (projection_flops):
    assert any("activations form (d=64, batch 8, old rank 16 " in n for n in picks)  # 1.3e5 vs factored 3.3e5
    assert any("factored form (d=64, batch 256, old rank 32 " in n for n in picks)  # 7.9e5 vs dense 1.0e6
    assert any(r["name"].startswith("matrix-product rate") and r["value"] > 0 for r in recs)
    assert any("update-mode projection" in r["name"] for r in recs) and any("rebuild" in r["name"] for r in recs)
    assert all(r["value"] > 0 for r in recs if "activations form" not in r["name"])  # that one is a difference


def test_flop_count_includes_cpu_attention():
    """count_flops counts CPU attention: one (1, 1, n, d) attention call is
    2 products of 2 n^2 d operations (Q K^T and the weights times V)."""
    q = torch.randn(1, 1, 16, 8)
    n = bench.count_flops(lambda: F.scaled_dot_product_attention(q, q, q))
    assert n == 2 * 2 * 16 * 16 * 8


def test_a_short_run_keeps_the_full_runs_records_file():
    """--quick and --only write benchmarks/results-partial.json unless --out says otherwise; only the full run
    writes the committed benchmarks/results.json."""
    assert bench.default_out(False, "") == str(bench.ROOT / "benchmarks" / "results.json")
    for quick, only in ((True, ""), (False, "dns"), (True, "dns")):
        assert bench.default_out(quick, only) == str(bench.ROOT / "benchmarks" / "results-partial.json")


def test_the_data_path_benchmark_splits_a_sample_into_its_parts(tmp_path):
    """benchmarks/data_path.py (issue 71.4's premise): a sample's seeding, decoding and transform, each timed alone,
    are each a part of the whole sample's time, measured on the lab's split."""
    import data_path
    out = data_path.measure(data_root=str(tmp_path), n=24, repeats=1)
    us, share = out["us per sample"], out["share of the whole"]
    assert out["samples"] == 24 and us["whole"] > 0
    assert all(0 < share[k] < 1 and us[k] > 0 for k in ("seeding", "decoding", "transform"))


def test_the_cclip_demo_time_benchmark_times_each_part_once(tmp_path):
    """benchmarks/cclip_demo_time.py (issue 71.4): a row's optimisation steps, evaluations and loading are parts of
    its time, each counted once (a second row in the same process is timed by its own clocks, not the first's)."""
    import cclip_demo_time
    import common
    step = common.train_step
    out = cclip_demo_time.measure(str(tmp_path / "runs"), processes=1, methods=("full", "full"), steps=2,
                                  data_root=str(tmp_path))
    assert common.train_step is step  # put back
    a, b = out["rows"]["full FT"], out["cpu seconds a seed"]
    for part in cclip_demo_time.PARTS:
        assert 0 < a[part] < a["total"]
    assert sum(a[p] for p in cclip_demo_time.PARTS) < a["total"]
    assert b["total"] == pytest.approx(2 * a["total"], rel=0.5)  # two rows of the same work, neither counted twice
