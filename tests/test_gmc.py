"""Tests of gmc.py (m2-Mix Sec. 5.5): GMC's loss and the m2 term against per-sample loops written from their
definitions, the restricted unpickler, the data checks, and a run on the lab's sentiment fixture that trains,
resumes exactly and evaluates every subset of observed modalities (Table 4's layout)."""
import dataclasses
import json
import math
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
from plumbing.base import DataError, UsageError
from plumbing.flags import parse_config
import gmc
from lab.sentiment import sentiment_world
from plumbing import published
from papers import mosei
from test_resume import _Payload  # runs code when unpickled

torch.set_num_threads(1)
SMALL = {"train": 64, "valid": 16, "test": 48}


def unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def nt_xent_loop(a, b, tau):
    """Per anchor of x = [a; b]: -log exp(x_i . x_pos(i) / tau) / sum_{k != i} exp(x_i . x_k / tau)."""
    x, n = torch.cat([a, b]).double(), len(a)
    out = []
    for i in range(2 * n):
        pos = (i + n) % (2 * n)
        den = sum(math.exp(float(x[i] @ x[k]) / tau) for k in range(2 * n) if k != i)
        out.append(-math.log(math.exp(float(x[i] @ x[pos]) / tau) / den))
    return out


def test_gmc_loss_is_the_sum_over_modalities_of_nt_xent_with_the_joint():
    z_j, zs, tau = unit(5, 4, seed=1), [unit(5, 4, seed=s) for s in (2, 3, 4)], 0.3
    per_anchor = np.sum([nt_xent_loop(z_j, z, tau) for z in zs], 0)  # (2B,): summed over modalities
    assert gmc.gmc_loss(z_j, zs, tau).item() == pytest.approx(per_anchor.mean(), rel=1e-5)


@pytest.mark.parametrize("pairs", [[(0, 1), (0, 2), (1, 2)], [(2, 1)]])
def test_m2_term_puts_the_mixture_against_the_joint_as_positive_and_negatives(pairs):
    z_j, zs, tau, lam = unit(6, 4, seed=5), [unit(6, 4, seed=s) for s in (6, 7, 8)], 0.3, 0.3
    want = np.mean([np.mean(nt_xent_loop(common.geodesic_mix(lam, zs[a], zs[b]), z_j, tau)) for a, b in pairs])
    assert gmc.m2_gmc_loss(z_j, zs, tau, lam, pairs).item() == pytest.approx(want, rel=1e-5)


def test_objective_weights_and_the_classification_loss():
    model = gmc.GMC([5, 4, 3], 6, layers=1)
    batch = {"text": torch.randn(8, 6, 5), "audio": torch.randn(8, 6, 4), "vision": torch.randn(8, 6, 3),
             "label": torch.tensor([-2.0, -1, 0, 0.33, 1, 2, 3, -0.33])}
    ctx = SimpleNamespace(generator=torch.Generator().manual_seed(0), epoch=0, replay=False)
    model.eval()
    paper = gmc.GMCNet(model, gmc.GMCConfig(method="gmc"))(batch, ctx)
    code = gmc.GMCNet(model, gmc.GMCConfig(method="gmc", weights="code", clf="l1"))(batch, ctx)
    assert set(paper) == {"loss_clf", "loss_gmc"} and code["loss_gmc"].item() == pytest.approx(
        2 * paper["loss_gmc"].item(), rel=1e-6)
    pred = model.classify(model.latents([batch[k] for k in mosei.MODALITIES])[1]).squeeze(-1)
    assert code["loss_clf"].item() == pytest.approx((pred - batch["label"]).abs().mean().item(), rel=1e-5)
    ce = F.binary_cross_entropy_with_logits(pred, (batch["label"] > 0).float())  # the paper's cross-entropy (G1)
    assert paper["loss_clf"].item() == pytest.approx(0.5 * ce.item(), rel=1e-5)
    m2 = gmc.GMCNet(model, gmc.GMCConfig(method="gmc-m2", m2_weight=0.5))(batch, ctx)
    assert m2["loss_m2"].item() > 0


