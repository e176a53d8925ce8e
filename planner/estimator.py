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

from pydantic import BaseModel, ConfigDict

from .activations import Tensors, inference_working_set, training_activations
from .errors import UserError
from .modelspec import ModelSpec, ParamGroup
from .profiles import GPUProfile
from .rules import (
    ALLOC_LARGE_BUFFER, ALLOC_MIN_LARGE_ALLOC, ALLOC_SMALL_BUFFER, ALLOC_SMALL_SIZE, OPTIMIZERS, PRECISIONS,
    WEIGHT_FORMATS, optimizer_state_bytes, round_block, round_segment,
)
from .workload import Workload

LINEAR_CATEGORIES = ("attention", "mlp", "experts", "router", "head")
# cuBLAS workspace, allocated through the caching allocator: 4096 KiB * 2 + 16 KiB * 8 before Hopper,
# 32 MiB on sm90+ (PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize).
CUBLAS_WORKSPACE = {False: 4096 * 1024 * 2 + 16 * 1024 * 8, True: 32 << 20}
# Fragmentation of the activation churn: blocks freed in backward are re-split for gradients and the
# lazily created optimizer state, so the next forward cannot reuse all of them (docs/estimator.md).
ACTIVATION_FRAGMENTATION = 0.10

BREAKDOWN_KEYS = ("weights", "autocast_cache", "gradients", "optimizer_states", "optimizer_temporaries",
                  "activations", "transient", "kv_cache", "workspace", "allocator_overhead", "cuda_context")


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
    return tuple(a for a in ("flash", "sdpa", "eager") if a not in ATTN_UNSUPPORTED.get(spec.model_type, ()))


def check_support(spec: ModelSpec, w: Workload) -> None:
    if w.attn not in supported_attn(spec):
        raise UserError(f"transformers has no {w.attn} attention for {spec.model_type} "
                        f"(choose from {', '.join(supported_attn(spec))})")


def check_hardware(gpu: GPUProfile, w: Workload) -> None:
    """Refuse what the hardware cannot do, with the reason."""
    if "bf16" in w.precision and not gpu.bf16:
        cc = ".".join(map(str, gpu.compute_capability))
        raise UserError(f"{gpu.name} (sm {cc}) has no bf16 support (needs compute capability >= 8.0); "
                        "use --precision fp16")
    if w.attn == "flash" and not gpu.flash_attention:
        cc = ".".join(map(str, gpu.compute_capability))
        raise UserError(f"FlashAttention-2 needs compute capability >= 8.0; {gpu.name} is sm {cc} "
                        "(use --attn sdpa)")


def estimate(spec: ModelSpec, gpu: GPUProfile, w: Workload) -> MemoryBreakdown:
    check_hardware(gpu, w)
    check_support(spec, w)
    if w.task == "infer":
        parts, phases, peak_phase, act_ts, notes, per_layer = _inference(spec, w)
    else:
        parts, phases, peak_phase, act_ts, notes, per_layer = _training(spec, w)
    hopper = gpu.compute_capability >= (9, 0)
    parts["workspace"] = CUBLAS_WORKSPACE[hopper]
    allocated = sum(parts.values())

    # Reserved: persistent tensors in their own segments, the peak's activation tensors in theirs,
    # plus the fragmentation of the activation churn.
    persistent = _persistent_tensors(spec, w)
    reserved = _segments(persistent) + _segments([(t.nbytes, t.count) for t in act_ts])
    reserved += int(ACTIVATION_FRAGMENTATION * (parts.get("activations", 0) + parts.get("transient", 0)))
    reserved += parts["workspace"]
    reserved = max(reserved, allocated)
    parts["allocator_overhead"] = reserved - allocated
    parts["cuda_context"] = gpu.cuda_context_bytes
    device_used = reserved + gpu.cuda_context_bytes
    usable = int(gpu.memory_bytes * (1 - w.headroom))
    info = ModelInfo(name=spec.name, hf_id=spec.hf_id, model_type=spec.model_type, head=spec.head,
                     params_total=spec.params_total, params_trainable=spec.params_trainable,
                     params_by_category=spec.params_by_category())
    breakdown = {k: int(parts.get(k, 0)) for k in BREAKDOWN_KEYS}
    return MemoryBreakdown(
        model=info, gpu=gpu.name, workload=w, breakdown=breakdown, peak_phase=peak_phase,
        phases={k: int(v) for k, v in phases.items()}, activations_per_layer=per_layer,
        peak_allocated_bytes=int(allocated), peak_reserved_bytes=int(reserved), device_used_bytes=int(device_used),
        capacity_bytes=gpu.memory_bytes, usable_bytes=usable, headroom_bytes=usable - int(device_used),
        fits=device_used <= usable, notes=notes,
    )


