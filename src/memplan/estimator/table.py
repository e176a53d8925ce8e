"""The estimator and the cost model over a table of candidates: every setting of one layout's knobs
(rows) x every micro batch (columns) at once, in numpy, for `suggest`.

This is `estimator._stage_numbers` + `estimator.peak` (for the device-used meter) and `cost.step_time`
written over arrays: the same terms in the same order, so a search of tens of thousands of candidates
takes a fraction of a second. tests/test_table.py holds every cell equal to the scalar `peak` and
`step_time`, and every plan `suggest` shows is estimated again by the scalar path.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from memplan.search import cost
from memplan.estimator.activations import training_activations
from memplan.estimator.step import (
    ACTIVATION_FRAGMENTATION, CUBLAS_WORKSPACE, _act_segments, _memo, _stage_acts, _stage_states,
    ACT_SUMS, _tied_grad_sum, _train_precision, half_model, is_log_softmax, StageActs, StageStates,
)
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.estimator.rules import (
    ALLOC_LARGE_BUFFER, ALLOC_MIN_BLOCK, ALLOC_MIN_LARGE_ALLOC, ALLOC_ROUND_LARGE, ALLOC_SMALL_BUFFER,
    ALLOC_SMALL_SIZE, PRECISIONS,
)
from memplan.inputs.workload import Workload

PHASES = ("forward-loss", "backward-start", "backward-layer", "optimizer-step", "backward-end")


class Table(NamedTuple):
    """One layout's candidates: rows are `bases`, columns the micro batches `mbs` (m = per_rank // mb)."""

    device_used: np.ndarray  # (B, K) bytes
    cpu_per_gpu: np.ndarray  # (B, K)
    params_per_gpu: np.ndarray  # (B, K)
    saved: np.ndarray  # (B, K) saved activation bytes (the cost model's traffic)
    state: np.ndarray  # (B, K) weights + gradients + optimizer states
    step: np.ndarray  # (B, K) seconds per optimizer step
    terms: np.ndarray  # (6, B, K) the step's terms (cost.StepTime order)


def _col(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)[:, None]