def test_partial_observation_is_the_mean_of_the_observed_latents():
    model = gmc.GMC([5, 4, 3], 6, layers=1).eval()
    xs = [torch.randn(4, 6, 5), torch.randn(4, 6, 4), torch.randn(4, 6, 3)]
    with torch.no_grad():
        zs, z_j = model.latents(xs)
        assert torch.allclose(model.observe(xs, (0, 1, 2)), z_j)
        assert torch.allclose(model.observe(xs, (0, 2)), (zs[0] + zs[2]) / 2)  # not renormalised (G7)
        assert torch.allclose(model.observe([xs[0], None, None], (0,)), zs[0])


def test_evaluate_runs_in_the_models_dtype_and_matches_float32(tmp_path):
    """Issue 40.7: evaluate fed float32 inputs and latents to the model, so a model in another dtype failed (a
    double GRU given float inputs); it now uses the model's parameter dtype, and float64 gives float32's numbers."""
    import copy
    splits, _ = mosei.load_splits(sentiment_world(tmp_path, sizes=SMALL))
    torch.manual_seed(0)
    model = gmc.GMC([splits["train"][k].shape[2] for k in mosei.MODALITIES], 8, layers=1)
    single = gmc.evaluate(model, splits["test"], batch=20)
    double = gmc.evaluate(copy.deepcopy(model).double(), splits["test"], batch=20)
    flip = 100 / int((splits["test"]["label"] != 0).sum()) + 1e-6  # one prediction at the sign's edge may flip
    assert set(double) == set(single)
    assert all(math.isfinite(v) and abs(v - single[k]) <= (flip if "acc" in k else 1e-4) for k, v in double.items())


# ----------------------------------------------------------------------------- the data
def test_the_restricted_unpickler_refuses_a_pickle_that_would_run_code(tmp_path):
    marker = tmp_path / "ran.txt"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"train": {"text": _Payload(marker)}}))
    with pytest.raises(DataError, match="builtins.exec, which is not a numpy array: refused"):
        mosei.load_splits(path)
    assert not marker.exists()


def test_the_fixture_loads_its_inf_is_counted_and_npz_reads_the_same(tmp_path):
    path = sentiment_world(tmp_path, sizes=SMALL, neg_inf=0.01)
    splits, fixed = mosei.load_splits(path)
    assert splits["train"]["text"].shape == (64, 8, 16) and splits["test"]["label"].shape == (48,)
    assert fixed["train/audio"] > 0 and all(torch.isfinite(v).all() for s in splits.values() for v in s.values())
    with pytest.raises(DataError, match="non-finite values"):
        mosei.load_splits(path, "refuse")
    npz = mosei.convert(path)
    again, _ = mosei.load_splits(npz)
    assert all(torch.equal(again[s][k], splits[s][k]) for s in splits for k in splits[s])


def test_a_file_in_another_layout_stops_with_one_message_naming_it(tmp_path):
    path = tmp_path / "bad.pkl"
    arrays = {s: {"text": np.zeros((4, 5, 3)), "audio": np.zeros((4, 5, 2)), "vision": np.zeros((4, 6, 2)),
                  "labels": np.zeros((4, 1, 1))} for s in ("train", "valid", "test")}
    path.write_bytes(pickle.dumps(arrays))
    with pytest.raises(DataError, match="train's modalities have \\[5, 6\\] steps"):
        mosei.load_splits(path)
    path.write_bytes(pickle.dumps({"train": {}}))
    with pytest.raises(DataError, match="train/text"):
        mosei.load_splits(path)
    with pytest.raises(UsageError, match="no such file"):
        gmc.main(["--data", str(tmp_path / "missing.pkl")])


