"""Tiled (flash-style) attention: softmax(Q K^T * scale + mask) V without ever holding the sq x sk scores.

Eager attention keeps the b x h x sq x sk scores, their fp32 softmax and its half-precision copy for the
backward: memory quadratic in the sequence length. This computes the same attention block by block and
keeps, per query row, only the fp32 log-sum-exp (4 bytes), so the memory is linear in the sequence.

Algorithm (FlashAttention, Dao et al. 2022, arXiv:2205.14135; FlashAttention-2, Dao 2023,
arXiv:2307.08691, whose loop order and backward this follows):
- forward, per block of queries, over the key blocks: S = Q K^T * scale (fp32), masked entries -inf;
  online softmax: m' = max(m, rowmax S), P = exp(S - m'), l = l * exp(m - m') + rowsum P,
  acc = acc * exp(m - m') + P V (fp32). At the end O = acc / l and lse = m + log l. A row that sees no
  key (all keys padded, or sq > sk under the causal mask) gets O = 0 and lse = +inf, so the backward's
  P = exp(S - lse) is 0 there: zero gradients, never NaN.
- backward recomputes each block: D = rowsum(dO * O), P = exp(S - lse), dV += P^T dO, dP = dO V^T,
  dS = P * (dP - D), dQ += dS K * scale, dK += dS^T Q * scale. Under GQA, dK and dV of a key/value head
  are summed over the query heads of its group. It runs in two passes, as the Triton kernels do: dK and
  dV per key block (over the query blocks that see it), then dQ per query block (over its key blocks).
  Every sum is block-local fp32, so no fp32 dQ or dK/dV of the whole sequence is held; the price is
  recomputing S, P and dP once more (7 block matmuls instead of 5).
- causal: bottom-right aligned, as flash-attn (>= 2.1) does: query i sees key j iff j <= i + (sk - sq),
  i.e. the queries are the last sq positions of the keys (a KV-cache prefill or decode step). With sq == sk
  (training) it is the usual lower triangle. Key blocks that the causal mask hides from a whole query
  block are skipped; key padding cannot be skipped without data-dependent control flow, so it is masked.
- GQA / MQA: query head i uses key/value head i // (hq // hkv) (transformers' repeat_kv order).

Two implementations of the same arithmetic:
- `TiledAttention` (this file): PyTorch, an autograd.Function, the CPU path and the GPU fallback. It
  saves q, k, v, out, the fp32 lse and the (b, sk) padding mask only; block temporaries (an fp32 score
  block, which becomes P in place, and dS) live inside one step of the loop. Default tiles: key blocks
  of 512, query blocks sized so that a score block is at most 16 MiB (`default_blocks`). No
  data-dependent shapes, so it runs on fake tensors and the meta device (memplan's tracer runs it
  that way). The query heads of a GQA group are folded into the rows of one block, so a block is a
  plain batched matmul with no repeated keys. It computes in fp32 throughout (half inputs are up-cast
  a block at a time).
- kernels/triton_attention.py: the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1), half
  precision matmul operands with fp32 accumulation, P and dS cast to the input dtype before their
  matmuls, as flash-attn does.
`attention(..., backend="auto")` takes the Triton kernels for real CUDA tensors, and this path for
everything else (CPU, fake and meta tensors: memplan's tracer counts this path's allocations).

`hf_attention`, `hf_mask` and `register()` plug it into transformers as attn_implementation="memplan".

`reference` is the plain computation the tests hold both to: it follows transformers'
`eager_attention_forward` of llama (scores in the input dtype, softmax in fp32, cast back before P V).
"""

from __future__ import annotations

import math

import torch

from .amp import cast_once
from .backend import pick, triton_module

BLOCK_BYTES = 16 * 2**20  # default tiles: one fp32 score block of b x hq x block_q x block_k is at most this
MAX_BLOCK_K = 512
MIN_BLOCK_Q, MAX_BLOCK_Q = 16, 1024
MAX_TRITON_HEAD_DIM = 256  # a whole head (padded to a power of two) sits in each tile's registers

