"""Tiled MLP: a transformer's MLP run over chunks of tokens and recomputed chunk by chunk in backward,
so its b*s x intermediate activations are never held for all tokens at once; and a fused gated
activation act(gate) * up for the gated MLPs (SwiGLU, GeGLU) that saves only its two inputs.

Tiled MLP (`tiled_mlp`, `patch_mlp`). A transformer's MLP is token-wise: token i's output depends on
token i's input only, so it can run over chunks of the flattened tokens with the same result. This is
the TiledMLP of "Arctic Long Sequence Training" (ALST; Bekman et al. 2025, arXiv:2506.13996), written
here from that description:
- forward: for each chunk, out[chunk] = fn(x[chunk]) with autograd off (Function.forward). Only x is
  saved: the MLP's input, which its first linears would save anyway. No chunk's intermediates outlive
  the chunk.
- backward: for each chunk, recompute fn(x[chunk]) with autograd on, then call
  torch.autograd.grad(out_chunk, (x_chunk, *params), grad_out[chunk]) once. x's gradient chunk is
  written into its place. The parameters' gradients are summed over the chunks in fp32 and returned
  once.
Between forward and backward the layer holds x instead of its intermediates (15x less for Llama-3-8B's
MLP, benchmarks/mlp_memory.py). Backward's working memory is one chunk's intermediates and graph, plus
the gradient sums. The price is one more forward of the MLP, about a third more MLP FLOPs, as under
activation checkpointing.

Design decisions:
- The parameters are inputs of the autograd.Function. Their gradients leave backward as ordinary
  results, and autograd accumulates them into .grad once per backward. So gradient accumulation,
  DDP's and FSDP's gradient hooks and post-accumulate-grad hooks see one gradient, as for the plain
  MLP; writing .grad from inside backward would bypass them. A parameter that does not require grad is
  passed but not differentiated (None). One that fn does not use gets None, as autograd gives it.
- The parameters' gradients are summed in fp32 over the chunks and cast once, whatever their dtype.
  The untiled weight gradient is one GEMM that sums all tokens in fp32 and rounds once. A bf16 running
  sum would add one rounding of the running total per chunk. The number of chunks grows with the
  sequence length (123 chunks at 500k tokens for Llama-3-8B), and long sequences are what tiling is for.
  The price is 4 bytes per MLP parameter during this layer's backward instead of 2: 0.33 GiB more for
  Llama-3-8B's MLP (3 x 4096 x 14336 parameters x 2 bytes), a constant while the saving grows with the sequence. With one chunk
  there is no sum at all, and x's gradient is the chunk's own, not a copy.
- The parameters are kept on ctx, not in save_for_backward, so that saved-tensor hooks (CPU offload of
  activations, which ALST pairs with tiling) move x and never the weights.
- The recompute runs under the forward's autocast state, captured in forward and re-entered in
  backward whatever autocast state backward is called in. One autocast region spans all chunks, so its
  cache casts each weight once per backward.
- The recompute also runs with the forward's CPU and CUDA RNG states restored, and the chunks run in
  the same order in both passes, so dropout inside the MLP draws the same masks (as
  torch.utils.checkpoint does).
- Shapes never depend on data, so the same code runs under FakeTensorMode (memplan's tracer). The
  recomputed chunk's output is live during its autograd.grad: one chunk x hidden more than untiled.

Default chunk: `hidden` tokens. ALST shards each sequence into ceil(seqlen / hidden_size) pieces.
A piece then holds about hidden tokens, and each of its intermediate tensors (chunk x intermediate) is
the size of one of the MLP's weight matrices (hidden x intermediate). For Llama-3-8B that is 4096
tokens and 112 MiB per bf16 intermediate tensor. We apply that rule to the flattened tokens:
- the extra memory is a small constant multiple of the layer's weights at any sequence length;
- it needs only x's last dimension (fn is opaque);
- the chunk's GEMMs (hidden x hidden x intermediate) are large enough to run at full speed, so the
  recompute is the only cost.
A fixed number of chunks, such as ceil(intermediate / hidden), would make a chunk's intermediates as
large as x itself, which still grows with the sequence. `chunk_tokens` overrides the default.

Not for MLPs that are not token-wise: a mixture of experts whose router drops or balances tokens with a
capacity across the batch gives other results on a chunk than on the whole batch.

Fused gated activation (`gated_act`). transformers' gated MLP computes act(gate_proj(x)) * up_proj(x).
Autograd then saves three b*s x intermediate tensors: gate (for act), and act(gate) and up (for the
product). `gated_act` saves gate and up and recomputes act(gate) in backward. (GLU variants: Shazeer
2020, "GLU Variants Improve Transformer", arXiv:2002.05202; SwiGLU is Llama's, GeGLU with the tanh
GELU is Gemma's.) Two backends:
- Triton (CUDA; kernels/triton_mlp.py): computes in fp32 and stores in the inputs' dtype, one
  rounding per output.
- PyTorch (elsewhere, fake tensors included): the ATen ops eager runs (silu / gelu and their backward
  ops) in the inputs' dtype. So it rounds as transformers does, and creates no fp32 copies of
  b*s x intermediate tensors.

`reference_gated` and `gated_mlp` are the plain computation and the gated MLP the tests use.
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from memplan.estimator.rules import tiled_mlp_chunk

from .backend import pick, triton_module

ACTS = ("silu", "gelu_tanh")
_ORIGINAL = "_memplan_mlp_original_forward"
_CHUNK = "_memplan_mlp_chunk_tokens"


def default_chunk(hidden: int) -> int:
    """Tokens per chunk: the ALST rule (module docstring; memplan.estimator.rules.tiled_mlp_chunk, which the
    planner's activation model uses too)."""
    return tiled_mlp_chunk(hidden)


# -- tiled MLP ------------------------------------------------------------------------------------------


class TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk, x, *params):
        # autograd is off inside Function.forward: the chunks keep no graph
        n = x.shape[0]
        device = x.device.type
        ctx.autocast = None  # a device autocast does not know (meta): nothing to replay
        if torch.amp.is_autocast_available(device):
            ctx.autocast = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                                dtype=torch.get_autocast_dtype(device), cache_enabled=torch.is_autocast_cache_enabled())
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        out = None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            y = fn(x[s:e])
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"tiled_mlp: fn must return one tensor, not {type(y).__name__}")
            if out is None:  # the output's width and dtype (autocast's) are known after the first chunk
                out = torch.empty((n, *y.shape[1:]), dtype=y.dtype, device=y.device)
            out[s:e] = y
            del y
        ctx.save_for_backward(x)
        ctx.fn, ctx.chunk, ctx.params = fn, chunk, params
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        fn, chunk, params = ctx.fn, ctx.chunk, ctx.params
        n = x.shape[0]
        need_x = ctx.needs_input_grad[2]
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        grad_x = None
        single = n <= chunk  # one chunk: its gradients are the results, no buffer and no sum
        if need_x and not single:
            grad_x = torch.empty_like(x)
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        rng_devices = [x.device] if ctx.cuda_rng is not None else []
        # one autocast region around all chunks: its cache casts each weight once for the whole backward
        autocast = torch.autocast(**ctx.autocast) if ctx.autocast else contextlib.nullcontext()
        with torch.random.fork_rng(devices=rng_devices, device_type="cuda"), torch.enable_grad(), autocast:
            # replay the forward's random draws in the forward's order (dropout inside fn)
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                xc = x[s:e].detach().requires_grad_(need_x)
                y = fn(xc)
                inputs = ([xc] if need_x else []) + [params[i] for i in wanted]
                if y.requires_grad and inputs:
                    grads = list(torch.autograd.grad(y, inputs, grad_out[s:e], allow_unused=True))
                else:  # fn used none of the inputs that need a gradient
                    grads = [None] * len(inputs)
                del y
                if need_x:
                    gx = grads.pop(0)
                    if gx is None:  # fn ignores x
                        gx = torch.zeros_like(xc)
                    if single:
                        grad_x = gx
                    else:
                        grad_x[s:e] = gx
                    del gx
                for k, g in enumerate(grads):
                    if g is None:
                        continue  # unused by fn: the same graph in every chunk, so None throughout
                    if single:
                        sums[k] = g
                    elif sums[k] is None:
                        # a copy: g may be grad_out's own chunk (a (1, H) parameter broadcast over a
                        # one-token chunk gets the incoming gradient itself), which must stay intact
                        sums[k] = g.to(torch.float32, copy=True)
                    else:
                        sums[k].add_(g)
                del grads
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        for k, i in enumerate(wanted):
            if sums[k] is not None:
                param_grads[i] = sums[k].to(params[i].dtype)
        return (None, None, grad_x, *param_grads)


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Iterable[torch.Tensor],
              chunk_tokens: int | None = None) -> torch.Tensor:
    """fn(x) for a token-wise MLP fn (..., H) -> (..., H'), run over chunks of `chunk_tokens` tokens and
    recomputed chunk by chunk in backward (module docstring).

    params: every tensor fn uses that may need a gradient (a module's `list(module.parameters())`);
    their gradients reach .grad through autograd as for fn itself. Those that do not require grad are
    left alone. fn must be token-wise (no mixing across tokens: not a capacity-limited MoE router) and
    return one tensor; it runs once per chunk in forward and once more in backward.
    chunk_tokens: tokens per chunk over the flattened leading dimensions; default `default_chunk(H)`.
    """
    params = tuple(params)
    lead, hidden = x.shape[:-1], x.shape[-1]
    chunk = default_chunk(hidden) if chunk_tokens is None else chunk_tokens
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be positive, not {chunk_tokens}")
    flat = x.reshape(-1, hidden)
    if flat.shape[0] == 0:
        return fn(x)
    out = TiledMLP.apply(fn, chunk, flat, *params)
    return out.reshape(*lead, *out.shape[1:])