# ----------------------------------------------------------------------------- end to end
def test_a_run_trains_resumes_exactly_and_evaluates_every_subset(tmp_path, capsys, model_files_as_readme_says):
    data = sentiment_world(tmp_path, sizes=SMALL)
    base = ["--data", str(data), "--layers", "1", "--batch-size", "16", "--steps", "6", "--device", "cpu",
            "--precision", "fp32", "--workers", "0", "--log-every", "1", "--method", "gmc-m2"]
    straight = gmc.main(base + ["--out", str(tmp_path / "a"), "--save-every", "0"])
    test = straight["results"][0]["test"]
    assert set(test) == {f"{s} {m}" for s in gmc.SUBSETS for m in ("acc", "align", "unif")} - {"Full align"}
    assert "| GMC+m2-Mix (ours, 1 seed) |" in straight["table"] and "| GMC (paper) | 80.1 |" in straight["table"]
    model_files_as_readme_says("gmc", tmp_path / "a")
    log = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert {"loss_clf", "loss_gmc", "loss_m2"} <= set(log[-1])
    cut = gmc.main(base + ["--out", str(tmp_path / "b"), "--save-every", "3", "--stop-at", "3"])
    assert cut[0]["summary"]["stopped_at"] == 3
    gmc.main(base + ["--out", str(tmp_path / "b"), "--save-every", "3", "--resume", "latest"])
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("a", "b"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_seeds_give_mean_and_std_and_a_results_file(tmp_path, results_files_are_strict_json):
    data = sentiment_world(tmp_path, sizes=SMALL)
    res = gmc.main(["--data", str(data), "--layers", "1", "--batch-size", "16", "--steps", "2", "--device", "cpu",
                    "--workers", "0", "--method", "gmc", "--seeds", "3,4", "--out", str(tmp_path / "s")])
    assert sorted(res["results"]) == [3, 4] and (tmp_path / "s" / "seed4" / "model.pt").exists()
    saved = results_files_are_strict_json(tmp_path / "s", "gmc")  # issue 42.3: one schema, strict JSON
    assert saved["seeds"] == [3, 4] and "±" in saved["table"]
    assert {r["seed"] for r in saved["records"]} == {3, 4} and {r["stage"] for r in saved["records"]} == {"tuned"}
    assert results_files_are_strict_json(tmp_path / "s" / "seed3", "gmc")["records"][0]["metric"] == "Full acc"


def test_demo_writes_claims_results_and_figure(tmp_path, monkeypatch, check_demo_results):
    import lab.demos.gmc as demo
    monkeypatch.setattr(demo, "sentiment_world", lambda out: sentiment_world(out, sizes=SMALL))
    out = tmp_path / "demo"
    gmc.main(["--demo", "--seeds", "0,1", "--steps", "2", "--data-root", str(tmp_path / "data"), "--out", str(out)])
    saved = check_demo_results(out, "gmc-demo.png", ("GMC", "GMC+m2-Mix"), min_claims=6)
    assert "GMC+m2-Mix (paper)" in saved["table4"]


def test_table4_published_numbers_are_the_papers():
    t = published.M2MIX_TABLE4
    assert t["GMC"]["T acc"] == 78.5 and t["GMC+m2-Mix"]["V+A unif"] == 3.10 and t["MulT"]["T align"] is None
    assert dataclasses.fields(gmc.GMCConfig)  # the settings parse without torch (flags.answer_early)


def test_the_committed_demo_is_the_one_its_docs_print():
    from pathlib import Path

    import lab
    from lab import report
    root = Path(gmc.__file__).parent
    saved = json.loads((root / "docs" / "gmc-demo-results.json").read_text())
    assert saved["seeds"] == list(lab.SEEDS) and saved["config"]["steps"] == 200
    assert lab.claims_table(saved["claims"]) in (root / "docs" / "gmc.md").read_text()
    readme = (root / "README.md").read_text()  # issue 70: each line with the fresh seeds' verdict beside
    assert report.claims_lines(root / "docs" / "gmc-demo-results.json",
                               root / "docs" / "gmc-demo-fresh-results.json") in readme


def _fairseq_positions(n: int, d: int) -> torch.Tensor:
    """GMC's SinusoidalPositionalEmbedding.get_embedding written out: rows 0..n, row 0 (padding_idx) zero."""
    half = d // 2
    freq = [math.exp(-k * math.log(10000) / (half - 1)) for k in range(half)]
    rows = [[0.0] * d] + [[math.sin(p * f) for f in freq] + [math.cos(p * f) for f in freq] + [0.0] * (d - 2 * half)
                          for p in range(1, n + 1)]
    return torch.tensor(rows)


def test_padded_steps_get_no_position_as_in_gmcs_code():
    """Issue 40.3: GMC's encoder keys its fairseq positions on the input's first channel with padding index 0,
    so an all-zero (padded) step gets none; the others get position t (1..n); inputs scaled by sqrt(d) first."""
    torch.manual_seed(0)
    enc = gmc.CrossModalTransformer(30, layers=1).eval()
    x = torch.randn(7, 3, 30, dtype=torch.float64)
    x[:3, 0] = 0  # left padding, as MulT's aligned MOSEI
    x[5, 2] = 0
    got = enc.double().embed(x)
    pe = _fairseq_positions(7, 30).double()
    for t in range(7):
        for b in range(3):
            padded = bool(x[t, b, 0] == 0)
            want = math.sqrt(30) * x[t, b] + (0 if padded else pe[t + 1])
            torch.testing.assert_close(got[t, b], want, rtol=0, atol=1e-6)  # the table in float32, as GMC's
    assert bool((got[:3, 0] == 0).all())


def test_gmcs_layer_one_layernorm_for_query_keys_values_two_dropout_masks_and_fairseq_init():
    """Issue 40.3: one LayerNorm for query, keys and values (GMC's layer_norms[0]; ours had two), keys and values
    embedded with their own dropout masks (GMC draws two), xavier weights and zero biases on the attention's
    output and the FFN (fairseq's Linear)."""
    torch.manual_seed(0)
    enc = gmc.CrossModalTransformer(30, layers=1)
    layer = enc.layers[0]
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in layer.modules()) == 2
    for lin in (layer.attn.out_proj, layer.ffn[0], layer.ffn[3]):
        assert bool((lin.bias == 0).all())
        bound = math.sqrt(6 / (lin.in_features + lin.out_features))
        assert lin.weight.abs().max() <= bound
    seen = []
    real = type(layer).forward
    type(layer).forward = lambda self, x, k, v, mask: seen.append((k, v)) or real(self, x, k, v, mask)
    try:
        x, y = torch.randn(5, 2, 30), torch.randn(5, 2, 30)
        enc.train()(x, y)
        assert not torch.equal(*seen[-1])  # two masks while training
        enc.eval()(x, y)
        assert torch.equal(*seen[-1])
    finally:
        type(layer).forward = real