def _stage(spec: ModelSpec, bases: list[Workload], stage: int, mbs: np.ndarray, ms: np.ndarray):
    """(phases (5, B, K), fields) of one pipeline stage: `_stage_numbers` over the table."""
    B, K = len(bases), len(mbs)
    acc = ms > 1  # (K,)
    w0 = bases[0]
    first, last = stage == 0, stage == w0.pp - 1
    sts = []
    for w in bases:  # accumulation changes the states only through offload's host buffer (ZeRO-1/2)
        one = _stage_states(spec, w, stage, False)
        sts.append((one, _stage_states(spec, w, stage, True) if w.offload != "none" and w.zero in (1, 2) else one))
    # every numeric field of the stage states, (B, 2, F): without and with gradient accumulation
    numeric = np.array([[s[0], s[1]] for s in sts], dtype=np.int64)
    position = {name: i for i, name in enumerate(StageStates._fields)}

    # (B, K, F): each cell's states, with accumulation where the cell accumulates (one numpy call, not one
    # per field)
    cells = np.where(acc[None, :, None], numeric[:, None, 1, :], numeric[:, None, 0, :])

    def st_field(name: str) -> np.ndarray:
        return cells[:, :, position[name]]

    # activation sums per (distinct activation key, micro batch), gathered to rows
    keys: dict = {}
    reps: list[Workload] = []  # one workload per distinct activation model
    rows = []
    for w in bases:
        k = (w.precision, w.attn == "eager", w.grad_ckpt, w.sp, half_model(w), w.kernels, w.tiled_mlp)
        if k not in keys:
            keys[k] = len(reps)
            reps.append(w)
        rows.append(keys[k])
    ridx = np.asarray(rows)
    # every byte sum of the activation models, (U, K, F), gathered to the rows on use
    units = _stacked(spec, reps)
    sums = _act_sums(spec, reps, units, mbs)
    sa_position = {name: i - 1 for i, name in enumerate(StageActs._fields)}

    def sa_field(name: str) -> np.ndarray:
        return sums[:, :, sa_position[name]][ridx]

    n_enc = sts[0][0].n_enc
    n_dec = sts[0][0].n_dec
    n_layers = n_enc + n_dec
    # micro batches in flight (estimator.in_flight)
    if w0.pp > 1:
        flight = np.minimum(w0.pp - stage, ms).astype(np.float64)[None, :].repeat(B, 0)
        vpp = _col([w.vpp for w in bases])
        if stage == 0:
            inter = np.minimum(flight * (1 + (w0.pp - 1) / (w0.pp * vpp)), ms[None, :])
            flight = np.where(vpp > 1, inter, flight)
    else:
        flight = np.ones((B, K))
    embed_b = sa_field("embed") if first else np.zeros((B, K), np.int64)
    head_b = sa_field("head_saved") if last else np.zeros((B, K), np.int64)
    lsm = sa_field("lsm") if last else np.zeros((B, K), np.int64)
    full = _col([w.grad_ckpt == "full" for w in bases]).astype(bool)
    selective = _col([w.grad_ckpt == "selective" for w in bases]).astype(bool)
    layer, dec = sa_field("layer"), sa_field("decoder_layer")
    acts_full = flight * (n_layers * sa_field("layer_input") + embed_b) + head_b
    acts_rest = flight * (n_enc * layer + n_dec * dec + embed_b) + head_b
    acts = np.where(full, acts_full, acts_rest).astype(np.int64)  # int() of a positive float truncates
    recompute = np.where(full, np.maximum(layer, dec), np.where(selective, sa_field("layer_core"), 0))

    c_all, c_head, c_mlp = st_field("c_all"), st_field("c_head"), st_field("c_mlp")
    tiled = _col([w.tiled_mlp for w in bases]).astype(bool)
    c_bwd = np.where(full, c_head + (c_all - c_head) // max(n_layers, 1), c_all - np.where(tiled, c_mlp, 0))
    c_mlp_layer = np.where(tiled & ~full, c_mlp // max(n_layers, 1), 0)
    zeros = _col([w.zero_grad == "zeros" for w in bases]).astype(bool)
    grads_in_fwd = zeros | acc[None, :] | st_field("grads_persistent").astype(bool)
    grads = st_field("grads")
    g_live = np.where(grads_in_fwd, grads, 0)
    g_head = np.where(grads_in_fwd, 0, st_field("head_grads"))
    loss_fwd = sa_field("loss_forward") if last else 0
    loss_bwd = sa_field("loss_backward") if last else 0
    layer_bwd = sa_field("layer_backward") + c_mlp_layer

    weights, states, comm, gathered, temp = (st_field(f) for f in ("weights", "states", "comm", "gathered", "temp"))
    base = weights + states + g_live + comm + gathered
    tied = st_field("tied") > 0
    ds = _col([half_model(w) for w in bases]).astype(bool)
    grad_bytes = [PRECISIONS[w.precision].grad for w in bases]
    tied_live = _col([_tied_grad_sum(spec, g, True, w.tp) for w, g in zip(bases, grad_bytes)])
    tied_none = _col([_tied_grad_sum(spec, g, False, w.tp) for w, g in zip(bases, grad_bytes)])
    tied_sum = np.where(tied & ~ds, np.where(grads_in_fwd, tied_live, tied_none), 0)
    step_phase = weights + grads + states + temp + comm
    phases = np.stack([
        base + c_all + acts + loss_fwd,
        base + c_bwd + acts + loss_bwd,
        base + c_bwd + acts - lsm + g_head + recompute + layer_bwd,
        step_phase,
        np.where(tied_sum > 0, weights + states + grads + comm + tied_sum, -1),
    ])
    transient = np.stack([np.broadcast_to(loss_fwd, (B, K)), np.broadcast_to(loss_bwd, (B, K)),
                          recompute + layer_bwd, np.zeros((B, K), np.int64), tied_sum])
    fields = dict(acts=acts, lsm=lsm, transient=transient, flight=flight, sts=sts, ridx=ridx, reps=reps, units=units,
                  st_field=st_field, n_layers=n_layers)
    return phases, fields


# -- the activation models over the micro batches ------------------------------------------------------
# Every activation term is affine in the micro batch b: activations.py builds each from T = b*s, b*a*s*s,
# b*s*E ..., and a few are shared by the batch (T5's position bias), except the blocks of memplan's
# kernels (the fused loss, the tiled MLP), whose sizes depend on the token count. So the models at b = 1
# and b = 2, before tensor-parallel sharding, give every micro batch's tensors as (c + mb * x) / tp, the same float the scalar path
# computes as bytes(mb) / tp (tests/test_table.py checks this over the catalog); the allocator's
# rounding is then applied per tensor, for all the distinct activation models of a layout and all micro
# batches at once.
_LISTS = ACT_SUMS  # StageActs' sums, in its order
_LIST = {name: i for i, name in enumerate(_LISTS)}
_MOMENT_LIST = {"forward-loss": _LIST["loss_forward"], "backward-start": _LIST["loss_backward"],
                "backward-layer": _LIST["layer_backward"]}


class _Units(NamedTuple):
    """The tensors of one activation model, unsharded, every list in one: bytes(b) = c + b * x."""

    c: np.ndarray  # (T,) float64 bytes of one tensor that do not grow with the batch
    x: np.ndarray  # (T,) float64 bytes of one tensor per sequence of the micro batch
    count: np.ndarray  # (T,) int64
    rep: np.ndarray  # (T,) bool: replicated under TP unless SP (activations.shard)
    member: np.ndarray  # (T, F) int64: 1 where the tensor belongs to list f (lsm is part of head_saved)


class _Stack(NamedTuple):
    """The units of a layout's distinct activation models, padded to one width T: (R, T) arrays."""

    c: np.ndarray
    x: np.ndarray
    count: np.ndarray
    div: np.ndarray  # int64: tp where the tensor is sharded, else 1
    member: np.ndarray  # (R, T, F)


def _units(spec: ModelSpec, w: Workload) -> _Units:
    prec = _train_precision(w)
    key = ("unit-acts", w.seq_len, prec.name, w.attn == "eager", w.grad_ckpt)

    def make() -> _Units:
        one, two = (training_activations(spec, b, w.seq_len, prec, w.attn, selective=w.grad_ckpt == "selective",
                                         kv_cache=w.grad_ckpt != "full") for b in (1, 2))
        every, rows = [], []
        for name in _LISTS:
            if name == "lsm":
                continue
            for t, t2 in zip(getattr(one, name), getattr(two, name), strict=True):
                every.append((t, t2))
                row = [0] * len(_LISTS)
                row[_LIST[name]] = 1
                if name == "head_saved" and is_log_softmax(t):
                    row[_LIST["lsm"]] = 1
                rows.append(row)
        n1 = np.array([float(t.nbytes) for t, _ in every])
        n2 = np.array([float(t2.nbytes) for _, t2 in every])
        return _Units(2 * n1 - n2, n2 - n1, np.array([t.count for t, _ in every], np.int64),
                      np.array([t.rep for t, _ in every], bool), np.array(rows, np.int64).reshape(-1, len(_LISTS)))
    return _memo(spec, key, make)


def _stacked(spec: ModelSpec, reps: list[Workload]) -> _Stack:
    """The reps' units padded to one width (a padding tensor has 0 bytes and belongs to no list)."""
    us = [_units(spec, w) for w in reps]
    width = max(len(u.x) for u in us)
    R = len(us)
    c, x = np.zeros((R, width)), np.zeros((R, width))
    count, div = np.zeros((R, width), np.int64), np.ones((R, width), np.int64)
    member = np.zeros((R, width, len(_LISTS)), np.int64)
    for r, (u, w) in enumerate(zip(us, reps)):
        n = len(u.x)
        c[r, :n], x[r, :n], count[r, :n], member[r, :n] = u.c, u.x, u.count, u.member
        if w.tp > 1:
            div[r, :n] = np.where(u.rep & (not w.sp), 1, w.tp)
    return _Stack(c, x, count, div, member)


def _round_block(nbytes: np.ndarray) -> np.ndarray:
    """rules.round_block over an array of float byte counts."""
    n = np.trunc(nbytes).astype(np.int64)
    return np.where(n > 0, -(-n // ALLOC_MIN_BLOCK) * ALLOC_MIN_BLOCK, 0)


def _act_sums(spec: ModelSpec, reps: list[Workload], u: _Stack, mbs: np.ndarray) -> np.ndarray:
    """(R, K, F): estimator._stage_acts' rounded sums (StageActs[1:]) of every rep at every micro batch
    (u: `_stacked(reps)`)."""
    n = _round_block((u.c[:, None, :] + mbs[None, :, None] * u.x[:, None, :]) / u.div[:, None, :])  # (R, K, T)
    sums = np.einsum("rkt,rtf->rkf", n * u.count[:, None, :], u.member)
    for r, w in enumerate(reps):
        if w.kernels or w.tiled_mlp:  # blocks sized by the token count: the scalar path, one model per micro batch
            sums[r] = np.array([_stage_acts(spec, w, int(mb))[1:] for mb in mbs], dtype=np.int64)
    return sums


def _segments(spec: ModelSpec, reps: list[Workload], u: _Stack, stage: int, r: np.ndarray, mb: np.ndarray,
              moment: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """estimator._act_segments at U (rep r, micro batch mb, moment (index into PHASES), copies) points:
    the segments of the activation tensors alive at that moment."""
    first, last = stage == 0, stage == reps[0].pp - 1
    n = _round_block((u.c[r] + mb[:, None] * u.x[r]) / u.div[r])  # (U, T)
    # how many of each tensor are alive: its lists' multiplicities at that point
    mult = np.zeros((len(r), len(_LISTS)), np.int64)
    full = np.array([w.grad_ckpt == "full" for w in reps])[r]
    mult[:, _LIST["layer"]] = np.where(full, 0, copies)
    mult[:, _LIST["layer_input"]] = np.where(full, copies, 0)
    mult[:, _LIST["embed"]] = first
    if last:
        mult[:, _LIST["head_saved"]] = 1
        for i, name in enumerate(PHASES):
            if name in _MOMENT_LIST:
                mult[moment == i, _MOMENT_LIST[name]] = 1
    count = u.count[r] * np.einsum("utf,uf->ut", u.member[r], mult)
    # estimator._segments: small tensors packed into 2 MiB segments, 1-10 MiB ones into 20 MiB segments,
    # larger ones rounded to 2 MiB each
    small_m = (n > 0) & (n <= ALLOC_SMALL_SIZE)
    mid_m = (n > ALLOC_SMALL_SIZE) & (n < ALLOC_MIN_LARGE_ALLOC)
    large_m = n >= ALLOC_MIN_LARGE_ALLOC
    small = np.where(small_m, n * count, 0).sum(axis=1)
    per_seg = ALLOC_LARGE_BUFFER // np.where(mid_m, n, 1)
    mid = np.where(mid_m, -(-count // per_seg) * ALLOC_LARGE_BUFFER, 0).sum(axis=1)
    large = np.where(large_m, -(-n // ALLOC_ROUND_LARGE) * ALLOC_ROUND_LARGE * count, 0).sum(axis=1)
    out = -(-small // ALLOC_SMALL_BUFFER) * ALLOC_SMALL_BUFFER + mid + large
    for j in np.nonzero(np.array([w.kernels or w.tiled_mlp for w in reps])[r])[0].tolist():  # not affine: scalar
        w = reps[r[j]]
        am = _stage_acts(spec, w, int(mb[j])).am
        out[j] = _act_segments(spec, w, stage, am, int(copies[j]), PHASES[moment[j]])
    return out


def evaluate(spec: ModelSpec, gpu: GPUProfile, bases: list[Workload], mbs: list[int], per_rank: int) -> Table:
    """Every base (same layout: tp, pp, dp, gpus, nodes, seq) at every micro batch in `mbs`."""
    mb = np.asarray(mbs, dtype=np.int64)
    ms = per_rank // mb
    B, K = len(bases), len(mbs)
    pp = bases[0].pp
    stages = (0, pp - 1) if pp > 1 else (0,)
    results = [_stage(spec, bases, s, mb, ms) for s in stages]
    peaks = [ph.max(axis=0) for ph, _ in results]
    pick_last = peaks[-1] > peaks[0] if pp > 1 else np.zeros((B, K), bool)  # the later stage only if larger

    def chosen(fn):
        a = fn(results[0])
        return np.where(pick_last, fn(results[-1]), a) if pp > 1 else a

    workspace = CUBLAS_WORKSPACE[gpu.compute_capability >= (9, 0)]
    allocated = chosen(lambda r: r[0].max(axis=0)) + workspace
    # reserved: persistent segments + the activation segments of the peak moment + fragmentation
    segs = np.zeros((B, K), np.int64)
    frag_bytes = np.zeros((B, K), np.int64)
    persistent = np.zeros((B, K), np.int64)
    for si, (ph, f) in enumerate(results):
        sel = pick_last if si == len(results) - 1 and pp > 1 else ~pick_last
        idx = ph.argmax(axis=0)  # the first largest, as max() over the phases dict in order
        persistent = np.where(sel, f["st_field"]("persistent_segments"), persistent)
        act_now = np.where(idx >= 3, 0, f["acts"] - np.where(idx == 2, f["lsm"], 0))
        tr = np.take_along_axis(f["transient"], idx[None], 0)[0]
        frag_bytes = np.where(sel, act_now + tr, frag_bytes)
        # the activation segments of the peak moment, once per distinct (activation model, micro batch,
        # moment, layers held) rather than per cell
        mask = sel & (idx < 3)
        if mask.any():
            copies = f["n_layers"] * np.maximum(1, np.round(f["flight"])).astype(np.int64)
            ks = np.broadcast_to(np.arange(K), (B, K))
            top = int(copies.max()) + 1
            code = ((np.broadcast_to(f["ridx"][:, None], (B, K)) * K + ks) * 3 + idx) * top + copies
            uniq, inv = np.unique(code[mask], return_inverse=True)
            rest, cps = np.divmod(uniq, top)
            rest, moment = np.divmod(rest, 3)
            r_of, k_of = np.divmod(rest, K)
            values = _segments(spec, f["reps"], f["units"], stages[si], r_of, mb[k_of], moment, cps)
            segs[mask] = values[inv.reshape(-1)]
    reserved = persistent + segs + workspace + (ACTIVATION_FRAGMENTATION * frag_bytes).astype(np.int64)
    reserved = np.maximum(reserved, allocated)
    device_used = reserved + gpu.cuda_context_bytes
    saved = chosen(lambda r: r[1]["acts"])
    state = chosen(lambda r: r[1]["st_field"]("weights") + r[1]["st_field"]("grads") + r[1]["st_field"]("states"))
    cpu = chosen(lambda r: r[1]["st_field"]("cpu"))
    params = chosen(lambda r: r[1]["st_field"]("n_params"))
    terms = step_terms(spec, gpu, bases, mb, ms, saved, state, params)
    return Table(device_used, cpu, params, saved, state, terms.sum(axis=0), terms)


def step_terms(spec: ModelSpec, gpu: GPUProfile, bases: list[Workload], mb: np.ndarray, m: np.ndarray,
               saved: np.ndarray, state: np.ndarray, params: np.ndarray) -> np.ndarray:
    """`cost.step_time` over the table: (6, B, K) seconds, in StepTime's order."""
    C = cost
    w0 = bases[0]
    B, K = saved.shape
    seq = spec.seq_positions if spec.arch == "vision" else w0.seq_len
    tokens = (mb * seq).astype(np.float64)[None, :]
    m = m.astype(np.float64)[None, :]
    peak = _col_f([gpu.tflops.get(C.COMPUTE_DTYPE[w.precision]) or gpu.tflops.get("fp32", 1.0) for w in bases])
    width = spec.hidden_size / w0.tp
    eff = C.PEAK_EFFICIENCY * tokens / (tokens + C.TOKENS_HALF) * width / (width + C.HIDDEN_HALF)
    bw = gpu.memory_bandwidth_gbs * 1e9
    hw_f = _col_f([C.flops_per_token(spec, seq, w.attn, w.grad_ckpt, w.kernels, w.tiled_mlp)[1] for w in bases])
    dp = w0.dp
    compute_micro = hw_f * tokens / (w0.tp * w0.pp) / (peak * 1e12 * eff)
    micro = compute_micro + C.ACTIVATION_TRAFFIC * saved / bw
    compute = micro * m
    vpp = _col_f([w.vpp for w in bases])
    bubble = micro * (w0.pp - 1) / vpp
    half = _col_f([w.precision != "fp32" for w in bases]).astype(bool)
    act_bytes = np.where(half, 2.0, 4.0)
    layers = spec.total_layers / w0.pp
    intra = C.intra_node_gbs(gpu) * 1e9
    tp_comm = np.zeros((B, K))
    if w0.tp > 1:
        n_ar = _col_f([4 + (2 if w.grad_ckpt == "full" else 0) for w in bases])
        tp_comm = m * layers * n_ar * C.ring(w0.tp, 1.0, intra, "all-reduce") * tokens * spec.hidden_size * act_bytes
    pp_comm = np.zeros((B, K))
    if w0.pp > 1:
        sp_div = _col_f([w0.tp if w.sp else 1 for w in bases])
        msg = tokens * spec.hidden_size * act_bytes / sp_div
        p2p_bw = C._group_bw(gpu, w0, w0.tp * dp, w0.pp)
        pp_comm = 2 * m * vpp * msg / p2p_bw
    zero = _col_f([w.zero for w in bases])
    fsdp = [w.fsdp for w in bases]
    sharded = (zero > 0) | _col_f([f != "none" for f in fsdp]).astype(bool)
    g_bytes = params * np.where(half & sharded, 2.0, 4.0)
    p_bytes = params * np.where(half, 2.0, 4.0)
    dpbw = C._group_bw(gpu, w0, w0.tp, dp)
    backward = 2 / 3 * compute_micro
    dp_comm = np.zeros((B, K))
    if dp > 1:
        ar, ag = C.ring(dp, 1.0, dpbw, "all-reduce"), C.ring(dp, 1.0, dpbw, "all-gather")
        z01 = np.maximum(ar * g_bytes - backward, 0.0)
        z2 = m * np.maximum(ag * g_bytes - backward, 0.0) + ag * p_bytes
        z3 = m * np.maximum(2 * ag * p_bytes + ag * g_bytes - compute_micro, 0.0)
        dp_comm = np.where(zero <= 1, z01, np.where(zero == 2, z2, z3))
        for i, f in enumerate(fsdp):
            if f == "none":
                continue
            n = w0.gpus if f == "hybrid-shard" else dp
            bw_n = C._group_bw(gpu, w0, 1, n)
            gathers = 1 if f == "shard-grad-op" else 2
            per = gathers * C.ring(n, 1.0, bw_n, "all-gather") * p_bytes[i] + C.ring(n, 1.0, bw_n, "reduce-scatter") * g_bytes[i]
            row = m[0] * np.maximum(per - compute_micro[i], 0.0)
            if f == "hybrid-shard":
                row = row + C.ring(dp // n, 1.0, C.inter_node_gbs(gpu, w0) * 1e9, "all-reduce") * g_bytes[i] / n
            dp_comm[i] = row
    n_opt = params / np.where(sharded, dp, 1)
    offload = [w.offload for w in bases]
    gpu_opt = C.OPTIMIZER_TRAFFIC * state / bw
    pcie = gpu.pcie_gbs * C.LINK_EFFICIENCY * 1e9
    cpu_opt = (C.CPU_ADAM_BYTES_PER_PARAM * n_opt * w0.gpus / (C.HOST_MEMORY_GBS * 1e9)
               + (m * 2 * n_opt + 2 * n_opt) / pcie)
    all_extra = m * 2 * (params / dp) * 2 / pcie
    off = _col_f([o != "none" for o in offload]).astype(bool)
    off_all = _col_f([o == "all" for o in offload]).astype(bool)
    optimizer = np.where(off, cpu_opt + np.where(off_all, all_extra, 0.0), gpu_opt)
    return np.stack([np.broadcast_to(x, (B, K)) for x in (compute, bubble, tp_comm, pp_comm, dp_comm, optimizer)])


def _col_f(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)[:, None]
