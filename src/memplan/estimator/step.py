"""The memory of a training step, over a table of candidates: rows are workloads of one layout (same
tp, pp, dp, GPUs, sequence), columns micro batches. `suggest` evaluates whole tables; `estimate` is a
one-cell table. No torch.

A training step is a sequence of moments; the peak is the largest of them (docs/estimator.md):
  forward-loss    weights + states + autocast copies + saved activations + logits while the loss runs
  backward-start  ... + the loss gradient chain (dL/dlogp, dL/dlogits in fp32)
  backward-layer  ... + the head's gradients + one layer's grad buffers (+ its recompute under checkpointing)
  backward-last-layer  the last layer backward runs (the first block): the other layers' saved activations are
                  freed and their weight gradients made (set-to-none, one micro batch); under full checkpointing
                  or at small batches the gradients outweigh what was freed
  optimizer-step  weights + gradients + states + the optimizer's temporaries
  backward-end    (tied heads) weights + gradients + states + the tied matrix's two gradients being summed
States count from the second step on (created lazily by the first step()), which is the steady state.
Under pipeline parallelism the worst stage is the first (most activations in flight) or the last (the
head and the loss).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from memplan.estimator import activation_arrays as A, traced
from memplan.estimator.activations import shard
from memplan.estimator.allocation import round_block, segments
from memplan.estimator.breakdown import MemoryBreakdown, Peak, allocator_mode, report, usable_bytes
from memplan.estimator.finetune import Tuning, unquantised_note
from memplan.estimator.inference import inference_peak
from memplan.estimator.meters import Meters, gpu_workspace, meters
from memplan.estimator.serving_timeline import ServingKey, serving_replayable
from memplan.estimator.timeline import Capped, ReplayKey, StepKey, replay, replay_within, replayable
from memplan.estimator.rules import OPTIMIZERS, PRECISIONS
from memplan.estimator.states import StageStates, StatesKey, half_model, states_row, tied_grad_sum
from memplan.inputs import constraints
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import Workload
from memplan.search import cost

PHASES = ("forward-loss", "backward-start", "backward-layer", "backward-last-layer", "optimizer-step", "backward-end")
FORWARD_LOSS, BACKWARD_START, BACKWARD_LAYER, BACKWARD_LAST, OPTIMIZER_STEP, BACKWARD_END = range(len(PHASES))
# the activation lists alive at a moment besides the saved ones (none at the optimizer step)
MOMENT_LIST = {FORWARD_LOSS: "loss_forward", BACKWARD_START: "loss_backward", BACKWARD_LAYER: "layer_backward",
               BACKWARD_LAST: "layer_backward"}
LAYER_BACKWARD = (BACKWARD_LAYER, BACKWARD_LAST)
# the per-layer activation lists, one set per layer and micro batch held (StageCells.held)
HELD_LISTS = ("layer", "decoder_layer", "frozen_layer", "frozen_decoder_layer")
# the order in which a step's forward meets them, by HELD_LISTS index: a frozen encoder-side block before the trained
# ones under freeze, an encoder layer before a decoder's; backward reaches the first of these last
FORWARD_ORDER = (2, 0, 3, 1)


# -- one pipeline stage over the table -------------------------------------------------------------
class StageCells(NamedTuple):
    """One pipeline stage's byte counts at every cell: (B, K) arrays, phases and transients (6, B, K)."""

    phases: np.ndarray
    transient: np.ndarray
    kv_cache: np.ndarray  # the KV cache no saved tensor is (activations._cache_copies: recorded blocks and the rest)
    weights: np.ndarray
    adapters: np.ndarray  # part of weights
    quant_constants: np.ndarray  # part of weights
    states: np.ndarray
    managed: np.ndarray  # paged optimizer states: device used only
    comm: np.ndarray
    gathered: np.ndarray
    temp: np.ndarray
    grads: np.ndarray
    g_live: np.ndarray  # gradients alive through forward (accumulation, zeros, ZeRO's persistent buffers)
    g_head: np.ndarray  # the head's gradients, allocated first in backward otherwise
    c_all: np.ndarray  # autocast's half copies in forward
    c_bwd: np.ndarray  # ... and those alive in backward
    c_start: np.ndarray  # ... and at its start (full checkpointing: the head's only)
    c_last: np.ndarray  # ... and at the last layer's backward (the first block's)
    acts: np.ndarray  # saved activations of the micro batches in flight
    acts_last: np.ndarray  # ... at the last layer's backward: the current micro batch's first block and embeddings
    g_done: np.ndarray  # gradients made by then beyond g_live: the head's and the other layers'
    lsm: np.ndarray  # the loss's saved log-softmax output (freed in the last layer's backward)
    cpu: np.ndarray
    n_params: np.ndarray
    n_trained: np.ndarray
    persistent: np.ndarray  # the persistent tensors' segments
    flight: np.ndarray  # micro batches in flight (float: the interleaved schedule's average)
    held: np.ndarray  # (4, B, K) per-layer activation sets held, layers x micro batches in flight, by HELD list
    held_last: np.ndarray  # (4, B, K) ... at the last layer's backward
    n_layers: int