def test_adam_as_gmcs_code_by_default():
    """Issue 40.3, G5: GMC's code builds optim.Adam(params, lr), torch's betas (0.9, 0.999) and eps 1e-8 (ours
    inherited the shared config's 0.98 / 1e-6)."""
    cfg = gmc.GMCConfig()
    assert (cfg.beta1, cfg.beta2, cfg.eps, cfg.wd) == (0.9, 0.999, 1e-8, 0.0)


def test_the_joint_encoder_has_gmcs_layernorm_count():
    """Issue 40.3: GMC's TransformerEncoderLayer holds two LayerNorms (layer_norms[0] for query, keys and values;
    layer_norms[1] before the FFN) and each encoder one more at its end: (2 layers + 1) LayerNorms of 2 d values per
    encoder, six cross-modal ones at d = 30 and three memories at d = 60 (ours had a third per layer: 3,600 more)."""
    want = lambda layers: (6 * 2 * 30 + 3 * 2 * 60) * (2 * layers + 1)  # noqa: E731
    for layers in (1, 5):
        joint = gmc.GMC([16, 8, 6], 8, layers=layers).joint
        got = sum(p.numel() for m in joint.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters())
        assert got == want(layers)
    assert want(5) + 3600 == (6 * 2 * 30 + 3 * 2 * 60) * (3 * 5 + 1)  # the separate-LayerNorm count of the issue


