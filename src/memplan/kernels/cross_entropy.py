"""Fused linear + cross-entropy: hidden states x LM-head weight -> loss, without ever holding the whole
b*s x V logits (their fp32 up-cast and their gradient are the largest activation terms of an LLM with a
large vocabulary; docs/estimator.md).

Forward runs over chunks of tokens and keeps, per token, only the log-sum-exp (4 bytes). Backward runs
over blocks of the vocabulary and, inside each, chunks of tokens. It recomputes each block of logits and
forms softmax - onehot scaled by the loss gradient. The weight gradient of a vocabulary block is summed
in fp32 over all tokens in place (`addmm_`) and cast once; the hidden-state gradient is summed in fp32
over the blocks. Peak extra memory: one block of fp32 logits and its gradient (about 64 MiB each), one
block's fp32 weight-gradient sum, the fp32 hidden-state gradient (N x H x 4) and the log-sum-exp.

An optional LM-head bias (V,) (BERT's masked-LM decoder) is added to each fp32 logits block before the
soft-capping; its gradient, d summed over the tokens, is summed in fp32 per vocabulary block next to the
weight's and cast once (one block-sized fp32 vector, never a V-sized one).

This is the tiled PyTorch path (CPU, and the fallback on GPU). On CUDA, `linear_cross_entropy` runs the
Triton kernels of kernels/triton_cross_entropy.py instead (backend="auto"), imported only then: triton may
be missing (it is Linux-only). `reference` is the plain computation the tests hold both to.
"""

from __future__ import annotations


import torch

from .amp import cast_once
from .backend import pick

from memplan.estimator.rules import FUSED_LOSS_CHUNK_BYTES, fused_loss_blocks, fused_loss_chunk

CHUNK_BYTES = FUSED_LOSS_CHUNK_BYTES  # fp32 logits per chunk: 64 MiB (128 tokens at V = 128,256)


def default_chunk(vocab: int) -> int:
    return fused_loss_chunk(vocab, CHUNK_BYTES)


def _denominator(targets: torch.Tensor, ignore_index: int, reduction: str, num_items_in_batch) -> torch.Tensor:
    if reduction == "sum" or reduction == "none":
        return torch.ones((), dtype=torch.float32, device=targets.device)
    if num_items_in_batch is not None:  # gradient accumulation: normalise by the whole batch's tokens
        return torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=targets.device)
    return (targets != ignore_index).sum().to(torch.float32)


def finish_forward(ctx, per_token, lse, hidden, weight, bias, targets, ignore_index, reduction, num_items_in_batch):
    """The reduction of the per-token losses, with what backward needs saved (both backends): hidden,
    weight, bias (None when there is none), targets, lse, denom, in that order."""
    denom = _denominator(targets, ignore_index, reduction, num_items_in_batch)
    ctx.save_for_backward(hidden, weight, bias, targets, lse, denom)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total / denom if reduction == "mean" else total


def token_grads(grad_out: torch.Tensor, denom: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                reduction: str) -> torch.Tensor:
    """Each token's loss gradient: the reduction's scale, or the caller's per-token gradient; zero for
    ignored tokens, also when every token is ignored and the mean is 0 / 0 (torch's cross_entropy gives
    a NaN loss and zero gradients there)."""
    g = grad_out.float() if reduction == "none" else (grad_out.float() / denom).expand(targets.shape[0])
    return torch.where(targets != ignore_index, g, 0.0)


