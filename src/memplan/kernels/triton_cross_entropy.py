"""Fused linear + cross-entropy in Triton: the CUDA path of `memplan.kernels.linear_cross_entropy`.

Same semantics as the tiled PyTorch path (kernels/cross_entropy.py): loss of `hidden @ weight.T` (hidden
(N, H), weight (V, H)) against `targets`, without ever holding the N x V logits.

Forward (`_forward_kernel`, one program per block of BLOCK_N tokens): for each block of BLOCK_V
vocabulary entries, the (BLOCK_N, BLOCK_V) logits tile is summed over the hidden size in steps of BLOCK_H
with `tl.dot` (fp32 accumulation), optionally soft-capped (softcap * tanh(z / softcap), Gemma 2), folded
into a running max and a running sum of exponentials (the online softmax normaliser of Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax", arXiv:1805.02867), and the target's logit
is picked when its column passes by. Each token's loss (0 for `ignore_index`) and its fp32 log-sum-exp
are written. The idea of computing the loss of a large vocabulary tile by tile, logits never in global
memory, is Cut Cross-Entropy's (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language
Models", arXiv:2411.09009).

Memory held between forward and backward: the per-token log-sum-exp (4 bytes a token), besides the
inputs autograd keeps anyway.

Backward: d loss / d logits = (softmax - onehot(target)) x the token's loss gradient (x 1 - tanh^2 under
soft-capping), recomputed tile by tile from the saved log-sum-exp. Both gradients are sums over the
other axis: grad_hidden sums over the vocabulary, grad_weight over the tokens. Summing them in one pass
over (token block, vocabulary block) tiles would need atomic adds, whose order (and fp32 rounding)
changes from run to run. Instead two kernels each own their output rows and sum in a fixed order, so the
gradients are bitwise deterministic:
- `_grad_hidden_kernel`: programs over token blocks, looping over vocabulary blocks:
  recompute the logits tile, form d, add d @ W_tile;
- `_grad_weight_kernel`: programs over vocabulary blocks, looping over token blocks:
  recompute the logits tile, form d, add d^T @ h_tile.
The price is one more logits recomputation: the logits matmul runs 3 times (forward, each backward
kernel) besides the 2 gradient matmuls, 5 matmuls of 2·N·V·H FLOPs against eager's 3 (1 forward + 2
backward) and the tiled PyTorch path's 4. A kernel whose gradient is not needed is skipped.

A program's fp32 sum is (BLOCK_N or BLOCK_V) x H, too large for registers at H = 4096, so it lives in a
global fp32 scratch buffer that only that program reads and writes, one H step at a time; the last step
of the reduction stores the result in the input dtype instead. The programs are persistent (at most one
per SM on CUDA, each taking blocks pid, pid + programs, ...), so the scratch is programs x block x H x 4
bytes (about 0.26 GiB at H = 4096 on 132 SMs with 128-row blocks) rather than a V x H fp32 weight
gradient (2 GiB at V = 128,256). Its cost is traffic: every tile reads and writes its rows' H-wide fp32
sums once, 8·H bytes a row against the tile's 4·H·(other block) FLOPs of matmul.

Bias (optional, (V,), BERT's masked-LM decoder; `HAS_BIAS`): every kernel adds the bias tile, up-cast to
fp32, to its fp32 logits tile before the soft-capping. Its gradient, d summed over the tokens, comes from
`_grad_weight_kernel`, which already forms every d tile of its vocabulary block: it sums them over the
token rows into a BLOCK_V fp32 vector in registers, in a fixed order (no atomics: deterministic), and
stores it once in the bias's dtype. With the weight's gradient not wanted (`GRAD_W` off) the kernel
still runs for the bias's, skipping the d^T @ h matmul and its scratch.

Precision: the logits stay in fp32 straight from the accumulator (eager and the PyTorch path round them to
the input dtype before the up-cast, so in bf16 the kernel's loss is if anything nearer the exact one);
log-sum-exp and all sums are fp32; d is cast to the input dtype before each gradient matmul, as eager
autograd and the PyTorch path's `d.to(weight.dtype) @ w` do. fp32 inputs multiply in IEEE fp32 unless
torch.set_float32_matmul_precision allows TF32, as for torch's own fp32 matmuls.

Tiles: on CUDA `triton.autotune` picks among a few configs per (H, V, soft-capping, dtype, bias, gradients); under Triton's interpreter
(TRITON_INTERPRET=1 set before this module is imported, how the CPU test suite runs it) one small fixed
config, since autotuning there would run every config on the slow interpreter. `Tiles` overrides both.
`tl.dot` needs every tile dimension >= 16; N, V and H need not be multiples of the tiles (masked).

Interpreter caveats (triton 3.x, triton/runtime/interpreter.py), handled under the interpreter only:
- it stores bf16 as uint16 (numpy has no bf16) and its `tl.dot` hands those arrays to np.matmul, which
  multiplies the bit patterns as integers. Dot operands are up-cast to fp32 first: exact for bf16, and
  the same math as the tensor cores (exact products, fp32 sums);
- its fp32 -> bf16 cast truncates. Casts to bf16 round to nearest even on the bits, as the GPU does.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .cross_entropy import finish_forward, token_grads


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # interpreter: its dot would multiply bf16 bit patterns as integers
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _to(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """x (fp32) in `dtype`, rounded to nearest even."""
    if UPCAST and dtype == tl.bfloat16:
        # interpreter: its own cast truncates; round on the bits (ties to even), keep NaN a NaN
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        y = tl.where(x == x, u.to(tl.uint16).to(tl.bfloat16, bitcast=True), x.to(tl.bfloat16))
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _tanh(x):
    # exp overflows to inf for large x, which gives exactly 1 (and -1 for large -x): no NaN
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, H, s_hn, s_hk, s_wv, s_wk, softcap,
                 HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """fp32 logits of tokens `rows` x vocabulary entries `cols` (plus the bias, soft-capped), and their tanh."""
    ks = tl.arange(0, BLOCK_H)
    h_base = h_ptr + rows.to(tl.int64)[:, None] * s_hn
    w_base = w_ptr + cols.to(tl.int64)[:, None] * s_wv
    z = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        k = k0 + ks
        h = tl.load(h_base + k[None, :] * s_hk, mask=(rows[:, None] < N) & (k[None, :] < H), other=0.0)
        w = tl.load(w_base + k[None, :] * s_wk, mask=(cols[:, None] < V) & (k[None, :] < H), other=0.0)
        z = _dot(h, tl.trans(w), z, PRECISION, UPCAST)
    if HAS_BIAS:  # in fp32, before the soft-capping (which caps the whole logit); b_ptr is contiguous
        b = tl.load(b_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        z = z + b[None, :]
    th = z
    if HAS_SOFTCAP:
        th = _tanh(z / softcap)
        z = softcap * th
    return z, th


@triton.jit
def _dlogits(z, th, cols, t, lse, g, V, HAS_SOFTCAP: tl.constexpr):
    """d loss / d logits of a tile: (softmax - onehot(target)) x the token's loss gradient (0 for ignored
    tokens and rows past N), x the soft-capping's derivative 1 - tanh^2; 0 in columns past V."""
    d = tl.exp(z - lse[:, None]) - tl.where(cols[None, :] == t[:, None], 1.0, 0.0)
    d = d * g[:, None]
    if HAS_SOFTCAP:
        d = d * (1.0 - th * th)
    return tl.where(cols[None, :] < V, d, 0.0)


