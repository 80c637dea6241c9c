"""Tests of baselines/maps.py: EWC, LwF and ZSCL on DNS's maps over frozen features (issue 60). Each term at a
task's start, each row end to end with resume, EWC's state across a boundary, ZSCL's weight ensemble, CMCL's
setting (and ZSCL's refusal there)."""
from types import SimpleNamespace

import pytest
import torch

from plumbing.base import UsageError
import lab
from baselines import maps


def _args(tmp_path, mode, n_a=32, n_b=96):
    spec = (f"a={lab.synthetic_manifest('task-photo', tmp_path, n=n_a)},"
            f"b={lab.synthetic_manifest('task-night', tmp_path, n=n_b)}")
    return ["--mode", mode, "--tasks", spec, "--data-root", str(tmp_path), "--batch-size", "16", "--epochs", "1",
            "--lr", "1e-2", "--zero-shot", "", "--task-classes", "", "--pretrained", "random", "--device", "cpu",
            "--feature-cache", str(tmp_path / "features"),
            "--ref-images", str(lab.synthetic_manifest("train", tmp_path, n=40))]


def _net(mode, **over):
    cfg = maps.MapsConfig(mode=mode, **over)
    learner = maps.MapsLearner(cfg, (torch.randn(12, 8), torch.randn(10, 8)), 8, 2.0)
    return learner, learner.net


def _batch(g, n=6):
    img, txt = (torch.nn.functional.normalize(torch.randn(n, 8, generator=g), dim=-1) for _ in range(2))
    return {"img": img, "txt": txt}


@pytest.mark.parametrize("mode, term", [("lwf", "loss_lwf_img"), ("zscl", "loss_zscl_img")])
def test_distillation_has_no_gradient_while_the_maps_equal_their_teacher(mode, term):
    """LwF's teacher is the maps at the task's start, ZSCL's the initial (identity) maps: at the start of task 1
    both equal the student, so the distillation's gradient is 0 (its value is the teacher's entropy, > 0); after a
    change of the maps it is not."""
    learner, net = _net(mode)
    net.teacher = maps.copy.deepcopy(net.model).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ctx = SimpleNamespace(generator=torch.Generator().manual_seed(1))
    batch = _batch(g)
    loss = net.losses(net.features(batch), ctx)[term]
    grad = torch.autograd.grad(loss, net.model.W_img)[0]
    assert loss > 0 and grad.abs().max() < 1e-5
    with torch.no_grad():
        net.model.W_img.add_(0.1 * torch.randn(8, 8, generator=g))
    ctx = SimpleNamespace(generator=torch.Generator().manual_seed(1))
    loss = net.losses(net.features(batch), ctx)[term]
    assert torch.autograd.grad(loss, net.model.W_img)[0].abs().max() > 1e-3


def test_ewc_penalty_is_zero_at_the_anchor_and_pulls_back_after(tmp_path):
    """After task 1 the consolidated Fisher is kept; the penalty is 0 at theta*_1 and its gradient points back
    toward it (F > 0, lambda > 0)."""
    learner, net = _net("ewc", ewc_lambda=10.0, out=str(tmp_path), batch_size=4, epochs=1, lr=1e-2,
                        device="cpu", log_every=1000)
    g = torch.Generator().manual_seed(0)
    b = _batch(g, 16)
    learner.learn(learner.cfg, b["img"], b["txt"], tmp_path / "t1")
    assert set(learner.fisher) == {"W_img", "W_txt"} and all(f.sum() > 0 for f in learner.fisher.values())
    state = learner.state_dict()
    again, _ = _net("ewc", ewc_lambda=10.0)
    again.load_state_dict(state)  # a boundary keeps (F, W)
    assert all(torch.equal(again.fisher[k], learner.fisher[k]) for k in learner.fisher)
    params = dict(net.model.named_parameters())
    net.fisher = learner.fisher
    net.anchor = maps.anchor(list(learner.fisher.values()), list(learner.weighted.values()),
                             [params[n] for n in learner.fisher])
    at_anchor = maps.ewc_penalty([params[n] for n in net.fisher], list(net.fisher.values()), net.anchor, 10.0)
    assert float(at_anchor.detach()) == pytest.approx(0.0, abs=1e-10)
    step = 0.05 * torch.randn(8, 8, generator=g)
    with torch.no_grad():
        net.model.W_img.add_(step)
    pen = maps.ewc_penalty([params[n] for n in net.fisher], list(net.fisher.values()), net.anchor, 10.0)
    grad = torch.autograd.grad(pen, net.model.W_img)[0]
    assert pen > 0 and float((grad * step).sum()) > 0  # the gradient points away from the anchor: descent returns


