"""Inputs and a forward + backward runner shared by the fused-loss tests (PyTorch and Triton paths)."""

import torch


def run(fn, h, w, t, g=None, **kw):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = fn(h, w, t, **kw)
    g = torch.ones_like(out) if g is None else g
    gh, gw = torch.autograd.grad(out, (h, w), g)
    return out.detach(), gh, gw


def data(n, hid, vocab, dtype, seed=0, ignore_every=5):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hid, generator=gen).to(dtype)
    w = (torch.randn(vocab, hid, generator=gen) * hid ** -0.5).to(dtype)
    t = torch.randint(0, vocab, (n,), generator=gen)
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t
