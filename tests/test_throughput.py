"""Issue 75.1: benchmarks/throughput.py (gpu_check's section 5) on CPU with the tiny backbone: the FLOP count of a
plain CLIP step against the transformer arithmetic written out by hand, the report's fields and their relations,
the peak table, the batch sweep's stop at the memory limit, --accum-freq's parts, the loop with data."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import throughput  # noqa: E402

import lab  # noqa: E402
from plumbing import models  # noqa: E402


def _stepper(batch=8, method="plain"):
    torch.manual_seed(0)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    case = gpu_check.build(method, model, tok, batch, "cpu")
    return gpu_check.Stepper(case, "cpu", "fp32"), train_tf, tok


def _tower_flops(B, n, width, layers, mlp):
    """Forward FLOPs of `layers` pre-norm transformer blocks on (B, n, width): the fused q/k/v projection, the
    output projection, the two MLP matrices (2 m k n each), Q K^T and A V (2 B n n width each, summed over
    heads)."""
    per_layer = 2 * B * n * width * (3 * width + width + 2 * mlp) + 2 * 2 * B * n * n * width
    return layers * per_layer


def test_a_plain_steps_flops_are_the_transformer_arithmetic():
    """flop_counter's count of one plain CLIP step (forward and backward) equals the count by hand: each matrix
    product's forward, twice that backward (the input's and the weight's gradients), the patch embedding's input
    (the image) taking no gradient, and attention's backward at 2.5x its forward (flop_counter recomputes the
    scores, as the fused kernels do)."""
    s, _, _ = _stepper(batch=8)
    batch = s.case.batch
    B, D = 8, lab.TINY_CFG["embed_dim"]
    v, t = lab.TINY_CFG["vision_cfg"], lab.TINY_CFG["text_cfg"]
    patches = (v["image_size"] // v["patch_size"]) ** 2
    n_img, n_txt = patches + 1, int((batch["text"] != 0).sum(1).max())  # the class token; the trimmed captions
    patch = 2 * B * patches * 3 * v["patch_size"] ** 2 * v["width"]
    vis = _tower_flops(B, n_img, v["width"], v["layers"], 4 * v["width"])
    txt = _tower_flops(B, n_txt, t["width"], t["layers"], 4 * t["width"])
    attn = lambda n, w, layers: layers * 2 * 2 * B * n * n * w  # noqa: E731
    heads = 2 * B * v["width"] * D + 2 * B * t["width"] * D  # the two projections to the joint space
    logits = 2 * B * B * D
    forward = patch + vis + txt + heads + logits
    backward = 2 * (forward - patch) + patch + 0.5 * (attn(n_img, v["width"], v["layers"])
                                                      + attn(n_txt, t["width"], t["layers"]))
    counted = throughput.count_flops(s.step)
    assert counted == pytest.approx(forward + backward, rel=1e-9), (counted, forward + backward)


def test_the_report_fields_and_their_relations():
    s, _, _ = _stepper(batch=8)
    r = throughput.step_throughput(s, 8, steps=3, warmup=1, peak=2.0)
    t = r["seconds"]
    assert t["n"] == 3 and t["min"] <= t["median"] <= t["max"]
    assert r["pairs_per_s"] == pytest.approx(8 / t["median"])
    assert r["achieved_tflops"] == pytest.approx(r["gflop_per_pair"] * 8 / t["median"] / 1e3)
    assert r["mfu"] == pytest.approx(r["achieved_tflops"] / 2.0) and r["precision"] == "fp32"
    assert throughput.step_throughput(s, 8, steps=3, warmup=0, peak=None, flops=8e9)["gflop_per_pair"] == 1.0


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.5),
                                        ("NVIDIA H100 NVL", 835.5), ("NVIDIA H200", 989.5),
                                        ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", None)])
def test_the_peak_table_by_device_name(name, peak):
    assert throughput.peak_tflops(name)[0] == peak


def test_the_batch_sweep_stops_at_the_memory_limit():
    made = []

    def make(b):
        made.append(b)
        if b > 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return _stepper(batch=b)[0]
    rows = throughput.batch_sweep(make, (4, 8, 16, 32), steps=2, warmup=0)
    assert made == [4, 8, 16] and [r["batch_size"] for r in rows] == [4, 8, 16]
    assert rows[-1] == {"batch_size": 16, "out_of_memory": True} and rows[0]["pairs_per_s"] > 0


def test_accum_breakdown_times_each_part():
    s, _, _ = _stepper(batch=8)
    r = throughput.accum_breakdown(s.case, "cpu", "fp32", 2, repeat=2)
    parts = ("features_no_graph", "loss_and_backward", "replays_and_backward")
    assert all(r[p] > 0 for p in parts) and r["accumulated"] == pytest.approx(sum(r[p] for p in parts))
    assert r["ratio_to_plain"] == pytest.approx(r["accumulated"] / r["plain_forward_backward"]) and r["k"] == 2
    # issue 75.2's cause: 4/3 of the plain FLOPs (one more forward without a graph), but over k times the
    # operations (k forwards without a graph, k with their backward: ViT-B/16 at k = 4, 5.36x)
    assert r["flops"]["accumulated"] == pytest.approx(4 / 3 * r["flops"]["plain"], rel=0.02)
    assert r["ops"]["accumulated"] > 2 * r["ops"]["plain"]


def test_accum_op_counts_show_the_step_cast_once():
    """--accum-ops (docs/benchmarks.md, issue 75.2): the accumulated step as training runs it dispatches fewer
    operations than with a cast per pass (the weights' casts made once a step), and still over twice the plain
    step's (the GradCache replay)."""
    r = throughput.accum_op_counts("tiny", k=2, batch=4)
    assert r["plain"] > 0 and 2 * r["plain"] < r["accumulated"] < r["accumulated_cast_per_pass"]
    assert r["ratio"] == pytest.approx(r["accumulated"] / r["plain"])


def test_the_loop_with_data_decodes_jpegs_and_steps():
    s, train_tf, tok = _stepper(batch=4)
    before = s.case.batch
    r = throughput.data_loop_throughput(s, train_tf, tok, 4, workers=0, steps=2, warmup=1, image_px=48)
    assert r["loop_pairs_per_s"] > 0 and r["data_only_pairs_per_s"] > r["loop_pairs_per_s"] * 0.5
    assert r["loop_pairs_per_s"] == pytest.approx(4 / r["loop_seconds_per_step"]) and r["steps"] == 2
    assert s.case.batch is before  # the fixed batch back in place


def test_gpu_checks_plain_section_runs_every_part(monkeypatch):
    """throughput_check as gpu_check runs it for the plain step: the sweep, the compiled step (aot_eager here: the
    graph capture without inductor's C++ build), --accum-freq's parts, the loop with data."""
    monkeypatch.setattr(models, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    model, train_tf, _, tok = models.load_model("tiny", "random")
    r = gpu_check.throughput_check("plain", model, tok, "cpu", batch_size=4, backbone="tiny", peak=None, steps=2,
                                   sweep=(4, 8), compiled=True, accum=2, data_loop=True, train_tf=train_tf)
    torch._dynamo.reset()
    assert [(t["variant"], t["batch_size"]) for t in r["rows"]] == [("step", 4), ("batch sweep", 4),
                                                                     ("batch sweep", 8), ("compiled", 4)]
    assert r["rows"][-1]["compile_seconds"] > 0 and r["accum_breakdown"]["k"] == 2
    assert r["data_loop"]["loop_pairs_per_s"] > 0
    table = gpu_check.throughput_rows([r])
    assert len(table) == 4 and all(row["MFU"] == "no peak" for row in table)


def test_the_projection_from_a_committed_gpu_run(tmp_path):
    """Issue 75.3 on paper: operations and FLOPs counted here joined with a gpu_check file's seconds; the host-pace
    model reproduces the plain step's measured MFU by construction, and the other rows follow from it."""
    import json
    doc = {"info": {"device": "NVIDIA H200", "batch_size": 64},
           "results": [{"check": "plain step (fp16 vs fp32)", "method": "plain", "sec_per_step": 0.05},
                       {"check": "m2-mix step (fp16 vs fp32)", "method": "m2-mix", "sec_per_step": 0.06},
                       {"check": "plain step (fp16, --accum-freq 4 vs fp32)", "method": "plain", "sec_per_step": 1}]}
    (tmp_path / "g.json").write_text(json.dumps(doc))
    rows = {r["method"]: r for r in throughput.project(tmp_path / "g.json", backbone="tiny", batch=4)}
    assert set(rows) == {"plain", "m2-mix"}  # the accumulation row is not a step of its own
    plain = rows["plain"]
    assert plain["ops"] > 100 and plain["gflop_per_pair"] > 0 and plain["gpu_seconds"] == 0.05
    assert plain["mfu_measured"] == pytest.approx(plain["gflop_per_pair"] * 1e9 * 64 / 0.05 / 989.5e12)
    assert plain["mfu_projected_at_gpu_batch"] == pytest.approx(plain["mfu_measured"])
    assert plain["host_seconds_projected"] == pytest.approx(0.05)
    assert rows["m2-mix"]["seconds_per_op"] == pytest.approx(0.06 / rows["m2-mix"]["ops"])