def test_zscl_task_ends_on_the_weight_ensemble(tmp_path):
    """ZSCL's parameter space: the task's result is the running average of theta_start and the merged updates
    (every I = 2 steps), and the history records that result, not the last iterate."""
    learner, net = _net("zscl", we_every=2, out=str(tmp_path), batch_size=4, epochs=1, lr=1e-2, device="cpu",
                        log_every=1000, ref_batch=4, ref_texts_per_step=4)
    g = torch.Generator().manual_seed(0)
    b = _batch(g, 16)  # 4 steps: merges after updates 1 and 3, so 3 models in the average
    start = net.model.W_img.detach().clone()
    summary = learner.learn(learner.cfg, b["img"], b["txt"], tmp_path / "t1")
    assert summary["we_models"] == 3
    assert torch.equal(net.model.W_img.detach(), net.average[0].detach())
    assert torch.equal(learner.history[-1][0], net.model.W_img.detach())
    assert not torch.equal(net.model.W_img.detach(), start)


@pytest.mark.parametrize("mode", ["ewc", "lwf", "zscl"])
def test_each_row_runs_and_resumes_inside_task_two_as_if_uninterrupted(tmp_path, mode):
    """End to end on the tiny backbone (random weights), stopped inside task 2 and resumed: the same R[i][j] and
    maps as an uninterrupted run (EWC's Fisher comes back from the boundary, LwF's teacher from the maps at task 2's
    start, ZSCL's average from the checkpoint); results.json names the row."""
    args = _args(tmp_path, mode)
    full = maps.main(args + ["--out", str(tmp_path / "full")])
    with pytest.raises(SystemExit):  # task 1 has 2 steps, task 2 has 6: stops inside task 2
        maps.main(args + ["--out", str(tmp_path / "cut"), "--stop-at", "4"])
    resumed = maps.main(args + ["--out", str(tmp_path / "cut"), "--resume", "latest"])
    assert resumed["continual"]["matrices"] == full["continual"]["matrices"]
    W_full = torch.load(tmp_path / "full" / "boundary.pt", weights_only=False)
    W_cut = torch.load(tmp_path / "cut" / "boundary.pt", weights_only=False)
    assert all(torch.allclose(W_full["maps"][k], W_cut["maps"][k], atol=1e-6) for k in W_full["maps"])
    assert full["method"] == mode
    if mode == "ewc":
        assert W_full["fisher"] is not None and set(W_full["fisher"]) == {"W_img", "W_txt"}


def test_a_strong_ewc_keeps_task_one_scores_closer_than_a_weak_one(tmp_path):
    """lambda large: task 2 barely moves the maps away from task 1's (score drift of task 1 at most half of a
    lambda-0 run's); the penalty does what Eq. (3) says."""
    args = _args(tmp_path, "ewc", n_a=64, n_b=64)
    weak = maps.main(args + ["--out", str(tmp_path / "weak"), "--ewc-lambda", "0"])
    strong = maps.main(args + ["--out", str(tmp_path / "strong"), "--ewc-lambda", "1e6"])
    assert strong["drift"]["train"][0] < 0.5 * weak["drift"]["train"][0]


def test_cmcl_setting_runs_ewc_and_refuses_zscl(tmp_path, capsys):
    """CMCL's own steps (--features): EWC and LwF apply (a step's pair of maps); ZSCL has no reference set of those
    modalities: one message."""
    features = lab.synthetic_multimodal(tmp_path / "world", "cmcl", "imagebind", dim=8, n_train=32, n_test=16,
                                        conflict=0.0)
    args = ["--features", str(features), "--epochs", "1", "--batch-size", "16", "--device", "cpu",
            "--tasks", "ucf101~esc50"]
    res = maps.main(["--mode", "ewc", "--out", str(tmp_path / "ewc")] + args)
    assert res["method"] == "ewc" and len(res["continual"]["matrices"]["R@1"]) == 3
    with pytest.raises(UsageError, match="not applicable"):
        maps.main(["--mode", "zscl", "--out", str(tmp_path / "zscl")] + args)

