"""Triton kernels of the fused gated activation act(gate) * up (kernels/mlp.py, `gated_act`).

Imported lazily by kernels/mlp.py, only when the Triton backend runs: importing triton costs about a
second, and `triton.jit` reads TRITON_INTERPRET when it decorates, so the variable must be set before
this module is imported for the kernels to run in Triton's interpreter (on CPU tensors).

Both kernels are elementwise over 2-D tiles of (rows, cols) tensors whose last dimension is contiguous
and whose rows are `stride` elements apart, so gate and up may be the two halves of one fused
gate_up projection (`chunk(2, -1)`) without a copy. They load in the input dtype, compute in fp32 and
store in the input dtype (one rounding per output).

- forward: out = act(g) * u
- backward: recomputes act(g) and act'(g) from g (the forward saves only gate and up):
  d_up = dout * act(g), d_gate = dout * u * act'(g)

Activations (ACT, a constexpr):
- 0, SiLU: silu(g) = g * s, s = sigmoid(g); silu'(g) = s * (1 + g * (1 - s)).
- 1, GELU with the tanh approximation (Hendrycks & Gimpel 2016; the "gelu_pytorch_tanh" of Gemma):
  gelu(g) = 0.5 g (1 + t), t = tanh(c (g + 0.044715 g^3)), c = sqrt(2/pi);
  gelu'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 * 0.044715 g^2).
  tanh(z) = 2 sigmoid(2z) - 1: triton.language has sigmoid on every backend (the interpreter
  included); it saturates to +-1 without overflow. The constants are literals in the kernels
  (2c = 1.5957691216057308, 3 * 0.044715 = 0.134145).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTS = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def _act_fwd(g, ACT: tl.constexpr):
    if ACT == 0:
        a = g * tl.sigmoid(g)
    else:
        t = 2.0 * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g)) - 1.0
        a = 0.5 * g * (1.0 + t)
    return a


@triton.jit
def _act_fwd_and_grad(g, ACT: tl.constexpr):
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    else:
        t = 2.0 * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g)) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    return a, da


@triton.jit
def _gated_fwd_kernel(g_ptr, u_ptr, o_ptr, rows, cols, g_stride, u_stride,
                      ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < rows) & (rn[None, :] < cols)
    rm64 = rm.to(tl.int64)  # rows x stride passes 2^31 at long sequences (128k tokens x fused 2 x 14336)
    g = tl.load(g_ptr + rm64[:, None] * g_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rm64[:, None] * u_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    out = _act_fwd(g, ACT) * u
    tl.store(o_ptr + rm64[:, None] * cols + rn[None, :], out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(g_ptr, u_ptr, do_ptr, dg_ptr, du_ptr, rows, cols, g_stride, u_stride, do_stride,
                      ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < rows) & (rn[None, :] < cols)
    rm64 = rm.to(tl.int64)
    g = tl.load(g_ptr + rm64[:, None] * g_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rm64[:, None] * u_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + rm64[:, None] * do_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    a, da = _act_fwd_and_grad(g, ACT)
    out_offs = rm64[:, None] * cols + rn[None, :]
    tl.store(du_ptr + out_offs, (do * a).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + out_offs, (do * u * da).to(dg_ptr.dtype.element_ty), mask=mask)


try:
    from triton.runtime.interpreter import InterpretedFunction

    # what triton.jit made of the kernels: TRITON_INTERPRET is read when this module is imported
    INTERPRETED = isinstance(_gated_fwd_kernel, InterpretedFunction)
except ImportError:  # a triton without the interpreter
    INTERPRETED = False

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(rows, cols) with a contiguous last dimension and one row stride: a view where the layout allows
    (the halves of a fused gate_up projection do), a copy otherwise."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _grid(rows: int, cols: int):
    # about 4096 elements per program: wide rows get one program per 1024 columns, narrow ones several rows
    block_n = min(1024, triton.next_power_of_2(max(cols, 1)))
    block_m = max(1, 4096 // block_n)
    return (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n)), block_m, block_n


def forward(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up, in gate's dtype and shape (contiguous)."""
    g, u = _rows(gate), _rows(up)
    rows, cols = g.shape
    out = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
    if rows and cols:
        grid, bm, bn = _grid(rows, cols)
        _gated_fwd_kernel[grid](g, u, out, rows, cols, g.stride(0), u.stride(0),
                                ACT=ACTS[act], BLOCK_M=bm, BLOCK_N=bn)
    return out.reshape(gate.shape)


def backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor, act: str):
    """(d gate, d up) of act(gate) * up for the output gradient grad_out, in the inputs' dtype."""
    # grad_out may be expanded (the backward of a sum): a row stride of 0 is read like any other
    g, u, do = _rows(gate), _rows(up), _rows(grad_out)
    rows, cols = g.shape
    dg = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
    du = torch.empty((rows, cols), dtype=up.dtype, device=up.device)
    if rows and cols:
        grid, bm, bn = _grid(rows, cols)
        _gated_bwd_kernel[grid](g, u, do, dg, du, rows, cols, g.stride(0), u.stride(0), do.stride(0),
                                ACT=ACTS[act], BLOCK_M=bm, BLOCK_N=bn)
    return dg.reshape(gate.shape), du.reshape(up.shape)
