"""Tests of dns.py's projection forms: dense, factored and from the batch
(activations, projected_linear) all compute project_gradient; the operation
counts that choose between them; NullSpaceProjection's form argument."""
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import dns
from lab.demos import dns as dns_demo


def _basis(dim, rank, g):
    """An orthonormal (dim, rank) basis and its projector, float64."""
    U = torch.linalg.qr(torch.randn(dim, rank, generator=g, dtype=torch.float64))[0][:, :rank]
    return U, U @ U.t()


# shapes (D_out, D_in, k_out, k_in, B): rectangular maps, empty and full subspaces, B below and above the ranks
CASES = [(12, 9, 3, 5, 4), (12, 9, 0, 4, 7), (10, 10, 10, 10, 3), (16, 8, 6, 2, 40), (8, 8, 5, 0, 1)]


@pytest.mark.parametrize("d_out,d_in,k_out,k_in,b", CASES)
def test_every_form_equals_project_gradient(d_out, d_in, k_out, k_in, b):
    g = torch.Generator().manual_seed(d_out * 100 + k_out * 10 + b)
    U_out, P_out = _basis(d_out, k_out, g)
    U_in, P_in = _basis(d_in, k_in, g)
    delta = torch.randn(b, d_out, generator=g, dtype=torch.float64)  # dL/d(mapped), (B, D_out)
    X = torch.randn(b, d_in, generator=g, dtype=torch.float64)  # the map's input, (B, D_in)
    G = delta.t() @ X  # the gradient of mapped = X W^T
    ref = dns.project_gradient(G, P_out, P_in)
    assert torch.allclose(dns.project_gradient_factored(G, U_out, U_in), ref, atol=1e-10, rtol=0)
    for order in ("basis", "batch", "auto"):
        got = dns.project_gradient_activations(delta, X, U_out, U_in, order=order)
        assert torch.allclose(got, ref, atol=1e-10, rtol=0), order
    if k_out and k_in:  # the projection did something
        assert not torch.allclose(ref, G, atol=1e-3)
    with pytest.raises(ValueError):
        dns.project_gradient_activations(delta, X, U_out, U_in, order="nope")


@pytest.mark.parametrize("d_out,d_in,k_out,k_in,b", CASES + [(64, 48, 20, 30, 16)])
def test_projection_flops_match_the_flop_counter(d_out, d_in, k_out, k_in, b):
    """The chooser's operation counts are those torch.utils.flop_counter
    counts on the shipped functions (the activation form: beyond delta^T X)."""
    g = torch.Generator().manual_seed(0)
    U_out, P_out = _basis(d_out, k_out, g)
    U_in, P_in = _basis(d_in, k_in, g)
    delta, X = torch.randn(b, d_out, dtype=torch.float64), torch.randn(b, d_in, dtype=torch.float64)
    G = delta.t() @ X

    def counted(fn):
        with FlopCounterMode(display=False) as fc:
            fn()
        return fc.get_total_flops()
    assert counted(lambda: dns.project_gradient(G, P_out, P_in)) == dns.projection_flops("dense", d_out, d_in,
                                                                                          k_out, k_in)
    assert counted(lambda: dns.project_gradient_factored(G, U_out, U_in)) == dns.projection_flops(
        "factored", d_out, d_in, k_out, k_in)
    plain = 2 * b * d_out * d_in
    for order in ("basis", "batch"):
        n = counted(lambda: dns.project_gradient_activations(delta, X, U_out, U_in, order=order))
        assert n - plain == dns._activation_flops(order, b, d_out, d_in, k_out, k_in), order
    n = counted(lambda: dns.project_gradient_activations(delta, X, U_out, U_in))
    assert n - plain == dns.projection_flops("activations", d_out, d_in, k_out, k_in, b)


