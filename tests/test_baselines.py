"""Issue 60's continual baselines (baselines/zscl.py, lwf.py, ewc.py): each loss by hand and against a loop from
its equation; ZSCL's and LwF's against the authors' computation (Thunderbeee/ZSCL, mtil/src/models/finetune.py
and helpers.py at b96e714), re-implemented here from reading it, on identical inputs; EWC's consolidated penalty
against the sum of per-task penalties (no code was released with EWC); each baseline end to end on the tiny
backbone, and resumed at a task boundary and mid-task equal to an uninterrupted run."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import common
from plumbing.base import UsageError
from plumbing.flags import parse_config
import lab
from baselines import ewc, lwf, sequence, zscl

# --------------------------------------------------------------------------- the authors' computation
# Thunderbeee/ZSCL at b96e714 (the commit docs/baselines.md records), re-implemented from reading it (not imported:
# it loads OpenAI's clip package). Each function names its file and function in that repository at that commit.


def _authors_distillation(t, s, T=2.0):
    """Thunderbeee/ZSCL at b96e714, mtil/src/models/helpers.py, distillation: p = softmax(t / T, dim=1);
    cross_entropy(s / T, p, reduction='mean') * T ** 2, written out as sums (an independent path to the same
    number)."""
    p = torch.exp(t / T - torch.logsumexp(t / T, dim=1, keepdim=True))
    log_q = s / T - torch.logsumexp(s / T, dim=1, keepdim=True)
    return -(p * log_q).sum(1).mean() * T ** 2


def _authors_zscl_terms(ref_out_current, ref_out, ref_embeddings, logit_scale, T=2.0):
    """Thunderbeee/ZSCL at b96e714, mtil/src/models/finetune.py, finetune's `args.method == "ZSCL"` block
    (loss_ZSCL, and loss_ZSCL_2 under --text_loss): both sides on the reference model's text features, one
    (frozen) logit scale; its features normalised as x / x.norm(dim=-1, keepdim=True)."""
    norm = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    ref_out_current, ref_out, ref_embeddings = norm(ref_out_current), norm(ref_out), norm(ref_embeddings)
    logits_current = logit_scale * ref_out_current @ ref_embeddings.t()
    logits_ref = logit_scale * ref_out @ ref_embeddings.t()
    return (_authors_distillation(logits_ref, logits_current, T),
            _authors_distillation(logits_ref.t(), logits_current.t(), T))


def _authors_we(params_per_update, start, avg_freq):
    """Thunderbeee/ZSCL at b96e714, mtil/src/models/finetune.py (finetune's loop, `# we`) and
    mtil/src/models/helpers.py (merge_we): we_model = the starting model, we_n = 0; after the update of
    iteration i (i = 0, 1, ...), if i % avg_freq == 0: we_n += 1, we = (we * we_n + theta) / (1 + we_n)."""
    we, we_n = [s.clone() for s in start], 0
    for iteration, theta in enumerate(params_per_update):
        if iteration % avg_freq == 0:
            we_n += 1
            we = [(w * we_n + t) / (1.0 + we_n) for w, t in zip(we, theta)]
    return we


def test_zscl_matches_the_authors_code_on_identical_inputs():
    """--distil-towers image (the code's form: theta_0's text features on both sides) with one logit scale is the
    code's loss_ZSCL and loss_ZSCL_2. Max abs difference printed (issue 60 report)."""
    g = torch.Generator().manual_seed(0)
    cur, ref, txt = (torch.randn(n, 16, generator=g) for n in (12, 12, 30))
    s = torch.tensor(100.0)
    a_img, a_txt = _authors_zscl_terms(cur, ref, txt, s)
    txt_0 = F.normalize(txt, dim=-1)
    o_img, o_txt = zscl.zscl_loss(F.normalize(cur, dim=-1), txt_0, F.normalize(ref, dim=-1), txt_0, s, s)
    diff = max(float((o_img - a_img).abs()), float((o_txt - a_txt).abs()))
    print(f"ZSCL vs Thunderbeee/ZSCL finetune.py: max abs difference {diff:.3g} "
          f"(terms {float(a_img):.4f}, {float(a_txt):.4f})")
    assert diff < 1e-4 and float(a_img) > 0.1


def test_lwf_matches_the_authors_code_on_identical_inputs():
    """ZSCL's lwf.sh runs the same block with the previous model as reference and the task's own data: LwF's
    loss with --distil-towers image is those two terms."""
    g = torch.Generator().manual_seed(1)
    new, old, txt_old = (torch.randn(8, 16, generator=g) for _ in range(3))
    s = torch.tensor(50.0)
    a = _authors_zscl_terms(new, old, txt_old, s)
    txt_old = F.normalize(txt_old, dim=-1)
    o = lwf.lwf_loss(F.normalize(new, dim=-1), txt_old, F.normalize(old, dim=-1), txt_old, s, s)
    diff = max(float((x - y).abs()) for x, y in zip(o, a))
    print(f"LwF vs Thunderbeee/ZSCL (lwf.sh's path): max abs difference {diff:.3g}")
    assert diff < 1e-4


def test_weight_ensemble_matches_the_authors_schedule():
    """WeightEnsemble (after update k, (k - 1) % I == 0) with weight_ensemble gives the code's we_model after
    N updates, on a toy model whose weights move at random."""
    g = torch.Generator().manual_seed(2)
    model = torch.nn.Linear(3, 2)
    net = torch.nn.Module()
    net.model = model
    zscl.WeightEnsemble.start(net)
    start = [p.detach().clone() for p in model.parameters()]
    hooks, seen = zscl.WeightEnsemble(every=3), []
    for _ in range(10):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        seen.append([p.detach().clone() for p in model.parameters()])
        hooks.after_optimizer_step(net)
    want = _authors_we(seen, start, 3)
    diff = max(float((a - w).abs().max()) for a, w in zip(net.average, want))
    print(f"WE vs Thunderbeee/ZSCL merge_we schedule: max abs difference {diff:.3g}")
    assert diff < 1e-6 and int(net.we_count) == 1 + 4  # merges after updates 1, 4, 7, 10


# --------------------------------------------------------------------------- the losses by hand / from the equation
def test_distillation_by_hand():
    """Equal two-class logits: T^2 * log 2 (the teacher's entropy: a cross-entropy, not a KL, as the code)."""
    z = torch.zeros(1, 2)
    assert math.isclose(float(lwf.distillation(z, z, 2.0)), 4 * math.log(2), rel_tol=1e-6)
    t, s = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 0.0]])
    p = torch.softmax(t / 2, dim=1)[0]
    assert math.isclose(float(lwf.distillation(t, s, 2.0)), 4 * math.log(2) * float(p.sum()), rel_tol=1e-6)