def _persistent_tensors(spec: ModelSpec, w: Workload) -> list[tuple[float, int]]:
    """Weights, gradients and optimizer states as (bytes, count) tensors, for segment packing."""
    out: list[tuple[float, int]] = []
    if w.task == "infer":
        fmt = WEIGHT_FORMATS[w.precision]
        for g in spec.params:
            out.append((g.numel * _weight_bytes(fmt, g), g.count))
        return out
    prec = PRECISIONS[w.precision]
    rule = OPTIMIZERS[w.optim]
    for g in spec.params:
        out.append((g.numel * prec.param, g.count))
        if prec.autocast and g.category in LINEAR_CATEGORIES:
            out.append((g.numel * 2, g.count))  # the half copies autocast re-creates every step
        if g.trainable:
            out.append((g.numel * prec.grad, g.count))
            st = optimizer_state_bytes(rule, g.shape, prec.param, w.momentum > 0)
            n_states = max(rule.states + (1 if rule.momentum_arg and w.momentum > 0 else 0), 1)
            if st:
                out.append((st / n_states, g.count * n_states))
    return out


def _weight_bytes(fmt, g: ParamGroup) -> float:
    quantisable = g.category in ("attention", "mlp", "experts", "router") and len(g.shape) >= 2
    return fmt.linear if quantisable else fmt.other


def _tied_head(spec: ModelSpec) -> bool:
    """The LM head's weight is the input embedding matrix (tie_word_embeddings)."""
    return spec.tie_embeddings and spec.head in ("causal-lm", "seq2seq-lm", "masked-lm")


def _tied_grad_sum(spec: ModelSpec, grad_bytes: float, grads_live: bool) -> int:
    """The end of backward for a tied head: autograd holds the head's weight gradient in the input
    buffer of the shared parameter until the embedding's backward produces its own, then adds them
    (torch/csrc/autograd/input_buffer.cpp): two vocab x hidden inputs and the sum coexist with every
    other gradient. With set-to-none the sum becomes .grad (counted as a gradient); with gradients
    already allocated it is a third temporary that AccumulateGrad adds in place."""
    if not _tied_head(spec):
        return 0
    return (3 if grads_live else 2) * round_block(spec.vocab_size * spec.hidden_size * grad_bytes)


def _autocast_copies(spec: ModelSpec, half: int = 2) -> tuple[int, int]:
    """(all copies, head copies): half copies of the parameters that autocast casts for matmuls.
    A tied LM head casts the embedding matrix, so that copy exists too."""
    groups = [g for g in spec.params if g.category in LINEAR_CATEGORIES]
    all_c = _rounded(tuple(groups), lambda g: g.numel * half)
    head_c = _rounded(tuple(g for g in groups if g.category == "head"), lambda g: g.numel * half)
    if _tied_head(spec):
        tied = round_block(spec.vocab_size * spec.hidden_size * half)
        all_c += tied
        head_c += tied
    return all_c, head_c


def _head_grads(spec: ModelSpec, grad_bytes: float) -> int:
    """Gradients allocated first in backward: the head (or the tied embedding matrix)."""
    g = _rounded(tuple(x for x in spec.params if x.category == "head" and x.trainable), lambda x: x.numel * grad_bytes)
    if _tied_head(spec):
        g += round_block(spec.vocab_size * spec.hidden_size * grad_bytes)
    return g


