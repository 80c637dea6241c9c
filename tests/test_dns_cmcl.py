"""Tests of dns.py in CMCL's own setting: the M-modality learner (the CLIP
path is its (img, txt) case and unused modalities change nothing, absent
modalities untouched, per-modality projectors from every past partner,
old-pair drift bounded in update mode), both feature layouts, the code's step list, the masked
continual metrics, and main() end to end on a fixture in the code's layout."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
from plumbing.base import DataError, RunError
import dns
import eval as evaluation
import lab
from lab.demos import dns as dns_demo
from papers import cmcl

FAST = dict(device="cpu", precision="fp32", log_every=10_000)


def _cfg(tmp_path, **kw):
    return dns.DNSConfig(**(FAST | {"out": str(tmp_path)} | kw))


# --- the code's step list and datasets --------------------------------------------
def test_cmcl_steps_follow_the_codes_training_py():
    steps = cmcl.parse_steps("cmcl", lambda d: cmcl.CMCL_DATASETS[d][0])
    assert [s.dataset for s in steps] == ["ucf101", "esc50", "nyudv2", "clotho"] + ["vggsound_s"] * 3 + ["tvl"] * 3 \
        + ["llvip"]
    assert [s.modalities for s in steps] == [
        ("text", "video"), ("text", "audio"), ("vision", "depth"), ("text", "audio"),
        ("text", "audio"), ("text", "video"), ("audio", "video"),
        ("vision", "tactile"), ("text", "tactile"), ("vision", "text"), ("vision", "thermal")]
    assert len({s.name for s in steps}) == 11
    for bad in ("nyudv2:0,5", "nyudv2:1,1", "esc50:a,b", ""):
        with pytest.raises(DataError):
            cmcl.parse_steps(bad, lambda d: cmcl.CMCL_DATASETS[d][0])


# --- features in both layouts ----------------------------------------------------
def test_both_layouts_read_the_same_world(tmp_path):
    worlds = {lay: lab.synthetic_multimodal(tmp_path / lay, lay, dim=8, n_train=40, n_test=20) for lay in
              ("cmcl", "ours")}
    assert (tmp_path / "cmcl" / "esc50_train_imagebind.h5").exists()
    assert (tmp_path / "cmcl" / "esc50_class_imagebind.h5").exists()
    for d in ("ucf101", "nyudv2", "vggsound_s"):
        a, b = (cmcl.read_features(worlds[lay], d, "test") for lay in ("cmcl", "ours"))
        assert a["layout"] == "cmcl" and b["layout"] == "ours"
        assert a["ids"] == b["ids"] and a["modalities"] == b["modalities"] == cmcl.CMCL_DATASETS[d][0]
        assert a["x"].shape == (20, len(a["modalities"]), 8) and torch.equal(a["x"], b["x"])
        if d == "nyudv2":  # recall only
            assert a["labels"] is None and b["labels"] is None
        else:
            assert torch.equal(a["labels"], b["labels"]) and torch.equal(a["class_x"], b["class_x"])
            assert a["classes"] == b["classes"] and len(a["classes"]) == a["class_x"].shape[0]


def test_h5_entries_are_per_sample_modality_arrays_sorted_by_id(tmp_path):
    """The code's layout: one dataset per sample id, (modalities, d); read in sorted-id order."""
    import h5py
    rows = {"b": np.ones((2, 3)), "a": np.zeros((2, 3)), "c": 2 * np.ones((2, 3))}
    with h5py.File(tmp_path / "clotho_train_unibind.h5", "w") as f:
        for k, v in rows.items():
            f.create_dataset(k, data=v)
    feats = cmcl.read_features(tmp_path, "clotho", "train", "unibind")
    assert feats["ids"] == ["a", "b", "c"] and feats["x"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert feats["modalities"] == ("text", "audio") and feats["labels"] is None


def test_classes_from_the_codes_h5_keys(tmp_path):
    """The code's perceptors key each sample "<id>__<class name>__<class index>";
    without a labels JSON the class comes from the key."""
    import h5py
    with h5py.File(tmp_path / "esc50_test_imagebind.h5", "w") as f:
        for k in ("1-1-A-0.wav__dog__0", "1-2-A-5.wav__rain__1", "1-3-A-0.wav__dog__0"):
            f.create_dataset(k, data=np.ones((2, 3)))
    with h5py.File(tmp_path / "esc50_class_imagebind.h5", "w") as f:
        for k in ("rain", "dog"):
            f.create_dataset(k, data=np.zeros(3))
    (tmp_path / "esc50_train_imagebind.h5").touch()
    feats = cmcl.read_features(tmp_path, "esc50", "test")
    assert feats["classes"] == ["dog", "rain"] and feats["labels"].tolist() == [0, 1, 0]


def test_cmcl_labels_from_the_codes_dataset_json(tmp_path):
    p = tmp_path / "paired_data_test.json"
    p.write_text(json.dumps([[{"id": "x1", "name": "dog", "class": 0}], [{"id": 7, "name": "rain", "class": 1}]]))
    assert cmcl.cmcl_labels(p) == {"x1": "dog", "7": "rain"}


def _vggsound_like(tmp_path, keys, classes=("dog", "rain")):
    import h5py
    with h5py.File(tmp_path / "vggsound_s_test_imagebind.h5", "w") as f:
        for k in keys:
            f.create_dataset(k, data=np.ones((3, 3)))  # text, audio, video
    with h5py.File(tmp_path / "vggsound_s_class_imagebind.h5", "w") as f:
        for c in classes:
            f.create_dataset(c, data=np.zeros(3))
    (tmp_path / "vggsound_s_train_imagebind.h5").touch()


def test_an_id_holding_double_underscores_keeps_its_class(tmp_path):
    """Issue 25.1: a YouTube id ending in '_' makes '<id>__<class>__<k>' hold '___'; the class is read from the
    right (it was 'no class for 1 sample(s)' before)."""
    _vggsound_like(tmp_path, ["abc_000010___dog__0", "xyz_000020__rain__1"])
    feats = cmcl.read_features(tmp_path, "vggsound_s", "test")
    assert feats["labels"].tolist() == [0, 1] and cmcl.sample_key("abc_000010___dog__0") == ("abc_000010_", "dog")


def test_the_labels_json_from_cmcl_labels_matches_the_h5_keys(tmp_path):
    """Issue 25.2: cmcl_labels() keys by the raw id, the h5 by the whole key; read_features finds both (the
    documented remedy matched no sample before)."""
    keys = ["abc_000010___dog__0", "xyz_000020__rain__1"]
    _vggsound_like(tmp_path, keys)
    rows = [[{"id": "abc_000010_", "name": "rain"}], [{"id": "xyz_000020", "name": "dog"}]]  # the JSON decides
    (tmp_path / "paired.json").write_text(json.dumps(rows))
    labels = cmcl.cmcl_labels(tmp_path / "paired.json")
    (tmp_path / "vggsound_s_test_labels.json").write_text(json.dumps(labels))
    assert cmcl.read_features(tmp_path, "vggsound_s", "test")["labels"].tolist() == [1, 0]
    (tmp_path / "vggsound_s_test_labels.json").write_text(json.dumps({keys[0]: "dog", keys[1]: "dog"}))  # whole keys
    assert cmcl.read_features(tmp_path, "vggsound_s", "test")["labels"].tolist() == [0, 0]


def test_missing_or_unknown_features_say_what_is_wrong(tmp_path):
    with pytest.raises(DataError, match="meta.json"):
        cmcl.read_features(tmp_path, "esc50", "train")
    with pytest.raises(DataError, match="no such folder"):
        dns.main(["--features", str(tmp_path / "nowhere"), "--tasks", "cmcl", "--out", str(tmp_path / "o")])


# --- the learner -------------------------------------------------------------------
@pytest.mark.parametrize("settings", [dict(mode="gradient"), dict(mode="update"), dict(mode="vanilla"),
                                      dict(mode="update", output_cov="per-task", bias=True, lambda_min_out=0.0)])
def test_clip_path_is_the_learner_with_img_txt_and_unused_modalities_change_nothing(tmp_path, settings):
    """The CLIP path is DNSLearner with modalities (img, txt): three image-text
    tasks give the covariances of the raw features and, per task, the mapped
    partner features at that task's end (computed here from the equations),
    and a learner that also holds modalities it never uses (aud, dep) learns
    every weight, covariance and projector rank bitwise the same."""
    tasks = dns_demo.low_rank_tasks(n=96) + dns_demo.low_rank_tasks(n=96, seed=1)[:1]
    cfg = _cfg(tmp_path, batch_size=32, epochs=2, lr=1e-2, wd=0.1, **{k: v for k, v in settings.items() if k != "bias"})
    bias = settings.get("bias", False)
    clip = dns.DNSLearner(32, math.log(1 / 0.07), bias=bias)
    more = dns.DNSLearner(32, math.log(1 / 0.07), bias=bias, modalities=("aud", "img", "dep", "txt"))
    for i, (img, txt) in enumerate(tasks):
        clip.learn(cfg, img, txt, tmp_path / f"clip{i}")
        more.learn(cfg, img, txt, tmp_path / f"more{i}", pair=("img", "txt"))
        assert clip.summaries[-1]["old_rank"] == more.summaries[-1]["old_rank"]
        assert bool(clip.summaries[-1]["old_rank"]) == (i > 0 and settings["mode"] != "vanilla")
    assert [n for n, _ in clip.net.model.named_parameters()] == \
        ["W_img", "W_txt"] + (["b_img", "b_txt"] if bias else [])  # checkpoints and hooks find them by name
    for k, v in clip.net.model.state_dict().items():
        assert torch.equal(v, more.net.model.state_dict()[k]), k
    for m in ("aud", "dep"):
        assert torch.equal(getattr(more.net.model, f"W_{m}"), torch.eye(32))
    assert not torch.equal(clip.net.model.W_img, torch.eye(32))  # it did train
    Z = {m: torch.zeros(32, 32, dtype=torch.float64) for m in ("img", "txt", "Zo_img", "Zo_txt")}
    for k, (img, txt) in enumerate(tasks):  # running mean of x x^T with equal task sizes
        W_img, W_txt = (w.double() for w in clip.history[k][:2])
        mapped = {"img": img.double(), "txt": txt.double(), "Zo_img": txt.double() @ W_txt.t(),
                  "Zo_txt": img.double() @ W_img.t()}
        Z = {m: Z[m] * (k / (k + 1)) + mapped[m].t() @ mapped[m] / (96 * (k + 1)) for m in Z}
    for m in ("img", "txt"):
        assert torch.allclose(clip.Z[m], Z[m], atol=1e-10) and torch.equal(clip.Z[m], more.Z[m])
        assert torch.allclose(clip.Zo[m], Z[f"Zo_{m}"], atol=1e-10) and torch.equal(clip.Zo[m], more.Zo[m])
    assert not hasattr(clip, "Z_img") and "img" in clip.Z and "txt" in clip.Zo  # no synthesised names (56.5)


@pytest.mark.parametrize("mode", ["vanilla", "gradient", "update"])
def test_absent_modalities_are_bitwise_untouched(tmp_path, mode):
    """A step on (a, b) leaves W_c exactly as it was, weight decay included:
    W_c is not even in the optimizer."""
    g = torch.Generator().manual_seed(0)
    x = {m: F.normalize(torch.randn(64, 16, generator=g), dim=-1) for m in "abc"}
    learner = dns.DNSLearner(16, math.log(1 / 0.07), modalities=("a", "b", "c"))
    cfg = _cfg(tmp_path, batch_size=32, epochs=2, lr=1e-2, wd=0.5, mode=mode)
    learner.learn(cfg, x["c"], x["a"], tmp_path / "s1", pair=("c", "a"))
    W_c = learner.net.model.W_c.detach().clone()
    assert not torch.equal(W_c, torch.eye(16))
    learner.learn(cfg, x["a"], x["b"], tmp_path / "s2", pair=("a", "b"))
    assert torch.equal(learner.net.model.W_c, W_c)
    names = [n for grp in common.param_groups(learner.net, 1e-3, 0.5) for n in grp["names"]]
    assert names == ["model.W_a", "model.W_b"]


def test_adamw_would_decay_a_map_with_zero_gradient():
    """Why the absent maps must stay out of the optimizer: AdamW's decoupled
    weight decay moves a parameter whose gradient is zero."""
    W = torch.nn.Parameter(torch.eye(4))
    opt = torch.optim.AdamW([W], lr=1e-2, weight_decay=0.5)
    W.grad = torch.zeros_like(W)
    opt.step()
    assert not torch.equal(W.detach(), torch.eye(4))


def test_projectors_span_every_past_partner_and_input(tmp_path):
    """After steps (a, b) and (a, c) on low-rank features, W_a's input-side
    projector keeps a's features of both steps and its output side the
    mapped b and c features (with the maps as they are now)."""
    g = torch.Generator().manual_seed(3)
    basis = {m: torch.linalg.qr(torch.randn(24, 4, generator=g))[0] for m in ("a1", "a2", "b", "c")}
    z1, z2 = torch.randn(64, 4, generator=g), torch.randn(64, 4, generator=g)
    xa1, xb = z1 @ basis["a1"].t(), z1 @ basis["b"].t()
    xa2, xc = z2 @ basis["a2"].t(), z2 @ basis["c"].t()
    learner = dns.DNSLearner(24, math.log(1 / 0.07), modalities=("a", "b", "c"))
    cfg = _cfg(tmp_path, batch_size=32, epochs=2, lr=1e-2, mode="update")
    learner.learn(cfg, xa1, xb, tmp_path / "s1", pair=("a", "b"))
    learner.learn(cfg, xa2, xc, tmp_path / "s2", pair=("a", "c"))
    P = learner.projectors(cfg, "a", "b")
    P_out, P_in = P["W_a"]
    model = learner.net.model
    for x in (xa1, xa2):
        assert torch.allclose(x @ P_in, x, atol=1e-4)
    for m, x in (("b", xb), ("c", xc)):
        mapped = model.map(m, x).detach()
        assert torch.allclose(mapped @ P_out, mapped, atol=1e-3)
    assert round(float(P_in.trace())) == 8 and round(float(P_out.trace())) == 8
    assert round(float(P["W_b"][1].trace())) == 4  # b took part once


def _low_rank_world(tmp_path):
    """Three modalities, three datasets pairing them, noise-free features on
    rank-6 subspaces of R^24 (the guarantee is exact there), our layout."""
    datasets = {"one": (("vision", "text"), True), "two": (("text", "audio"), True),
                "three": (("vision", "audio"), False)}
    return lab.synthetic_multimodal(tmp_path / "world", "ours", datasets=datasets, dim=24, n_train=128, n_test=64,
                                    latent=12, active=6, noise=0.0)


def test_old_pair_drift_bounded_in_update_mode(tmp_path):
    """Steps one (V-T), two (T-A), three (V-A): every map is shared with an
    earlier step. Update mode keeps each old step's test score matrix within
    1e-3 relative (what is left: the second-order cross term); vanilla moves
    it far more; every mode still learns."""
    world = _low_rank_world(tmp_path)
    res = {}
    for mode in ("vanilla", "update"):
        res[mode] = dns.main(["--features", str(world), "--tasks", "one~two~three", "--mode", mode, "--lr", "1e-2",
                              "--epochs", "3", "--batch-size", "32", "--device", "cpu", "--precision", "fp32",
                              "--out", str(tmp_path / mode)])
    drift = {m: r["drift"]["test"] for m, r in res.items()}
    assert len(drift["update"]) == 2 and max(drift["update"]) <= 1e-3
    assert min(drift["vanilla"]) > 1e-2 and min(drift["vanilla"]) > 30 * max(drift["update"])
    for r in res.values():
        assert all(t["final_loss"] < 1.0 for t in r["tasks"])  # chance: ln(32) = 3.47
        R = r["continual"]["matrices"]["R@1"]
        assert all(R[k + 1][k] > R[0][k] + 10 for k in range(3))  # each step learned its pair


# --- metrics -----------------------------------------------------------------------
def test_masked_metrics_equal_continual_metrics_on_full_matrices():
    R = np.random.default_rng(0).uniform(0, 100, (5, 4))
    assert evaluation.masked_continual_metrics(R) == pytest.approx(common.continual_metrics(R))
    # column 1 has no such metric: last/bwt/forgetting over columns 0, 2, 3 by hand
    R[:, 1] = np.nan
    m = evaluation.masked_continual_metrics(R)
    assert m["last"] == pytest.approx(R[4, [0, 2, 3]].mean())
    assert m["bwt"] == pytest.approx(np.mean([R[4, 0] - R[1, 0], R[4, 2] - R[3, 2]]))
    assert m["forgetting"] == pytest.approx(np.mean([R[:4, 0].max() - R[4, 0], R[:4, 2].max() - R[4, 2]]))
    assert m["avg"] == pytest.approx(np.mean([R[1, [0]].mean(), R[2, [0]].mean(), R[3, [0, 2]].mean(),
                                              R[4, [0, 2, 3]].mean()]))


# --- end to end --------------------------------------------------------------------
def test_main_runs_the_cmcl_steps_on_the_codes_layout(tmp_path, results_files_are_strict_json):
    """python dns.py --features <dir> --tasks cmcl --perceptor imagebind, on
    a small fixture in the code's h5 layout."""
    world = lab.synthetic_multimodal(tmp_path / "features_storage", "cmcl", dim=8, n_train=48, n_test=24)
    r = dns.main(["--features", str(world), "--tasks", "cmcl", "--perceptor", "imagebind", "--mode", "update",
                  "--epochs", "1", "--batch-size", "16", "--device", "cpu", "--precision", "fp32",
                  "--out", str(tmp_path / "run")])
    assert len(r["steps"]) == 11 and (tmp_path / "run" / "results.json").exists()
    # issue 42.3: accuracy of a step without classes was a bare NaN; now null with a reason, strict JSON
    saved = results_files_are_strict_json(tmp_path / "run", "dns")
    assert any(x["value"] is None and "no classes" in x["reason"] for x in saved["records"] if x["metric"] == "acc")
    acc, R10 = (np.array(r["continual"]["matrices"][k], dtype=float) for k in ("acc", "R@10"))
    assert acc.shape == R10.shape == (12, 11) and np.isfinite(R10).all()
    # accuracy where the dataset has classes and the pair includes text: ucf101, esc50, vggsound_s T-A, T-VI
    assert [j for j in range(11) if np.isfinite(acc[-1, j])] == [0, 1, 4, 5]
    m = r["continual"]["metrics"]
    assert all(math.isfinite(m[k][s]) for k in ("acc", "R@10") for s in ("last", "bwt", "forgetting"))
    assert len(r["drift"]["test"]) == 10


@pytest.mark.slow
def test_cmcl_demo_writes_claims_results_and_figure(tmp_path, monkeypatch, check_demo_results):
    """The CMCL demo's plumbing on a shrunken world (1 epoch per step): every
    seed of every mode kept, claims with the agreed keys, the PNG exists."""
    monkeypatch.setattr(dns_demo, "CMCL_DEMO", dict(dim=8, n_train=32, n_test=16))
    out = tmp_path / "demo"
    dns.main(["--demo-cmcl", "--seeds", "0,1", "--epochs", "1", "--batch-size", "16", "--out", str(out)])
    names = [*dns_demo.CMCL_DEMO_MODES.values(), *(name for name, _ in dns_demo.CMCL_BASELINES.values())]
    saved = check_demo_results(out, "dns-cmcl-demo.png", names, min_claims=11)
    assert len(saved["per_seed"]["vanilla"][0]["R"]) == 12  # identity + after each of the 11 steps
    assert all(f"| {name} |" in saved["table"] for name in ("LwF", "EWC"))  # issue 60: the rows that apply here


@pytest.mark.parametrize("code_settings", [False, True])
def test_resume_inside_a_projected_step_equals_an_uninterrupted_run(tmp_path, code_settings):
    """Interrupted inside step 2 and resumed: same matrices and maps as an
    uninterrupted run (the per-modality covariances, partner covariances and
    frozen maps survive the boundary state; with the code's settings the
    per-task output covariances and biases too)."""
    world = _low_rank_world(tmp_path)
    folder = world / "one" / "train"  # step one: 32 samples (1 batch), so --stop-at 2 falls inside step two
    for m in ("vision", "text"):
        torch.save(torch.load(folder / f"{m}.pt")[:32].clone(), folder / f"{m}.pt")
    meta = json.loads((folder / "samples.json").read_text())
    (folder / "samples.json").write_text(json.dumps({k: v[:32] for k, v in meta.items()}))
    args = ["--features", str(world), "--tasks", "one~two~three", "--mode", "update", "--lr", "1e-2", "--epochs", "1",
            "--batch-size", "32", "--device", "cpu", "--precision", "fp32"]
    if code_settings:
        args += ["--mode", "gradient", "--loss", "code", "--bias", "--output-cov", "per-task", "--lambda-min-out", "0"]
    full = dns.main(args + ["--out", str(tmp_path / "full")])
    with pytest.raises(SystemExit):
        dns.main(args + ["--out", str(tmp_path / "cut"), "--stop-at", "2"])
    resumed = dns.main(args + ["--out", str(tmp_path / "cut"), "--resume", "latest"])
    for k, R in full["continual"]["matrices"].items():  # NaN where a metric does not apply: equal_nan
        np.testing.assert_array_equal(np.array(resumed["continual"]["matrices"][k]), np.array(R))
    W_full, W_cut = (torch.load(tmp_path / d / "boundary.pt", weights_only=False) for d in ("full", "cut"))
    assert all(torch.allclose(W_full["maps"][k], W_cut["maps"][k], atol=1e-6) for k in W_full["maps"])
    assert resumed["tasks"][1]["old_rank"]["W_text_in"] > 0  # the resumed step was projected
    assert ("b_audio" in W_full["maps"]) == code_settings


def test_grad_clip_1_reaches_the_learner_as_the_codes_trainer(tmp_path, monkeypatch):
    """Deviation 22 (issue 25.6): CMCL's Hugging Face Trainer clips the global norm at 1.0 (max_grad_norm's
    default); --grad-clip 1 gives the same clip in dns.py's learner, which by default does not clip."""
    calls = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm, *a, **k: calls.append(max_norm)
                        or real(params, max_norm, *a, **k))
    img, txt = lab.low_rank_tasks(n=64)[0]
    for clip in (0.0, 1.0):
        cfg = dns.DNSConfig(grad_clip=clip, device="cpu", precision="fp32", out=str(tmp_path / f"c{clip}"),
                            log_every=10_000, epochs=1, batch_size=32)
        dns.DNSLearner(img.shape[1], math.log(1 / 0.07)).learn(cfg, img, txt, tmp_path / f"c{clip}" / "task1")
    assert calls and set(calls) == {1.0}  # every step clipped at 1 with the flag, none without