@triton.jit
def _forward_kernel(h_ptr, w_ptr, b_ptr, t_ptr, loss_ptr, lse_ptr, N, V, H, s_hn, s_hk, s_wv, s_wk, ignore_index,
                    softcap, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    t = tl.load(t_ptr + rows, mask=row_ok, other=ignore_index)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)  # running max
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)  # running sum of exp(z - m)
    picked = tl.zeros((BLOCK_N,), dtype=tl.float32)  # the target's logit
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z, _ = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, H, s_hn, s_hk, s_wv, s_wk, softcap,
                            HAS_SOFTCAP, HAS_BIAS, PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
        z = tl.where(cols[None, :] < V, z, float("-inf"))
        # every block holds a column < V, so m_new is finite and exp(-inf - m_new) = 0 on the first block
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
        picked += tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), axis=1)
    lse = m + tl.log(s)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(loss_ptr + rows, tl.where(t != ignore_index, lse - picked, 0.0), mask=row_ok)


@triton.jit
def _grad_hidden_kernel(h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, g_ptr, gh_ptr, acc_ptr, N, V, H, s_hn, s_hk, s_wv, s_wk,
                        softcap, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    local = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_H)
    # this program's fp32 sum, BLOCK_N x H, read and written by it alone
    acc_base = acc_ptr + (pid.to(tl.int64) * BLOCK_N + local)[:, None] * H
    last_v = tl.cdiv(V, BLOCK_V) - 1
    for nb in range(pid, tl.cdiv(N, BLOCK_N), nprog):
        rows = nb * BLOCK_N + local
        row_ok = rows < N
        t = tl.load(t_ptr + rows, mask=row_ok, other=-1)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
        gh_base = gh_ptr + rows.to(tl.int64)[:, None] * H
        for vb in range(0, last_v + 1):
            cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
            z, th = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, H, s_hn, s_hk, s_wv, s_wk, softcap,
                                 HAS_SOFTCAP, HAS_BIAS, PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
            d = _to(_dlogits(z, th, cols, t, lse, g, V, HAS_SOFTCAP), w_ptr.dtype.element_ty, UPCAST)
            w_base = w_ptr + cols.to(tl.int64)[:, None] * s_wv
            for k0 in range(0, H, BLOCK_H):
                k = k0 + ks
                k_ok = k[None, :] < H
                w = tl.load(w_base + k[None, :] * s_wk, mask=(cols[:, None] < V) & k_ok, other=0.0)
                # the first block starts from 0 (masked load: no read), the last stores the result. (Block
                # mask & scalar flag would do; the interpreter types that as int32 and rejects it.)
                acc = tl.load(acc_base + k[None, :], mask=tl.where(vb > 0, k_ok, False), other=0.0)
                acc = _dot(d, w, acc, PRECISION, UPCAST)
                tl.store(acc_base + k[None, :], acc, mask=tl.where(vb < last_v, k_ok, False))
                tl.store(gh_base + k[None, :], _to(acc, gh_ptr.dtype.element_ty, UPCAST),
                         mask=tl.where(vb == last_v, row_ok[:, None] & k_ok, False))
            # the next block reads the sum back, maybe in another thread layout than it was stored in
            tl.debug_barrier()