def _per_layer_terms(layer: list[Tensors]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in layer:
        out[t.name] = out.get(t.name, 0) + int(round_block(t.nbytes) * t.count)
    return out


def _training(spec: ModelSpec, w: Workload):
    prec = PRECISIONS[w.precision]
    rule = OPTIMIZERS[w.optim]
    notes: list[str] = []
    trainable = tuple(g for g in spec.params if g.trainable)
    weights = _rounded(spec.params, lambda g: g.numel * prec.param)
    grads = _rounded(trainable, lambda g: g.numel * prec.grad)
    states = sum(round_block(optimizer_state_bytes(rule, g.shape, prec.param, w.momentum > 0)) * g.count
                 for g in trainable)
    temp = 0
    if rule.foreach_temp:
        temp = _rounded(trainable, lambda g: g.numel * prec.param * rule.foreach_temp)
    if rule.per_tensor_temp:
        temp = int(rule.per_tensor_temp * round_block(spec.largest_tensor * 4))
    if rule.paged:
        notes.append(f"{w.optim}: paged optimizer state can spill to CPU memory under pressure; counted on the GPU")

    am = training_activations(spec, w.micro_batch, w.seq_len, prec, w.attn, selective=w.grad_ckpt == "selective",
                              kv_cache=w.grad_ckpt != "full")
    layer_b = _rounded_tensors(am.layer)
    dec_b = _rounded_tensors(am.decoder_layer)
    other_b = _rounded_tensors(am.other)
    n_enc, n_dec = spec.num_layers, spec.num_decoder_layers
    lsm = _rounded_tensors([t for t in am.other if t.name.startswith("log_softmax")])
    if w.grad_ckpt == "full":
        acts = (n_enc + n_dec) * _rounded_tensors(am.layer_input) + other_b
        recompute = max(layer_b, dec_b)  # one layer's activations, rebuilt during its backward
    else:
        acts = n_enc * layer_b + n_dec * dec_b + other_b
        # selective: one layer's attention core is rebuilt during that layer's backward
        recompute = _rounded_tensors(am.layer_core) if w.grad_ckpt == "selective" else 0

    c_all, c_head = _autocast_copies(spec) if prec.autocast else (0, 0)
    n_layers = n_enc + n_dec
    c_layer = (c_all - c_head) // max(n_layers, 1)
    c_bwd = (c_head + c_layer) if w.grad_ckpt == "full" else c_all

    grads_in_fwd = w.zero_grad == "zeros" or w.grad_accum > 1
    g_live = grads if grads_in_fwd else 0
    g_head = 0 if grads_in_fwd else _head_grads(spec, prec.grad)
    loss_fwd = _rounded_tensors(am.loss_forward)
    loss_bwd = _rounded_tensors(am.loss_backward)
    layer_bwd = _rounded_tensors(am.layer_backward)

    base = weights + states + g_live
    phases = {
        "forward-loss": base + c_all + acts + loss_fwd,
        "backward-start": base + c_bwd + acts + loss_bwd,
        "backward-layer": base + c_bwd + acts - lsm + g_head + recompute + layer_bwd,
        "optimizer-step": weights + grads + states + temp,
    }
    tied_sum = _tied_grad_sum(spec, prec.grad, grads_in_fwd)
    if tied_sum:
        phases["backward-end"] = weights + states + grads + tied_sum
    peak_phase = max(phases, key=lambda k: phases[k])
    parts = {"weights": weights, "optimizer_states": states}
    if peak_phase in ("optimizer-step", "backward-end"):
        parts |= {"gradients": grads, "optimizer_temporaries": temp if peak_phase == "optimizer-step" else 0,
                  "transient": tied_sum if peak_phase == "backward-end" else 0}
        act_ts: list[Tensors] = []
    else:
        parts["gradients"] = g_live + (g_head if peak_phase == "backward-layer" else 0)
        parts["autocast_cache"] = c_all if peak_phase == "forward-loss" else c_bwd
        parts["activations"] = acts - (lsm if peak_phase == "backward-layer" else 0)
        parts["transient"] = {"forward-loss": loss_fwd, "backward-start": loss_bwd,
                              "backward-layer": recompute + layer_bwd}[peak_phase]
        per = am.layer_input if w.grad_ckpt == "full" else am.layer
        act_ts = [Tensors(t.name, t.nbytes, t.count * (n_enc + n_dec)) for t in per] + am.other
        act_ts += {"forward-loss": am.loss_forward, "backward-start": am.loss_backward,
                   "backward-layer": am.layer_backward}[peak_phase]
    if w.grad_accum > 1:
        notes.append("gradient accumulation keeps the gradients allocated through the next forward")
    return parts, phases, peak_phase, act_ts, notes, _per_layer_terms(am.layer)


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
    cache = _autocast_copies(spec)[0] if autocast else 0
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