def _logits(hidden_chunk: torch.Tensor, weight: torch.Tensor, softcap: float | None, bias: torch.Tensor | None = None):
    """fp32 logits of one chunk (and tanh of the soft-capped ones, for the backward). `bias`: the
    matching slice of the LM head's bias, added in fp32 after the up-cast (as the Triton kernels add it to
    their fp32 accumulator) and before the soft-capping, which applies to the whole logit."""
    z = (hidden_chunk @ weight.T).float()
    if bias is not None:
        z += bias.float()
    if softcap is None:
        return z, None
    th = torch.tanh(z / softcap)
    return softcap * th, th


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, chunk, softcap, num_items_in_batch, bias=None):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        per_token = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            logits, _ = _logits(hidden[s:e], weight, softcap, bias)
            lse_c = torch.logsumexp(logits, dim=-1)
            t = targets[s:e]
            valid = t != ignore_index
            picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            per_token[s:e] = torch.where(valid, lse_c - picked, torch.zeros_like(lse_c))
            lse[s:e] = lse_c
            del logits
        ctx.cfg = (ignore_index, reduction, chunk, softcap)
        return finish_forward(ctx, per_token, lse, hidden, weight, bias, targets, ignore_index, reduction,
                              num_items_in_batch)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse, denom = ctx.saved_tensors
        ignore_index, reduction, chunk, softcap = ctx.cfg
        n, vocab = hidden.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[8]
        # per-token loss gradient: the reduction's scale, or the caller's per-token gradient
        g_tok = token_grads(grad_out, denom, targets, ignore_index, reduction)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_weight = torch.empty_like(weight) if need_w else None
        grad_bias = torch.empty_like(bias) if need_b else None
        # vocabulary blocks outside, token chunks inside: each block of the weight gradient is summed in
        # fp32 over all tokens, then cast once (no V x H fp32 buffer)
        _, vchunk, tchunk = fused_loss_blocks(n, weight.shape[1], vocab, CHUNK_BYTES, chunk)
        for v0 in range(0, vocab, vchunk):
            v1 = min(v0 + vchunk, vocab)
            w = weight[v0:v1]
            b = bias[v0:v1] if bias is not None else None
            acc = torch.zeros((v1 - v0, weight.shape[1]), dtype=torch.float32, device=weight.device) if need_w else None
            # the bias gradient is d summed over the tokens: one block's fp32 sum, cast once like the weight's
            acc_b = torch.zeros(v1 - v0, dtype=torch.float32, device=weight.device) if need_b else None
            for s in range(0, n, tchunk):
                e = min(s + tchunk, n)
                h = hidden[s:e]
                logits, th = _logits(h, w, softcap, b)
                # d loss_i / d logits = softmax - onehot(target), times each token's loss gradient
                d = torch.exp(logits - lse[s:e].unsqueeze(1))
                del logits
                t = targets[s:e]
                # - onehot for the targets inside this block, without data-dependent shapes (no mask
                # indexing: the same code runs under fake tensors and compiles to one graph)
                mine = ((t >= v0) & (t < v1)).to(d.dtype)
                d.scatter_add_(1, (t - v0).clamp(0, v1 - v0 - 1).unsqueeze(1), -mine.unsqueeze(1))
                d *= g_tok[s:e].unsqueeze(1)
                if th is not None:  # d/dz softcap * tanh(z / softcap) = 1 - tanh^2
                    d *= 1.0 - th * th
                    del th
                if need_h:
                    grad_hidden[s:e] += (d.to(weight.dtype) @ w).float()
                if need_w:
                    acc.addmm_(d.T, h.float())
                if need_b:
                    acc_b += d.sum(0)
                del d
            if need_w:
                grad_weight[v0:v1] = acc.to(weight.dtype)
            if need_b:
                grad_bias[v0:v1] = acc_b.to(bias.dtype)
        if need_h:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, grad_bias


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", *, chunk_size: int | None = None, softcap: float | None = None,
                         num_items_in_batch: int | torch.Tensor | None = None, backend: str = "auto",
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T + bias` against `targets`, in chunks of tokens.

    hidden: (..., H); weight: (V, H); targets: (...) token ids, `ignore_index` for none.
    bias: optional (V,) LM-head bias (BERT's masked-LM decoder), added to the fp32 logits before the
    soft-capping; its gradient is returned in its own dtype.
    reduction: "mean" (over the targets that are not ignored, or over `num_items_in_batch` when given,
    as transformers passes it under gradient accumulation), "sum" or "none" (per token, fp32).
    softcap: Gemma 2's final logit soft-capping, softcap * tanh(logits / softcap).
    backend: "auto" (the Triton kernels for fp32/fp16/bf16 tensors on CUDA when triton imports, else the
    tiled PyTorch path), "triton" (CUDA tensors, or CPU tensors under Triton's interpreter:
    TRITON_INTERPRET=1 set before the kernel module is first imported) or "torch". chunk_size applies to
    the PyTorch path only; the Triton kernels have their own tiles.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, not {reduction!r}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} does not match the weight's {weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be ({weight.shape[0]},), one entry per vocabulary entry")
    lead = hidden.shape[:-1]
    if targets.shape != lead:
        raise ValueError(f"targets {tuple(targets.shape)} must match the hidden states' leading shape {tuple(lead)}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    # the bias follows the weight, as autocast's addmm would cast it
    (h, weight, bias), no_autocast = cast_once(h.device.type, h, weight, bias)
    with no_autocast:
        out = _apply(backend, h, weight, t, ignore_index, reduction, chunk_size, softcap, num_items_in_batch, bias)
    return out.reshape(lead) if reduction == "none" else out


def _apply(backend, h, weight, t, ignore_index, reduction, chunk_size, softcap, num_items_in_batch, bias=None):
    triton_loss = _triton_loss(backend, h, weight, bias)
    if triton_loss is not None:
        return triton_loss.apply(h, weight, t, ignore_index, reduction, softcap, num_items_in_batch, None, bias)
    chunk = chunk_size or default_chunk(weight.shape[0])
    return LinearCrossEntropy.apply(h, weight, t, ignore_index, reduction, chunk, softcap, num_items_in_batch, bias)


def _triton_loss(backend: str, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The Triton autograd.Function if `backend` picks it for these tensors (kernels/backend.py), else None."""
    mod = pick(backend, (h, weight, bias), "triton_cross_entropy", fits=h.dtype == weight.dtype)
    return mod.TritonLinearCrossEntropy if mod else None


def reference(hidden, weight, targets, ignore_index=-100, reduction="mean", softcap=None, num_items_in_batch=None,
              bias=None):
    """The plain computation: whole logits, up-cast to fp32, torch's cross_entropy (transformers'
    ForCausalLMLoss does the same); `bias` added to the up-cast logits, before the soft-capping."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.T).float()
    if bias is not None:
        logits = logits + bias.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    t = targets.reshape(-1)
    if reduction == "mean" and num_items_in_batch is not None:
        return torch.nn.functional.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum") / num_items_in_batch
    out = torch.nn.functional.cross_entropy(logits, t, ignore_index=ignore_index, reduction=reduction)
    return out.reshape(targets.shape) if reduction == "none" else out