def in_flight(bases: list[Workload], stage: int, ms: np.ndarray) -> np.ndarray:
    """(B, K) micro batches whose activations stage `stage` holds at once under 1F1B: pp - stage, at most
    the micro batches of the step; the interleaved schedule (vpp virtual stages) holds
    1 + (pp - 1) / (pp * vpp) times more on the first stage (Narayanan et al. 2021; Megatron's
    theoretical_memory_usage.py, interleaved_schedule_memory_penalty)."""
    pp = bases[0].pp
    flight = np.broadcast_to(np.minimum(pp - stage, ms).astype(np.float64), (len(bases), len(ms)))
    if pp > 1 and stage == 0:
        vpp = _col([w.vpp for w in bases])
        flight = np.where(vpp > 1, np.minimum(flight * (1 + (pp - 1) / (pp * vpp)), ms[None, :]), flight)
    return flight


def _states(spec: ModelSpec, bases: list[Workload], stage: int, ms: np.ndarray):
    """(B, K) array of each StageStates field, by name: with the accumulation variant where m > 1."""
    keys = [StatesKey.of(spec, w, stage) for w in bases]
    numeric = np.stack([(states_row(k), states_row(k.accumulated())) for k in keys])  # (B, 2, F)
    cells = np.where((ms > 1)[None, :, None], numeric[:, None, 1, :], numeric[:, None, 0, :])  # (B, K, F)
    return {name: cells[:, :, i] for i, name in enumerate(StageStates._fields)}


def _activation_sums(sums: np.ndarray, rows: np.ndarray, first: bool, last: bool) -> dict[str, np.ndarray]:
    """Each list's (B, K) sum for this stage (embeddings on the first, the head and loss on the last)."""
    gathered = sums[rows]  # (B, K, F)
    out = {name: gathered[:, :, i] for i, name in enumerate(A.LISTS)}
    zero = np.zeros_like(out["layer"])
    if not first:
        out["embed"] = zero
    if not last:  # no loss here: nor a model output holding the KV cache until it
        out |= {name: zero for name in ("head_saved", "lsm", "loss_forward", "loss_backward", "forward_cache",
                                        "unrecorded_cache")}
    return out


