"""Every method's losses in float32 under AMP (common.float32): autocast recasts a matmul's inputs to bf16 / fp16
whatever `.float()` said, and at logit scale 100 bf16 logits are off by 0.1-0.4 each. Each loss runs on bf16
embeddings inside bf16 autocast on CPU (the CUDA fp16 path's mechanism) and must give a float32 loss within 1e-5
of the same inputs in float32 without autocast."""
import pytest
import torch
import torch.nn.functional as F

import cclip
import common
import dns
import erclip
import longclip
import m2mix

B, D, SCALE = 16, 32, torch.tensor(100.0)


def _embeddings(n: int, seed: int = 0):
    """n (B, D) unit rows made the way a model makes them under AMP: a bf16 matmul."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(n, B, D, generator=g), torch.randn(D, D, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return [F.normalize(e @ w, dim=-1) for e in x]


def _total(out):
    return sum(out.values()) if isinstance(out, dict) else out


CASES = {
    "clip_loss": lambda e: common.clip_loss(e[0], e[1], SCALE, 0.1),
    "erclip preservation": lambda e: erclip.preservation_loss(e[0], e[1], e[2], e[3]),
    "erclip losses": lambda e: erclip.erclip_losses(e[0], e[1], e[2], e[3], e[4], SCALE, 1.0, 1.0, 0.1),
    "longclip losses": lambda e: longclip.longclip_losses(e[0], longclip.pca_reconstruct(e[0], 8), e[1], e[2],
                                                          SCALE, 0.0),
    "m2mix (text form)": lambda e: m2mix.m2mix_loss(e[0], e[1], SCALE, 0.7),
    "m2mix (printed form)": lambda e: m2mix.m2mix_loss(e[0], e[1], SCALE, 0.7, form="printed"),
    "v-mix": lambda e: m2mix.vmix_loss(e[0], e[1], SCALE, 0.7),
    "l-mix": lambda e: m2mix.lmix_loss(e[0], e[1], SCALE, 0.7),
    "vl-mix": lambda e: m2mix.vlmix_loss(e[0], e[1], SCALE, 0.7),
    "ckc": lambda e: cclip.ckc_loss(e[0], e[1], e[2], e[3], SCALE),
    "dns code loss": lambda e: dns.code_loss(e[0], e[1]),
}


@pytest.mark.parametrize("name", CASES)
def test_each_loss_is_float32_under_bf16_autocast(name):
    emb = _embeddings(5)
    reference = _total(CASES[name]([e.float() for e in emb]))  # the same inputs, float32, no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_amp = _total(CASES[name](emb))
    assert under_amp.dtype == torch.float32
    assert abs(float(under_amp) - float(reference)) < 1e-5, (name, float(under_amp), float(reference))


def test_gradients_reach_the_bf16_graph_through_the_casts():
    x = torch.randn(B, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        img, txt = F.normalize(x @ torch.eye(D), dim=-1), F.normalize(torch.randn(B, D), dim=-1)
        loss = common.clip_loss(img, txt, SCALE)
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
