"""The estimator: a pure function (ModelSpec, GPUProfile, Workload) -> MemoryBreakdown. No torch.

A training step is a sequence of moments; the peak is the largest of them (docs/estimator.md):
  forward-loss    weights + states + autocast copies + saved activations + logits while the loss runs
  backward-start  ... + the loss gradient chain (dL/dlogp, dL/dlogits in fp32)
  backward-layer  ... + the head's gradients + one layer's grad buffers (+ its recompute under checkpointing)
  backward-end    (tied heads) weights + gradients + states + the tied matrix's two gradients being summed
  optimizer-step  weights + gradients + states + the optimizer's temporaries
States count from the second step on (created lazily by the first step()), which is the steady state.
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from memplan.estimator.activations import ActivationModel, Tensors, inference_working_set, training_activations
from memplan.errors import UserError
from memplan.inputs import constraints
from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.estimator.parallel import fsdp_states, numel, stage_params, tied_head, zero_states
from memplan.inputs.profiles import GPUProfile
from memplan.estimator.rules import (
    ALLOC_LARGE_BUFFER, ALLOC_MIN_LARGE_ALLOC, ALLOC_SMALL_BUFFER, ALLOC_SMALL_SIZE, FUSED_LOSS_FAMILIES, FUSED_LOSS_MASKED_LM,
    MEMPLAN_ATTN_FAMILIES, OPTIMIZERS, PRECISIONS, TILED_MLP_FAMILIES, WEIGHT_FORMATS, optimizer_state_bytes,
    round_block, round_segment,
)
from memplan.inputs.workload import Workload

LINEAR_CATEGORIES = ("attention", "mlp", "experts", "router", "head")
# cuBLAS workspace, allocated through the caching allocator: 4096 KiB * 2 + 16 KiB * 8 before Hopper,
# 32 MiB on sm90+ (PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize).
CUBLAS_WORKSPACE = {False: 4096 * 1024 * 2 + 16 * 1024 * 8, True: 32 << 20}
# Fragmentation of the activation churn: blocks freed in backward are re-split for gradients and the
# lazily created optimizer state, so the next forward cannot reuse all of them (docs/estimator.md).
ACTIVATION_FRAGMENTATION = 0.10

BREAKDOWN_KEYS = ("weights", "autocast_cache", "gradients", "optimizer_states", "optimizer_temporaries",
                  "comm_buffers", "gathered_params", "activations", "transient", "kv_cache", "workspace",
                  "allocator_overhead", "cuda_context")


class ModelInfo(BaseModel):
    name: str
    hf_id: str | None
    model_type: str
    head: str
    params_total: int
    params_trainable: int
    params_by_category: dict[str, int]


class MemoryBreakdown(BaseModel):
    """Bytes per category at the peak moment, and the three meters of DESIGN.md."""

    model_config = ConfigDict(frozen=True)

    model: ModelInfo
    gpu: str
    workload: Workload
    breakdown: dict[str, int]
    peak_phase: str
    phases: dict[str, int]  # peak allocated bytes of each moment of the step
    activations_per_layer: dict[str, int]  # saved bytes per layer by term (one micro batch)
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    capacity_bytes: int
    usable_bytes: int  # capacity minus the headroom
    headroom_bytes: int  # usable - device used (negative: does not fit)
    fits: bool
    notes: list[str]
    # Per GPU: every byte above is one GPU's (the worst pipeline stage's). Host RAM that offload pins,
    # for all the GPUs of one node (docs/parallel.md).
    cpu_ram_per_node_bytes: int = 0
    params_per_gpu: int = 0  # parameters one GPU holds before ZeRO partitioning (after TP / PP)


def _rounded(groups: tuple[ParamGroup, ...], bytes_of) -> int:
    """Allocated bytes of one tensor per parameter, each rounded as the allocator rounds it."""
    return sum(round_block(bytes_of(g)) * g.count for g in groups)


def _segments(tensors: list[tuple[float, int]]) -> int:
    """Reserved bytes for tensors allocated fresh: small ones packed into 2 MiB segments, 1-10 MiB ones
    into 20 MiB segments, larger ones rounded to 2 MiB each (CUDACachingAllocator)."""
    small = mid = large = 0
    for nbytes, count in tensors:
        n = round_block(nbytes)
        if n <= 0:
            continue
        if n <= ALLOC_SMALL_SIZE:
            small += n * count
        elif n < ALLOC_MIN_LARGE_ALLOC:
            per_seg = ALLOC_LARGE_BUFFER // n
            mid += -(-count // per_seg) * ALLOC_LARGE_BUFFER
        else:
            large += round_segment(n) * count
    return -(-small // ALLOC_SMALL_BUFFER) * ALLOC_SMALL_BUFFER + mid + large


def _rounded_tensors(ts: list[Tensors]) -> int:
    return sum(round_block(t.nbytes) * t.count for t in ts)


# Attention implementations transformers offers per model_type (`_supports_sdpa` / `_supports_flash_attn`
# in transformers 5 modelling files); eager exists everywhere.
ATTN_UNSUPPORTED = {"t5": ("flash",), "gemma2": ("sdpa",)}


def supported_attn(spec: ModelSpec) -> tuple[str, ...]:
    """The attention implementations of this model; memplan's tiled attention last (kernels/attention.py)."""
    out = tuple(a for a in ("flash", "sdpa", "eager") if a not in ATTN_UNSUPPORTED.get(spec.model_type, ()))
    return out + (("memplan",) if spec.model_type in MEMPLAN_ATTN_FAMILIES else ())