def test_lwf_loss_against_a_loop_from_the_equation():
    g = torch.Generator().manual_seed(3)
    img, txt, img_o, txt_o = (F.normalize(torch.randn(5, 8, generator=g), dim=-1) for _ in range(4))
    s, s_o, T = 20.0, 30.0, 2.0
    to_txt, to_img = lwf.lwf_loss(img, txt, img_o, txt_o, torch.tensor(s), torch.tensor(s_o), T)
    rows, cols = [], []
    for i in range(5):  # L_old per image over the texts, per text over the images
        y = torch.softmax(torch.stack([s_o * img_o[i] @ txt_o[j] for j in range(5)]) / T, 0)
        q = torch.log_softmax(torch.stack([s * img[i] @ txt[j] for j in range(5)]) / T, 0)
        rows.append(-(y * q).sum() * T * T)
        y = torch.softmax(torch.stack([s_o * img_o[j] @ txt_o[i] for j in range(5)]) / T, 0)
        q = torch.log_softmax(torch.stack([s * img[j] @ txt[i] for j in range(5)]) / T, 0)
        cols.append(-(y * q).sum() * T * T)
    torch.testing.assert_close(to_txt, torch.stack(rows).mean())
    torch.testing.assert_close(to_img, torch.stack(cols).mean())