def patch_mlp(module: torch.nn.Module, chunk_tokens: int | None = None) -> torch.nn.Module:
    """Run `module` (an MLP instance, e.g. a transformers LlamaMLP or GPT2MLP) through `tiled_mlp`, in
    place, and return it. Its parameters are `list(module.parameters())`, read at every call (so a
    wrapper that swaps parameters between calls, as FSDP does, is followed). Patching again only sets
    chunk_tokens. `unpatch_mlp` restores it.

    Only for token-wise MLPs: not for a mixture of experts whose router balances or drops tokens with a
    capacity across the batch (a chunk would be routed differently from the whole batch), nor for any
    module whose output for one token depends on other tokens.
    """
    setattr(module, _CHUNK, chunk_tokens)
    if not hasattr(module, _ORIGINAL):
        setattr(module, _ORIGINAL, module.forward)
        module.forward = types.MethodType(_tiled_forward, module)
    return module


def unpatch_mlp(module: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch_mlp` (a no-op on a module that is not patched)."""
    if hasattr(module, _ORIGINAL):
        del module.forward  # the instance attribute: the forward it had shows again
        delattr(module, _ORIGINAL)
        delattr(module, _CHUNK)
    return module


def _tiled_forward(self, hidden_states, *args, **kwargs):
    original = getattr(self, _ORIGINAL)
    return tiled_mlp(lambda h: original(h, *args, **kwargs), hidden_states, list(self.parameters()),
                     getattr(self, _CHUNK))


# -- fused gated activation -----------------------------------------------------------------------------


def _act(g: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")


def _act_backward(grad: torch.Tensor, g: torch.Tensor, act: str) -> torch.Tensor:
    """grad * act'(g) with ATen's own backward ops, the ones autograd runs for F.silu / F.gelu."""
    if act == "silu":
        return torch.ops.aten.silu_backward(grad, g)
    return torch.ops.aten.gelu_backward(grad, g, approximate="tanh")


class GatedAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act, backend):
        ctx.save_for_backward(gate, up)  # not act(gate): backward recomputes it
        ctx.cfg = (act, backend)
        if backend == "triton":
            return triton_module("triton_mlp").forward(gate, up, act)
        return _act(gate, act) * up

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        act, backend = ctx.cfg
        if backend == "triton":
            d_gate, d_up = triton_module("triton_mlp").backward(gate, up, grad_out, act)
        else:
            # the eager ops and roundings, in the inputs' dtype: no fp32 copies of b*s x intermediate tensors
            d_up = grad_out * _act(gate, act)
            d_gate = _act_backward(grad_out * up, gate, act)
        return (d_gate if ctx.needs_input_grad[0] else None), (d_up if ctx.needs_input_grad[1] else None), None, None


def _backend(backend: str, t: torch.Tensor) -> str:
    """"triton" or "torch" for `backend` and these tensors (kernels/backend.py)."""
    return "triton" if pick(backend, (t,), "triton_mlp") else "torch"


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", backend: str = "auto") -> torch.Tensor:
    """act(gate) * up, saving only gate and up for backward (act(gate) is recomputed there).

    act: "silu" (SwiGLU: Llama, Mistral, Qwen) or "gelu_tanh" (GeGLU with the tanh GELU: Gemma).
    backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" (CUDA, or CPU under TRITON_INTERPRET=1)
    or "torch". Triton computes in fp32 and rounds once to the inputs' dtype; PyTorch runs eager's ATen
    ops in the inputs' dtype (module docstring). Inputs of two dtypes are promoted to a common one.
    """
    if act not in ACTS:
        raise ValueError(f"act must be one of {', '.join(ACTS)}, not {act!r}")
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    dtype = torch.result_type(gate, up)
    gate, up = gate.to(dtype), up.to(dtype)
    return GatedAct.apply(gate, up, act, _backend(backend, gate))


def reference_gated(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The plain computation, as transformers' gated MLPs do it: act(gate) * up in the inputs' dtype
    (autograd saves gate, act(gate) and up)."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {', '.join(ACTS)}, not {act!r}")
    return _act(gate, act) * up


def gated_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, act: str = "silu",
              backend: str = "auto") -> torch.Tensor:
    """A gated MLP (Llama's SwiGLU, Gemma's GeGLU) without biases: down(act(x W_gate^T) * (x W_up^T))."""
    return F.linear(gated_act(F.linear(x, w_gate), F.linear(x, w_up), act, backend), w_down)