def tiled_mlp_supported(spec: ModelSpec) -> bool:
    return spec.model_type in TILED_MLP_FAMILIES and not spec.is_moe and spec.arch != "encoder-decoder"


def fused_loss_supported(spec: ModelSpec) -> bool:
    return ((spec.head == "causal-lm" and spec.model_type in FUSED_LOSS_FAMILIES)
            or (spec.head == "masked-lm" and spec.model_type in FUSED_LOSS_MASKED_LM))


class Peak(NamedTuple):
    """The estimate without its report: what the search needs for every candidate."""

    parts: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    notes: list[str]
    per_layer: dict[str, int]
    allocated: int
    reserved: int
    device_used: int
    cpu_per_gpu: int
    params_per_gpu: int
    saved_activations: int  # bytes written in forward and read in backward (the cost model's traffic)
    state_bytes: int  # weights + gradients + optimizer states (the optimizer step's traffic)


def peak(spec: ModelSpec, gpu: GPUProfile, w: Workload, mb: int | None = None, m: int | None = None) -> Peak:
    """The three meters of one GPU at the peak moment of a step (no validation of `w` against the
    hardware: `estimate` does that). mb, m: micro batch and accumulation steps instead of w's (the
    search evaluates many micro batches of one workload without copying it)."""
    mb = w.micro_batch if mb is None else mb
    m = w.grad_accum if m is None else m
    if w.task == "infer":
        if mb != w.micro_batch:
            raise ValueError("peak(): inference reads the batch from the workload")
        parts, phases, peak_phase, act_ts, notes, per_layer = _inference(spec, w)
        extra = {"cpu": 0, "n_params": spec.params_total, "saved": parts["transient"],
                 "state": parts["weights"] + parts["kv_cache"], "persistent_segments": _segments(_persistent_tensors(spec, w, list(spec.params))),
                 "act_segments": _segments([(t.nbytes, t.count) for t in act_ts])}
    else:
        parts, phases, peak_phase, notes, per_layer, extra = _training(spec, w, mb, m)
    hopper = gpu.compute_capability >= (9, 0)
    parts["workspace"] = CUBLAS_WORKSPACE[hopper]
    allocated = sum(parts.values())

    # Reserved: persistent tensors in their own segments, the peak's activation tensors in theirs,
    # plus the fragmentation of the activation churn.
    reserved = extra["persistent_segments"] + extra["act_segments"]
    reserved += int(ACTIVATION_FRAGMENTATION * (parts.get("activations", 0) + parts.get("transient", 0)))
    reserved += parts["workspace"]
    reserved = max(reserved, allocated)
    parts["allocator_overhead"] = reserved - allocated
    parts["cuda_context"] = gpu.cuda_context_bytes
    return Peak(parts, phases, peak_phase, notes, per_layer, int(allocated), int(reserved),
                int(reserved + gpu.cuda_context_bytes), extra["cpu"], extra["n_params"], extra["saved"],
                extra["state"])