def test_lwf_gradient_vanishes_at_the_teacher_and_pulls_toward_it():
    """The mechanism: at student == teacher the distillation's gradient is zero (soft CE's minimum); a moved
    student is pulled back (a step along -grad lowers the loss)."""
    g = torch.Generator().manual_seed(4)
    img_o, txt_o = (F.normalize(torch.randn(6, 8, generator=g), dim=-1) for _ in range(2))
    img = img_o.clone().requires_grad_(True)
    sum(lwf.lwf_loss(img, txt_o, img_o, txt_o, torch.tensor(10.0), torch.tensor(10.0))).backward()
    assert float(img.grad.abs().max()) < 1e-6
    moved = (img_o + 0.3 * torch.randn(6, 8, generator=g)).requires_grad_(True)
    loss = sum(lwf.lwf_loss(moved, txt_o, img_o, txt_o, torch.tensor(10.0), torch.tensor(10.0)))
    loss.backward()
    after = sum(lwf.lwf_loss(moved.detach() - 1e-3 * moved.grad, txt_o, img_o, txt_o, torch.tensor(10.0),
                             torch.tensor(10.0)))
    assert float(moved.grad.abs().max()) > 1e-4 and float(after) < float(loss.detach())


def test_lwf_with_weight_zero_is_plain_clip():
    from plumbing import models
    torch.manual_seed(0)
    model, _, eval_tf, tokenizer = models.load_model("tiny", "random", device="cpu", world=lab.WORLD)
    size = eval_tf.transforms[0].size if hasattr(eval_tf, "transforms") else 32
    size = size if isinstance(size, int) else size[0]
    batch = {"image": torch.randn(4, 3, size, size), "text": tokenizer(["a red circle", "a blue star", "a cat",
                                                                       "a night shot of a ring"])}
    net = lwf.LwF(model, sequence.frozen_copy(model), weight=0.0)
    losses = net(batch)
    f = net.features(batch)
    plain = common.clip_loss(F.normalize(f["img"], dim=-1), F.normalize(f["txt"], dim=-1), model.logit_scale.exp())
    assert float(losses["loss_lwf_img"].detach()) == 0.0 and float(losses["loss_lwf_txt"].detach()) == 0.0
    torch.testing.assert_close(losses["loss_clip"], plain)


def test_weight_ensemble_by_hand():
    out = zscl.weight_ensemble([torch.tensor([1.0])], [torch.tensor([4.0])], 2)
    assert float(out[0]) == 2.0  # (2 * 1 + 4) / 3


def test_ewc_penalty_by_hand():
    p, f, a = [torch.tensor([1.0, 3.0])], [torch.tensor([2.0, 0.5])], [torch.tensor([0.0, 1.0])]
    # lambda/2 * (2 * 1^2 + 0.5 * 2^2) = 5 * 4 = 20 for lambda = 10
    assert math.isclose(float(ewc.ewc_penalty(p, f, a, 10.0)), 20.0)


def _ewc_tasks(seed=5, n=3):
    """n tasks' Fishers F_t and end weights theta*_t, for two tensors (one entry no task constrains at first)."""
    g = torch.Generator().manual_seed(seed)
    fishers = [[torch.rand(4, 3, generator=g), torch.rand(3, generator=g)] for _ in range(n)]
    fishers[0][1][0] = 0.0
    thetas = [[torch.randn(4, 3, generator=g), torch.randn(3, generator=g)] for _ in range(n)]
    theta = [torch.randn(4, 3, generator=g, requires_grad=True), torch.randn(3, generator=g, requires_grad=True)]
    return fishers, thetas, theta


