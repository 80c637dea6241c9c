"""Tests of dns.py: the projections, the covariances, the cached features,
the stability guarantee on low-rank features, the released code's
behaviours behind flags (loss, biases, per-task output covariance,
thresholds), and main() end to end."""
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import common
from plumbing.flags import parse_config
from plumbing.manifests import read_manifest
import lab
import dns
import eval as evaluation
from lab.demos import dns as dns_demo
from plumbing import models
from papers import cmcl


def _random_projector(dim, rank, g):
    Q = torch.linalg.qr(torch.randn(dim, rank, generator=g))[0]
    return Q @ Q.t()


# --- (a) hand-computed cases ------------------------------------------------
def test_project_gradient_by_hand():
    G = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    P_out, P_in = torch.diag(torch.tensor([1.0, 0.0])), torch.diag(torch.tensor([0.0, 1.0]))
    # P_out G P_in keeps only G[0, 1] = 2, so dW = G with that entry zeroed
    assert torch.equal(dns.project_gradient(G, P_out, P_in), torch.tensor([[1.0, 0.0], [3.0, 4.0]]))
    # nothing old (P = 0): the gradient passes unchanged; everything old on both sides: nothing passes
    assert torch.equal(dns.project_gradient(G, torch.zeros(2, 2), torch.zeros(2, 2)), G)
    assert torch.equal(dns.project_gradient(G, torch.eye(2), torch.eye(2)), torch.zeros(2, 2))


def test_null_space_leak_by_hand():
    """||P_out dW P_in|| / ||dW||: dW = [[3, 4], [0, 0]] with P_out = P_in = diag(1, 0) keeps 3 of norm 5."""
    P = torch.diag(torch.tensor([1.0, 0.0]))
    assert dns.null_space_leak(torch.tensor([[3.0, 4.0], [0.0, 0.0]]), P, P) == pytest.approx(0.6)
    assert dns.null_space_leak(dns.project_gradient(torch.ones(2, 2), P, P), P, P) == 0.0  # Thm. 4: projected
    assert dns.null_space_leak(torch.zeros(2, 2), P, P) == 0.0  # a map that did not move leaks nothing


def test_null_space_projector_on_a_known_subspace():
    g = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    Z = U @ torch.diag(torch.tensor([3.0, 0.5, 0.02, 0.005, 1e-9, 0.0], dtype=torch.float64)) @ U.t()
    P = dns.null_space_projector(Z, 0.01)  # eigenvalues 3, 0.5, 0.02 exceed 0.01
    assert torch.allclose(P, U[:, :3] @ U[:, :3].t(), atol=1e-10)
    assert torch.allclose(P @ P, P, atol=1e-10) and round(float(P.trace())) == 3
    # relative: 0.1 x the largest eigenvalue (3) = 0.3 keeps 3 and 0.5
    assert torch.allclose(dns.null_space_projector(Z, 0.1, relative=True), U[:, :2] @ U[:, :2].t(), atol=1e-10)
    assert torch.equal(dns.null_space_projector(torch.zeros(4, 4), 0.01), torch.zeros(4, 4))


def test_factored_projection_equals_the_dense_one():
    """The hooks' speed path (bases instead of projectors) computes project_gradient exactly."""
    g = torch.Generator().manual_seed(2)
    for k_out, k_in in ((3, 5), (0, 4), (8, 8)):
        P_out, P_in = _random_projector(8, k_out, g), _random_projector(8, k_in, g)
        U_out, U_in = dns.projector_basis(P_out), dns.projector_basis(P_in)
        assert U_out.shape == (8, k_out) and U_in.shape == (8, k_in)
        G = torch.randn(8, 8, generator=g)
        assert torch.allclose(dns.project_gradient_factored(G, U_out, U_in), dns.project_gradient(G, P_out, P_in),
                              atol=1e-5)


def test_projected_change_is_invisible_to_every_old_pair():
    g = torch.Generator().manual_seed(1)
    P_out, P_in = _random_projector(8, 3, g), _random_projector(8, 5, g)
    dW = dns.project_gradient(torch.randn(8, 8, generator=g), P_out, P_in)
    assert torch.allclose(P_out @ dW @ P_in, torch.zeros(8, 8), atol=1e-6)
    # per pair, from the stability condition: old partner w in span(P_out), old input x in span(P_in)
    for _ in range(20):
        w, x = P_out @ torch.randn(8, generator=g), P_in @ torch.randn(8, generator=g)
        assert abs(float(w @ dW @ x)) < 1e-5
    # and the projection is not the zero map: new directions still move
    assert dW.norm() > 0.5