def estimate(spec: ModelSpec, gpu: GPUProfile, w: Workload) -> MemoryBreakdown:
    constraints.check(spec, gpu, w)
    return report(spec, gpu, w, peak(spec, gpu, w))


def report(spec: ModelSpec, gpu: GPUProfile, w: Workload, p: Peak) -> MemoryBreakdown:
    usable = int(gpu.memory_bytes * (1 - w.headroom))
    info = ModelInfo(name=spec.name, hf_id=spec.hf_id, model_type=spec.model_type, head=spec.head,
                     params_total=spec.params_total, params_trainable=spec.params_trainable,
                     params_by_category=spec.params_by_category())
    breakdown = {k: int(p.parts.get(k, 0)) for k in BREAKDOWN_KEYS}
    return MemoryBreakdown(
        model=info, gpu=gpu.name, workload=w, breakdown=breakdown, peak_phase=p.peak_phase,
        phases={k: int(v) for k, v in p.phases.items()}, activations_per_layer=p.per_layer,
        peak_allocated_bytes=p.allocated, peak_reserved_bytes=p.reserved, device_used_bytes=p.device_used,
        capacity_bytes=gpu.memory_bytes, usable_bytes=usable, headroom_bytes=usable - p.device_used,
        fits=p.device_used <= usable, notes=p.notes, cpu_ram_per_node_bytes=p.cpu_per_gpu * w.gpus,
        params_per_gpu=p.params_per_gpu,
    )


def _persistent_tensors(spec: ModelSpec, w: Workload, groups: list[ParamGroup]) -> list[tuple[float, int]]:
    """Weights, gradients and optimizer states as (bytes, count) tensors, for segment packing.
    (DeepSpeed keeps each state in one flat buffer per parameter group: see _make_stage_states.)"""
    out: list[tuple[float, int]] = []
    if w.task == "infer":
        fmt = WEIGHT_FORMATS[w.precision]
        for g in groups:
            out.append((g.numel * _weight_bytes(fmt, g), g.count))
        return out
    prec = PRECISIONS[w.precision]
    rule = OPTIMIZERS[w.optim]
    for g in groups:
        out.append((g.numel * prec.param, g.count))
        if prec.autocast and g.category in LINEAR_CATEGORIES:
            out.append((g.numel * 2, g.count))  # the half copies autocast re-creates every step
        if g.trainable:
            out.append((g.numel * prec.grad, g.count * (2 if w.dp > 1 else 1)))  # + DDP's bucket copy
            st = optimizer_state_bytes(rule, g.shape, prec.param, w.momentum > 0)
            n_states = max(rule.states + (1 if rule.momentum_arg and w.momentum > 0 else 0), 1)
            if st:
                out.append((st / n_states, g.count * n_states))
    return out


def _weight_bytes(fmt, g: ParamGroup) -> float:
    quantisable = g.category in ("attention", "mlp", "experts", "router") and len(g.shape) >= 2
    return fmt.linear if quantisable else fmt.other


