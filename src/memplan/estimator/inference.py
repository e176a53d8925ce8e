"""Serving: the weights (quantised or not), autocast's copies, the KV cache and one layer's working set
under no_grad, at prefill and while decoding (docs/estimator.md)."""

from __future__ import annotations

from memplan.estimator.activations import inference_working_set
from memplan.estimator.allocation import round_block, segments_of
from memplan.estimator.breakdown import Peak
from memplan.estimator.families import family
from memplan.estimator.parallel import tied_head
from memplan.estimator.rules import FP32, HALF, WEIGHT_FORMATS, WeightFormat
from memplan.estimator.states import autocast_copies, by_shape, rounded
from memplan.estimator.meters import gpu_workspace, meters
from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import Workload


def kv_bytes_per_token(spec: ModelSpec, kv_bytes: int) -> int:
    """One layer's KV cache bytes per token: k and v at the KV heads (2 * kv_heads * head_dim), or, with
    multi-head latent attention, the latent and the shared rotary key (kv_lora_rank + qk_rope_head_dim): transformers
    5.23 caches them before decompressing (modeling_deepseek_v3.py DeepseekV3Attention.forward:
    past_key_values.update(kv_nope, k_rot) as one-head keys and values), as serving engines do (vLLM's
    MLAAttentionSpec: num_kv_heads=1, head_size=kv_lora_rank + qk_rope_head_dim; DeepSeek-V3: 576 values against
    49,152 decompressed)."""
    if spec.is_mla:
        return (spec.kv_lora_rank + spec.qk_rope_head_dim) * kv_bytes
    return 2 * spec.num_kv_heads * spec.head_dim * kv_bytes


def kv_cache_bytes(spec: ModelSpec, sequences: int, length: int, kv_bytes: int) -> int:
    """kv_bytes_per_token * layers * sequences * length; sliding-window layers keep at most the window
    (transformers' DynamicSlidingWindowLayer)."""
    per_token = kv_bytes_per_token(spec, kv_bytes)
    layers = spec.num_decoder_layers if spec.arch == "encoder-decoder" else spec.num_layers
    window = spec.sliding_window
    if window and length > window:
        # gemma2 alternates sliding and global layers; mistral v0.1 slides on every layer
        sliding = layers // family(spec.model_type).sliding_every
        return per_token * sequences * (sliding * window + (layers - sliding) * length)
    return per_token * sequences * layers * length


def weight_bytes(fmt: WeightFormat, g: ParamGroup) -> float:
    """bitsandbytes quantises the linear layers' matrices; embeddings, norms and the head stay half."""
    quantisable = g.category in ("attention", "mlp", "experts", "router") and len(g.shape) >= 2
    return fmt.linear if quantisable else fmt.other


def inference_peak(spec: ModelSpec, gpu: GPUProfile, w: Workload) -> Peak:
    fmt = WEIGHT_FORMATS[w.precision]
    p = FP32 if fmt.compute == "fp32" else HALF
    notes: list[str] = []
    weights = rounded(spec.params, lambda g: g.numel * weight_bytes(fmt, g))
    autocast = w.precision in ("fp16", "bf16")
    tied = spec.vocab_size * spec.hidden_size if tied_head(spec) else 0
    cache = autocast_copies(list(spec.params), tied)[0] if autocast else 0
    seqs = w.micro_batch * w.beams
    generate = w.max_new_tokens > 0
    kv = kv_cache_bytes(spec, seqs, w.seq_len + w.max_new_tokens, p) if generate else 0
    kv_prompt = kv_cache_bytes(spec, seqs, w.seq_len, p) if generate else 0
    work_ts = inference_working_set(spec, seqs, w.seq_len, p, w.attn, full_logits=not generate)
    work = sum(round_block(t.nbytes) * t.count for t in work_ts)
    kv_grow = 0
    if generate:  # DynamicCache grows by torch.cat: one layer's old and new k, v live together
        kv_grow = kv // max(spec.num_layers, 1)
        notes.append(f"KV cache for {seqs} sequences x {w.seq_len + w.max_new_tokens} tokens")
    phases = {"prefill": weights + cache + kv_prompt + work, "decode": weights + cache + kv + kv_grow}
    peak_phase = max(phases, key=lambda k: phases[k])
    parts = {"weights": weights, "autocast_cache": cache, "kv_cache": kv_prompt if peak_phase == "prefill" else kv,
             "transient": work if peak_phase == "prefill" else kv_grow}
    persistent = segments_of([(g.numel * weight_bytes(fmt, g), g.count) for g in by_shape(spec.params)])
    act_segments = segments_of([(t.nbytes, t.count) for t in work_ts] if peak_phase == "prefill" else [])
    allocated, reserved, used = meters(gpu, sum(parts.values()), persistent, act_segments, parts["transient"])
    parts |= {"workspace": gpu_workspace(gpu), "allocator_overhead": reserved - allocated,
              "cuda_context": gpu.cuda_context_bytes}
    return Peak(parts, phases, peak_phase, notes, {}, allocated, reserved, used, 0, spec.params_total,
                parts["transient"], parts["weights"] + parts["kv_cache"])