def default_blocks(b: int, hq: int, sq: int, sk: int) -> tuple[int, int]:
    """Tiles of the PyTorch path: key blocks of up to 512, query blocks sized to the byte budget."""
    block_k = max(1, min(sk, MAX_BLOCK_K))
    block_q = BLOCK_BYTES // (4 * b * hq * block_k)
    return max(1, min(sq, max(MIN_BLOCK_Q, min(MAX_BLOCK_Q, block_q)))), block_k


def _scores(qs, kb, i0: int, rows, j0: int, j1: int, causal: bool, offset: int, kpm):
    """The fp32 score block qs @ kb^T (qs: the scaled queries), masked entries -inf, in place."""
    s = qs @ kb.transpose(-1, -2)
    hidden = None
    if causal and j1 - 1 > i0 + offset:  # only blocks that cross the diagonal need the causal mask
        hidden = torch.arange(j0, j1, device=s.device)[None, :] > rows[:, None] + offset
    if kpm is not None:
        pad = ~kpm[:, None, None, j0:j1]
        hidden = pad if hidden is None else hidden | pad
    if hidden is not None:
        s.masked_fill_(hidden, -math.inf)
    return s


class TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kpm, causal, scale, block_q, block_k):
        b, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        g = hq // hkv
        offset = sk - sq  # bottom-right causal alignment
        # stored (b, sq, hq, d), as flash-attn does: transformers' transpose(1, 2).contiguous() of the
        # output is then a view, not a second copy beside the saved one
        out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
        # query heads of a group side by side: (b, hkv, g, s, d); these are views, no copy
        q_g, out_g, lse_g = q.unflatten(1, (hkv, g)), out.unflatten(1, (hkv, g)), lse.unflatten(1, (hkv, g))
        for i0 in range(0, sq, block_q):
            i1 = min(i0 + block_q, sq)
            n = i1 - i0
            # the group's heads become rows of one block: (b, hkv, g * n, d), row r is position i0 + r % n
            qs = q_g[:, :, :, i0:i1].float().reshape(b, hkv, g * n, d) * scale
            rows = torch.arange(i0, i1, device=q.device).repeat(g)
            m = torch.full((b, hkv, g * n), -math.inf, device=q.device)
            l = torch.zeros((b, hkv, g * n), device=q.device)
            acc = torch.zeros((b, hkv, g * n, d), device=q.device)
            for j0, j1 in _key_blocks(i1, sk, offset, causal, block_k):
                p = _scores(qs, k[:, :, j0:j1].float(), i0, rows, j0, j1, causal, offset, kpm)
                m_new = torch.maximum(m, p.amax(-1))
                # rows that have seen no allowed key yet keep m = -inf: shift by 0 so exp gives 0, not NaN
                m_shift = torch.where(m_new == -math.inf, 0.0, m_new)
                p.sub_(m_shift.unsqueeze(-1)).exp_()  # the scores become P in place: one block in memory
                alpha = torch.exp(m - m_shift)  # rescales what was summed under the old maximum
                l = l * alpha + p.sum(-1)
                acc.mul_(alpha.unsqueeze(-1)).add_(p @ v[:, :, j0:j1].float())
                m = m_new
                del p
            empty = l == 0  # no allowed key: output 0, lse +inf
            o = acc / torch.where(empty, 1.0, l).unsqueeze(-1)
            out_g[:, :, :, i0:i1] = o.view(b, hkv, g, n, d)
            lse_g[:, :, :, i0:i1] = torch.where(empty, math.inf, m + torch.log(l)).view(b, hkv, g, n)
        ctx.save_for_backward(q, k, v, out, lse, kpm)
        ctx.cfg = (causal, scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, kpm = ctx.saved_tensors
        causal, scale, block_q, block_k = ctx.cfg
        b, hq, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        g = hq // hkv
        offset = sk - sq
        delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)  # D = rowsum(dO * O)
        for i0 in range(0, sq, block_q):  # in blocks: no fp32 copy of the whole dO and O
            delta[:, :, i0:i0 + block_q] = (grad_out[:, :, i0:i0 + block_q].float()
                                            * out[:, :, i0:i0 + block_q].float()).sum(-1)
        q_g, do_g, lse_g, delta_g = (t.unflatten(1, (hkv, g)) for t in (q, grad_out, lse, delta))

        def rows_of(i0, i1):
            """A query block, the group's heads as rows: scaled q, dO, lse, D and each row's position."""
            n = i1 - i0
            qs = q_g[:, :, :, i0:i1].float().reshape(b, hkv, g * n, d) * scale
            dob = do_g[:, :, :, i0:i1].float().reshape(b, hkv, g * n, d)
            return (qs, dob, lse_g[:, :, :, i0:i1].reshape(b, hkv, g * n, 1),
                    delta_g[:, :, :, i0:i1].reshape(b, hkv, g * n, 1), torch.arange(i0, i1, device=q.device).repeat(g))

        def ds_of(qs, dob, lse_b, delta_b, rows, i0, kb, vb, j0, j1):
            """P recomputed (masked: exp(-inf) = 0; rows with lse = +inf: 0), and dS = P * (dO V^T - D)."""
            p = _scores(qs, kb, i0, rows, j0, j1, causal, offset, kpm).sub_(lse_b).exp_()
            return p, (dob @ vb.transpose(-1, -2)).sub_(delta_b).mul_(p)

        # two passes, as the Triton kernels: P is recomputed twice, but every sum is block-local (no fp32
        # dQ or dK/dV buffer of the whole sequence), so the memory is what the Triton backward uses
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        for j0 in range(0, sk, block_k):  # dK, dV of a key block, summed over its query blocks and heads
            j1 = min(j0 + block_k, sk)
            kb, vb = k[:, :, j0:j1].float(), v[:, :, j0:j1].float()
            dkb = torch.zeros((b, hkv, j1 - j0, d), device=k.device)
            dvb = torch.zeros((b, hkv, j1 - j0, d), device=k.device)
            for i0, i1 in _query_blocks(j0, sq, offset, causal, block_q):
                qs, dob, lse_b, delta_b, rows = rows_of(i0, i1)
                p, ds = ds_of(qs, dob, lse_b, delta_b, rows, i0, kb, vb, j0, j1)
                dvb += p.transpose(-1, -2) @ dob  # P^T dO
                del p
                dkb += ds.transpose(-1, -2) @ qs  # dS^T Q * scale
                del ds
            dk[:, :, j0:j1] = dkb
            dv[:, :, j0:j1] = dvb
        del kb, vb, dkb, dvb
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dq_g = dq.unflatten(1, (hkv, g))
        for i0 in range(0, sq, block_q):  # dQ of a query block, summed over its key blocks
            i1 = min(i0 + block_q, sq)
            qs, dob, lse_b, delta_b, rows = rows_of(i0, i1)
            dqb = torch.zeros_like(qs)
            for j0, j1 in _key_blocks(i1, sk, offset, causal, block_k):
                kb, vb = k[:, :, j0:j1].float(), v[:, :, j0:j1].float()
                ds = ds_of(qs, dob, lse_b, delta_b, rows, i0, kb, vb, j0, j1)[1]
                dqb += ds @ kb
                del ds
            dq_g[:, :, :, i0:i1] = (dqb * scale).view(b, hkv, g, i1 - i0, d)
        return dq, dk, dv, None, None, None, None, None