def test_recall_protocol_cmcl_is_the_codes_five_subsets(tmp_path):
    """--recall-protocol cmcl (deviation 18, issue 25.9): R@k averaged over 5 random 1,000-subsets drawn from the
    seed, per direction, against a hand loop written as eval_util.compute_recall does it (topk hits); 'full' uses
    every sample. At N = 1,500 the two differ (a subset has fewer distractors)."""
    g = torch.Generator().manual_seed(0)
    a = F.normalize(torch.randn(1500, 16, generator=g), dim=-1)
    b = F.normalize(a + 0.9 * torch.randn(1500, 16, generator=g), dim=-1)
    test = {"x": torch.stack([a, b], 1), "labels": None}
    step = cmcl.Step("clotho", (0, 1), ("text", "audio"))
    model = SimpleNamespace(map=lambda modality, x: x)
    row = cmcl.evaluate_step(model, step, test, ks=(1, 10), protocol="cmcl", seed=7)
    gen, hits = torch.Generator().manual_seed(7), {"A->B": [], "B->A": []}
    for _ in range(5):
        idx = torch.randperm(1500, generator=gen)[:1000]
        scores = a[idx] @ b[idx].T
        for d, s in (("A->B", scores), ("B->A", scores.T)):
            top = torch.topk(s, 10, dim=1).indices == torch.arange(1000).view(-1, 1)
            hits[d].append((100 * top[:, :1].any(1).float().mean().item(), 100 * top.any(1).float().mean().item()))
    for d in hits:
        assert row[f"{d} R@1"] == pytest.approx(np.mean([h[0] for h in hits[d]]), abs=1e-4)
        assert row[f"{d} R@10"] == pytest.approx(np.mean([h[1] for h in hits[d]]), abs=1e-4)
    assert row["R@10"] == pytest.approx((row["A->B R@10"] + row["B->A R@10"]) / 2)
    full = cmcl.evaluate_step(model, step, test, ks=(1, 10))
    again = cmcl.evaluate_step(model, step, test, ks=(1, 10), protocol="cmcl", seed=7)
    assert full["R@10"] < row["R@10"] and {k: v for k, v in again.items() if k != "acc"} == {
        k: v for k, v in row.items() if k != "acc"}  # the subsets come from the seed alone (acc: NaN, no classes)