# --- (b) vectorised vs loops ------------------------------------------------
def test_running_covariance_equals_the_batch_computation():
    g = torch.Generator().manual_seed(2)
    chunks = [torch.randn(n, 5, generator=g, dtype=torch.float64) for n in (7, 1, 12)]
    Z, n = torch.zeros(5, 5, dtype=torch.float64), 0
    for X in chunks:
        Z, n = dns.update_covariance(Z, n, X)
    X = torch.cat(chunks)
    batch = sum(torch.outer(x, x) for x in X) / len(X)  # (1/N) sum_i x_i x_i^T
    assert n == 20 and torch.allclose(Z, batch, atol=1e-12)


def test_scores_match_a_loop_over_pairs():
    g = torch.Generator().manual_seed(3)
    img, txt = torch.randn(4, 6, generator=g), torch.randn(5, 6, generator=g)
    W_img, W_txt = torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)
    A = dns.dns_scores(img, txt, W_img, W_txt)
    for i in range(4):
        for j in range(5):
            assert A[i, j].item() == pytest.approx(float((W_img @ img[i]) @ (W_txt @ txt[j])), rel=1e-5, abs=1e-5)


def test_scores_with_biases_match_a_loop_over_pairs():
    g = torch.Generator().manual_seed(8)
    img, txt = torch.randn(3, 4, generator=g), torch.randn(2, 4, generator=g)
    W_img, W_txt, b_img, b_txt = (torch.randn(*s, generator=g) for s in ((4, 4), (4, 4), (4,), (4,)))
    A = dns.dns_scores(img, txt, W_img, W_txt, b_img, b_txt)
    for i in range(3):
        for j in range(2):
            ref = float((W_img @ img[i] + b_img) @ (W_txt @ txt[j] + b_txt))
            assert A[i, j].item() == pytest.approx(ref, rel=1e-5, abs=1e-5)