def _key_blocks(i1: int, sk: int, offset: int, causal: bool, block_k: int):
    """(j0, j1) of the key blocks a query block ending before row i1 must visit: under the causal mask,
    the keys past its last row's diagonal are hidden from every row of it and are not visited."""
    end = min(sk, i1 + offset) if causal else sk
    return [(j0, min(j0 + block_k, end)) for j0 in range(0, max(end, 0), block_k)]


def _query_blocks(j0: int, sq: int, offset: int, causal: bool, block_q: int):
    """(i0, i1) of the query blocks that can see a key block starting at j0: under the causal mask the
    rows before j0 - offset see none of it."""
    start = max(0, j0 - offset) if causal else 0
    return [(i0, min(i0 + block_q, sq)) for i0 in range(start, sq, block_q)]


class TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kpm, causal, scale, block_q, block_k):
        kern = triton_module("triton_attention")
        kpm8 = None if kpm is None else kpm.to(torch.int8).contiguous()
        out, lse = kern.forward(q, k, v, causal, kpm8, scale, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse, kpm8)
        ctx.cfg = (causal, scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, kpm8 = ctx.saved_tensors
        causal, scale, block_q, block_k = ctx.cfg
        dq, dk, dv = triton_module("triton_attention").backward(grad_out, q, k, v, out, lse, causal, kpm8, scale, block_q, block_k)
        return dq, dk, dv, None, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              key_padding_mask: torch.Tensor | None = None, scale: float | None = None, block_q: int | None = None,
              block_k: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Attention of q (b, hq, sq, d) over k, v (b, hkv, sk, d), tiled; returns (b, hq, sq, d) in q's dtype.

    hkv must divide hq (GQA; hkv = 1 is MQA): query head i uses key/value head i // (hq // hkv).
    causal: bottom-right aligned, query i sees key j iff j <= i + sk - sq (the lower triangle when sq == sk).
    key_padding_mask: (b, sk) bool, True = attend. A query that sees no key gets 0 and zero gradients.
    scale: default 1 / sqrt(d). block_q, block_k: tile sizes (the Triton path needs powers of two >= 16;
    default: autotuned on CUDA, a byte budget on the PyTorch path). backend: "auto" (Triton for real CUDA
    tensors with head dim <= 256 when triton imports, else PyTorch), "triton" or "torch".
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, seq, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, hq, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be (batch={b}, kv_heads, seq_k, head_dim={d}); got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if hq % k.shape[1]:
        raise ValueError(f"the key/value heads ({k.shape[1]}) must divide the query heads ({hq})")
    sk = k.shape[2]
    if key_padding_mask is not None:
        if key_padding_mask.shape != (b, sk):
            raise ValueError(f"key_padding_mask must be (batch, seq_k) = {(b, sk)}; "
                             f"got {tuple(key_padding_mask.shape)}")
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
    scale = d ** -0.5 if scale is None else float(scale)
    if backend == "triton" and q.shape[-1] > MAX_TRITON_HEAD_DIM:
        raise ValueError(f"the Triton kernels take head dims up to {MAX_TRITON_HEAD_DIM}, not {q.shape[-1]}")
    path = "triton" if pick(backend, (q, k, v), "triton_attention", fits=q.shape[-1] <= MAX_TRITON_HEAD_DIM) else "torch"
    (q, k, v), no_autocast = cast_once(q.device.type, q, k, v)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if path == "triton":
        if (block_q or block_k) is not None:
            block_q = block_q or block_k
            block_k = block_k or block_q
            if any(x < 16 or x & (x - 1) for x in (block_q, block_k)):
                raise ValueError(f"the Triton tiles must be powers of two >= 16; got {block_q}, {block_k}")
        fn = TritonAttention
    else:
        default_q, default_k = default_blocks(b, hq, sq, sk)
        block_q, block_k = block_q or default_q, block_k or default_k
        fn = TiledAttention
    with no_autocast:
        return fn.apply(q, k, v, key_padding_mask, bool(causal), scale, block_q, block_k)


def reference(q, k, v, causal=False, key_padding_mask=None, scale=None):
    """The plain computation, as transformers' eager_attention_forward (llama) does it: scores
    q @ k^T * scale in the input dtype, masked, softmax in fp32 (fp64 for fp64 inputs), cast back to the
    input dtype, times v. GQA by repeating the key/value heads (repeat_kv). Holds the whole sq x sk scores.

    Masked scores are set to the dtype's minimum as transformers' masks do (additive min there); a row
    with no allowed key, which eager turns into a uniform average, is 0 here, as in the tiled paths.
    """
    sq, sk = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = torch.ones((sq, sk), dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.ones_like(allowed).tril(sk - sq)  # bottom-right: j <= i + sk - sq
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(device=q.device, dtype=torch.bool)[:, None, None, :]
    return _eager(q, k, v, allowed, scale)


def _eager(q, k, v, mask, scale):
    """Eager attention under a mask broadcastable to (b, hq, sq, sk): bool (True = attend) or an additive
    float mask, which is added as transformers' eager attention adds it."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min) if mask.dtype == torch.bool else s + mask
    p = torch.softmax(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32))
    if mask.dtype == torch.bool:
        p = torch.where(mask.any(-1, keepdim=True), p, 0.0)
    return p.to(q.dtype) @ v


# ---------------------------------------------------------------------------------------------------------
# transformers integration
# ---------------------------------------------------------------------------------------------------------

NAME = "memplan"
DROPOUT_FIELDS = ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop", "dropout")


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' AttentionInterface callable: query (b, hq, sq, d), key/value (b, hkv, sk, d) ->
    ((b, sq, hq, d), None). Registered as "memplan" by `register()`.

    attention_mask is what `hf_mask` built: None (no padding), a (b, sk) bool key-padding mask (the cheap
    case: causal + padding or bidirectional + padding), or a 4D bool mask for the patterns the tiled
    kernels do not express (sliding windows, chunked or packed sequences, custom overlays, a static
    cache); the last falls back to the eager computation under that mask (correct, not memory saving).
    Causality comes from the `is_causal` kwarg or `module.is_causal`, as for sdpa and flash_attention_2.
    """
    if dropout and dropout > 0:
        config = getattr(module, "config", None)
        field = next((f for f in DROPOUT_FIELDS if getattr(config, f, 0)), "attention dropout")
        raise ValueError(f"memplan attention does not implement attention dropout (got p={dropout}); set the model "
                         f"config's `{field}` to 0, or train with another attn_implementation")
    for unsupported in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"memplan attention does not support `{unsupported}`; use attn_implementation='eager'")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError("memplan attention needs the same head dim for queries and values")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if attention_mask is not None and attention_mask.dim() == 4:  # bool from hf_mask, or a user's own mask
        out = _eager(query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling)
    else:
        # bottom-right causal: a single decoding query sees every key, as it must
        out = attention(query, key, value, causal=bool(is_causal), key_padding_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def hf_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
            **kwargs):
    """transformers' AttentionMaskInterface callable for "memplan": the cheap (b, kv_length) bool key padding
    mask (or None without padding) when the pattern is plain causal or bidirectional, and the causal
    alignment is bottom-right (the queries are the last q_length keys, as in training and with a dynamic
    cache). Anything else gets sdpa's full 4D bool mask, which hf_attention honours through the eager path.
    """
    from transformers.masking_utils import (bidirectional_mask_function, causal_mask_function, prepare_padding_mask,
                                            sdpa_mask)

    mask_function = causal_mask_function if mask_function is None else mask_function
    aligned = (isinstance(q_offset, int) and isinstance(kv_offset, int)
               and q_offset + q_length == kv_offset + kv_length)
    plain = mask_function is bidirectional_mask_function or (mask_function is causal_mask_function and aligned)
    if not plain:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         **{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})
    if attention_mask is None:
        return None
    # no .all() check for "no padding": it would sync with the GPU and cannot run on fake tensors
    padding = prepare_padding_mask(attention_mask.bool(), kv_length, kv_offset)
    return padding[:, kv_offset:kv_offset + kv_length]


def register() -> None:
    """Make "memplan" an attn_implementation of transformers (AttentionInterface) with its cheap mask
    (AttentionMaskInterface). Then: `AutoModel.from_config(config, attn_implementation="memplan")`,
    `from_pretrained(..., attn_implementation="memplan")` or `model.set_attn_implementation("memplan")`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, hf_attention)
    AttentionMaskInterface.register(NAME, hf_mask)