def test_ewc_consolidated_penalty_has_the_gradient_of_the_per_task_sum():
    """After Eq. (3), gamma 1: sum_t F_t (theta - theta*_t)^2 = F (theta - theta*)^2 + const: equal gradients,
    values apart by a constant."""
    fishers, thetas, theta = _ewc_tasks()
    F_, W = None, None
    for f, t in zip(fishers, thetas):
        F_, W = ewc.consolidate(F_, W, f, t)
    g_one = torch.autograd.grad(ewc.ewc_penalty(theta, F_, ewc.anchor(F_, W, theta), 3.0), theta)
    each = sum(ewc.ewc_penalty(theta, f, t, 3.0) for f, t in zip(fishers, thetas))
    for x, y in zip(g_one, torch.autograd.grad(each, theta)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_ewc_gamma_below_one_is_online_ewc_anchored_at_the_last_task():
    """Schwarz et al. (Progress & Compress), online EWC: F*_t = gamma F*_{t-1} + F_t and task t+1's penalty
    lambda/2 sum gamma F*_t (theta - theta*_t)^2, so its gradient is lambda gamma F*_t (theta - theta*_t), with
    theta*_t the LAST task's weights (before issue 74: the F-weighted mean of all of them)."""
    fishers, thetas, theta = _ewc_tasks()
    lam, gamma = 3.0, 0.5
    F_, W = None, None
    for f, t in zip(fishers, thetas):
        F_, W = ewc.consolidate(F_, W, f, t, gamma)
    got = torch.autograd.grad(ewc.ewc_penalty(theta, F_, ewc.anchor(F_, W, theta), lam), theta)
    F_star = [torch.zeros_like(x) for x in theta]
    for f in fishers:  # the paper's recursion, from F*_0 = 0
        F_star = [gamma * s + x for s, x in zip(F_star, f)]
    want = [lam * gamma * s * (p.detach() - a) for s, p, a in zip(F_star, theta, thetas[-1])]
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def _avalanche_ewc():
    """avalanche-lib's EWCPlugin (avalanche/training/plugins/ewc.py), the one installable EWC the tests can call."""
    plugin = pytest.importorskip("avalanche.training.plugins.ewc", reason="avalanche-lib is not installed (pip "
                                 "install avalanche-lib==0.6.0): EWC's cross-check against its EWCPlugin is skipped")
    from avalanche.training.utils import ParamData
    return plugin.EWCPlugin, ParamData


@pytest.mark.parametrize("mode", ["separate", "online"])
def test_ewc_penalty_gradient_matches_avalanches_plugin(mode):
    """avalanche's EWCPlugin.before_backward adds ewc_lambda * sum F (theta - theta*)^2 (no 1/2; online: F* =
    decay F*_{t-1} + F_t, no decay on the penalty): ours at lambda = 2a ("separate", the sum over tasks, gamma 1)
    or 2a / gamma ("online") has its gradient (ewc.py deviation 6)."""
    from types import SimpleNamespace
    EWCPlugin, ParamData = _avalanche_ewc()
    fishers, thetas, theta = _ewc_tasks()
    a, gamma = 7.0, (1.0 if mode == "separate" else 0.5)
    model = torch.nn.Module()
    model.w, model.b = (torch.nn.Parameter(t.detach().clone()) for t in theta)
    names = ["w", "b"]
    plugin = EWCPlugin(a, mode=mode, decay_factor=None if mode == "separate" else gamma)
    for t, (f, th) in enumerate(zip(fishers, thetas)):
        plugin.update_importances({n: ParamData(n, init_tensor=x.clone()) for n, x in zip(names, f)}, t)
        plugin.saved_params[t] = {n: ParamData(n, init_tensor=x.clone()) for n, x in zip(names, th)}
    strategy = SimpleNamespace(clock=SimpleNamespace(train_exp_counter=len(fishers)), model=model, device="cpu",
                               loss=torch.zeros(()))
    plugin.before_backward(strategy)
    theirs = torch.autograd.grad(strategy.loss, [model.w, model.b])
    F_, W = None, None
    for f, th in zip(fishers, thetas):
        F_, W = ewc.consolidate(F_, W, f, th, gamma)
    ours = torch.autograd.grad(ewc.ewc_penalty(theta, F_, ewc.anchor(F_, W, theta), 2 * a / gamma), theta)
    diff = max(float((x - y).abs().max()) for x, y in zip(ours, theirs))
    print(f"EWC ({mode}) vs avalanche-lib EWCPlugin: max abs gradient difference {diff:.3g}")
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_ewc_fisher_matches_avalanches_and_drops_the_partial_batch():
    """avalanche's compute_importances is the mean over batches of squared batch-loss gradients, as
    empirical_fisher; it keeps a last partial batch (one term of the mean), ours drops it (ewc.py deviation 7): on
    12 items in batches of 4 the two agree, on 14 they differ by that batch."""
    EWCPlugin, _ = _avalanche_ewc()
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    data = [(torch.randn(5), int(torch.randint(3, ())), 0) for _ in range(14)]

    def ours(items):
        def gradients():
            for i in range(0, len(items) - len(items) % 4, 4):  # full batches only, as task_fisher's loader
                x = torch.stack([d[0] for d in items[i:i + 4]])
                y = torch.tensor([d[1] for d in items[i:i + 4]])
                yield torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        return ewc.empirical_fisher(gradients())

    def theirs(items):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        imp = EWCPlugin(1.0).compute_importances(model, F.cross_entropy, opt, items, "cpu", 4)
        return [imp[n].data for n, _ in model.named_parameters()]

    for x, y in zip(ours(data[:12]), theirs(data[:12])):
        torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-5)
    assert max(float((x - y).abs().max()) for x, y in zip(ours(data), theirs(data))) > 1e-6