def test_the_chooser_picks_by_size():
    # by hand, d = 512: dense 4 d^3 = 5.4e8; factored at k = d/4 on both sides 2 d^2 (2k) + 4 d k^2 = 1.7e8;
    # from a batch of 64: 2 B d^2 + 4 B d (2k) = 6.7e7 (batch order)
    assert dns.cheapest_projection_form(512, 512, 128, 128) == "factored"
    assert dns.cheapest_projection_form(512, 512, 128, 128, batch=64) == "activations"
    assert dns.projection_flops("activations", 512, 512, 128, 128, 64) == 2 * 64 * 512 ** 2 + 4 * 64 * 512 * 256
    # everything old (k = d): factored costs 8 d^3, dense 4 d^3
    assert dns.cheapest_projection_form(512, 512, 512, 512) == "dense"
    # a batch far larger than d: projecting the batch costs more than the d x d gradient
    assert dns.cheapest_projection_form(512, 512, 64, 64, batch=8192) == "factored"
    with pytest.raises(ValueError):
        dns.projection_flops("nope", 4, 4, 1, 1)


def test_projected_linear_gradients():
    """Forward x W^T; backward: x's gradient as a plain linear map, W's
    gradient equal to project_gradient of the plain one; gradcheck."""
    g = torch.Generator().manual_seed(3)
    U_out, P_out = _basis(6, 2, g)
    U_in, P_in = _basis(5, 3, g)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(7, 6, generator=g, dtype=torch.float64)  # a linear loss: delta = w_out
    out = dns.projected_linear(x, W, U_out, U_in)
    assert torch.allclose(out, x @ W.t(), atol=1e-12)
    gx, gW = torch.autograd.grad((out * w_out).sum(), (x, W))
    ref_x, ref_W = torch.autograd.grad((x @ W.t() * w_out).sum(), (x, W))
    assert torch.allclose(gx, ref_x, atol=1e-12)
    assert torch.allclose(gW, dns.project_gradient(ref_W, P_out, P_in), atol=1e-10)
    assert not torch.allclose(gW, ref_W, atol=1e-3)
    # gradcheck: x's gradient is the true one; W's is the true one projected, so check it against
    # the projection of a plain linear map's gradient instead (linear in W: the projected map is x Pi(W)^T)
    assert torch.autograd.gradcheck(lambda x_: dns.projected_linear(x_, W.detach(), U_out, U_in), (x,))

    def through_projection(W_):  # a map whose gradient is exactly project_gradient(grad)
        return x.detach() @ dns.project_gradient(W_, P_out, P_in).t()
    gW2, = torch.autograd.grad((through_projection(W) * w_out).sum(), W)
    assert torch.allclose(gW, gW2, atol=1e-10)


@pytest.mark.parametrize("n", [3, 40])
def test_product_norm_both_ways(n):
    """||A^T B||_F through the (N, N) Grams (N small) and directly (N large): the matrix norm of the product."""
    g = torch.Generator().manual_seed(n)
    A, B = torch.randn(n, 12, generator=g, dtype=torch.float64), torch.randn(n, 9, generator=g, dtype=torch.float64)
    assert float(dns.product_norm(A, B)) == pytest.approx(float(torch.linalg.matrix_norm(A.t() @ B)), rel=1e-12)