def stage_cells(spec: ModelSpec, bases: list[Workload], stage: int, ms: np.ndarray, stack: A.Stack,
                sums: np.ndarray) -> StageCells:
    B, K = len(bases), len(ms)
    st = _states(spec, bases, stage, ms)
    sa = _activation_sums(sums, stack.rows, stage == 0, stage == bases[0].pp - 1)
    n_layers = int(st["n_enc"][0, 0] + st["n_dec"][0, 0])
    n_enc, n_dec = st["grad_enc"], st["grad_dec"]  # (B, K) the trained layers autograd records (freeze: fewer)
    f_enc, f_dec = st["frozen_enc"], st["frozen_dec"]  # freeze: the frozen blocks it records too
    recorded = n_enc + n_dec + f_enc + f_dec
    flight = in_flight(bases, stage, ms)
    flags = np.array([(w.grad_ckpt == "full", w.grad_ckpt == "selective", w.tiled_mlp, w.zero_grad == "zeros")
                      for w in bases])  # (B, 4)
    full, selective, tiled, zeros = (flags[:, i:i + 1] for i in range(4))
    layer, dec = sa["layer"], sa["decoder_layer"]
    acts_full = flight * (recorded * sa["layer_input"] + sa["embed"]) + sa["head_saved"]
    acts_rest = flight * (n_enc * layer + n_dec * dec + f_enc * sa["frozen_layer"] + f_dec * sa["frozen_decoder_layer"]
                          + sa["embed"]) + sa["head_saved"]
    acts = np.where(full, acts_full, acts_rest).astype(np.int64)  # int() of a positive float truncates
    # full: one layer's activations rebuilt during its backward; selective: one layer's attention core
    recompute = np.where(full, np.maximum(layer, dec), np.where(selective, sa["layer_core"], 0))
    # The tiled MLP runs its forward without autograd, so no graph keeps the MLP weights' autocast copies:
    # they go with autocast's cache when the forward ends, and its backward casts one layer's again.
    c_all, c_head, c_mlp = st["c_all"], st["c_head"], st["c_mlp"]
    c_bwd = np.where(full, c_head + (c_all - c_head) // max(n_layers, 1), c_all - np.where(tiled, c_mlp, 0))
    # under full checkpointing nothing saved the layers' casts: when the forward's autocast cache goes, only the
    # head's (its matmul saved it) is left until a layer's recomputation casts that layer's again (traced: the
    # autocast_cache gap of every bf16 full-checkpoint case, e.g. GLM-4-MoE +5 MiB of 207)
    c_start = np.where(full, c_head, c_bwd)
    # at the last layer's backward every other layer's backward has freed the casts its matmuls saved, and the head's
    # too: the first block's are left (under full checkpointing, those its recomputation made)
    c_last = (c_all - c_head - np.where(tiled & ~full, c_mlp, 0)) // max(n_layers, 1)
    c_mlp_layer = np.where(tiled & ~full, c_mlp // max(n_layers, 1), 0)
    grads_in_fwd = zeros | (ms > 1)[None, :] | st["grads_persistent"].astype(bool)
    g_live = np.where(grads_in_fwd, st["grads"], 0)
    g_head = np.where(grads_in_fwd, 0, st["head_grads"])
    layer_bwd = recompute + sa["layer_backward"] + c_mlp_layer
    tied_sum = _tied_sums(spec, bases, st, grads_in_fwd)
    held = np.maximum(1, np.round(flight)).astype(np.int64)
    per_mb = np.stack([n_enc, n_dec, f_enc, f_dec]).astype(np.int64)  # one micro batch's layer sets, by HELD list
    first_block = _first_block(per_mb)
    sets = per_mb * held
    acts_last, g_done = _last_layer(sa, per_mb, first_block, full, acts, g_head, st, grads_in_fwd)
    last_bwd = np.where(full, _first_list(sa, first_block), recompute) + sa["layer_backward"] + c_mlp_layer
    base = st["weights"] + st["states"] + g_live + st["comm"] + st["gathered"]
    after_backward = st["weights"] + st["states"] + st["grads"] + st["comm"]
    kv = recorded * sa["forward_cache"] + (n_layers - recorded) * sa["unrecorded_cache"]  # _cache_copies
    phases = np.stack([
        base + c_all + acts + kv + sa["loss_forward"],
        base + c_start + acts + sa["loss_backward"],
        base + c_bwd + acts - sa["lsm"] + g_head + layer_bwd,
        np.where(per_mb.sum(axis=0) > 1, base + c_last + acts_last + g_done + last_bwd, -1),
        after_backward + st["temp"],
        np.where(tied_sum > 0, after_backward + tied_sum, -1),
    ])
    zero = np.zeros((B, K), np.int64)
    transient = np.stack([sa["loss_forward"], sa["loss_backward"], layer_bwd, last_bwd, zero, tied_sum])
    return StageCells(phases, transient, kv, st["weights"], st["adapters"], st["quant_constants"], st["states"],
                      st["managed"], st["comm"], st["gathered"], st["temp"], st["grads"], g_live, g_head, c_all, c_bwd,
                      c_start, c_last, acts, acts_last, g_done, sa["lsm"], st["cpu"], st["n_params"],
                      st["n_trained"], st["persistent_segments"], flight, sets, sets - per_mb + first_block, n_layers)


def _first_block(per_mb: np.ndarray) -> np.ndarray:
    """(4, B, K) one-hot of the HELD list of the block backward reaches last: the first recorded one (a frozen
    block before the trained ones under freeze; an encoder layer before a decoder's)."""
    out = np.zeros_like(per_mb)
    taken = np.zeros(per_mb.shape[1:], bool)
    for i in FORWARD_ORDER:
        here = (per_mb[i] > 0) & ~taken
        out[i] = here
        taken |= here
    return out


def _first_list(sa: dict, first_block: np.ndarray) -> np.ndarray:
    """(B, K) one block's saved bytes of the block backward reaches last (its recompute under full checkpointing): a
    frozen block's list under freeze when the frozen blocks are recorded, an encoder layer's in an encoder-decoder."""
    return (first_block * np.stack([sa[name] for name in HELD_LISTS])).sum(axis=0)


def _last_layer(sa: dict, per_mb: np.ndarray, first_block: np.ndarray, full: np.ndarray, acts: np.ndarray,
                g_head: np.ndarray, st: dict, grads_in_fwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(activations, gradients beyond g_live) while the last layer's backward runs: the current micro batch holds
    only its first block's saved tensors (full checkpointing: its input) and the embeddings', its head's are gone;
    without gradients alive through forward the head's and every other trained layer's weight gradients exist
    (a replica's: ZeRO and FSDP reduce them into their own partitions as backward goes; traced: ELECTRA's and
    XLM-RoBERTa's full-checkpointing steps peak there, 4-5 % above the first layer's backward)."""
    lists = np.stack([sa[name] for name in HELD_LISTS])  # (4, B, K) one block's saved bytes, by HELD list
    blocks = np.where(full, per_mb.sum(axis=0) * sa["layer_input"], (per_mb * lists).sum(axis=0))
    first = np.where(full, sa["layer_input"], _first_list(sa, first_block))
    acts_last = acts - blocks - sa["head_saved"] + first
    trained = per_mb[0] + per_mb[1]
    frozen_first = (first_block[2] + first_block[3]) > 0  # freeze: every trained layer is done by then
    done = np.where(frozen_first, st["layer_grads"], st["layer_grads"] * np.maximum(trained - 1, 0)
                    // np.maximum(trained, 1))
    return acts_last, np.where(grads_in_fwd, 0, g_head + done)


def _tied_sums(spec: ModelSpec, bases: list[Workload], st: dict, grads_in_fwd: np.ndarray) -> np.ndarray:
    """(B, K) the tied head's gradient sum at the end of backward (states.tied_grad_sum); DeepSpeed and
    FSDP reduce it in their own buffers."""
    tied = (st["tied"] > 0) & ~_col([half_model(w) for w in bases]).astype(bool)
    if not tied.any():  # untied heads (most large models), or every row a half model
        return np.zeros(tied.shape, np.int64)
    live = _col([tied_grad_sum(spec, PRECISIONS[w.precision].grad, True, w.tp) for w in bases])
    none = _col([tied_grad_sum(spec, PRECISIONS[w.precision].grad, False, w.tp) for w in bases])
    return np.where(tied, np.where(grads_in_fwd, live, none), 0)


def activations_now(c: StageCells, idx: np.ndarray) -> np.ndarray:
    """Saved activations alive at moment `idx` (the log-softmax output is freed by the last layer's
    backward; the other layers' by the first block's; none at the optimizer step)."""
    return np.select([idx >= OPTIMIZER_STEP, idx == BACKWARD_LAST, idx == BACKWARD_LAYER],
                     [0, c.acts_last, c.acts - c.lsm], c.acts)


def breakdown(c: StageCells, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Bytes per category at moment `idx` of each cell (the categories of MemoryBreakdown)."""
    step = idx >= OPTIMIZER_STEP
    return {
        "weights": c.weights - c.adapters - c.quant_constants, "adapter_weights": c.adapters,
        "quant_constants": c.quant_constants, "optimizer_states": c.states, "comm_buffers": c.comm,
        "paged_optimizer_states": c.managed,
        "transient": np.take_along_axis(c.transient, idx[None], 0)[0],
        "gradients": np.where(step, c.grads, c.g_live + np.select([idx == BACKWARD_LAYER, idx == BACKWARD_LAST],
                                                                  [c.g_head, c.g_done], 0)),
        "optimizer_temporaries": np.where(idx == OPTIMIZER_STEP, c.temp, 0),
        "gathered_params": np.where(step, 0, c.gathered),
        "autocast_cache": np.where(step, 0, np.select(
            [idx == FORWARD_LOSS, idx == BACKWARD_START, idx == BACKWARD_LAST], [c.c_all, c.c_start, c.c_last],
            c.c_bwd)),
        "activations": activations_now(c, idx),
        "kv_cache": kv_now(c, idx),
    }


def kv_now(c: StageCells, idx: np.ndarray) -> np.ndarray:
    """The forward's KV cache alive at moment `idx`: at the loss's forward only (the output holding it dies then)."""
    return np.where(idx == FORWARD_LOSS, c.kv_cache, 0)


# -- the table ------------------------------------------------------------------------------------
class Table(NamedTuple):
    """One layout's candidates: rows are `bases`, columns the micro batches `mbs` (m = per_rank // mb)."""

    allocated: np.ndarray  # (B, K) bytes
    reserved: np.ndarray
    device_used: np.ndarray
    cpu_per_gpu: np.ndarray  # host RAM that offload pins, per GPU
    params_per_gpu: np.ndarray
    saved: np.ndarray  # saved activation bytes (the cost model's traffic)
    state: np.ndarray  # weights + gradients + optimizer states
    step: np.ndarray  # seconds per optimizer step
    terms: np.ndarray  # (6, B, K) the step's terms (cost.StepTime order)
    moment: np.ndarray  # (B, K) index into PHASES of the peak
    stages: tuple[int, ...]  # the stages evaluated (the first, and the last under PP)
    cells: tuple[StageCells, ...]
    pick_last: np.ndarray  # (B, K) bool: the last stage is the worst
    modes: Meters  # (B, K) reserved and device used in both allocator modes (device used with managed memory)


def evaluate(spec: ModelSpec, gpu: GPUProfile, bases: list[Workload], mbs: list[int], per_rank: int) -> Table:
    """Every base (one layout: tp, pp, dp, gpus, nodes, seq) at every micro batch in `mbs`."""
    mb = np.asarray(mbs, dtype=np.int64)
    ms = per_rank // mb
    pp = bases[0].pp
    stack = A.stack(spec, bases, mb)
    sums = np.einsum("rkt,rktf->rkf", round_block(stack.nbytes) * stack.count, stack.member)  # (R, K, F)
    stages = (0, pp - 1) if pp > 1 else (0,)
    cells = tuple(stage_cells(spec, bases, s, ms, stack, sums) for s in stages)
    peaks = [c.phases.max(axis=0) for c in cells]
    pick_last = peaks[-1] > peaks[0]  # the later stage only if larger

    def chosen(fn):
        return np.where(pick_last, fn(cells[-1]), fn(cells[0]))

    moment = chosen(lambda c: c.phases.argmax(axis=0))  # the first largest, in PHASES order
    act_segs = np.zeros(moment.shape, np.int64)
    for si, c in enumerate(cells):
        sel = (pick_last if si == len(cells) - 1 and pp > 1 else ~pick_last) & (moment < OPTIMIZER_STEP)
        act_segs[sel] = activation_segments(stack, stages[si], pp, c, moment, sel)
    churn = chosen(lambda c: activations_now(c, moment) + np.take_along_axis(c.transient, moment[None], 0)[0]
                   + kv_now(c, moment))
    mt = meters(gpu, "train", np.maximum(peaks[0], peaks[-1]), chosen(lambda c: c.persistent), act_segs, churn)
    managed = chosen(lambda c: c.managed)  # CUDA managed memory: on the device, outside the allocator
    modes = mt._replace(device_used=mt.device_used + managed,
                        device_used_expandable=mt.device_used_expandable + managed)
    expandable = _col([w.expandable_segments for w in bases]).astype(bool)
    allocated = mt.allocated
    reserved = np.where(expandable, mt.reserved_expandable, mt.reserved)
    used = np.where(expandable, modes.device_used_expandable, modes.device_used)
    saved, state = chosen(lambda c: c.acts), chosen(lambda c: c.weights + c.grads + c.states + c.managed)
    params = chosen(lambda c: c.n_params)
    terms = cost.step_time(spec, gpu, bases, mb, ms, state, params, chosen(lambda c: c.n_trained))
    return Table(allocated, reserved, used, chosen(lambda c: c.cpu), params, saved, state, terms.sum(axis=0), terms,
                 moment, stages, cells, pick_last, modes)


def activation_segments(stack: A.Stack, stage: int, pp: int, c: StageCells, moment: np.ndarray,
                        sel: np.ndarray) -> np.ndarray:
    """The segments of the activation tensors alive at the peak moment of the selected cells, once per
    distinct (model, micro batch, moment, layer sets held) rather than per cell."""
    B, K = moment.shape
    rows = np.broadcast_to(stack.rows[:, None], (B, K))
    held = np.where(moment == BACKWARD_LAST, c.held_last, c.held)
    keys = np.stack([rows[sel], np.broadcast_to(np.arange(K), (B, K))[sel], moment[sel]]
                    + [h[sel] for h in held], axis=1)
    if not len(keys):
        return np.zeros(0, np.int64)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    r, k, mom = uniq[:, 0], uniq[:, 1], uniq[:, 2]
    sets = uniq[:, 3:].T  # (4, U): HELD_LISTS
    first, last = stage == 0, stage == pp - 1
    mult = np.zeros((len(uniq), len(A.LISTS)), np.int64)  # how many of each list are alive
    full = stack.full[r]  # full checkpointing holds each layer's input instead of its activations
    for name, n in zip(HELD_LISTS, sets):
        mult[:, A.LIST[name]] = np.where(full, 0, n)
    mult[:, A.LIST["layer_input"]] = np.where(full, sets.sum(axis=0), 0)
    # full: the layer being recomputed for its backward (the first block's at the last layer's backward)
    rebuilt = np.flatnonzero(full & np.isin(mom, LAYER_BACKWARD))
    top = np.where(sets[1] + sets[3] > 0, A.LIST["decoder_layer"], A.LIST["layer"])  # backward starts in a decoder
    # and ends in the first recorded block in FORWARD_ORDER: a frozen one's list under freeze
    order = np.array([A.LIST[HELD_LISTS[i]] for i in FORWARD_ORDER])
    first_list = order[np.argmax(np.stack([sets[i] for i in FORWARD_ORDER]) > 0, axis=0)]
    mult[rebuilt, np.where(mom == BACKWARD_LAST, first_list, top)[rebuilt]] += 1
    mult[:, A.LIST["embed"]] = first
    mult[:, A.LIST["head_saved"]] = last & (mom != BACKWARD_LAST)  # the current micro batch's head is done by then
    for moment_i, name in MOMENT_LIST.items():  # every stage runs its layers' backward, the last one the loss
        if last or moment_i in LAYER_BACKWARD:
            mult[mom == moment_i, A.LIST[name]] = 1
    # the current micro batch's KV cache at the loss's forward (stage_cells' kv): its recorded blocks' and the rest's
    recorded = np.minimum(sets.sum(axis=0), c.n_layers)
    mult[:, A.LIST["forward_cache"]] = np.where(last & (mom == FORWARD_LOSS), recorded, 0)
    mult[:, A.LIST["unrecorded_cache"]] = np.where(last & (mom == FORWARD_LOSS), c.n_layers - recorded, 0)
    return segments(stack.nbytes[r, k], stack.count[r, k] * np.einsum("utf,uf->ut", stack.member[r, k], mult))[
        inv.reshape(-1)]


def _col(values) -> np.ndarray:
    return np.asarray(values)[:, None]


# -- one configuration: a one-cell table ----------------------------------------------------------
def peak(spec: ModelSpec, gpu: GPUProfile, w: Workload, simulate: bool = False) -> Peak:
    """The three meters of one GPU at the peak moment of a step, and the bytes by category (no
    validation of `w` against the model or the hardware: `estimate` does that)."""
    if w.task == "infer":
        return _serving_peak(spec, gpu, w, simulate)
    t = evaluate(spec, gpu, [w], [w.micro_batch], w.micro_batch * w.grad_accum)
    return cell_peak(spec, gpu, t, w, 0, 0, simulate)


def cell_peak(spec: ModelSpec, gpu: GPUProfile, t: Table, w: Workload, b: int, k: int, simulate: bool = False) -> Peak:
    """The report of cell (b, k) of a table, whose workload (with its micro batch and accumulation) is w.
    simulate: reserved and device used from the replay of the step's allocations where it covers w (timeline.py),
    else the segment arithmetic of the table."""
    last = bool(t.pick_last[b, k])
    c, stage, i = t.cells[-1 if last else 0], t.stages[-1 if last else 0], int(t.moment[b, k])
    parts = {name: int(v[b, k]) for name, v in breakdown(c, t.moment).items()}
    allocated = int(t.allocated[b, k])
    by_mode = t.modes.report((b, k))
    replayed = simulate and replayable(w)
    if replayed:
        by_mode = _with_replay(by_mode, ReplayKey.of(spec, w), gpu, w, allocated)
    modes = by_mode[allocator_mode(w.expandable_segments)]
    reserved = modes["peak_reserved_bytes"]
    parts |= {"workspace": gpu_workspace(gpu, w.task), "allocator_overhead": reserved - allocated,
              "cuda_context": gpu.cuda_context_bytes}
    phases = {name: int(c.phases[j, b, k]) for j, name in enumerate(PHASES) if c.phases[j, b, k] >= 0}
    notes = _notes(spec, w, stage, float(c.flight[b, k]), c.n_layers) + _held_note(modes)
    return Peak(parts, phases, PHASES[i], notes,
                _per_layer_terms(spec, w), allocated, reserved, modes["device_used_bytes"], int(t.cpu_per_gpu[b, k]),
                int(t.params_per_gpu[b, k]), int(t.saved[b, k]), int(t.state[b, k]),
                cost.workload_rates(spec, gpu, w, w.micro_batch, w.grad_accum, float(t.step[b, k]),
                                    cost.StepTime(*t.terms[:, b, k].tolist())), by_mode,
                "replay" if replayed else "segment arithmetic")


def _serving_peak(spec: ModelSpec, gpu: GPUProfile, w: Workload, simulate: bool) -> Peak:
    """A serving step's meters: reserved and device used from the replay of its allocations (serving_timeline.py)
    where it covers the workload, else the segment arithmetic's."""
    p = inference_peak(spec, gpu, w)
    if not (simulate and serving_replayable(spec, w)):
        return p
    by_mode = _with_replay(p.by_allocator, ServingKey.of(spec, w), gpu, w, p.allocated)
    modes = by_mode[allocator_mode(w.expandable_segments)]
    reserved = modes["peak_reserved_bytes"]
    return p._replace(parts=p.parts | {"allocator_overhead": reserved - p.allocated}, reserved=reserved,
                      device_used=modes["device_used_bytes"], notes=p.notes + _held_note(modes), by_allocator=by_mode,
                      reserved_from="replay")


def _with_replay(by_mode: dict, key: StepKey, gpu: GPUProfile, w: Workload, allocated: int) -> dict:
    """Each allocator mode's meters from the caching-allocator simulation of the estimate's own allocations
    replayed in order (timeline.py): the figure real runs and verify's simulation agree with (docs/estimator.md,
    "Reserved and device used"). The segment arithmetic the search ranks and filters with stays beside it as
    `arithmetic_reserved_bytes`; device used keeps what the arithmetic adds to reserved (the context, managed
    memory). Where the default allocator's high-water mark does not fit the usable memory, the replay is held to
    it, as the GPU holds the allocator, which releases its cached segments before it runs out
    (`roomy_reserved_bytes`: the high-water mark a GPU with room would read)."""
    r = replay(key)
    ws, usable = gpu_workspace(gpu, w.task), usable_bytes(gpu, w.headroom)
    sim = {"default": r.reserved, "expandable_segments": r.reserved_expandable}
    out = {}
    for mode, v in by_mode.items():
        roomy = max(sim[mode] + ws, allocated)
        beyond = v["device_used_bytes"] - v["peak_reserved_bytes"]
        # held only where the tensors themselves fit: past that no release of cached segments helps
        tight = mode == "default" and roomy + beyond > usable >= allocated + beyond
        held = replay_within(Capped(key, usable - beyond - ws)) if tight else None  # what the allocator may reserve
        reserved = roomy if held is None else max(held + ws, allocated)
        out[mode] = {"peak_reserved_bytes": reserved, "device_used_bytes": reserved + beyond,
                     "arithmetic_reserved_bytes": v["peak_reserved_bytes"]}
        if held is not None:
            out[mode]["roomy_reserved_bytes"] = roomy
    return out


def _held_note(modes: dict) -> list[str]:
    """Where the replay was held to the usable memory (_with_replay), what a GPU with room would read."""
    roomy = modes.get("roomy_reserved_bytes")
    if roomy is None:
        return []
    return [f"reserved held to the usable memory: the caching allocator releases its cached segments when a "
            f"cudaMalloc would not fit, and runs this step in {modes['peak_reserved_bytes'] / 2**30:.2f} GiB; a GPU "
            f"with room would show {roomy / 2**30:.2f} GiB (max_memory_reserved)"]


def _notes(spec: ModelSpec, w: Workload, stage: int, flight: float, n_layers: int) -> list[str]:
    notes = [n for n in (unquantised_note(spec, Tuning.of(w)),) if n]
    if spec.traced_config:
        notes.append(traced.note(A.ActsKey.of(spec, w).trace_key, spec.model_type))
    if OPTIMIZERS[w.optim].paged:
        notes.append(f"{w.optim}: the optimizer states live in CUDA managed memory (paged): outside torch's "
                     "allocator, counted in device used; under memory pressure the driver pages them to CPU RAM")
    if w.grad_accum > 1 and not half_model(w):
        notes.append("gradient accumulation keeps the gradients allocated through the next forward")
    if w.pp > 1:
        notes.append(f"pipeline stage {stage} of {w.pp} is the worst ({n_layers} layers, "
                     f"{flight:g} micro batches in flight)")
    return notes


def _per_layer_terms(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """Saved bytes of one layer by term, for the report (one tensor-parallel rank's share)."""
    out: dict[str, int] = {}
    for t in shard(A.ActsKey.of(spec, w).model(w.micro_batch).layer, w.tp, w.sp):
        out[t.name] = out.get(t.name, 0) + int(round_block(t.nbytes) * t.count)
    return out


def estimate(spec: ModelSpec, gpu: GPUProfile, w: Workload, simulate: bool = False) -> MemoryBreakdown:
    constraints.check(spec, gpu, w)
    return report(spec, gpu, w, peak(spec, gpu, w, simulate))