def test_empirical_fisher_is_the_mean_squared_gradient():
    grads = [[torch.tensor([1.0, -2.0])], [torch.tensor([3.0, 0.0])]]
    torch.testing.assert_close(ewc.empirical_fisher(iter(grads))[0], torch.tensor([5.0, 2.0]))


# --------------------------------------------------------------------------- end to end, resume
from test_cclip import _tasks  # noqa: E402  (C-CLIP's two synthetic tasks: the baselines run its protocol)


def _argv(name, root, out, *extra):
    own = {"zscl": ["--ref-images", str(lab.synthetic_manifest("train", root, n=24)), "--we-every", "2",
                    "--ref-batch", "6", "--ref-texts-per-step", "10"],
           "lwf": [], "ewc": ["--fisher-batches", "2", "--ewc-lambda", "100"]}[name]
    return ["--backbone", "tiny", "--pretrained", "random", "--tasks", _tasks(root), "--unseen", "",
            "--zero-shot", "", "--steps", "3", "--batch-size", "8", "--workers", "0", "--device", "cpu",
            "--precision", "fp32", "--lr", "1e-3", "--save-every", "0", "--log-every", "1",
            "--data-root", str(root), "--out", str(out), *own, *extra]


MODULES = {"zscl": zscl, "lwf": lwf, "ewc": ewc}


