"""fp16 autocast with a GradScaler, the CUDA user's path, exercised on CPU
(torch runs fp16 autocast and GradScaler("cpu") there, slowly): every
method's fp16 steps against fp32, a forced overflow skipped bitwise inside
train_step and inside common.train with checkpoint and resume, DNS's
projection on unscaled gradients, the non-finite guard, and the GPU check
script's CPU-runnable parts (it shares Stepper, check_method, overflow_check
and resume_check with these tests)."""
import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

import common  # noqa: E402
import dns  # noqa: E402
from lab.demos import dns as dns_demo  # noqa: E402


def _dns_case(mode="gradient", n=16, dim=32):
    """DNS on the low-rank features of dns.low_rank_tasks: task 1 is old, a
    batch of task 2 trains (milliseconds per step, so fp16 on CPU is cheap)."""
    (img1, txt1), (img2, txt2) = dns_demo.low_rank_tasks(dim=dim, n=64)
    net = dns.DNSNet(dim, math.log(1 / 0.07))
    Z_img, _ = dns.update_covariance(torch.zeros(dim, dim, dtype=torch.float64), 0, img1)
    Z_txt, _ = dns.update_covariance(torch.zeros(dim, dim, dtype=torch.float64), 0, txt1)
    hooks = dns.NullSpaceProjection(mode, dns.build_projectors(net.model, Z_img, Z_txt, 0.01))
    return gpu_check.Case(f"dns-{mode}", net, {"img": img2[:n], "txt": txt2[:n]}, hooks)


# ----------------------------------------------------------------------------- every method, fp16 vs fp32
@pytest.mark.parametrize("method", gpu_check.METHODS)
def test_fp16_steps_of_each_method_are_finite_and_close_to_fp32(tiny_random, method):
    """Two steps from the same weights; C-CLIP's LoRA parametrizations and
    ERCLIP's teacher run under fp16 autocast. A step the scaler skips is
    compared with the fp32 model after as many applied updates."""
    model, _, _, tok = tiny_random
    r = gpu_check.check_method(method, model, tok, "cpu", batch_size=4, steps=2, precision="fp16", tol=2e-2,
                               sentences=2)
    assert r["ok"], r["problems"]
    assert all(math.isfinite(v) for v in r["losses"]) and r["max_rel_diff"] < 2e-2


@pytest.mark.parametrize("method", gpu_check.METHODS)
def test_fp16_accumulated_steps_follow_one_fp32_batch(tiny_random, method):
    """--accum-freq 2 under fp16 autocast and grad scaling (the scaled feature gradients of the loss pass carry
    the scale into the towers' backward): the losses of one fp32 batch, step after step."""
    model, _, _, tok = tiny_random
    r = gpu_check.check_method(method, model, tok, "cpu", batch_size=4, steps=2, precision="fp16", tol=2e-2,
                               sentences=2, accum=2)
    assert r["ok"], r["problems"]
    assert "--accum-freq 2" in r["check"]


def test_bf16_steps_close_to_fp32_without_a_scaler(tiny_random):
    model, _, _, tok = tiny_random
    r = gpu_check.check_method("plain", model, tok, "cpu", batch_size=4, steps=2, precision="bf16", tol=5e-2)
    assert r["ok"], r["problems"]
    assert r["scale"] is None and r["skipped"] == [False, False]