@triton.jit
def _grad_weight_kernel(h_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, g_ptr, gw_ptr, gb_ptr, acc_ptr, N, V, H, s_hn, s_hk,
                        s_wv, s_wk, softcap, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, GRAD_W: tl.constexpr,
                        GRAD_B: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    local = tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_H)
    acc_base = acc_ptr + (pid.to(tl.int64) * BLOCK_V + local)[:, None] * H  # this program's BLOCK_V x H fp32 sum
    last_n = tl.cdiv(N, BLOCK_N) - 1
    for vb in range(pid, tl.cdiv(V, BLOCK_V), nprog):
        cols = vb * BLOCK_V + local
        col_ok = cols < V
        gw_base = gw_ptr + cols.to(tl.int64)[:, None] * H
        # the bias gradient of this block: d summed over the token rows, in fp32, in token-block order
        db = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for nb in range(0, last_n + 1):
            rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < N
            t = tl.load(t_ptr + rows, mask=row_ok, other=-1)
            lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
            g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
            z, th = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, N, V, H, s_hn, s_hk, s_wv, s_wk, softcap,
                                 HAS_SOFTCAP, HAS_BIAS, PRECISION, UPCAST, BLOCK_N, BLOCK_V, BLOCK_H)
            d = _dlogits(z, th, cols, t, lse, g, V, HAS_SOFTCAP)
            if GRAD_B:  # the fp32 d, before its cast for the matmul (rows past N and ignored tokens are 0)
                db += tl.sum(d, axis=0)
            if GRAD_W:
                d_t = tl.trans(_to(d, h_ptr.dtype.element_ty, UPCAST))
                h_base = h_ptr + rows.to(tl.int64)[:, None] * s_hn
                for k0 in range(0, H, BLOCK_H):
                    k = k0 + ks
                    k_ok = k[None, :] < H
                    h = tl.load(h_base + k[None, :] * s_hk, mask=row_ok[:, None] & k_ok, other=0.0)
                    acc = tl.load(acc_base + k[None, :], mask=tl.where(nb > 0, k_ok, False), other=0.0)
                    acc = _dot(d_t, h, acc, PRECISION, UPCAST)
                    tl.store(acc_base + k[None, :], acc, mask=tl.where(nb < last_n, k_ok, False))
                    tl.store(gw_base + k[None, :], _to(acc, gw_ptr.dtype.element_ty, UPCAST),
                             mask=tl.where(nb == last_n, col_ok[:, None] & k_ok, False))
                tl.debug_barrier()
        if GRAD_B:  # cast once, to the bias's dtype
            tl.store(gb_ptr + cols, _to(db, gb_ptr.dtype.element_ty, UPCAST), mask=col_ok)


