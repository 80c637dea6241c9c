"""Tests of cclip.py: LoRA by weight parametrization (fresh = no-op, acts on
both towers through the attention weights, exact merge), CKC against a
per-sample loop and a hand-computed case, reduction to plain CLIP, which
parameters get gradient, a bf16 step, resume of the task sequence, and the
script end to end."""
import copy
import dataclasses
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cclip  # noqa: E402
from plumbing import models
from papers import cclip_tasks  # noqa: E402
import common  # noqa: E402
from plumbing.flags import parse_config
from plumbing.manifests import read_manifest
import lab  # noqa: E402
from lab.demos import cclip as cclip_demo  # noqa: E402
from protocols import wise_ft  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture()
def tiny():
    torch.manual_seed(0)
    model, _, _, tok = models.load_model("tiny", "random")
    return model.eval(), tok


def _batch(tok, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    caps = ["a photo of a red circle.", "a dark picture of a blue square.", "a line drawing of a green cross.",
            "a striped scene with a yellow diamond.", "a photo of a purple triangle.", "a tiled picture of a cross."]
    return {"image": torch.randn(n, 3, lab.IMAGE_SIZE, lab.IMAGE_SIZE, generator=g), "text": tok(caps[:n])}


def _encode(model, batch):
    return model.encode_image(batch["image"]), common.encode_text(model, batch["text"])


def _adapters(model, prefix=""):
    """name -> LoRA module, for adapters whose module path starts with prefix."""
    return {n: m for n, m in model.named_modules() if isinstance(m, common.LoRA) and n.startswith(prefix)}


# ----------------------------------------------------------------------------- LoRA
def test_fresh_adapter_leaves_outputs_unchanged(tiny):
    model, tok = tiny
    batch = _batch(tok)
    img0, txt0 = _encode(model, batch)
    names = common.add_lora(model)
    # 4 targets x 4 blocks x 2 towers
    assert len(names) == 32 and any(n.startswith("visual.") for n in names) and any(
        n.startswith("transformer.") for n in names)
    img1, txt1 = _encode(model, batch)  # equal up to float rounding (another matmul kernel may run)
    torch.testing.assert_close(img1, img0, atol=1e-6, rtol=0)
    torch.testing.assert_close(txt1, txt0, atol=1e-6, rtol=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith((".A", ".B")) for n in trainable)


@pytest.mark.parametrize("target", ["attn.in_proj_weight", "attn.out_proj.weight", "mlp.c_fc.weight"])
def test_nonzero_adapter_changes_each_tower_through_that_weight(tiny, target):
    """nn.MultiheadAttention reads in_proj_weight and out_proj.weight directly;
    a module wrapper on out_proj would leave the output unchanged here."""
    model, tok = tiny
    batch = _batch(tok)
    common.add_lora(model, targets=(target,))
    img0, txt0 = _encode(model, batch)  # fresh adapters
    with torch.no_grad():
        for m in _adapters(model, "visual.").values():
            m.B.normal_(std=0.05)
    img1, txt1 = _encode(model, batch)
    assert (img1 - img0).abs().max() > 1e-3 and torch.equal(txt1, txt0)  # only the image tower moved
    with torch.no_grad():
        for m in _adapters(model, "transformer.").values():
            m.B.normal_(std=0.05)
    img2, txt2 = _encode(model, batch)
    assert torch.equal(img2, img1) and (txt2 - txt1).abs().max() > 1e-3


def test_merge_is_exact_and_leaves_a_plain_model(tiny, tmp_path):
    model, tok = tiny
    batch = _batch(tok)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    names = common.add_lora(model, rank=4, alpha=8.0)
    torch.manual_seed(1)
    with torch.no_grad():
        for m in _adapters(model).values():
            m.B.normal_(std=0.05)
    # theta and DeltaW = (alpha / r) B A of every adapted weight, read before merging
    theta, delta = {}, {}
    for n in names:
        mod_name, _, p_name = n.rpartition(".")
        mod = model.get_submodule(mod_name)
        plist = getattr(mod.parametrizations, p_name)
        theta[n] = plist.original.detach().clone()
        delta[n] = (8.0 / 4) * (plist[0].B @ plist[0].A).detach()
    img_adapted, txt_adapted = _encode(model, batch)

    torch.manual_seed(0)  # an identical twin (a deepcopy would share the parametrized classes)
    twin = models.load_model("tiny", "random")[0].eval()
    common.add_lora(twin, rank=4, alpha=8.0)
    twin.load_state_dict(model.state_dict())
    common.merge_lora(twin, 1.0)  # coef 1: the same function as the adapted model
    img_m, txt_m = _encode(twin, batch)
    torch.testing.assert_close(img_m, img_adapted, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(txt_m, txt_adapted, atol=1e-5, rtol=1e-5)

    common.merge_lora(model, 0.5)  # coef 0.5: theta + 0.5 DeltaW, exactly
    sd = model.state_dict()
    for n in names:
        assert torch.equal(sd[n], theta[n] + 0.5 * delta[n]), n
    assert {k: v.shape for k, v in sd.items()} == shapes  # the original keys, nothing added
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    models.save_model(model, tmp_path / "m.pt", "tiny")  # refuses adapter keys; must pass


def test_merge_coef_zero_is_the_old_model(tiny):
    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    common.add_lora(model)
    with torch.no_grad():
        for m in _adapters(model).values():
            m.B.normal_(std=0.05)
    common.merge_lora(model, 0.0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------- CKC loss
def test_ckc_loss_hand_computed():
    # N = 1: p = [e1; e2], z = [e1; e2], s = 1 -> logits = I_2, each row's
    # CE = -log(e / (e + 1)) = log(1 + 1/e). As printed (Sec. 4.2) the two
    # directions are summed: L = 2 log(1 + 1/e); the research code's mean: half.
    e1, e2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    loss = cclip.ckc_loss(3 * e1, 2 * e2, e1, 5 * e2, torch.tensor(1.0))  # scale of the inputs is irrelevant
    assert loss.item() == pytest.approx(2 * math.log(1 + math.exp(-1)), abs=1e-6)
    mean = cclip.ckc_loss(3 * e1, 2 * e2, e1, 5 * e2, torch.tensor(1.0), directions="mean")
    assert mean.item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    with pytest.raises(ValueError):
        cclip.ckc_loss(e1, e2, e1, e2, 1.0, directions="half")


def _ckc_printed_loop(p_img, p_txt, z_img, z_txt, s):
    """L_CKC written from the printed formula, one i at a time:
    -1/(2N) sum_{i=1}^{2N} [log a_i + log b_i], a_i = exp(s p_i.z_i) / sum_j exp(s p_i.z_j),
    b_i = exp(s z_i.p_i) / sum_j exp(s z_i.p_j), p and z the normalised stacks."""
    p = [x / x.norm() for x in torch.cat([p_img, p_txt])]
    z = [x / x.norm() for x in torch.cat([z_img, z_txt])]
    n2, total = len(p), 0.0
    for i in range(n2):
        a_i = math.exp(s * float(p[i] @ z[i])) / sum(math.exp(s * float(p[i] @ z[j])) for j in range(n2))
        b_i = math.exp(s * float(z[i] @ p[i])) / sum(math.exp(s * float(z[i] @ p[j])) for j in range(n2))
        total += -(math.log(a_i) + math.log(b_i)) / n2
    return total


def test_ckc_loss_matches_the_printed_formula_per_sample():
    g = torch.Generator().manual_seed(0)
    N, D, s = 5, 7, 12.0
    p_img, p_txt, z_img, z_txt = (torch.randn(N, D, generator=g).double() * 3 for _ in range(4))
    expected = _ckc_printed_loop(p_img, p_txt, z_img, z_txt, s)
    got = cclip.ckc_loss(p_img, p_txt, z_img, z_txt, torch.tensor(s))
    assert got.item() == pytest.approx(expected, rel=1e-5)
    got_mean = cclip.ckc_loss(p_img, p_txt, z_img, z_txt, torch.tensor(s), directions="mean")
    assert got_mean.item() == pytest.approx(0.5 * expected, rel=1e-5)


def test_ckc_mean_option_is_clip_loss_on_the_stacks():
    """Rule 9: the research code's variant is CLIP's symmetric loss on (p, z)."""
    g = torch.Generator().manual_seed(1)
    p_img, p_txt, z_img, z_txt = (torch.randn(4, 6, generator=g) for _ in range(4))
    p = F.normalize(torch.cat([p_img, p_txt]), dim=-1)
    z = F.normalize(torch.cat([z_img, z_txt]), dim=-1)
    ref = common.clip_loss(p, z, torch.tensor(7.0))
    torch.testing.assert_close(cclip.ckc_loss(p_img, p_txt, z_img, z_txt, torch.tensor(7.0), "mean"), ref)
    torch.testing.assert_close(cclip.ckc_loss(p_img, p_txt, z_img, z_txt, torch.tensor(7.0)), 2 * ref)


# ----------------------------------------------------------------------------- the training step
def _cclip_net(model, hidden=32):
    teacher = cclip.copy.deepcopy(model)
    common.add_lora(model)
    return cclip.CClip(model, teacher, cclip.projector(model.visual.output_dim, hidden))


def test_without_ckc_the_step_is_plain_clip(tiny):
    model, tok = tiny
    batch = _batch(tok)
    plain = lab.ClipFineTune(model)(batch)
    losses = cclip.CClip(model)(batch)  # no projector: the full fine-tuning / LoRA-only step
    assert list(losses) == ["loss_clip"]
    torch.testing.assert_close(losses["loss_clip"], plain["loss_clip"])
    net = _cclip_net(model)  # fresh adapters change nothing; CKC weighted 0
    net.ckc_weight = 0.0
    losses = net(batch)
    assert losses["loss_ckc"].item() == 0.0
    torch.testing.assert_close(losses["loss_clip"], plain["loss_clip"], atol=1e-5, rtol=0)


def test_ckc_directions_flag_reaches_the_step(tiny):
    model, tok = tiny
    batch = _batch(tok)
    net = _cclip_net(model).eval()
    summed = net(batch)["loss_ckc"]
    net.ckc_directions = "mean"
    torch.testing.assert_close(net(batch)["loss_ckc"], 0.5 * summed)
    assert parse_config(cclip.CClipConfig, []).ckc_directions == "sum"
    assert parse_config(cclip.CClipConfig, ["--ckc-directions", "mean"]).ckc_directions == "mean"


def test_lora_methods_freeze_logit_scale(tiny):
    """Deviation 8: add_lora freezes logit_scale with the backbone."""
    model, _ = tiny
    common.add_lora(model)
    assert not model.logit_scale.requires_grad


def test_only_adapters_and_projector_get_gradient(tiny):
    model, tok = tiny
    net = _cclip_net(model)
    with torch.no_grad():  # B = 0 would leave A's gradient zero
        for m in _adapters(model).values():
            m.B.normal_(std=0.01)
    net.train()
    assert not net.teacher.training and net.projector.training
    losses = net(_batch(tok))
    assert set(losses) == {"loss_clip", "loss_ckc"} and losses["loss_ckc"] > 0
    sum(losses.values()).backward()
    for name, p in net.named_parameters():
        trains = name.startswith("projector.") or name.endswith((".A", ".B"))
        if trains:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name  # frozen backbone and the old model
    assert all(p.grad is None and not p.requires_grad for p in net.teacher.parameters())


def test_bf16_autocast_step_is_finite(tiny):
    model, tok = tiny
    net = _cclip_net(model).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = net(_batch(tok))
    loss = sum(v.float() for v in losses.values())
    assert torch.isfinite(loss) and all(v.dtype == torch.float32 for v in losses.values())
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


def test_ckc_pulls_the_new_embeddings_toward_the_old_ones(tiny):
    """The mechanism: a few steps of L_CKC alone on a drifted model lower it
    and bring the new embeddings' similarity structure back toward the old
    model's."""
    model, tok = tiny
    batch = _batch(tok, n=6)
    net = _cclip_net(model)
    with torch.no_grad():
        for m in _adapters(model).values():
            m.B.normal_(std=0.05)  # the new model has drifted away from the old one
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=3e-3)
    net.train()
    first = None
    for _ in range(30):
        loss = net(batch)["loss_ckc"]
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first


def test_lr_of_splits_the_encoders_and_the_paper_preset():
    cfg = parse_config(cclip.CClipConfig, ["--lr", "1e-5", "--lr-image", "2e-6", "--lr-text", "3e-5"])
    assert cclip_tasks.task_lrs(cfg, "COCO") == (5e-7, 4e-5)  # Sec. 5.2.3 preset
    assert cclip_tasks.task_lrs(cfg, "mine") == (2e-6, 3e-5)
    lr_of = cclip.make_lr_of(cfg, *cclip_tasks.task_lrs(cfg, "flickr30k"))
    assert lr_of("model.visual.transformer.resblocks.0.attn.parametrizations.in_proj_weight.0.A") == 8.6e-6
    assert lr_of("model.transformer.resblocks.0.mlp.c_fc.parametrizations.weight.0.B") == 1.3e-4
    assert lr_of("model.token_embedding.weight") == 1.3e-4
    assert lr_of("projector.0.weight") == 1e-5 and lr_of("model.logit_scale") == 1e-5


# ----------------------------------------------------------------------------- the continual driver
def _tasks(root, n=16):
    parts = []
    for d in ("photo", "night"):
        tr = lab.synthetic_manifest(f"task-{d}", root, n=n)
        te = lab.synthetic_manifest(f"task-{d}-test", root, n=n)
        parts.append(f"{d}={tr}:{te}")
    return ",".join(parts)


def _argv(root, out, *extra):
    return ["--backbone", "tiny", "--pretrained", "random", "--tasks", _tasks(root), "--unseen", "",
            "--zero-shot", "", "--steps", "3", "--batch-size", "8", "--workers", "0", "--device", "cpu",
            "--precision", "fp32", "--lr", "1e-3", "--lr-image", "1e-3", "--lr-text", "1e-3",
            "--proj-hidden", "32", "--save-every", "0", "--log-every", "1", "--data-root", str(root),
            "--out", str(out), *extra]


def _final(out):
    rec = json.loads((out / "continual.json").read_text())
    return rec["rows"], torch.load(out / "model.pt", weights_only=True)


@pytest.mark.parametrize("stop", [["--stop-after-tasks", "1"], ["--stop-at", "2"]], ids=["boundary", "mid-task"])
def test_resume_equals_an_uninterrupted_run(tmp_path, stop):
    root = tmp_path / "data"
    cclip.main(_argv(root, tmp_path / "a"))
    assert "interrupted" in cclip.main(_argv(root, tmp_path / "b", *stop))
    assert not (tmp_path / "b" / "model.pt").exists()
    cclip.main(_argv(root, tmp_path / "b", "--resume", "latest"))
    rows_a, sd_a = _final(tmp_path / "a")
    rows_b, sd_b = _final(tmp_path / "b")
    assert len(rows_a) == 3 and rows_a == rows_b
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        torch.testing.assert_close(sd_a[k], sd_b[k], atol=1e-6, rtol=0, msg=k)


def test_main_end_to_end(tmp_path, model_files_as_readme_says, results_files_are_strict_json, capsys):
    """Pretrained tiny backbone, two small synthetic tasks, unseen retrieval
    and zero-shot classification; results, matrices and per-task models."""
    root, out = tmp_path / "data", tmp_path / "run"
    unseen = lab.synthetic_manifest("unseen", root, n=32)
    argv = _argv(root, out, "--unseen", str(unseen), "--zero-shot", "synthetic-shape")
    argv[argv.index("--pretrained") + 1] = ""
    res = cclip.main(argv)
    s = res["summary"]
    R = s["matrices"]["R@1"]
    assert len(R) == 3 and len(R[0]) == 2 and all(0 <= v <= 100 for r in R for v in r)
    assert set(s["metrics"]["R@1"]) == {"last", "avg", "bwt", "forgetting"}
    assert "synthetic-shape/top1" in s["pd"] and f"{unseen}/i2t_R@1" in s["scalars"][-1]
    saved = results_files_are_strict_json(out, "cclip")  # issue 42.3: one schema, strict JSON
    assert saved["continual"]["matrices"]["R@1"] == R and saved["continual"]["tasks"] == ["photo", "night"]
    assert {r["stage"] for r in saved["records"]} == {"base", "task 1", "task 2"}
    shown = capsys.readouterr().out  # the user's numbers first: both ends, every recall, zero-shot top-1
    assert shown.index("Your tasks") < shown.index("R[i][j], R@1") and "| task 2 | night |" in shown
    assert "| i2t_R@10 |" in shown and "| task 2 | synthetic-shape |" in shown
    for i, d in enumerate(("photo", "night"), 1):
        sd = torch.load(out / f"task{i}-{d}" / "model.pt", weights_only=True)
        assert not any("parametrizations" in k for k in sd)
        # issue 42.5: one weight format per task folder by default (--task-safetensors: both)
        assert {p.name for p in (out / f"task{i}-{d}").glob("model*")} == {"model.pt", "model.pt.json"}
    assert not list(out.glob("boundary.safetensors*"))  # the boundary is resume state: one copy
    row = res["rows"][0]
    assert row["method"] == "cclip" and math.isfinite(row["last R@1"])
    model_files_as_readme_says("cclip", out)


def test_task_folders_keep_one_weight_format_unless_asked(tmp_path):
    """Issue 42.5: a task folder and the boundary keep model.pt only (each a full model: 2 copies per task were
    ~12 GB for 8 ViT-B/16 tasks); --task-safetensors adds the twins; the final model keeps both formats."""
    root = tmp_path / "data"
    sizes = {}
    for name, extra in (("one", ()), ("both", ("--task-safetensors",))):
        out = tmp_path / name
        cclip.main(_argv(root, out, *extra))
        folders = sorted(out.glob("task[0-9]*-*"))
        want = {"model.pt", "model.pt.json"} | ({"model.safetensors", "model.safetensors.json"} if extra else set())
        assert len(folders) == 2 and all({p.name for p in f.glob("model*")} == want for f in folders)
        assert {p.name for p in out.glob("model*")} >= {"model.pt", "model.safetensors"}
        sizes[name] = sum(p.stat().st_size for p in out.rglob("*") if p.suffix in (".pt", ".safetensors"))
    model = (tmp_path / "one" / "model.pt").stat().st_size
    # 2 task twins fewer: at least 1.5 model copies saved (the checkpoints' optimizer state is deleted anyway)
    assert sizes["both"] - sizes["one"] > 1.5 * model


@pytest.mark.slow
def test_demo_writes_claims_results_and_figure(tmp_path, shrink_world, check_demo_results):
    """The demo's plumbing on a shrunken world (2 steps per task): every seed
    of every method is kept, the claims carry the agreed keys, the PNG exists."""
    shrink_world(lambda k: 16 if k.startswith("task-") or k == "train" else 8 if k in ("unseen", "zs-test") else None)
    out = tmp_path / "demo"
    cclip.main(["--demo", "--seeds", "0,1", "--processes", "1", "--steps", "2", "--batch-size", "8", "--eval-n", "8",
                "--proj-hidden", "32",
                "--data-root", str(tmp_path / "data"), "--out", str(out)])
    saved = check_demo_results(out, "cclip-demo.png", cclip_demo.ALL_NAMES.values(), min_claims=18)
    for name in cclip_demo.ALL_NAMES.values():  # issue 60: ZSCL, LwF and EWC beside the ablation
        assert all(len(r["R"]) == 5 and len(r["R"][0]) == 4 for r in saved["per_seed"][name])


def test_real_runs_evaluate_no_synthetic_set_by_default(tmp_path):
    """With the lab loaded (its synthetic-* sets are in eval's registry), a
    real task sequence (--tasks vlcl or a manifest list) still evaluates only
    the paper's sets (deviation 9) or nothing by default; the synthetic
    sequences get the lab's sets."""
    a = tmp_path / "a.jsonl"
    a.write_text("")
    assert any(z.startswith("synthetic-") for z in cclip.evaluation.CLASSIFICATION_TASKS)
    vlcl = parse_config(cclip.CClipConfig, ["--tasks", "vlcl", "--data-root", str(tmp_path)])
    assert cclip_tasks.resolve_eval_sets(vlcl) == (str(tmp_path / "vlcl" / "havg" / "test.jsonl"),
                                                   ["imagenet", "cifar100"])
    mine = parse_config(cclip.CClipConfig, ["--tasks", f"a={a}"])
    assert cclip_tasks.resolve_eval_sets(mine) == (None, [])
    unseen, zero_shot = cclip_tasks.resolve_eval_sets(parse_config(cclip.CClipConfig, ["--tasks", "synthetic"]))
    assert unseen == "synthetic-unseen" and zero_shot and all(z.startswith("synthetic-") for z in zero_shot)


def test_synthetic_long_tasks_come_from_the_lab(tmp_path, shrink_world):
    """--tasks synthetic-long: the lab's four domains, captions replaced by their long captions."""
    shrink_world(lambda k: 8 if k.startswith("task-") else None)
    cfg = parse_config(cclip.CClipConfig, ["--tasks", "synthetic-long", "--data-root", str(tmp_path)])
    short = common.parse_tasks("synthetic", str(tmp_path), lab.WORLD)
    tasks = cclip_tasks.resolve_tasks(cfg, lab.WORLD)
    assert [t.name for t in tasks] == [t.name for t in short]
    for t, s in zip(tasks, short):
        long_rows, rows = read_manifest(t.train), read_manifest(s.train)
        assert [r["caption"] for r in long_rows] == [r["long_caption"] for r in rows]
        assert Path(t.test).name == Path(s.test).stem + "-long-as-caption.jsonl"


def test_override_resume_is_recorded_in_config_json(tmp_path):
    """cclip.run no longer rewrites config.json: the preflight's record of an
    --override-resume change survives the resumed run."""
    root, out = tmp_path / "data", tmp_path / "b"
    cclip.main(_argv(root, out, "--stop-after-tasks", "1"))
    cclip.main(_argv(root, out, "--resume", "latest", "--lr-text", "5e-4", "--override-resume"))
    saved = json.loads((out / "config.json").read_text())
    assert saved["lr_text"] == 5e-4
    assert saved["resume_overrides"] == [{"field": "lr_text", "was": 1e-3, "now": 5e-4}]


# ----------------------------------------------------------------------------- the research code's switches (issue 25)
def test_research_merge_schedule_is_a_mix_of_the_full_merge(tmp_path):
    """--merge-schedule research (deviation 1): LoRA merged at full strength, then a_mix.sh's 1:1 with the
    previous task's weights after task 2; so task 2 = (task 1 + the full merge of task 2) / 2, against a run that
    only merges at alpha 1 (same seed, same data: the same adapters)."""
    root = tmp_path / "data"
    cclip.main(_argv(root, tmp_path / "mix", "--method", "lora", "--merge-schedule", "research"))
    cclip.main(_argv(root, tmp_path / "full", "--method", "lora", "--merge-alpha", "1"))
    load = lambda run, k: torch.load(tmp_path / run / k / "model.pt", weights_only=True)  # noqa: E731
    one, full2, mix2 = load("mix", "task1-photo"), load("full", "task2-night"), load("mix", "task2-night")
    assert all(torch.equal(one[k], load("full", "task1-photo")[k]) for k in one)  # no mix after task 1
    moved = [k for k in one if not torch.equal(one[k], full2[k])]
    assert moved
    for k in one:
        torch.testing.assert_close(mix2[k], 0.5 * one[k] + 0.5 * full2[k], atol=1e-6, rtol=0, msg=k)


def test_interpolate_weights_new_by_its_share(tiny):
    """The research schedule's mixing is protocols.wise_ft.interpolate_weights (WiSE-FT's), new share 1/3 =
    2:1 old:new."""
    model = copy.deepcopy(tiny[0])
    old = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    now = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(wise_ft.interpolate_weights(old, model.state_dict(), 1 / 3))  # 2:1 old:new
    assert all(torch.allclose(model.state_dict()[k], now[k] / 3) for k in now if now[k].is_floating_point())


def test_research_schedule_is_pl_bolts_per_epoch_closed_form(monkeypatch, tmp_path):
    """--schedule research (deviation 13): per epoch, 1 % start and floor of the IMAGE lr for every group
    (pl_bolts takes one absolute warmup_start_lr / eta_min); hand values: W = 2 warm-up epochs of E = 5."""
    groups = [{"lr": 1.0}, {"lr": 10.0}]
    img, txt = cclip_tasks.epoch_warmup_cosine(2, 2, 5, 0.01, 0.01)(SimpleNamespace(param_groups=groups), 2, 10)
    assert [round(img(s), 6) for s in range(0, 10, 2)] == [0.01, 1.0, 1.0, 0.7525, 0.2575]
    assert txt(0) == pytest.approx(0.001) and txt(2) == 1.0 and txt(8) == pytest.approx((0.01 + 9.99 * 0.25) / 10)
    seen = []
    monkeypatch.setattr(common, "train", lambda *a, **k: seen.append(k["schedule"]) or {"stopped_at": 0})
    cclip.main(_argv(tmp_path / "data", tmp_path / "a", "--schedule", "research"))
    cclip.main(_argv(tmp_path / "data", tmp_path / "b"))
    assert callable(seen[0]) and seen[1] is None
    cfg = parse_config(cclip.CClipConfig, ["--schedule", "research", "--projector-lr", "image"])
    assert cclip.make_lr_of(cfg, 2e-6, 3e-5)("projector.0.weight") == 2e-6
    assert cclip.make_lr_of(dataclasses.replace(cfg, projector_lr="lr"), 2e-6, 3e-5)("projector.0.weight") == cfg.lr


def test_research_schedule_starts_task_5_from_the_average_of_the_tasks_own_results(tmp_path, monkeypatch):
    """--merge-schedule research from task 5 on (deviation 1; clip-lightning's aaaa_train_bs1024_simpson.sh lists
    four per-task checkpoints, its model file averages them): task 5 starts from, and distils from, the uniform
    average of tasks 1-4's own results (own.pt, the model right after each task's training), not from a_mix's
    chain (task 4's model.pt); after task 5 no a_mix either. --merge-schedule a_mix keeps the chain."""
    root = tmp_path / "data"
    domains = ("photo", "night", "pattern", "sketch", "photo")
    spec = ",".join(f"t{k + 1}={lab.synthetic_manifest(f'task-{d}', root, n=16)}:"
                    f"{lab.synthetic_manifest(f'task-{d}-test', root, n=16)}" for k, d in enumerate(domains))
    starts, real = {}, common.train

    def spy(task_cfg, net, *args, **kw):
        starts[Path(task_cfg.out).name] = ({k: v.clone() for k, v in net.model.state_dict().items()},
                                           {k: v.clone() for k, v in net.teacher.state_dict().items()})
        return real(task_cfg, net, *args, **kw)

    monkeypatch.setattr(common, "train", spy)

    def run(name, schedule):
        argv = _argv(root, tmp_path / name, "--method", "ckc", "--merge-schedule", schedule)
        cclip.main([*argv[:5], spec, *argv[6:]])  # five tasks in place of _argv's two
        return tmp_path / name

    out = run("avg", "research")
    own = [torch.load(out / f"task{k}-t{k}" / "own.pt", weights_only=True) for k in range(1, 5)]
    average = {k: sum(o[k] for o in own) / 4 for k in own[0]}
    start, teacher = starts["task5-t5"]
    for k in average:
        torch.testing.assert_close(start[k], average[k], atol=1e-6, rtol=0, msg=k)
        torch.testing.assert_close(teacher[k], average[k], atol=1e-6, rtol=0, msg=k)
    chain = torch.load(out / "task4-t4" / "model.pt", weights_only=True)
    assert any(not torch.allclose(chain[k], average[k]) for k in average)  # the chain is something else
    final, own5 = (torch.load(out / "task5-t5" / f, weights_only=True) for f in ("model.pt", "own.pt"))
    assert all(torch.equal(final[k], own5[k]) for k in final)  # no a_mix after the average's task
    out = run("chain", "a_mix")
    chained = torch.load(out / "task4-t4" / "model.pt", weights_only=True)
    assert all(torch.equal(starts["task5-t5"][0][k], chained[k]) for k in chained)
    assert not (out / "task1-t1" / "own.pt").exists()


def test_research_train_transform_leaves_the_fractional_tasks_unaugmented():
    """--train-transform research (deviation 15): the research code's data module sets the shared dataset's
    transform to the evaluation one, so the tasks it splits by a fraction (commands.vlcl's research sources) train
    unaugmented; the others, and every task by default, with the training transform."""
    from commands import vlcl
    fractional = {name for name, hf in vlcl.RESEARCH.items() if getattr(hf, "fraction", 0)}
    assert fractional == set(cclip_tasks.FRACTIONAL_TASKS)
    research = parse_config(cclip.CClipConfig, ["--train-transform", "research"])
    ours = parse_config(cclip.CClipConfig, [])
    for name in cclip_tasks.PAPER_TASKS:
        assert cclip_tasks.train_transform(ours, name, "train", "eval") == "train"
        assert cclip_tasks.train_transform(research, name, "train", "eval") == (
            "eval" if name in fractional else "train")