def test_projected_linear_under_bf16_autocast():
    g = torch.Generator().manual_seed(4)
    U_out, _ = _basis(16, 4, g)
    U_in, _ = _basis(16, 4, g)
    W = torch.nn.Parameter(torch.eye(16))
    x = torch.randn(8, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dns.projected_linear(x, W, U_out.float(), U_in.float())
    out.float().square().sum().backward()
    assert W.grad.dtype == torch.float32 and torch.isfinite(W.grad).all() and W.grad.abs().sum() > 0


def _maps_and_projectors(dim=24, k=6, seed=5):
    g = torch.Generator().manual_seed(seed)
    projectors = {name: (_basis(dim, k, g)[1].float(), _basis(dim, k + 2, g)[1].float()) for name in ("W_img", "W_txt")}
    maps = dns.ModalityMaps(dim, 2.0)
    with torch.no_grad():
        maps.W_img.add_(0.1 * torch.randn(dim, dim, generator=g))
        maps.W_txt.add_(0.1 * torch.randn(dim, dim, generator=g))
    img, txt = torch.randn(4, dim, generator=g), torch.randn(4, dim, generator=g)
    return maps, projectors, img, txt


def _grads(maps, hooks, img, txt, through_linear):
    maps.zero_grad(set_to_none=True)
    if through_linear:  # what a map's forward calls when wired to the hooks
        a, b = hooks.linear("W_img", img, maps.W_img), hooks.linear("W_txt", txt, maps.W_txt)
    else:
        a, b = maps.map_image(img), maps.map_text(txt)
    (a @ b.t()).logsumexp(1).sum().backward()
    seen = set(hooks.projected_in_backward)
    hooks.before_optimizer_step(SimpleNamespace(model=maps))
    return maps.W_img.grad.clone(), maps.W_txt.grad.clone(), seen


def test_null_space_projection_forms_agree():
    """dense, factored, auto in the hook, and the activation form through
    linear(): the same projected gradients."""
    maps, projectors, img, txt = _maps_and_projectors()
    *ref, _ = _grads(maps, dns.NullSpaceProjection("gradient", projectors, form="dense"), img, txt, False)
    for form in ("factored", "auto"):
        hooks = dns.NullSpaceProjection("gradient", projectors, form=form)
        for a, b in zip(_grads(maps, hooks, img, txt, False)[:2], ref):
            assert torch.allclose(a, b, atol=1e-5), form
    assert hooks.forms == {"W_img": "factored", "W_txt": "factored"}  # k_out + k_in = 14 of 24: factored is cheaper
    hooks = dns.NullSpaceProjection("gradient", projectors)
    assert hooks.rank("W_img") == (6, 8) and hooks.bases("W_img")[0].shape == (24, 6)
    *grads, seen = _grads(maps, hooks, img, txt, True)
    assert seen == {"W_img", "W_txt"}  # batch 4 < the ranks: the activation form was chosen for both maps ...
    assert not hooks.projected_in_backward  # ... and the hook, which skipped both, reset its record
    for a, b in zip(grads, ref):
        assert torch.allclose(a, b, atol=1e-5)
    dense = dns.NullSpaceProjection("gradient", projectors, form="dense")
    out = dense.linear("W_img", img, maps.W_img)  # a fixed form never goes through projected_linear
    assert out.grad_fn.name() != "ProjectedLinearBackward" and not dense.projected_in_backward
    assert dns.NullSpaceProjection("update", projectors).linear("W_img", img, maps.W_img).grad_fn.name() \
        != "ProjectedLinearBackward"
    with pytest.raises(ValueError):
        dns.NullSpaceProjection("gradient", projectors, form="activations")


def test_projection_form_flag():
    from plumbing.flags import parse_config
    assert parse_config(dns.DNSConfig, []).projection_form == "auto"
    assert parse_config(dns.DNSConfig, ["--projection-form", "dense"]).projection_form == "dense"
    with pytest.raises(SystemExit):
        parse_config(dns.DNSConfig, ["--projection-form", "activations"])


def test_learner_takes_the_activation_form_and_learns_what_the_dense_hook_learns(tmp_path, monkeypatch):
    """Wired into the maps: at a small batch on wide maps 'auto' trains the
    second task through projected_linear (W's gradient projected in the
    backward), and ends where the dense hook (project W.grad after the
    backward) ends, up to float32 rounding."""
    calls = []
    real = dns.projected_linear
    monkeypatch.setattr(dns, "projected_linear", lambda *a: calls.append(1) or real(*a))
    tasks = dns_demo.low_rank_tasks(dim=96, rank=4, shared=2, n=64)
    maps = {}
    for form in ("auto", "dense"):
        cfg = dns.DNSConfig(mode="gradient", projection_form=form, batch_size=8, epochs=1, lr=1e-2,
                            device="cpu", precision="fp32", log_every=10_000, out=str(tmp_path / form))
        learner = dns.DNSLearner(96, math.log(1 / 0.07))
        for i, (img, txt) in enumerate(tasks):
            learner.learn(cfg, img, txt, tmp_path / form / f"task{i}")
        maps[form] = learner.net.model.snapshot()
        if form == "auto":
            assert len(calls) == 2 * 8, "both maps of task 2, every step, through projected_linear"
            calls.clear()
    assert not calls, "the dense form never takes the activation path"
    moved = max(float((W - torch.eye(96)).abs().max()) for W in maps["dense"])
    assert moved > 1e-3  # the maps did train
    for a, b in zip(maps["auto"], maps["dense"]):
        assert float((a - b).abs().max()) < 1e-4 * max(1.0, moved)
