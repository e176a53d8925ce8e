"""Inputs and a forward + backward runner shared by the fused-loss tests (PyTorch and Triton paths)."""

import torch
from hypothesis import strategies as st

REDUCTIONS = ("mean", "sum", "none")


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


def run_bias(fn, h, w, b, t, g=None, **kw):
    """`run` with an LM-head bias: (loss, grad hidden, grad weight, grad bias)."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_()
    out = fn(h, w, t, bias=b, **kw)
    g = torch.ones_like(out) if g is None else g
    gh, gw, gb = torch.autograd.grad(out, (h, w, b), g)
    return out.detach(), gh, gw, gb


def bias_for(vocab, dtype, seed=0, device="cpu"):
    """A bias of a size like a trained head's (a few units), so it moves the softmax noticeably."""
    gen = torch.Generator().manual_seed(seed + 7)
    return (torch.randn(vocab, generator=gen) * 2.0).to(dtype).to(device)


def tokens_and_reduction(max_tokens: int):
    """(token count, reduction) that `data` makes well defined: it ignores every fifth token from the first,
    so one token alone is ignored and its mean is 0 / 0 (test_all_ignored's case), not a comparison."""
    return st.sampled_from(REDUCTIONS).flatmap(
        lambda r: st.tuples(st.integers(2 if r == "mean" else 1, max_tokens), st.just(r)))