try:
    from triton.runtime.interpreter import InterpretedFunction

    # what triton.jit made of the kernels: TRITON_INTERPRET is read when the module is imported
    INTERPRETED = isinstance(_forward_kernel, InterpretedFunction)
except ImportError:  # a triton without the interpreter
    INTERPRETED = False


@dataclass(frozen=True)
class Tiles:
    """Tile sizes (each >= 16, powers of two) and launch settings. `programs`: persistent programs of the
    backward kernels (None: one per SM on CUDA, 2 under the interpreter)."""

    block_n: int = 64
    block_v: int = 128
    block_h: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs: int | None = None


# Small under the interpreter: each tile op is a numpy call, and small tiles let small test shapes cross
# many blocks.
INTERPRETER_TILES = Tiles(block_n=16, block_v=32, block_h=16, num_warps=1, num_stages=1)


def _configs(shapes):
    return [triton.Config({"BLOCK_N": n, "BLOCK_V": v, "BLOCK_H": h}, num_warps=wp, num_stages=st)
            for n, v, h, wp, st in shapes]


# (BLOCK_N, BLOCK_V, BLOCK_H, warps, stages). Shared memory per stage: (BLOCK_N + BLOCK_V) x BLOCK_H x 2
# bytes (48 KiB at 128 + 256 rows); configs that do not fit a GPU are skipped by the autotuner.
_FORWARD_CONFIGS = _configs([(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                             (64, 256, 64, 8, 3), (128, 128, 32, 4, 4)])
# The backward's scratch is programs x (BLOCK_N or BLOCK_V) x H x 4 bytes: its block stays <= 128.
_GRAD_CONFIGS = _configs([(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (64, 64, 64, 4, 4),
                          (128, 128, 32, 8, 4)])
_TUNED = {}


def _tuned(kernel, configs):
    """The kernel autotuned over `configs` per (H, V, soft-capping, bias, which gradients) and dtypes (built on
    first use: CUDA only). GRAD_W is a key because without it the weight kernel skips its matmul, so
    another tile may win; the bias barely changes the work but keys the compiled variant anyway."""
    if kernel not in _TUNED:
        key = [k for k in ("H", "V", "HAS_SOFTCAP", "HAS_BIAS", "GRAD_W", "GRAD_B") if k in kernel.arg_names]
        _TUNED[kernel] = triton.autotune(configs=configs, key=key)(kernel)
    return _TUNED[kernel]


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: IEEE fp32 products unless torch allows TF32 for its own fp32 matmuls (default: not)
    return "ieee" if dtype != torch.float32 or torch.get_float32_matmul_precision() == "highest" else "tf32"


def _launch(kernel, configs, tiles: Tiles | None, grid, *args, **constexprs):
    """Launch with explicit tiles, INTERPRETER_TILES under the interpreter, else autotuned."""
    if tiles is None and INTERPRETED:
        tiles = INTERPRETER_TILES
    if tiles is None:
        _tuned(kernel, configs)[grid](*args, **constexprs)
        return
    meta = {"BLOCK_N": tiles.block_n, "BLOCK_V": tiles.block_v, "BLOCK_H": tiles.block_h}
    kernel[lambda _: grid(meta)](*args, **constexprs, **meta, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _programs(tiles: Tiles | None, device: torch.device) -> int:
    if tiles is not None and tiles.programs is not None:
        return tiles.programs
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # interpreter: programs run one after the other anyway; 2 exercise the persistent loop


def _block_rows(tiles: Tiles | None, configs, key: str) -> int:
    """The largest block of the scratch's row axis the launch may use (sizes the scratch)."""
    if tiles is None and INTERPRETED:
        tiles = INTERPRETER_TILES
    if tiles is not None:
        return {"BLOCK_N": tiles.block_n, "BLOCK_V": tiles.block_v}[key]
    return max(c.kwargs[key] for c in configs)


def _common(hidden, bias, softcap):
    return dict(HAS_SOFTCAP=softcap is not None, HAS_BIAS=bias is not None, PRECISION=_precision(hidden.dtype),
                UPCAST=INTERPRETED)


def _bias_arg(bias, weight):
    # without a bias, HAS_BIAS is off and the pointer is never read: the weight stands in for it
    return weight if bias is None else bias


def _strides(hidden, weight):
    return (*hidden.stride(), *weight.stride())


def _forward(hidden, weight, bias, targets, ignore_index, softcap, tiles):
    n, h = hidden.shape
    v = weight.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    if n == 0:
        return loss, lse
    _launch(_forward_kernel, _FORWARD_CONFIGS, tiles, lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),),
            hidden, weight, _bias_arg(bias, weight), targets, loss, lse, n, v, h, *_strides(hidden, weight),
            ignore_index, 1.0 if softcap is None else float(softcap), **_common(hidden, bias, softcap))
    return loss, lse


def _grad(kernel, key, outs, flags, hidden, weight, bias, targets, lse, g_tok, softcap, tiles):
    """One backward kernel: persistent programs over blocks of rows (tokens: key BLOCK_N, or vocabulary:
    BLOCK_V), writing the output tensors `outs` (contiguous, passed in kernel order); `flags`: the kernel's
    extra constexprs (GRAD_W, GRAD_B for the weight kernel)."""
    n, h = hidden.shape
    v = weight.shape[0]
    if n == 0:  # no tokens: nothing to sum, and no program would store a zero
        for out in outs:
            out.zero_()
        return
    programs = _programs(tiles, hidden.device)
    rows = n if key == "BLOCK_N" else v
    # the fp32 row sums of the matmul gradient; none when only the bias's gradient is wanted
    size = programs * _block_rows(tiles, _GRAD_CONFIGS, key) * h if flags.get("GRAD_W", True) else 1
    scratch = torch.empty(size, dtype=torch.float32, device=hidden.device)
    _launch(kernel, _GRAD_CONFIGS, tiles, lambda meta: (min(programs, triton.cdiv(rows, meta[key])),),
            hidden, weight, _bias_arg(bias, weight), targets, lse, g_tok, *outs, scratch, n, v, h,
            *_strides(hidden, weight), 1.0 if softcap is None else float(softcap),
            **_common(hidden, bias, softcap), **flags)


class TritonLinearCrossEntropy(torch.autograd.Function):
    """apply(hidden (N, H), weight (V, H), targets (N,), ignore_index, reduction, softcap, num_items_in_batch,
    tiles, bias): the loss as LinearCrossEntropy computes it, in Triton. tiles: a `Tiles`, or None for the
    defaults (autotuned on CUDA). bias: None or (V,) in fp32, fp16 or bf16."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, reduction, softcap, num_items_in_batch, tiles=None,
                bias=None):
        if hidden.dtype != weight.dtype or hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"the Triton loss takes fp32, fp16 or bf16 hidden states and weight of one dtype, "
                             f"not {hidden.dtype} and {weight.dtype}")
        if bias is not None:
            if tuple(bias.shape) != (weight.shape[0],) or bias.dtype not in (torch.float32, torch.float16,
                                                                               torch.bfloat16):
                raise ValueError(f"the Triton loss takes a ({weight.shape[0]},) fp32, fp16 or bf16 bias, not "
                                 f"{tuple(bias.shape)} {bias.dtype}")
            bias = bias.contiguous()  # the kernels index it by column alone
        targets = targets.contiguous()
        with torch.cuda.device(hidden.device) if hidden.is_cuda else nullcontext():
            per_token, lse = _forward(hidden, weight, bias, targets, ignore_index, softcap, tiles)
        ctx.cfg = (ignore_index, reduction, softcap, tiles)
        return finish_forward(ctx, per_token, lse, hidden, weight, bias, targets, ignore_index, reduction,
                              num_items_in_batch)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse, denom = ctx.saved_tensors
        ignore_index, reduction, softcap, tiles = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[8]
        # per-token loss gradient, as the PyTorch path forms it (ignored tokens: 0)
        g_tok = token_grads(grad_out, denom, targets, ignore_index, reduction).contiguous()
        args = (hidden, weight, bias, targets, lse, g_tok, softcap, tiles)
        grad_hidden = grad_weight = grad_bias = None
        with torch.cuda.device(hidden.device) if hidden.is_cuda else nullcontext():
            if need_h:
                grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
                _grad(_grad_hidden_kernel, "BLOCK_N", (grad_hidden,), {}, *args)
            if need_w or need_b:
                # one pass over the vocabulary blocks gives both: the bias's gradient is d summed over tokens;
                # an output that is not wanted gets a placeholder the kernel never writes (GRAD_W / GRAD_B off)
                grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
                grad_bias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if need_b else None
                outs = (weight if grad_weight is None else grad_weight, weight if grad_bias is None else grad_bias)
                _grad(_grad_weight_kernel, "BLOCK_V", outs, dict(GRAD_W=need_w, GRAD_B=need_b), *args)
        return grad_hidden, grad_weight, None, None, None, None, None, None, grad_bias