def test_covariance_code_is_the_codes_update_covariance(tmp_path, monkeypatch):
    """--covariance code (deviations 16-17, issue 25.10): every step adds its stored columns 0 and 1 (not its
    pair's) to the covariances of its two modalities, all weighted by ONE count over the steps (n_bar), and the
    output sides W_A Z0 W_A^T, W_B Z1 W_B^T with the step's end weights: a hand loop of cmcl/dns.py's
    update_covariance over the 11 steps gives the learner's Z and Zo."""
    world = lab.synthetic_multimodal(tmp_path / "features_storage", "cmcl", dim=8, n_train=48, n_test=24)
    made, real = [], dns.DNSLearner
    monkeypatch.setattr(dns, "DNSLearner", type("Kept", (real,), {
        "__init__": lambda self, *a, **k: (made.append(self), real.__init__(self, *a, **k))[1]}))
    dns.main(["--features", str(world), "--tasks", "cmcl", "--perceptor", "imagebind", "--covariance", "code",
              "--output-cov", "per-task", "--lambda-min-out", "0", "--epochs", "1", "--batch-size", "16",
              "--device", "cpu", "--precision", "fp32", "--out", str(tmp_path / "run")])
    learner = made[0]
    steps, data, dim = cmcl.read_cmcl_steps(world, "cmcl", "imagebind")
    Z, Zo, n_bar = {}, {}, 0
    for k, st in enumerate(steps):
        x = data[(st.dataset, "train")]["x"].double()
        (a, b), n_new = st.modalities, n_bar + len(x)
        W_a, W_b = (w.double() for w in learner.net.model.pair_maps(learner.history[k], a, b)[:2])
        c0, c1 = x[:, 0].t() @ x[:, 0] / n_new, x[:, 1].t() @ x[:, 1] / n_new
        old = n_bar / n_new
        Z[a] = Z.get(a, 0) * old + c0
        Zo[b] = Zo.get(b, 0) * old + W_a @ c0 @ W_a.t()
        Z[b] = Z.get(b, 0) * old + c1
        Zo[a] = Zo.get(a, 0) * old + W_b @ c1 @ W_b.t()
        n_bar = n_new
    assert learner.n_bar == n_bar and set(Z) == {m for m, n in learner.n.items() if n}
    for m in Z:
        torch.testing.assert_close(learner.Z[m], Z[m], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(learner.Zo[m], Zo[m], rtol=1e-9, atol=1e-12)
    ours = dns.DNSConfig().covariance
    assert ours == "ours" and json.loads((tmp_path / "run" / "results.json").read_text())["switches"]["covariance"] \
        == "code"


def test_inf_in_test_features_is_an_error_not_a_score():
    """Issue 26.1: DNS's step evaluation (R@k, accuracy) refuses non-finite features, naming the step."""
    a = F.normalize(torch.randn(20, 8), dim=-1)
    test = {"x": torch.stack([a, a.clone()], 1), "labels": None}
    test["x"][3, 1, 0] = float("inf")
    step = cmcl.Step("clotho", (0, 1), ("text", "audio"))
    with pytest.raises(RunError, match=r"clotho\(T-A\): 1 of 20 audio rows"):
        cmcl.evaluate_step(SimpleNamespace(map=lambda m, x: x), step, test, ks=(1,))