def _tied_grad_sum(spec: ModelSpec, grad_bytes: float, grads_live: bool, tp: int) -> int:
    """The end of backward for a tied head: autograd holds the head's weight gradient in the input
    buffer of the shared parameter until the embedding's backward produces its own, then adds them
    (torch/csrc/autograd/input_buffer.cpp): two vocab x hidden inputs and the sum coexist with every
    other gradient. With set-to-none the sum becomes .grad (counted as a gradient); with gradients
    already allocated it is a third temporary that AccumulateGrad adds in place."""
    if not tied_head(spec):
        return 0
    return (3 if grads_live else 2) * round_block(-(-spec.vocab_size // tp) * spec.hidden_size * grad_bytes)


def _autocast_copies(groups: list[ParamGroup], tied: int, half: int = 2) -> tuple[int, int, int]:
    """(all copies, head copies, MLP copies): half copies of the parameters that autocast casts for
    matmuls. A tied LM head casts the embedding matrix (`tied` elements), so that copy exists too."""
    lin = tuple(g for g in groups if g.category in LINEAR_CATEGORIES)
    all_c = _rounded(lin, lambda g: g.numel * half)
    head_c = _rounded(tuple(g for g in lin if g.category == "head"), lambda g: g.numel * half)
    mlp_c = _rounded(tuple(g for g in lin if g.category == "mlp"), lambda g: g.numel * half)
    all_c += round_block(tied * half)
    head_c += round_block(tied * half)
    return all_c, head_c, mlp_c


def _head_grads(groups: list[ParamGroup], tied: int, grad_bytes: float) -> int:
    """Gradients allocated first in backward: the head (or the tied embedding matrix)."""
    g = _rounded(tuple(x for x in groups if x.category == "head" and x.trainable), lambda x: x.numel * grad_bytes)
    return g + round_block(tied * grad_bytes)


def _per_layer_terms(layer: list[Tensors]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in layer:
        out[t.name] = out.get(t.name, 0) + int(round_block(t.nbytes) * t.count)
    return out


def in_flight(w: Workload, stage: int, m: int) -> float:
    """Micro batches whose activations stage `stage` holds at once under 1F1B: pp - stage, at most
    the micro batches of the step; the interleaved schedule (vpp virtual stages) holds
    1 + (pp - 1) / (pp * vpp) times more on the first stage (Narayanan et al. 2021; Megatron's
    theoretical_memory_usage.py, interleaved_schedule_memory_penalty)."""
    n = min(w.pp - stage, m)
    if w.vpp > 1 and stage == 0:
        n = min(n * (1 + (w.pp - 1) / (w.pp * w.vpp)), m)
    return n


def stage_layers(spec: ModelSpec, pp: int, stage: int) -> tuple[int, int]:
    """(encoder-or-decoder-only layers, decoder layers of an encoder-decoder) on one pipeline stage."""
    L = spec.total_layers
    per = -(-L // pp)
    lo, hi = stage * per, min(L, (stage + 1) * per)
    enc = max(0, min(hi, spec.num_layers) - lo)
    return enc, max(0, hi - lo - enc)


def _training(spec: ModelSpec, w: Workload, mb: int, m: int):
    """The worst pipeline stage (the first holds the most activations, the last the head and loss)."""
    best = _training_stage(spec, w, 0, mb, m)
    if w.pp > 1:
        r = _training_stage(spec, w, w.pp - 1, mb, m)
        if max(r[1].values()) > max(best[1].values()):
            best = r
    return best


def half_model(w: Workload) -> bool:
    """The model itself runs in half precision and the fp32 states live elsewhere: DeepSpeed (any ZeRO
    stage, or its PipelineEngine) or FSDP with accelerate's mixed-precision policy."""
    return w.zero > 0 or w.pp > 1 or w.fsdp != "none"


_MEMO: dict = {}


def _memo(spec: ModelSpec, key: tuple, make):
    """Results that depend on the spec and a few workload fields, shared by the search's candidates.
    The spec is kept with the value, so a recycled id() never returns another model's numbers."""
    k = (id(spec),) + key
    hit = _MEMO.get(k)
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_MEMO) > 100_000:
        _MEMO.clear()
    value = make()
    _MEMO[k] = (spec, value)
    return value


def _train_precision(w: Workload):
    prec = PRECISIONS[w.precision]
    if half_model(w) and prec.autocast:  # no autocast: the activations of a pure half model
        prec = PRECISIONS[f"{prec.half}-pure"]
    return prec


class StageStates(NamedTuple):
    """Everything of one pipeline stage's GPU that does not depend on the micro batch (all numbers: the
    search's table stacks them as one array)."""

    weights: int
    grads: int
    states: int
    temp: int
    comm: int
    gathered: int
    cpu: int
    grads_persistent: bool
    tied: int
    c_all: int
    c_head: int
    c_mlp: int  # the MLPs' share of c_all
    head_grads: int
    persistent_segments: int
    n_params: int
    n_enc: int  # layers on this stage
    n_dec: int


def _stage_states(spec: ModelSpec, w: Workload, stage: int, accumulating: bool) -> StageStates:
    # accumulation changes the states only through offload's host accumulation buffer (ZeRO-1/2)
    accumulating = accumulating and w.offload != "none" and w.zero in (1, 2)
    key = ("states", stage, w.tp, w.pp, w.zero, w.dp, w.offload, w.fsdp, w.precision, w.optim, w.momentum > 0,
           accumulating)
    return _memo(spec, key, lambda: _make_stage_states(spec, w, stage, accumulating))


def _make_stage_states(spec: ModelSpec, w: Workload, stage: int, accumulating: bool) -> StageStates:
    prec = _train_precision(w)
    rule = OPTIMIZERS[w.optim]
    ds = half_model(w)
    last = stage == w.pp - 1
    # shared by every ZeRO / precision / optimizer setting of a layout
    groups = _memo(spec, ("stage-params", w.tp, w.pp, stage), lambda: stage_params(spec, w.tp, w.pp, stage))
    tied = -(-spec.vocab_size // w.tp) * spec.hidden_size if (tied_head(spec) and last and w.pp == 1) else 0
    trainable = tuple(g for g in groups if g.trainable)
    comm = gathered = cpu = temp = 0
    if w.fsdp != "none":
        z = fsdp_states(groups, spec, strategy=w.fsdp, dp=w.dp, gpus=w.gpus, half=prec.half is not None,
                        moments=rule.states * 4)
    elif ds:
        z = zero_states(groups, spec, zero=w.zero, dp=w.dp, offload=w.offload, half=prec.half is not None,
                        moments=rule.states * 4, accumulating=accumulating)
    if ds:
        weights, grads, states, comm, gathered, cpu = (z.weights, z.gradients, z.optimizer_states, z.comm_buffers,
                                                       z.gathered, z.cpu)
        temp, grads_persistent = z.step_transient, z.grads_persistent
        persistent = [(weights, 1), (grads, 1), (states, 1), (comm, 1), (gathered, 1), (temp, 1)]
    else:
        weights = _rounded(groups, lambda g: g.numel * prec.param)
        grads = _rounded(trainable, lambda g: g.numel * prec.grad)
        states = sum(round_block(optimizer_state_bytes(rule, g.shape, prec.param, w.momentum > 0)) * g.count
                     for g in trainable)
        if rule.foreach_temp:
            temp = _rounded(trainable, lambda g: g.numel * prec.param * rule.foreach_temp)
        if rule.per_tensor_temp:
            temp = int(rule.per_tensor_temp * round_block(max((g.numel for g in groups), default=0) * 4))
        if w.dp > 1:  # DDP buckets: a second copy of every gradient (gradient_as_bucket_view=False)
            comm = grads
        grads_persistent = False
        persistent = _persistent_tensors(spec, w, groups)
    c_all, c_head, c_mlp = _autocast_copies(groups, tied) if prec.autocast else (0, 0, 0)
    return StageStates(weights, grads, states, temp, comm, gathered, cpu, grads_persistent, tied,
                       c_all, c_head, c_mlp, _head_grads(groups, tied, prec.grad), _segments(persistent),
                       numel(groups), *stage_layers(spec, w.pp, stage))


class StageActs(NamedTuple):
    """Rounded byte sums of one micro batch's activation lists (ACT_SUMS, see ActivationModel)."""

    am: ActivationModel
    layer: int
    decoder_layer: int
    embed: int
    head_saved: int
    lsm: int
    layer_input: int
    layer_core: int
    loss_forward: int
    loss_backward: int
    layer_backward: int


def _stage_acts(spec: ModelSpec, w: Workload, mb: int) -> StageActs:
    prec = _train_precision(w)
    # the activation model tells only eager from fused attention (SDPA and FlashAttention-2 save the same)
    key = ("acts", mb, w.seq_len, prec.name, w.attn == "eager", w.grad_ckpt, w.tp, w.sp, w.kernels, w.tiled_mlp)

    def make() -> StageActs:
        am = training_activations(spec, mb, w.seq_len, prec, w.attn,
                                  selective=w.grad_ckpt == "selective", kv_cache=w.grad_ckpt != "full", tp=w.tp,
                                  sp=w.sp, fused_loss=w.kernels, tiled_mlp=w.tiled_mlp)
        return StageActs(am, *(_rounded_tensors(act_list(am, name)) for name in ACT_SUMS))
    return _memo(spec, key, make)


ACT_SUMS = StageActs._fields[1:]  # the activation lists summed per micro batch (the table sums the same)


def is_log_softmax(t: Tensors) -> bool:
    """The loss's saved log_softmax output: part of head_saved, freed during the last layer's backward."""
    return t.name.startswith("log_softmax")


def act_list(am: ActivationModel, name: str) -> list[Tensors]:
    """One of ACT_SUMS' lists of an activation model (lsm: the log_softmax output within head_saved)."""
    return [t for t in am.head_saved if is_log_softmax(t)] if name == "lsm" else getattr(am, name)


class StageNumbers(NamedTuple):
    """The byte counts of one pipeline stage's step, before they are named as a breakdown."""

    st: StageStates
    sa: StageActs
    phases: dict[str, int]
    peak_phase: str
    acts: int  # saved activations of the micro batches in flight
    recompute: int
    c_all: int
    c_bwd: int
    g_live: int
    g_head: int
    lsm: int
    transient: dict[str, int]  # the transient of each moment
    copies: int  # per-layer activation sets held: layers x micro batches in flight
    flight: float


def _stage_numbers(spec: ModelSpec, w: Workload, stage: int, mb: int, m: int) -> StageNumbers:
    st = _stage_states(spec, w, stage, m > 1)
    sa = _stage_acts(spec, w, mb)
    ds = half_model(w)
    first, last = stage == 0, stage == w.pp - 1
    n_enc, n_dec = st.n_enc, st.n_dec
    n_layers = n_enc + n_dec
    flight = in_flight(w, stage, m) if w.pp > 1 else 1
    embed_b = sa.embed if first else 0
    head_b = sa.head_saved if last else 0
    lsm = sa.lsm if last else 0
    if w.grad_ckpt == "full":
        acts = flight * (n_layers * sa.layer_input + embed_b) + head_b
        recompute = max(sa.layer, sa.decoder_layer)  # one layer's activations, rebuilt during its backward
    else:
        acts = flight * (n_enc * sa.layer + n_dec * sa.decoder_layer + embed_b) + head_b
        # selective: one layer's attention core is rebuilt during that layer's backward
        recompute = sa.layer_core if w.grad_ckpt == "selective" else 0
    acts = int(acts)

    c_all = st.c_all
    # The tiled MLP runs its forward without autograd, so no graph keeps the MLP weights' autocast copies:
    # they go with autocast's cache when the forward ends, and its backward casts one layer's again.
    c_mlp_layer = st.c_mlp // max(n_layers, 1) if w.tiled_mlp and w.grad_ckpt != "full" else 0
    c_bwd = (st.c_head + (c_all - st.c_head) // max(n_layers, 1)) if w.grad_ckpt == "full" else (
        c_all - (st.c_mlp if w.tiled_mlp else 0))
    grads_in_fwd = w.zero_grad == "zeros" or m > 1 or st.grads_persistent
    g_live = st.grads if grads_in_fwd else 0
    g_head = 0 if grads_in_fwd else st.head_grads
    loss_fwd = sa.loss_forward if last else 0
    loss_bwd = sa.loss_backward if last else 0

    weights, states, grads, comm = st.weights, st.states, st.grads, st.comm
    base = weights + states + g_live + comm + st.gathered
    phases = {
        "forward-loss": base + c_all + acts + loss_fwd,
        "backward-start": base + c_bwd + acts + loss_bwd,
        "backward-layer": base + c_bwd + acts - lsm + g_head + recompute + sa.layer_backward + c_mlp_layer,
        "optimizer-step": weights + grads + states + st.temp + comm,
    }
    transient = {"forward-loss": loss_fwd, "backward-start": loss_bwd,
                 "backward-layer": recompute + sa.layer_backward + c_mlp_layer, "optimizer-step": 0}
    tied_sum = _tied_grad_sum(spec, PRECISIONS[w.precision].grad, grads_in_fwd, w.tp) if (st.tied and not ds) else 0
    if tied_sum:
        phases["backward-end"] = weights + states + grads + comm + tied_sum
        transient["backward-end"] = tied_sum
    peak_phase = max(phases, key=phases.__getitem__)
    return StageNumbers(st, sa, phases, peak_phase, acts, recompute, c_all, c_bwd, g_live, g_head, lsm, transient,
                        n_layers * max(1, round(flight)), flight)


def _act_segments(spec: ModelSpec, w: Workload, stage: int, am: ActivationModel, copies: int, phase: str) -> int:
    """Segments of the activation tensors alive at the moment `phase` (none at the optimizer step);
    `copies`: the per-layer sets held (layers x micro batches in flight)."""
    if phase in STEP_PHASES:
        return 0
    first, last = stage == 0, stage == w.pp - 1

    def segments() -> int:
        per = am.layer_input if w.grad_ckpt == "full" else am.layer
        ts = [(t.nbytes, t.count * copies) for t in per]
        ts += [(t.nbytes, t.count) for t in (am.embed if first else []) + (am.head_saved if last else [])]
        if last:
            ts += [(t.nbytes, t.count) for t in {"forward-loss": am.loss_forward, "backward-start": am.loss_backward,
                                                 "backward-layer": am.layer_backward}[phase]]
        return _segments(ts)
    return _memo(spec, ("segments", id(am), copies, first, last, phase), segments)


STEP_PHASES = ("optimizer-step", "backward-end")


def _training_stage(spec: ModelSpec, w: Workload, stage: int, mb: int, m: int):
    n = _stage_numbers(spec, w, stage, mb, m)
    st, peak_phase = n.st, n.peak_phase
    parts = {"weights": st.weights, "optimizer_states": st.states, "comm_buffers": st.comm,
             "transient": n.transient[peak_phase]}
    if peak_phase in STEP_PHASES:
        parts |= {"gradients": st.grads, "optimizer_temporaries": st.temp if peak_phase == "optimizer-step" else 0}
    else:
        parts["gathered_params"] = st.gathered
        parts["gradients"] = n.g_live + (n.g_head if peak_phase == "backward-layer" else 0)
        parts["autocast_cache"] = n.c_all if peak_phase == "forward-loss" else n.c_bwd
        parts["activations"] = n.acts - (n.lsm if peak_phase == "backward-layer" else 0)
    notes: list[str] = []
    if OPTIMIZERS[w.optim].paged:
        notes.append(f"{w.optim}: paged optimizer state can spill to CPU memory under pressure; counted on the GPU")
    if m > 1 and not half_model(w):
        notes.append("gradient accumulation keeps the gradients allocated through the next forward")
    if w.pp > 1:
        notes.append(f"pipeline stage {stage} of {w.pp} is the worst ({st.n_enc + st.n_dec} layers, "
                     f"{n.flight:g} micro batches in flight)")
    extra = {"cpu": st.cpu, "n_params": st.n_params, "persistent_segments": st.persistent_segments,
             "act_segments": _act_segments(spec, w, stage, n.sa.am, n.copies, peak_phase), "saved": n.acts,
             "state": st.weights + st.grads + st.states}
    return parts, n.phases, peak_phase, notes, _per_layer_terms(n.sa.am.layer), extra


def kv_cache_bytes(spec: ModelSpec, sequences: int, length: int, kv_bytes: int) -> int:
    """2 (k and v) * layers * sequences * length * kv_heads * head_dim * bytes; sliding-window layers
    keep at most the window (transformers' DynamicSlidingWindowLayer)."""
    per_token = 2 * spec.num_kv_heads * spec.head_dim * kv_bytes
    layers = spec.num_decoder_layers if spec.arch == "encoder-decoder" else spec.num_layers
    window = spec.sliding_window
    if window and length > window:
        # gemma2 alternates sliding and global layers; mistral v0.1 slides on every layer
        sliding = layers // 2 if spec.model_type == "gemma2" else layers
        return per_token * sequences * (sliding * window + (layers - sliding) * length)
    return per_token * sequences * layers * length


def _inference(spec: ModelSpec, w: Workload):
    fmt = WEIGHT_FORMATS[w.precision]
    p = 4 if fmt.compute == "fp32" else 2
    notes: list[str] = []
    weights = _rounded(spec.params, lambda g: g.numel * _weight_bytes(fmt, g))
    autocast = w.precision in ("fp16", "bf16")
    tied = spec.vocab_size * spec.hidden_size if tied_head(spec) else 0
    cache = _autocast_copies(list(spec.params), tied)[0] if autocast else 0
    seqs = w.micro_batch * w.beams
    generate = w.max_new_tokens > 0
    if generate and spec.arch in ("encoder", "vision"):
        raise UserError(f"{spec.name} is an encoder: --max-new-tokens needs a decoder or encoder-decoder")
    kv = kv_cache_bytes(spec, seqs, w.seq_len + w.max_new_tokens, p) if generate else 0
    kv_prompt = kv_cache_bytes(spec, seqs, w.seq_len, p) if generate else 0
    work_ts = inference_working_set(spec, seqs, w.seq_len, p, w.attn, full_logits=not generate)
    work = _rounded_tensors(work_ts)
    kv_grow = 0
    if generate:  # DynamicCache grows by torch.cat: one layer's old and new k, v live together
        kv_grow = kv_cache_bytes(spec, seqs, w.seq_len + w.max_new_tokens, p) // max(spec.num_layers, 1)
        notes.append(f"KV cache for {seqs} sequences x {w.seq_len + w.max_new_tokens} tokens")
    phases = {"prefill": weights + cache + kv_prompt + work, "decode": weights + cache + kv + kv_grow}
    peak_phase = max(phases, key=lambda k: phases[k])
    parts = {"weights": weights, "autocast_cache": cache, "kv_cache": kv_prompt if peak_phase == "prefill" else kv,
             "transient": work if peak_phase == "prefill" else kv_grow}
    act_ts = work_ts if peak_phase == "prefill" else []
    return parts, phases, peak_phase, act_ts, notes, {}
