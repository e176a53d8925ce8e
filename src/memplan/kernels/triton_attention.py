"""Triton kernels of memplan's tiled attention (the algorithm and its sources: kernels/attention.py).

Four kernels, all in the SDPA layout (batch, heads, sequence, head dim), any strides:

- `_fwd_kernel`, grid (query blocks, batch x query heads): one block of queries against every key block
  it can see, with the online softmax (running max m, running sum l, fp32 accumulator); writes the output
  and the fp32 log-sum-exp of each row (+inf for a row that sees no key: its output is 0).
- `_bwd_preprocess_kernel`: D = rowsum(dO * O) in fp32.
- `_bwd_dkdv_kernel`, grid (key blocks, batch x key/value heads): one block of keys and values against
  every query block of every query head of its GQA group; dK and dV are summed in registers and written
  once, so there are no atomics and the result is deterministic.
- `_bwd_dq_kernel`, grid (query blocks, batch x query heads): one block of queries against its key
  blocks, dQ summed in registers.

The head dimension is a constexpr padded to a power of two (80 -> 128) with masked loads and stores.
Tile sizes are arguments: given explicitly they are used as they are; otherwise `triton.autotune` picks
among a few configurations on CUDA, and the interpreter (TRITON_INTERPRET=1, CPU tensors) runs one small
fixed tile. Causal masking is bottom-right aligned (query i sees key j iff j <= i + sk - sq), and the
kernels skip the key (or query) blocks it fully masks.

Interpreter caveats (triton 3.9, triton/runtime/interpreter.py), worked around under the interpreter
only (the INTERP constexpr), so that it computes what the GPU computes:
- it stores bf16 as uint16 (numpy has no bf16) and its tl.dot multiplies those bit patterns as
  integers: `_dot` up-casts the operands to fp32 first (exact products, fp32 sums: the tensor cores' math);
- its fp32 -> bf16 cast truncates: `_to` rounds to nearest even on the bits, as the GPU does.
It also runs every program of the grid one after another in numpy, so it is for small shapes only.

Imported lazily by kernels/attention.py: importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# decided when the kernels below are decorated, so it must be read now, not at call time
INTERPRETED = bool(triton.knobs.runtime.interpret)
INTERPRETED_BLOCK = 16  # the smallest tile tl.dot takes


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, INTERP: tl.constexpr):
    if INTERP:  # Triton's interpreter multiplies bf16 as the raw uint16 bits: give it fp32 (exact products)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _to(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """fp32 x in `dtype`, rounded to nearest even as the GPU rounds."""
    if INTERP and dtype == tl.bfloat16:
        # the interpreter's own fp32 -> bf16 cast truncates: round on the bits (ties to even) instead
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, KPM,
                sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, skpm,
                scale, H, G, SQ, SK, OFF, HEAD_DIM,
                IS_CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)  # int64 base offsets: b * stride overflows int32 for large batches
    h = (pid_bh % H).to(tl.int64)
    hk = h // G  # GQA: query head h reads key/value head h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < SQ
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = SK
    if IS_CAUSAL:  # key blocks past the block's last query (bottom-right) are fully masked: not visited
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M + OFF)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < SK
        k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :] * skd, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, INTERP) * scale
        ok = n_ok[None, :] & m_ok[:, None]
        if IS_CAUSAL:
            ok = ok & (cols[None, :] <= offs_m[:, None] + OFF)
        if HAS_KPM:
            keep = tl.load(KPM + b * skpm + cols, mask=n_ok, other=0)
            ok = ok & (keep != 0)[None, :]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no allowed key yet keeps m = -inf; shift it by 0 so exp gives 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_shift[:, None])
        alpha = tl.exp(m_i - m_shift)  # rescales what was summed under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :] * svd, mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc = acc * alpha[:, None] + _dot(_to(p, v.dtype, INTERP), v, PRECISION, INTERP)
        m_i = m_new

    empty = l_i == 0.0  # no allowed key at all: output 0, lse +inf (backward then gives P = 0)
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log(l_safe))
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
             _to(out, O.dtype.element_ty, INTERP), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh.to(tl.int64) * SQ + offs_m, lse, mask=m_ok)


@triton.jit
def _bwd_preprocess_kernel(O, DO, D, sob, soh, som, sod, sdob, sdoh, sdom, sdod, H, SQ, HEAD_DIM,
                           BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < SQ)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask=mask, other=0.0)
    tl.store(D + pid_bh.to(tl.int64) * SQ + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1),
             mask=offs_m < SQ)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, D, DK, DV, KPM,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
                     sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, skpm,
                     scale, H, G, SQ, SK, OFF, HEAD_DIM,
                     IS_CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)  # over batch x key/value heads
    HKV = H // G
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < SK
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    key_ok = n_ok
    if HAS_KPM:
        key_ok = key_ok & (tl.load(KPM + b * skpm + offs_n, mask=n_ok, other=0) != 0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if IS_CAUSAL:  # query rows before j - OFF cannot see key j: start at the first block that can
        lo = (tl.maximum(pid_n * BLOCK_N - OFF, 0) // BLOCK_M) * BLOCK_M
    for g in range(0, G):  # the query heads of this key/value head's group, summed here: no atomics
        h = hk * G + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        row_base = (b * H + h) * SQ  # LSE and D are (b, hq, sq) contiguous
        for start_m in range(lo, SQ, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < SQ
            qd_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=qd_mask, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask=qd_mask, other=0.0)
            lse = tl.load(LSE + row_base + offs_m, mask=m_ok, other=float("inf"))
            delta = tl.load(D + row_base + offs_m, mask=m_ok, other=0.0)
            s = _dot(q, tl.trans(k), PRECISION, INTERP) * scale
            ok = m_ok[:, None] & key_ok[None, :]
            if IS_CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None] + OFF)
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)  # the forward's softmax, recomputed
            dv += _dot(tl.trans(_to(p, do.dtype, INTERP)), do, PRECISION, INTERP)
            dp = _dot(do, tl.trans(v), PRECISION, INTERP)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(_to(ds, q.dtype, INTERP)), q, PRECISION, INTERP)
    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
             _to(dk * scale, DK.dtype.element_ty, INTERP), mask=kv_mask)
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_d[None, :] * sdvd,
             _to(dv, DV.dtype.element_ty, INTERP), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, D, DQ, KPM,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
                   sdqb, sdqh, sdqm, sdqd, skpm,
                   scale, H, G, SQ, SK, OFF, HEAD_DIM,
                   IS_CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, PRECISION: tl.constexpr, INTERP: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < SQ
    qd_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=qd_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask=qd_mask, other=0.0)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * SQ + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(D + pid_bh.to(tl.int64) * SQ + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = SK
    if IS_CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M + OFF)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < SK
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, INTERP) * scale
        ok = m_ok[:, None] & n_ok[None, :]
        if IS_CAUSAL:
            ok = ok & (cols[None, :] <= offs_m[:, None] + OFF)
        if HAS_KPM:
            ok = ok & (tl.load(KPM + b * skpm + cols, mask=n_ok, other=0) != 0)[None, :]
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), PRECISION, INTERP)
        ds = p * (dp - delta[:, None])
        dq += _dot(_to(ds, k.dtype, INTERP), k, PRECISION, INTERP)
    tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :] * sdqd,
             _to(dq * scale, DQ.dtype.element_ty, INTERP), mask=qd_mask)


def _configs(pairs):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in pairs]


# a few tiles per kernel; ones that do not fit (large head dims) fail to compile and the autotuner skips them
_TUNE_KEY = ["SQ", "SK", "BLOCK_D", "IS_CAUSAL", "HAS_KPM"]
_fwd_tuned = triton.autotune(_configs([(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)]),
                             key=_TUNE_KEY)(_fwd_kernel)
# (32, 32, 4, 2) in dkdv and dq: the only tile of these that fits fp32 at head dim 256 on sm_80 (135 of 163 KiB)
_dkdv_tuned = triton.autotune(_configs([(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 2),
                                        (32, 32, 4, 2)]), key=_TUNE_KEY)(_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(_configs([(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2),
                                      (32, 32, 4, 2)]), key=_TUNE_KEY)(_bwd_dq_kernel)


def _launch(raw, tuned, grid_rows: int, grid_cols: int, rows_block: str, block_q, block_k, args, meta):
    """Explicit tiles: the raw kernel. Under the interpreter: one small fixed tile. Else: autotuned."""
    if block_q is None and INTERPRETED:
        block_q = block_k = INTERPRETED_BLOCK
    if block_q is not None:
        tile = {"BLOCK_M": block_q, "BLOCK_N": block_k}
        raw[(triton.cdiv(grid_rows, tile[rows_block]), grid_cols)](*args, **meta, **tile)
    else:
        tuned[lambda t: (triton.cdiv(grid_rows, t[rows_block]), grid_cols)](*args, **meta)


def _common(q, k, kpm, causal):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    # fp32 inputs: a true fp32 product (tf32 would miss the fp32 tolerance); ignored for half inputs
    meta = dict(IS_CAUSAL=causal, HAS_KPM=kpm is not None, BLOCK_D=max(16, triton.next_power_of_2(d)),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INTERP=INTERPRETED)
    kpm_arg = kpm if kpm is not None else q  # a placeholder pointer; never read when HAS_KPM is False
    kpm_stride = kpm.stride(0) if kpm is not None else 0
    return b, hq, hkv, sq, sk, d, meta, kpm_arg, kpm_stride


def forward(q, k, v, causal: bool, kpm, scale: float, block_q=None, block_k=None):
    """out (b, hq, sq, d) over (b, sq, hq, d) storage, lse (b, hq, sq) fp32. kpm: (b, sk) int8 (1 = attend)
    or None."""
    b, hq, hkv, sq, sk, d, meta, kpm_arg, kpm_stride = _common(q, k, kpm, causal)
    # (b, sq, hq, d) storage, as the PyTorch path: transformers' transpose(1, 2).contiguous() is a view
    out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    args = (q, k, v, out, lse, kpm_arg, *q.stride(), *k.stride(), *v.stride(), *out.stride(), kpm_stride,
            scale, hq, hq // hkv, sq, sk, sk - sq, d)
    _launch(_fwd_kernel, _fwd_tuned, sq, b * hq, "BLOCK_M", block_q, block_k, args, meta)
    return out, lse


def backward(do, q, k, v, out, lse, causal: bool, kpm, scale: float, block_q=None, block_k=None):
    """dq, dk, dv (each like its input)."""
    b, hq, hkv, sq, sk, d, meta, kpm_arg, kpm_stride = _common(q, k, kpm, causal)
    delta = torch.empty_like(lse)
    pre_block = INTERPRETED_BLOCK if INTERPRETED else 64
    _bwd_preprocess_kernel[(triton.cdiv(sq, pre_block), b * hq)](
        out, do, delta, *out.stride(), *do.stride(), hq, sq, d, BLOCK_D=meta["BLOCK_D"], BLOCK_M=pre_block)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    tail = (scale, hq, hq // hkv, sq, sk, sk - sq, d)
    _launch(_bwd_dkdv_kernel, _dkdv_tuned, sk, b * hkv, "BLOCK_N", block_q, block_k,
            (q, k, v, do, lse, delta, dk, dv, kpm_arg, *common, *dk.stride(), *dv.stride(), kpm_stride, *tail), meta)
    _launch(_bwd_dq_kernel, _dq_tuned, sq, b * hq, "BLOCK_M", block_q, block_k,
            (q, k, v, do, lse, delta, dq, kpm_arg, *common, *dq.stride(), kpm_stride, *tail), meta)
    return dq, dk, dv