# ----------------------------------------------------------------------------- overflow inside train_step
@pytest.mark.parametrize("fused,grad_clip", [(False, 0.0), (True, 1.0)])
def test_overflow_skips_exactly_that_step_bitwise_and_halves_the_scale(tiny_random, fused, grad_clip):
    """Unscaling inside scaler.step (no clipping, for-each AdamW) and before
    clipping (fused AdamW, which takes the inf flag itself, as on CUDA)."""
    model, _, _, tok = tiny_random
    case = gpu_check.build("plain", copy.deepcopy(model), tok, 4, "cpu")
    r = gpu_check.overflow_check(case, "cpu", grad_clip=grad_clip, fused=fused)
    assert r["ok"], r["problems"]
    assert r["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9]


@pytest.mark.parametrize("mode", ["gradient", "update"])
def test_overflow_with_dns_projection_hooks_is_skipped_too(mode):
    r = gpu_check.overflow_check(_dns_case(mode), "cpu")
    assert r["ok"], r["problems"]


@pytest.mark.parametrize("broken", ["step", "update"])
def test_the_overflow_check_catches_a_broken_skip_or_scale_update(monkeypatch, broken):
    """The check has teeth: with the scaler's skip or its backoff disabled it
    reports failure (for-each AdamW, whose skip lives in the scaler; fused
    AdamW skips inside its kernel)."""
    if broken == "step":  # step even when an inf was found
        monkeypatch.setattr(torch.amp.GradScaler, "_maybe_opt_step", lambda self, opt, state, *a, **k: opt.step())
    else:  # never lower the scale
        monkeypatch.setattr(torch.amp.GradScaler, "update",
                            lambda self, new_scale=None: self._per_optimizer_states.clear())
    r = gpu_check.overflow_check(_dns_case(), "cpu", fused=False)
    assert not r["ok"]
    expected = ["changed", "non-finite"] if broken == "step" else ["not halved", "expected [False, True, False]"]
    assert all(any(e in p for p in r["problems"]) for e in expected), r["problems"]


def test_a_huge_loss_scale_skips_until_it_fits_then_trains():
    """The real overflow, no injection: scale 2^40 overflows the fp16
    backward; each skipped step leaves the weights alone and halves the scale;
    no step raises (a scaled overflow is not a non-finite loss)."""
    case = _dns_case()
    s = gpu_check.Stepper(case, "cpu", "fp16", init_scale=2.0 ** 40, lr=1e-3)
    start = s.snapshot()
    recs = [s.step() for _ in range(40)]
    skipped = [r["skipped"] for r in recs]
    n = skipped.index(False)
    assert n >= 5 and not any(skipped[n:])
    assert [r["scale"] for r in recs[:n]] == [2.0 ** (39 - i) for i in range(n)]
    assert all(math.isfinite(r["loss"]) for r in recs)
    s2 = gpu_check.Stepper(_dns_case(), "cpu", "fp16", init_scale=2.0 ** 40, lr=1e-3)
    for _ in range(n):
        s2.step()
    after_skips = s2.snapshot()  # n skipped steps: no weight moved; fused AdamW created its state, all zero
    assert not gpu_check.changed(start, {k: v for k, v in after_skips.items() if k.startswith("param")})
    assert all(not v.any() for k, v in after_skips.items() if k.startswith("adamw"))
    assert gpu_check.changed(start, s.snapshot())  # then it trained


def test_a_nan_loss_still_stops_under_fp16():
    case = _dns_case()

    def nan_forward(batch, ctx):
        return {"loss_clip": case.net(batch, ctx)["loss_clip"] * float("nan")}
    s = gpu_check.Stepper(case, "cpu", "fp16")
    ctx = SimpleNamespace(step=7, device=torch.device("cpu"), precision="fp16")
    with pytest.raises(FloatingPointError, match="non-finite loss at step 8"):
        common.train_step(case.net, case.batch, ctx, s.opt, s.scaler, forward=nan_forward)


# ----------------------------------------------------------------------------- DNS sees unscaled gradients
def test_dns_projection_sees_unscaled_gradients():
    """The hook gets the same gradients in fp16 (loss scale 2^12, low
    enough not to overflow) as in fp32, before and after projecting. (The
    weights after the step could not tell: AdamW's update hardly depends on
    the gradient's scale.)"""
    seen = {"fp32": {}, "fp16": {}}

    class Recording(dns.NullSpaceProjection):
        def before_optimizer_step(self, net):
            seen[prec]["before"] = net.model.W_img.grad.clone()
            super().before_optimizer_step(net)
            seen[prec]["after"] = net.model.W_img.grad.clone()

    for prec in ("fp32", "fp16"):
        case = _dns_case()
        case.hooks = Recording("gradient", case.hooks.projectors)
        s = gpu_check.Stepper(case, "cpu", prec, init_scale=2.0 ** 12)
        assert not s.step()["skipped"]
    assert s.scaler.get_scale() == 2.0 ** 12
    for k in ("before", "after"):
        ref = seen["fp32"][k]
        assert torch.allclose(seen["fp16"][k], ref, rtol=2e-2, atol=2e-3 * ref.abs().max()), k
    assert not torch.allclose(seen["fp32"]["before"], seen["fp32"]["after"])  # the projection did something


def test_dns_update_mode_keeps_old_scores_under_fp16(tmp_path):
    """The stability guarantee through common.train in fp16 (two tasks):
    task 1's scores move as little as in fp32, and task 2 is learned."""
    res = {p: dns_demo.guarantee_check("update", tmp_path / p, precision=p) for p in ("fp32", "fp16")}
    assert res["fp16"]["drift"] <= max(1e-4, 2 * res["fp32"]["drift"]), res
    assert res["fp16"]["task2 loss after"] < res["fp16"]["task2 loss before"]


# ----------------------------------------------------------------------------- inside common.train
def test_overflow_in_the_loop_is_skipped_logged_checkpointed_and_resumes_identically(tmp_path):
    """common.train (tiny backbone, fp16) with an inf gradient injected at
    step 1 of 3: the checkpoints before and after it are bitwise equal except
    for the halved scale and the schedule (which counts the iteration, as
    open_clip_train's); stopped before and after it and resumed, the run ends
    with the straight run's weights, and the resumed run logs the restored
    scale."""
    r = gpu_check.resume_check("tiny", "cpu", "fp16", tmp_path, batch_size=4, steps=3, overflow_at=1)
    assert r["ok"], r["problems"]
    assert r["grad_scales"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15] and r["skipped_steps"] == 1
    assert r["max_weight_diff"] == 0.0
    fp32 = common.warmup_cosine(1, 3)
    assert r["lr"] == pytest.approx([1e-5 * fp32(s) for s in (1, 2, 3)])  # the schedule of a run without skips
    lines = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [rec["skipped_steps"] for rec in lines] == [0, 1, 1] and "loss_overflow" in lines[1]


def test_an_fp32_checkpoint_continues_in_fp16_at_the_default_scale(tmp_path, capsys):
    """A CPU fp32 run resumed where fp16 is on (as on a GPU with --precision
    auto): its checkpoint has no scaler state, so the scale starts afresh."""
    img, txt = dns_demo.low_rank_tasks(n=64)[0]
    cfg = dns.DNSConfig(device="cpu", precision="fp32", batch_size=16, steps=4, lr=1e-3, log_every=1,
                        out=str(tmp_path), stop_at=2)
    common.train(cfg, dns.DNSNet(32, math.log(1 / 0.07)), dns.feature_pairs(img, txt), common.Collate(None),
                 export=False)
    s = common.train(dns.dataclasses.replace(cfg, precision="fp16", stop_at=0, resume="latest"),
                     dns.DNSNet(32, math.log(1 / 0.07)), dns.feature_pairs(img, txt), common.Collate(None),
                     export=False)
    assert "has no grad-scaler state" in capsys.readouterr().err
    assert s["steps"] == 4 and s["precision"] == "fp16" and s["grad_scale"] in (2.0 ** 16, 2.0 ** 15)
    assert all(math.isfinite(v) for v in s["final_losses"].values())


# ----------------------------------------------------------------------------- benchmarks/gpu_check.py
@pytest.mark.slow
def test_gpu_check_without_cuda_says_so_in_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "needs CUDA" in p.stderr


def test_gpu_check_main_runs_on_cpu_and_writes_json_and_table(tmp_path, monkeypatch, capsys):
    """The script's orchestration on CPU with the tiny backbone and the
    cheapest method; resume_check (tested above) is stubbed to save time."""
    calls = []
    monkeypatch.setattr(gpu_check, "resume_check", lambda *a, **k: calls.append(a) or {"check": "resume", "ok": True})
    out = tmp_path / "g.json"
    rc = gpu_check.main(["--device", "cpu", "--backbone", "tiny", "--methods", "dns-gradient", "--batch-size", "8",
                         "--steps", "2", "--skip-bench", "--throughput-steps", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    checks = {r["check"]: r for r in res["results"]}
    assert rc == 0, [r for r in res["results"] if r["ok"] is False]
    assert checks["dns-gradient step (fp16 vs fp32)"]["ok"]
    assert sum(c.startswith("overflow skip (dns-gradient") for c in checks) == 2
    assert checks["2-process NCCL DDP"]["ok"] is None and calls and calls[0][2] == "fp16"
    rows = checks["dns-gradient throughput"]["rows"]  # section 5: one bf16 row on CPU (fp16 beside it on CUDA)
    assert [(r["variant"], r["precision"], r["steps"]) for r in rows] == [("step", "bf16", 2)]
    assert rows[0]["pairs_per_s"] > 0 and rows[0]["gflop_per_pair"] > 0 and rows[0]["mfu"] > 0
    assert checks["bf16 matmul rate"]["measured_tflops"] > 0 and checks["bf16 matmul rate"]["peak_tflops"] is None
    table = capsys.readouterr().out
    assert "| check | ok |" in table and "dns-gradient step" in table and "| method | variant | batch |" in table


@pytest.mark.slow
def test_gpu_check_runs_the_benchmark_as_a_subprocess(tmp_path):
    r = gpu_check.bench_quick(tmp_path / "b.json", timeout=120, extra=("--only", "none"))
    assert r["ok"], r["problems"]
    assert r["records"] == [] and "| measurement |" in r["table"]


@pytest.mark.slow
def test_gpu_check_ddp_step_with_gloo_on_cpu():
    """The same worker as the 2-GPU NCCL check, on two CPU processes."""
    r = gpu_check.ddp_check("tiny", "cpu", "fp32", batch_size=4)
    assert r["ok"], r["problems"]
    assert r["world_size"] == 2 and r["rank_weight_diff"] == 0.0


def test_gpu_check_reports_a_benchmark_timeout(tmp_path):
    r = gpu_check.bench_quick(tmp_path / "b.json", timeout=3, extra=("--quick", "--only", "retrieval"))
    assert not r["ok"] and "timed out" in r["problems"][0]