def test_the_optimizer_flags_reach_adam():
    """G5: by default Adam as GMC's model_trainer.py builds it (torch's betas (0.9, 0.999), eps 1e-8, no decay);
    --beta2 / --eps give the shared config's (0.98, 1e-6) or any other, and the optimizer gets them."""
    net = gmc.GMCNet(gmc.GMC([5, 4, 3], 6, layers=1), gmc.GMCConfig())
    for argv, betas, eps in (([], (0.9, 0.999), 1e-8), (["--beta2", "0.98", "--eps", "1e-6"], (0.9, 0.98), 1e-6)):
        opt = common.make_optimizer(parse_config(gmc.GMCConfig, argv), net, "cpu")
        assert all(g["betas"] == betas and g["eps"] == eps and g["weight_decay"] == 0 for g in opt.param_groups)


def test_keep_last_batch_ends_each_epoch_with_the_partial_batch_and_resumes_exactly(tmp_path):
    """G9: GMC's DataLoader (shuffle, no drop_last) ends each epoch with the partial batch; --keep-last-batch does
    the same after the whole batches of the shared shuffle, which a resume part-way into an epoch continues."""
    plain, kept = common.ResumableSampler(37, 8, seed=5), common.ResumableSampler(37, 8, seed=5, keep_last=True)
    for s in (plain, kept):
        s.set_epoch(2)
    full = list(kept)
    assert full[:32] == list(plain) and sorted(full) == list(range(37))
    kept.set_epoch(2, skip_batches=4)
    assert len(kept) == 5 and list(kept) == full[32:]
    data = sentiment_world(tmp_path, sizes=SMALL)  # 64 training rows: batches of 24, 24 and 16
    base = ["--data", str(data), "--layers", "1", "--batch-size", "24", "--epochs", "2", "--device", "cpu",
            "--precision", "fp32", "--workers", "0", "--log-every", "1", "--method", "gmc-m2"]
    drop = gmc.main(base + ["--out", str(tmp_path / "d")])["results"][0]["summary"]
    straight = gmc.main(base + ["--keep-last-batch", "--out", str(tmp_path / "a")])["results"][0]["summary"]
    assert (drop["steps"], straight["steps"]) == (4, 6)
    cut = gmc.main(base + ["--keep-last-batch", "--out", str(tmp_path / "b"), "--save-every", "2", "--stop-at", "2"])
    assert cut[0]["summary"]["stopped_at"] == 2  # the next step is the first epoch's partial batch
    gmc.main(base + ["--keep-last-batch", "--out", str(tmp_path / "b"), "--resume", "latest"])
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("a", "b"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    with pytest.raises(UsageError, match="--keep-last-batch: one process, without --accum-freq"):
        gmc.main(base + ["--keep-last-batch", "--accum-freq", "2", "--out", str(tmp_path / "c")])


def test_the_unofficial_codes_settings_line_parses_to_its_reporting_scripts():
    """G10: the docstring's settings line of the unofficial GMC + m2-Mix code (teang1995/DMM feaa2d9,
    supervised_mix/1003_m2_reporting1.sh: multi_mix 0.2, beta 2.0, temperature 0.25, batch 128; L1, weights 1,
    one random pair per batch, a DataLoader that keeps the last batch) is a command gmc.py accepts."""
    doc = gmc.__doc__.splitlines()
    at = next(i for i, line in enumerate(doc) if "--keep-last-batch" in line and "python gmc.py" in line)
    words = (doc[at] + " " + doc[at + 1]).split("(")[0].split()
    cfg = parse_config(gmc.GMCConfig, [w.replace("...", "x.pkl") for w in words[2:]])
    assert (cfg.clf, cfg.weights, cfg.mix_pairs, cfg.keep_last_batch) == ("l1", "code", "random", True)
    assert (cfg.batch_size, cfg.tau, cfg.m2_weight, cfg.beta, cfg.epochs) == (128, 0.25, 0.2, 2.0, 40)


def test_flags_are_checked_before_the_data_is_read(tmp_path):
    """A wrong --seeds is one message before the MOSEI file (GBs) is opened: here the file does not even exist."""
    with pytest.raises(UsageError, match="--seeds 'a,b'"):
        gmc.main(["--data", str(tmp_path / "missing.pkl"), "--seeds", "a,b"])
