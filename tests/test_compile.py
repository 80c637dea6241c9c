"""Issue 59.3: --torchcompile (open_clip's) for every method's step: the towers compiled in place
(plumbing.models.compile_towers), a compiled step equal to the eager one within float tolerance, and the loop around
it unchanged: resume gives the uninterrupted run, the non-finite guard stops the run, checkpoints keep open_clip's
names. All on the aot_eager backend: the same graph capture (dynamo), functionalisation and compiled autograd as
inductor, without its C++ build, which costs about 170 CPU-seconds on every machine whose inductor cache is empty
(issue 68.4). Inductor's own numerics are checked where it runs anyway: benchmarks/bench.py's compile section
(compiled_vs_eager, CPU) and benchmarks/gpu_check.py on CUDA."""
import copy
from types import SimpleNamespace

import pytest
import torch

import common
from plumbing.flags import Config
import erclip
import lab
from plumbing import models
from test_resume import _NanAtStep3, _cfg, _data, _tiny  # the loop's own resume / NaN fixtures


def _batch(tok, n=8):
    return {"image": torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
            "text": tok([f"a photo of a {c} {s}." for c, s in zip(lab.COLORS, lab.SHAPES * 2)][:n])}


@pytest.fixture
def graph_only(monkeypatch):
    """The compile backend set to aot_eager, counting the graphs dynamo hands it (a run that silently fell back to
    eager would count none)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(models, "COMPILE_BACKEND", counter)
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


def test_a_compiled_step_equals_the_eager_one(tiny_random, graph_only):
    """The loss and every gradient of one train_step, eager vs compiled towers (aot_eager), the same weights."""
    model, _, _, tok = tiny_random
    batch, got = _batch(tok), {}
    for mode in ("eager", "compiled"):
        net = lab.ClipFineTune(copy.deepcopy(model))
        if mode == "compiled":
            assert models.compile_towers(net.model) == ["visual", "transformer"]
        opt = common.make_optimizer(Config(lr=1e-3), net, "cpu")
        ctx = SimpleNamespace(device=torch.device("cpu"), precision="fp32")
        _, loss, _ = common.train_step(net, batch, ctx, opt, torch.amp.GradScaler("cpu", enabled=False))
        got[mode] = (loss.item(), {n: p.grad.clone() for n, p in net.named_parameters()})
        assert all("_orig_mod" not in k for k in net.state_dict())  # in place: open_clip's names
    assert abs(got["eager"][0] - got["compiled"][0]) < 1e-5 * abs(got["eager"][0])
    for name, g in got["eager"][1].items():
        assert torch.allclose(got["compiled"][1][name], g, rtol=1e-3, atol=1e-6), name
    assert graph_only.frame_count >= 2  # both towers ran as captured graphs


def test_a_compiled_run_resumes_to_the_uninterrupted_one(tmp_path, graph_only):
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    argv = ["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16", "--batch-size", "8",
            "--steps", "3", "--warmup", "0", "--lr", "1e-3", "--workers", "0", "--device", "cpu", "--eval-tasks",
            "none", "--save-every", "0", "--torchcompile"]
    erclip.main([*argv, "--out", str(tmp_path / "whole")])
    erclip.main([*argv, "--out", str(tmp_path / "parts"), "--stop-at", "1"])
    erclip.main([*argv, "--out", str(tmp_path / "parts"), "--resume", "latest"])
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "parts" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert "_orig_mod" not in " ".join(a)


def test_the_non_finite_guard_stops_a_compiled_run(tmp_path, graph_only):
    _, train_tf, tok = _tiny()
    cfg = _cfg(tmp_path, steps=10, log_every=5, save_every=3, torchcompile=True)
    with pytest.raises(FloatingPointError, match=r"non-finite loss at step 4: .*loss_bad"):
        common.train(cfg, _NanAtStep3(_tiny()[0]), _data(tmp_path, train_tf), common.Collate(tok))
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"] == 3