def test_code_loss_matches_a_per_sample_loop():
    """Deviation 14: the code's loss, -1/B sum_i log exp(a_i.b_i) / sum_j exp(a_i.b_j), temperature 1."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    expected = 0.0
    for i in range(5):
        den = sum(math.exp(float(a[i] @ b[j])) for j in range(5))
        expected -= math.log(math.exp(float(a[i] @ b[i])) / den) / 5
    assert dns.code_loss(a, b).item() == pytest.approx(expected, rel=1e-5)
    assert abs(dns.code_loss(b, a).item() - expected) > 1e-3  # one direction: not symmetric


def test_code_loss_and_biases_in_the_step():
    """--loss code --bias: the step returns loss_code, the biases train and
    the projection hook leaves them alone (deviation 4)."""
    g = torch.Generator().manual_seed(9)
    img, txt = (F.normalize(torch.randn(8, 16, generator=g), dim=-1),
                F.normalize(torch.randn(8, 16, generator=g), dim=-1))
    net = dns.DNSNet(16, math.log(30.0), loss="code", bias=True)
    losses = net({"img": img, "txt": txt})
    assert list(losses) == ["loss_code"]  # identity maps, zero biases: the code's loss on the raw features
    assert losses["loss_code"].item() == pytest.approx(dns.code_loss(img, txt).item(), rel=1e-6)
    losses["loss_code"].backward()
    assert sorted(n for n, _ in net.named_parameters()) == ["model.W_img", "model.W_txt", "model.b_img", "model.b_txt"]
    b_grad = net.model.b_img.grad.clone()
    assert b_grad.abs().sum() > 0
    hooks = dns.NullSpaceProjection("gradient", {k: (torch.eye(16),) * 2 for k in ("W_img", "W_txt")})
    hooks.before_optimizer_step(net)  # everything old on both sides: the weight gradients vanish ...
    assert torch.equal(net.model.W_img.grad, torch.zeros(16, 16))
    assert torch.equal(net.model.b_img.grad, b_grad)  # ... the bias gradient passes untouched
    assert len(net.model.snapshot()) == 4
    with pytest.raises(ValueError):
        dns.DNSNet(16, 0.0, loss="nope")


def test_defaults_follow_the_paper():
    cfg = parse_config(dns.DNSConfig, [])
    assert cfg.mode == "gradient" and cfg.loss == "clip" and not cfg.bias  # deviations 2, 14, 4
    assert cfg.output_cov == "current" and cfg.lambda_min == 0.01 and cfg.lambda_min_out < 0  # 13, 15, 6


# --- (c) reduction to plain CLIP ----------------------------------------------
def test_identity_maps_give_the_clip_loss():
    g = torch.Generator().manual_seed(4)
    img, txt = (F.normalize(torch.randn(8, 16, generator=g), dim=-1),
                F.normalize(torch.randn(8, 16, generator=g), dim=-1))
    net = dns.DNSNet(16, math.log(30.0))
    losses = net({"img": img, "txt": txt})
    assert losses["loss_clip"].item() == pytest.approx(common.clip_loss(img, txt, torch.tensor(30.0)).item(), rel=1e-6)


@pytest.mark.parametrize("mode", ["gradient", "update"])
def test_zero_projectors_train_exactly_like_vanilla(tmp_path, mode):
    img, txt = dns_demo.low_rank_tasks(n=64)[0]
    cfg = dns.DNSConfig(device="cpu", precision="fp32", batch_size=32, steps=4, lr=1e-2, log_every=100)
    nets = []
    for hooks in (None, dns.NullSpaceProjection(mode, {k: (torch.zeros(32, 32),) * 2 for k in ("W_img", "W_txt")})):
        net = dns.DNSNet(32, math.log(1 / 0.07))
        common.train(dns.dataclasses.replace(cfg, out=str(tmp_path / str(hooks))), net, dns.feature_pairs(img, txt),
                     common.Collate(None), hooks=hooks, export=False)
        nets.append(net)
    assert hooks.steps == 4  # the hook ran at every step
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.allclose(a, b, atol=1e-7) and not torch.equal(a, torch.eye(32))


@pytest.mark.parametrize("scale,accum", [(None, 1), (2.0 ** 12, 1), (None, 2)])
def test_grad_clip_sees_the_raw_norm_at_every_projection_form(scale, accum, monkeypatch):
    """--grad-clip (deviation 22): the UNPROJECTED gradient's total norm decides the clip factor at every
    projection form. One step (SGD at lr 100: the step is 100 x the clipped gradient, left in .grad) from the
    same maps on the same batch: the activation form (W's gradient projected in the backward) ends where the
    parameter-gradient form (projected after the backward, the raw gradient clipped first) ends; also under a
    loss scale and accumulation (two micro-batches: the raw gradient is their sum, not two norms)."""
    g = torch.Generator().manual_seed(12)
    dim, batch, clip = 24, 4, 1e-3
    img, txt = (F.normalize(torch.randn(batch, dim, generator=g), dim=-1) for _ in range(2))
    projectors = {k: tuple(_random_projector(dim, r, g) for r in (6, 8)) for k in ("W_img", "W_txt")}
    start = {k: torch.eye(dim) + 0.1 * torch.randn(dim, dim, generator=g) for k in ("W_img", "W_txt")}
    calls, real = [], dns.projected_linear
    monkeypatch.setattr(dns, "projected_linear", lambda *a: calls.append(1) or real(*a))

    def one_step(form):
        net = dns.DNSNet(dim, math.log(1 / 0.07))
        net.model.load_state_dict({**net.model.state_dict(), **start})
        net.hooks = hooks = dns.NullSpaceProjection("gradient", projectors, form)
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=100.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale is not None)
        ctx = SimpleNamespace(device=torch.device("cpu"), precision="fp32", step=0, epoch=0, total_steps=1,
                              generator=common.step_generator(0, 0))
        common.train_step(net, {"img": img, "txt": txt}, ctx, opt, scaler, grad_clip=clip, hooks=hooks,
                          accum=accum)
        return ({k: getattr(net.model, k).grad for k in start}, {k: getattr(net.model, k).detach() for k in start})

    net = dns.DNSNet(dim, math.log(1 / 0.07))  # the unclipped gradients, raw and projected
    net.model.load_state_dict({**net.model.state_dict(), **start})
    net({"img": img, "txt": txt})["loss_clip"].backward()
    raw = {k: getattr(net.model, k).grad for k in start}
    raw_norm = math.sqrt(sum(float(G.square().sum()) for G in raw.values()))
    projected_norm = math.sqrt(sum(float(dns.project_gradient(G, *projectors[k]).square().sum())
                                   for k, G in raw.items()))
    assert raw_norm > 10 * clip and projected_norm < 0.99 * raw_norm  # the clip binds; the two norms differ
    (dense, dense_maps) = one_step("dense")
    assert not calls
    (auto, auto_maps) = one_step("auto")
    assert len(calls) == 2 * accum, "batch 4 < the ranks: the activation form for both maps"
    for k in start:
        expected = dns.project_gradient(raw[k], *projectors[k]) * (clip / raw_norm)  # clip, then project
        assert torch.allclose(auto_maps[k], dense_maps[k], rtol=1e-6, atol=1e-6), k  # the updated maps
        assert torch.allclose(dense_maps[k], start[k] - 100 * expected, rtol=1e-6, atol=1e-6), k
        assert (dense[k] - expected).norm() <= 1e-4 * expected.norm(), k  # the clipped gradients (float32)
        assert (auto[k] - dense[k]).norm() <= 1e-4 * dense[k].norm(), k


# --- (d) gradients, (e) bf16 ---------------------------------------------------
def test_gradients_only_on_the_two_maps():
    g = torch.Generator().manual_seed(5)
    img, txt = (F.normalize(torch.randn(8, 16, generator=g), dim=-1),
                F.normalize(torch.randn(8, 16, generator=g), dim=-1))
    net = dns.DNSNet(16, math.log(1 / 0.07))
    net({"img": img, "txt": txt})["loss_clip"].backward()
    assert sorted(n for n, _ in net.named_parameters()) == ["model.W_img", "model.W_txt"]
    for p in net.parameters():
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    assert not net.model.logit_scale.requires_grad and net.model.logit_scale.grad is None  # frozen temperature


def test_bf16_autocast_step_on_cpu():
    img, txt = dns_demo.low_rank_tasks(n=16)[0]
    net = dns.DNSNet(32, math.log(1 / 0.07))
    with common.autocast("cpu", "bf16"):
        loss = net({"img": img, "txt": txt})["loss_clip"]
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(net.model.W_img.grad).all()


# --- (f) the mechanism: the stability guarantee ---------------------------------
def test_output_side_projector_spans_the_mapped_partner_features():
    g = torch.Generator().manual_seed(6)
    img, txt = dns_demo.low_rank_tasks(n=64)[0]
    maps = dns.ModalityMaps(32, 0.0)
    with torch.no_grad():
        maps.W_txt.add_(0.3 * torch.randn(32, 32, generator=g))
    Z_img, _ = dns.update_covariance(torch.zeros(32, 32, dtype=torch.float64), 0, img)
    Z_txt, _ = dns.update_covariance(torch.zeros(32, 32, dtype=torch.float64), 0, txt)
    P = dns.build_projectors(maps, Z_img, Z_txt, 0.01)
    mapped_txt = maps.map_text(txt).detach()
    assert torch.allclose(mapped_txt @ P["W_img"][0], mapped_txt, atol=1e-5)  # P_out of W_img: old W_txt t
    assert torch.allclose(img @ P["W_img"][1], img, atol=1e-5)  # P_in of W_img: old v
    assert round(float(P["W_img"][1].trace())) == 6  # the features' rank


def test_absolute_eigenvalues_and_the_output_side_threshold():
    """Deviations 6, 8: |eigenvalue| > lambda_min as the code's SVD; threshold
    0 keeps every numerically non-zero direction; --lambda-min-out sets the
    output side alone."""
    Z = torch.diag(torch.tensor([2.0, 0.5, 1e-14, -1e-14, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(dns.null_space_projector(Z, 0.0), torch.diag(torch.tensor([1.0, 1, 1, 1, 0, 0]).double()))
    assert round(float(dns.null_space_projector(Z, 0.01).trace())) == 2
    img, txt = dns_demo.low_rank_tasks(n=64)[0]
    maps = dns.ModalityMaps(32, 0.0)
    Z_img, _ = dns.update_covariance(torch.zeros(32, 32, dtype=torch.float64), 0, img)
    Z_txt, _ = dns.update_covariance(torch.zeros(32, 32, dtype=torch.float64), 0, txt)
    paper = dns.build_projectors(maps, Z_img, Z_txt, 0.01)
    code = dns.build_projectors(maps, Z_img, Z_txt, 0.01, lambda_min_out=0.0)
    assert torch.equal(dns.build_projectors(maps, Z_img, Z_txt, 0.01, lambda_min_out=-1.0)["W_img"][0],
                       paper["W_img"][0])
    assert round(float(paper["W_img"][0].trace())) == 6  # the mapped texts' rank
    assert float(code["W_img"][0].trace()) > 6.5  # rounding-noise directions kept: nearly one-sided
    assert torch.equal(code["W_img"][1], paper["W_img"][1])  # the input side is unchanged


def test_per_task_output_covariance_uses_each_tasks_end_weights(tmp_path):
    """Deviation 13: the code accumulates each task's mapped partner features
    with that task's end weights; ours re-maps the history with the current maps."""
    tasks = dns_demo.low_rank_tasks(n=64)
    cfg = dns.DNSConfig(device="cpu", precision="fp32", batch_size=32, epochs=1, lr=3e-2, log_every=100,
                        mode="vanilla", output_cov="per-task")
    learner = dns.DNSLearner(32, math.log(1 / 0.07))
    for i, (img, txt) in enumerate(tasks):
        learner.learn(cfg, img, txt, tmp_path / f"t{i}")
    (W1_img, W1_txt), (W2_img, W2_txt) = learner.history
    mapped = torch.cat([tasks[0][1].double() @ W1_txt.double().t(), tasks[1][1].double() @ W2_txt.double().t()])
    assert torch.allclose(learner.Zo["img"], mapped.t() @ mapped / len(mapped), atol=1e-10)
    mapped = torch.cat([tasks[0][0].double() @ W1_img.double().t(), tasks[1][0].double() @ W2_img.double().t()])
    assert torch.allclose(learner.Zo["txt"], mapped.t() @ mapped / len(mapped), atol=1e-10)
    ours = dns.build_projectors(learner.net.model, learner.Z["img"], learner.Z["txt"], 0.01)
    code = dns.build_projectors(learner.net.model, learner.Z["img"], learner.Z["txt"], 0.01,
                                Z_out={"W_img": learner.Zo["img"], "W_txt": learner.Zo["txt"]})
    assert (ours["W_img"][0] - code["W_img"][0]).norm() > 1e-2  # the maps moved: different output spans
    torch.testing.assert_close(ours["W_img"][1], code["W_img"][1])  # same input side


def test_stability_guarantee_on_low_rank_features(tmp_path, capsys):
    """Paper defaults (AdamW lr 1e-4, wd 1e-3, batch 64, 5 epochs). Update
    mode: task 1's score matrix moves <= 1e-4 relative after task 2 (what
    is left is the second-order cross term of the two maps' changes);
    vanilla clearly more; gradient mode is measured and printed only."""
    res = {m: dns_demo.guarantee_check(m, tmp_path / m) for m in ("vanilla", "gradient", "update")}
    with capsys.disabled():
        print("\nguarantee check (relative change of task 1's scores):",
              {m: f"{r['drift']:.2e}" for m, r in res.items()})
    assert res["update"]["drift"] <= 1e-4
    assert res["vanilla"]["drift"] > 1e-3 and res["vanilla"]["drift"] > 30 * res["update"]["drift"]
    for r in res.values():  # every mode still learns task 2
        assert r["task2 loss after"] < r["task2 loss before"] - 0.1


def test_each_task_records_its_null_space_leak_update_mode_keeps_it_gradient_mode_does_not(tmp_path, capsys):
    """Issue 57.5: Thm. 4's condition on a task's whole change dW (W after - W before), per map:
    ||P_out dW P_in|| / ||dW||. Under AdamW the paper's gradient mode leaks measurably (AdamW's per-coordinate
    scaling, momentum and decoupled decay act after the projection: 0.11-0.12 here); update mode keeps it at
    float32 rounding (~5e-6); vanilla, measured against the projectors DNS would keep, the most. Task 1 has no
    old features: no figure, a reason. Paper defaults on low_rank_tasks (20 steps a task)."""
    leak = {}
    for mode in ("vanilla", "gradient", "update"):
        learner = dns.DNSLearner(32, math.log(1 / 0.07))
        cfg = dns.DNSConfig(mode=mode, device="cpu", log_every=10_000, zero_shot="", task_classes="")
        for i, (img, txt) in enumerate(dns_demo.low_rank_tasks()):
            learner.learn(cfg, img, txt, tmp_path / mode / f"task{i + 1}")
        first, second = (s["null_space_leak"] for s in learner.summaries)
        assert first["max"] is None and "nothing to protect" in first["why"]
        assert set(second) == {"max", "W_img", "W_txt"} and second["max"] == max(second["W_img"], second["W_txt"])
        leak[mode] = second["max"]
    assert leak["update"] < 1e-4 and leak["gradient"] > 0.05 and leak["vanilla"] > 2 * leak["gradient"]
    cmcl.say_leak(learner.summaries[1], "b", "update")
    assert f"[dns] b (update): null-space leak ||P_out dW P_in|| / ||dW|| over the task: max {leak['update']:.1e}" \
        in capsys.readouterr().out


# --- features --------------------------------------------------------------------
def test_cached_features_equal_fresh_encoding(tmp_path, tiny_random):
    model, _, preprocess, tok = tiny_random
    model.eval()
    manifest = lab.synthetic_manifest("task-photo-test", tmp_path, n=6)
    key = {"manifest": str(manifest)}
    first = evaluation.cached(tmp_path / "cache", key,
                              lambda: cmcl.manifest_features(model, preprocess, tok, manifest, "shape"))
    again = evaluation.cached(tmp_path / "cache", key, lambda: pytest.fail("recomputed instead of read from the cache"))
    rows = read_manifest(manifest)
    with torch.no_grad():
        for i, r in enumerate(rows):  # one by one, straight through open_clip
            with Image.open(manifest.parent / r["image"]) as im:
                v = model.encode_image(preprocess(im.convert("RGB"))[None], normalize=True)[0]
            t = model.encode_text(tok([r["caption"]]), normalize=True)[0]
            assert torch.allclose(again["img"][i], v, atol=1e-5) and torch.allclose(again["txt"][i], t, atol=1e-5)
            assert again["labels"][i] == r["shape"]
    assert all(torch.equal(first[k], again[k]) for k in ("img", "txt", "t2i", "labels"))


def test_identity_maps_reproduce_clip_retrieval_and_zero_shot(tmp_path, tiny_random):
    model, _, preprocess, tok = tiny_random
    manifest = lab.synthetic_manifest("task-night-test", tmp_path, n=40)
    feats = cmcl.manifest_features(model, preprocess, tok, manifest)
    cs = evaluation.load_classification("synthetic-color", tmp_path)
    zs = {"synthetic-color": {"img": evaluation.image_features(model, preprocess, cs.image_paths),
                              "clf": common.zero_shot_classifier(model, tok, cs.classnames, cs.templates),
                              "labels": cs.labels}}
    ours = cmcl.evaluate_maps(dns.ModalityMaps(feats["img"].shape[1], 0.0), [feats], zeroshot=zs)
    ref = {r["metric"]: r["value"] for r in evaluation.evaluate(model, preprocess, tok, [str(manifest)], tmp_path)}
    ref_zs = {r["metric"]: r["value"]
              for r in evaluation.evaluate(model, preprocess, tok, ["synthetic-color"], tmp_path)}
    for metric in ("i2t_R@1", "t2i_R@1", "i2t_R@10", "t2i_R@10"):
        assert ours["per_task"][metric] == [ref[metric]]
    assert ours["scalars"]["synthetic-color_top1"] == ref_zs["top1"]


# --- end to end -----------------------------------------------------------------
def test_main_end_to_end(tmp_path, model_files_as_readme_says, capsys, results_files_are_strict_json):
    spec = ",".join(f"{d}={lab.synthetic_manifest(f'task-{d}', tmp_path, n=48)}:"
                    f"{lab.synthetic_manifest(f'task-{d}-test', tmp_path, n=24)}" for d in ("photo", "night"))
    out = tmp_path / "run"
    res = dns.main(["--tasks", spec, "--data-root", str(tmp_path), "--out", str(out), "--batch-size", "16",
                    "--epochs", "2", "--zero-shot", "synthetic-color", "--task-classes", "shape", "--device", "cpu"])
    written = results_files_are_strict_json(out, "dns")  # issue 42.3: one schema, strict JSON
    R = written["continual"]["matrices"]["acc"]
    assert len(R) == 3 and len(R[0]) == 2  # row 0 = before training, then one row per task
    assert set(written["continual"]["metrics"]) >= {"i2t_R@1", "t2i_R@1", "i2t_R@10", "t2i_R@10", "R@10", "acc"}
    assert written["tasks"][1]["old_rank"]["W_img_in"] > 0  # task 2 was projected
    assert written["tasks"][0]["null_space_leak"]["max"] is None and written["tasks"][1]["null_space_leak"]["max"] >= 0
    assert len(res["drift"]["train"]) == 1 and res["timing"]["projection_ms_per_step"] > 0
    assert (out / "features").is_dir() and (out / "boundary.pt").exists()
    model_files_as_readme_says("dns", out)
    assert not (out / "task2-night" / "checkpoints").exists()  # a recorded task's training checkpoint is dropped
    shown = capsys.readouterr().out  # issue 42.4: the R[i][j] matrices, as cclip.py prints them
    assert "R[i][j], acc:" in shown and "| after | photo | night |" in shown and "| task 2 |" in shown
    assert "| task 2 | night |" in shown and "| t2i_R@5 |" in shown  # issue 42.3: the user's numbers
    assert "[dns] night (gradient): null-space leak ||P_out dW P_in|| / ||dW|| over the task: max" in shown


def test_a_projector_that_holds_a_map_fixed_says_so(tmp_path, capsys):
    """Issue 42.5: after a first task of more samples than dimensions, --lambda-min 0 keeps every direction on
    both sides, so task 2's maps cannot move: a line names each map and the task (silent before)."""
    spec = (f"a={lab.synthetic_manifest('task-photo', tmp_path, n=96)},"
            f"b={lab.synthetic_manifest('task-night', tmp_path, n=32)}")
    args = ["--tasks", spec, "--data-root", str(tmp_path), "--batch-size", "16", "--epochs", "1", "--lr", "1e-2",
            "--zero-shot", "", "--task-classes", "", "--pretrained", "random", "--device", "cpu"]
    res = dns.main(args + ["--out", str(tmp_path / "frozen"), "--lambda-min", "0", "--lambda-min-out", "0"])
    dim = res["tasks"][1]["old_rank"]["W_img_in"]
    err = capsys.readouterr().err
    assert dim == res["tasks"][1]["old_rank"]["W_img_out"] and "task-photo" not in err
    for m in ("W_img", "W_txt"):
        assert f"b: {m} could not move" in err and f"old rank {dim} of {dim}" in err
    dns.main(args + ["--out", str(tmp_path / "free")])  # the default threshold leaves room: no line
    assert "could not move" not in capsys.readouterr().err


@pytest.mark.parametrize("code_settings", [False, True])
def test_resume_inside_a_projected_task_equals_an_uninterrupted_run(tmp_path, code_settings):
    """Interrupted in task 2 and resumed: the projectors must be rebuilt from
    the maps at the START of task 2 (the boundary state), not the checkpoint's;
    with the code's settings the per-task output covariances and the biases
    must survive the interruption too."""
    spec = (f"a={lab.synthetic_manifest('task-photo', tmp_path, n=32)},"
            f"b={lab.synthetic_manifest('task-night', tmp_path, n=96)}")
    args = ["--tasks", spec, "--data-root", str(tmp_path), "--batch-size", "16", "--epochs", "1", "--lr", "1e-2",
            "--zero-shot", "", "--task-classes", "", "--pretrained", "random", "--device", "cpu",
            "--feature-cache", str(tmp_path / "features")]
    if code_settings:
        args += ["--loss", "code", "--bias", "--output-cov", "per-task", "--lambda-min", "0.1", "--lambda-min-out", "0"]
    full = dns.main(args + ["--out", str(tmp_path / "full")])
    with pytest.raises(SystemExit):  # task 1 has 2 steps, task 2 has 6: stops inside task 2
        dns.main(args + ["--out", str(tmp_path / "cut"), "--stop-at", "4"])
    resumed = dns.main(args + ["--out", str(tmp_path / "cut"), "--resume", "latest"])
    assert resumed["continual"]["matrices"] == full["continual"]["matrices"]
    W_full = torch.load(tmp_path / "full" / "boundary.pt", weights_only=False)["maps"]
    W_cut = torch.load(tmp_path / "cut" / "boundary.pt", weights_only=False)["maps"]
    assert all(torch.allclose(W_full[k], W_cut[k], atol=1e-6) for k in W_full)
    assert resumed["tasks"][1]["old_rank"]["W_img_in"] > 0  # and the resumed task was projected
    if code_settings:
        assert "b_img" in W_full  # the code's biases are part of the saved maps
        log = [json.loads(x) for x in (tmp_path / "full" / "task2-b" / "metrics.jsonl").read_text().splitlines()]
        assert "loss_code" in log[-1] and "loss_clip" not in log[-1]


@pytest.mark.slow
def test_demo_writes_claims_results_and_figure(tmp_path, shrink_world, check_demo_results):
    """The demo's plumbing on a shrunken world (1 epoch per task): every seed
    of every mode is kept, the claims carry the agreed keys, the PNG exists."""
    shrink_world(lambda k: 48 if k.startswith("task-") or k == "zs-test" else None)
    out = tmp_path / "demo"
    dns.main(["--demo", "--seeds", "0,1", "--epochs", "1", "--batch-size", "16", "--device", "cpu", "--data-root",
              str(tmp_path / "data"), "--out", str(out)])
    names = [*dns_demo.DEMO_MODES.values(), *(name for name, _ in dns_demo.DEMO_BASELINES.values())]
    saved = check_demo_results(out, "dns-demo.png", names, min_claims=10)
    assert all(f"| {name} |" in saved["table"] for name in names)  # issue 60: the baselines' rows are printed


@pytest.mark.slow
def test_demo_seeds_flag_reruns_on_other_seeds(tmp_path, shrink_world):
    """--seeds 7,8: the claims on seeds nobody has seen, every one reported;
    the next demo without the flag is back on lab.SEEDS."""
    shrink_world(lambda k: 32 if k.startswith("task-") or k == "zs-test" else None)
    out = tmp_path / "demo"
    try:
        dns.main(["--demo", "--seeds", "7,8", "--epochs", "1", "--batch-size", "16", "--device", "cpu",
                  "--data-root", str(tmp_path / "data"), "--out", str(out)])
    finally:
        lab.take_seeds_flag([])
    saved = json.loads((out / "results.json").read_text())
    assert saved["seeds"] == [7, 8] and all(c["n_seeds"] == 2 for c in saved["claims"])
    assert [r["seed"] for r in saved["per_seed"]["vanilla"]] == [7, 8] and lab.seeds() == lab.SEEDS


# --- real paths without the lab (issue 23, item 5) -------------------------------
def test_defaults_evaluate_synthetic_sets_only_in_the_lab(tmp_path):
    """--task-classes / --zeroshot auto: the lab's sets only with --tasks synthetic;
    none on a user's own tasks, with a real backbone (which then names no lab
    at all) or the tiny one (issue 42.5); explicit values are kept."""
    real = parse_config(dns.DNSConfig, ["--backbone", "ViT-B/16", "--tasks", "a=a.jsonl:b.jsonl"])
    assert (real.task_classes, real.zero_shot) == ("auto", "auto")
    assert not models.wants_lab(real)
    got = cmcl.resolve(real)
    assert (got.task_classes, got.zero_shot) == ("", "")
    for argv in (["--tasks", "synthetic"], ["--backbone", "ViT-B/16", "--tasks", "synthetic"]):
        got = cmcl.resolve(parse_config(dns.DNSConfig, argv))
        assert (got.task_classes, got.zero_shot) == ("shape", "synthetic-shape,synthetic-color")
    own = cmcl.resolve(parse_config(dns.DNSConfig, ["--backbone", "tiny", "--tasks", "a=a.jsonl:b.jsonl"]))
    assert (own.task_classes, own.zero_shot) == ("", "")
    mine = cmcl.resolve(dataclasses.replace(real, task_classes="color", zero_shot="cifar10"))
    assert (mine.task_classes, mine.zero_shot) == ("color", "cifar10")
    assert cmcl.resolve_eval_sets(got) == got  # idempotent: run() resolves again