def _final(out):
    rec = json.loads((out / "continual.json").read_text())
    return rec["rows"], torch.load(out / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """name -> (rows, state_dict) of an uninterrupted run, made once per baseline for the resume cases."""
    made = {}

    def get(name, root):
        if name not in made:
            out = tmp_path_factory.mktemp(f"{name}-whole")
            MODULES[name].main(_argv(name, root, out))
            made[name] = _final(out)
        return made[name]
    return get


# ZSCL both ways (mid-task: the weight ensemble's running average comes back from the checkpoint), EWC and LwF at a
# boundary (EWC's Fisher and anchor come back from boundary-state.pt; LwF's teacher from boundary.pt)
RESUME_CASES = [("zscl", ["--stop-after-tasks", "1"]), ("zscl", ["--stop-at", "2"]),
                ("ewc", ["--stop-after-tasks", "1"]), ("lwf", ["--stop-after-tasks", "1"])]


@pytest.mark.parametrize("name, stop", RESUME_CASES, ids=["zscl-boundary", "zscl-mid-task", "ewc-boundary",
                                                          "lwf-boundary"])
def test_resume_equals_an_uninterrupted_run(tmp_path_factory, uninterrupted, name, stop):
    root, main = tmp_path_factory.getbasetemp() / "data", MODULES[name].main
    out = tmp_path_factory.mktemp(f"{name}-resumed")
    assert "interrupted" in main(_argv(name, root, out, *stop))
    main(_argv(name, root, out, "--resume", "latest"))
    rows_a, sd_a = uninterrupted(name, root)
    rows_b, sd_b = _final(out)
    assert len(rows_a) == 3 and rows_a == rows_b
    for k in sd_a:
        torch.testing.assert_close(sd_a[k], sd_b[k], atol=1e-6, rtol=0, msg=k)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_main_end_to_end(tmp_path, name, results_files_are_strict_json, capsys):
    """The pretrained tiny backbone on two small synthetic tasks, unseen retrieval and zero-shot: the matrices,
    results.json in plumbing.results' schema, per-task models, the headline row; the baseline's terms logged."""
    root, out = tmp_path / "data", tmp_path / "run"
    unseen = lab.synthetic_manifest("unseen", root, n=32)
    argv = _argv(name, root, out, "--unseen", str(unseen), "--zero-shot", "synthetic-shape", "--eval-n", "32")
    argv[argv.index("--pretrained") + 1] = ""
    res = MODULES[name].main(argv)
    R = res["summary"]["matrices"]["R@1"]
    assert len(R) == 3 and len(R[0]) == 2 and "synthetic-shape/top1" in res["summary"]["pd"]
    saved = results_files_are_strict_json(out, name)
    assert saved["continual"]["matrices"]["R@1"] == R
    assert res["rows"][0]["method"] == name and math.isfinite(res["rows"][0]["last R@1"])
    assert (out / "task2-night" / "model.pt").exists() and (out / "model.pt").exists()
    logged = [json.loads(line) for line in (out / "task2-night" / "metrics.jsonl").read_text().splitlines()]
    term = {"zscl": "loss_zscl_txt", "lwf": "loss_lwf_txt", "ewc": "loss_ewc"}[name]
    assert all(math.isfinite(r[term]) for r in logged) and any(r[term] > 0 for r in logged)
    assert "R[i][j], R@1" in capsys.readouterr().out


def test_zscl_ends_each_task_on_the_weight_ensemble(tmp_path):
    """With I = 2 and 3 steps, task 1's saved model is the mean of its start and its weights after updates 1
    and 3, not the last weights: it differs from a run without WE (--we-every 0), which ends on the last."""
    root = tmp_path / "data"
    zscl.main(_argv("zscl", root, tmp_path / "we", "--stop-after-tasks", "1"))
    zscl.main(_argv("zscl", root, tmp_path / "no", "--stop-after-tasks", "1", "--we-every", "0"))
    we = torch.load(tmp_path / "we" / "task1-photo" / "model.pt", weights_only=True)
    no = torch.load(tmp_path / "no" / "task1-photo" / "model.pt", weights_only=True)
    assert we.keys() == no.keys()
    assert max(float((we[k] - no[k]).abs().max()) for k in we if we[k].is_floating_point()) > 1e-4


def test_zscl_without_a_reference_set_says_what_to_pass(tmp_path):
    cfg = parse_config(zscl.ZSCLConfig, ["--tasks", "x=a.jsonl"])
    with pytest.raises(UsageError, match="--ref-images"):
        zscl.reference_paths(cfg, None)


# --------------------------------------------------------------------------- one step of each wrapper
def _tiny_nets(tmp_path):
    """Each baseline's training wrapper on the tiny backbone (random weights) with its continual part on:
    ZSCL with a reference set, LwF with a teacher, EWC with a Fisher and an anchor away from the weights."""
    from plumbing import models
    torch.manual_seed(0)
    model, _, eval_tf, tokenizer = models.load_model("tiny", "random", device="cpu", world=lab.WORLD)
    ref = lab.synthetic_manifest("train", tmp_path, n=12)
    cfg = parse_config(zscl.ZSCLConfig, ["--ref-images", str(ref), "--batch-size", "4",
                                                "--ref-texts-per-step", "6"])
    teacher = sequence.frozen_copy(model)
    with torch.no_grad():  # an old model apart from the current one (at equal weights LwF's gradient is 0)
        for p in teacher.parameters():
            p.add_(0.02 * torch.randn_like(p))
    reference = zscl.Reference(*zscl.reference_paths(cfg, lab.WORLD), eval_tf, tokenizer)
    params = ewc.trainable(model)
    fisher = {n: torch.rand_like(p) for n, p in params.items()}
    anchor = [p.detach() + 0.1 for p in params.values()]
    items = [reference.images[i] for i in range(4)]
    batch = {"image": torch.stack([it["image"] for it in items]), "text": tokenizer([it["caption"] for it in items])}
    return model, teacher, batch, {
        "zscl": zscl.ZSCL(model, teacher, reference, cfg),
        "lwf": lwf.LwF(model, teacher),
        "ewc": ewc.EWC(model, fisher, anchor, lam=10.0)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_of_each_wrapper_has_gradients_where_it_trains(tmp_path, precision):
    """(d) every loss term finite and positive, the trained model's weights get a gradient from the baseline's
    own term, the frozen teacher none; (e) the same under bf16 autocast on CPU."""
    from types import SimpleNamespace
    model, teacher, batch, nets = _tiny_nets(tmp_path)
    for name, net in nets.items():
        ctx = SimpleNamespace(generator=torch.Generator().manual_seed(0), device=torch.device("cpu"))
        with common.autocast(torch.device("cpu"), precision):
            losses = net(batch, ctx)
        own = [k for k in losses if k != "loss_clip"]
        assert own and all(math.isfinite(float(v.detach())) and float(v.detach()) > 0 for v in losses.values())
        model.zero_grad(set_to_none=True)
        sum(losses[k] for k in own).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and max(float(g.abs().max()) for g in grads) > 0, name
        assert all(p.grad is None for p in teacher.parameters()), name


def test_the_c_clip_demo_runs_the_baselines_at_their_calibrated_knob():
    """Issue 70.5: lab/demos/cclip.py's knobs are what the demo's one tuning rule chose: in the shared world
    docs/calibration-cclip-floor.json, in the conflict world -cclip-floor-2.json (issue 71.1; issue 60's records, by
    the highest val last R@1, keep their own choices)."""
    from lab import calibrate
    from lab.demos import cclip as demo
    for name in ("zscl", "lwf", "ewc"):
        assert demo.SHARED_BASELINES[name] == calibrate.record("cclip-floor")["chosen"][name], name
        assert demo.CHOSEN_BASELINES[name] == calibrate.record("cclip-floor-2")["chosen"][name], name
        assert demo.baseline_config(demo.CClipConfig(), name, "shared").__dict__.items() >= \
            demo.SHARED_BASELINES[name].items()
    assert calibrate.record("cclip-zscl")["chosen"] == {"image_weight": 0.3, "text_weight": 0.3}


def test_the_baselines_refuse_siglip_and_lora_with_one_message():
    """Issue 59's flags are built for the method files; a baseline says so rather than ignoring them."""
    from baselines import imix, lwf
    with pytest.raises(UsageError, match="not built for the baselines"):
        lwf.main(["--loss", "siglip", "--backbone", "tiny", "--tasks", "synthetic"])
    with pytest.raises(UsageError, match="not built for the baselines"):
        imix.main(["--lora", "2", "--backbone", "tiny"])
