"""Serving: the weights (quantised or not), autocast's copies, the KV cache and one layer's working set
under no_grad, at prefill and while decoding (docs/estimator.md)."""

from __future__ import annotations

from memplan.estimator.activations import (Tensors, inference_working_set, is_core, kv_widths,
                                           rotary_in_stream_dtype, total)
from memplan.estimator.allocation import allocated_of, segments_of
from memplan.estimator.breakdown import Peak
from memplan.estimator.families import family
from memplan.estimator.finetune import quantised, stored_tensors
from memplan.estimator.parallel import tied_head
from memplan.estimator.rules import FP32, HALF, WEIGHT_FORMATS, WeightFormat
from memplan.estimator.states import autocast_copies, by_shape
from memplan.estimator.meters import gpu_workspace, meters
from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import Workload
from memplan.search.cost import SERVING_KERNELS, inference_throughput


def kv_bytes_per_token(spec: ModelSpec, kv_bytes: int, v_bytes: int | None = None) -> int:
    """One layer's KV cache bytes per token: k and v at the KV heads (kv_heads * head_dim each, k at kv_bytes
    and v at v_bytes: transformers 5.24's DynamicLayer / StaticLayer allocate each in its own tensor's dtype,
    where 5.23 started both in k's and its torch.cat promoted a half v to an fp32 k), or, with
    multi-head latent attention, the latent and the shared rotary key (kv_lora_rank + qk_rope_head_dim): transformers
    5.23 caches them before decompressing (modeling_deepseek_v3.py DeepseekV3Attention.forward:
    past_key_values.update(kv_nope, k_rot) as one-head keys and values), as serving engines do (vLLM's
    MLAAttentionSpec: num_kv_heads=1, head_size=kv_lora_rank + qk_rope_head_dim; DeepSeek-V3: 576 values against
    49,152 decompressed)."""
    return sum(kv_widths(spec, kv_bytes, v_bytes))


def layer_windows(spec: ModelSpec) -> tuple[int | None, ...]:
    """Each cached layer's window: the keys a sliding-window layer keeps (sliding_window), or a chunked one
    (Llama 4's attention_chunk_size: transformers caches it as a sliding window, cache_utils.py
    LAYER_TYPE_MAPPING); None for a full-attention layer (ModelSpec.attention_kinds)."""
    window = {"sliding_attention": spec.sliding_window, "chunked_attention": spec.attention_chunk_size}
    return tuple(window.get(t) for t in spec.attention_kinds)


def kv_cache_bytes(spec: ModelSpec, sequences: int, length: int, kv_bytes: int, prefill: bool = False,
                   v_bytes: int | None = None) -> int:
    """kv_bytes_per_token * sequences * the tokens each layer's storage holds after a
    step over `length` tokens of context. transformers 5.23 DynamicCache (cache_utils.py): a full layer holds
    every token; a sliding layer (DynamicSlidingWindowLayer.update) keeps a view of the last window - 1 tokens
    of torch.cat(old, new), so its storage is the cat's: after a decode step min(length, window) tokens, but
    after the prefill (`prefill`) the whole prompt, until the first decode step replaces it."""
    per_token = kv_bytes_per_token(spec, kv_bytes, v_bytes)
    tokens = sum(length if (w is None or prefill) else min(length, w) for w in layer_windows(spec))
    return per_token * sequences * tokens


def _sum_min(first: int, last: int, window: int | None) -> int:
    """sum(min(c, window) for c in range(first, last + 1)), in closed form (window None: no cap)."""
    def below(n: int) -> int:  # sum of min(c, window) for c in 1..n
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window
    return below(last) - below(first - 1)


def decode_kv_traffic(spec: ModelSpec, sequences: int, prompt: int, new: int, kv_bytes: int, v_bytes: int,
                      static: bool) -> int:
    """Bytes of KV cache that generate's decode forwards move, all layers: new - 1 of them (the prefill gives the
    first token), step k attending to prompt + k keys, a sliding layer to its window of them. transformers 5.24's
    DynamicLayer.update grows each layer by torch.cat, which reads the old cache and writes the new one, and the
    attention reads it: 3 passes. StaticCache writes one token in place (index_copy_) and the attention reads the
    whole preallocated length (its mask hides the rest): 1 pass of prompt + new tokens every step."""
    steps = max(new - 1, 0)
    per_token = kv_bytes_per_token(spec, kv_bytes, v_bytes) * sequences
    if static:
        return steps * per_token * sum(prompt + new if w is None else min(prompt + new, w) for w in layer_windows(spec))
    return 3 * per_token * sum(_sum_min(prompt + 1, prompt + steps, w) for w in layer_windows(spec))


def served_tensors(fmt: WeightFormat, spec: ModelSpec, g: ParamGroup) -> list[tuple[float, int]]:
    """(bytes, count) of the tensors one weight group occupies while serving. bitsandbytes quantises what
    transformers converts (finetune.quantised: nn.Linear and Conv1D layers outside the modules it keeps, the head
    among them), stored as finetune.stored_tensors lays out the format's store (LLM.int8: the int8 weight and its
    fp32 row scales; NF4: the packed weight, its code and its absmax, each a tensor of its own); embeddings, norms,
    fused MoE experts and routers that are parameters of their own module (transformers 5.24
    replace_with_bnb_linear converts Linear and Conv1D modules only) stay half."""
    if fmt.quantised and quantised(spec, g):
        return stored_tensors(g.model_copy(update={"store": fmt.store}), HALF)
    return [(g.numel * fmt.other, g.count)]


def dequantised_copy(spec: ModelSpec, fmt: WeightFormat, rows: int) -> int:
    """Bytes of the half copy bitsandbytes 0.50.2 makes of a 4-bit weight for a matmul of more rows than its fused
    kernel takes (backends/cuda/ops.py gemm_4bit -> _dequant_linear_fallback: dequantize_4bit, then F.linear;
    cost.SERVING_KERNELS' crossover): the MLP's largest converted weight (fused MoE experts stay half). 0 for
    int8 (its int8 GEMM reads the int8 weight), other formats and fewer rows."""
    if fmt.name != "int4" or rows <= SERVING_KERNELS["int4"].fused_rows or spec.is_moe:
        return 0
    return HALF * max((g.numel for g in spec.params if g.category == "mlp" and quantised(spec, g)), default=0)


def _half_experts_note(spec: ModelSpec, fmt: WeightFormat) -> list[str]:
    """bitsandbytes weights: say so where a MoE layer's fused experts stay half (served_tensors)."""
    half = sum(g.total for g in spec.params if g.category == "experts" and not quantised(spec, g))
    if not fmt.quantised or not half:
        return []
    return [f"--precision {fmt.name}: transformers converts nn.Linear layers to bitsandbytes; the fused experts "
            f"({half / 1e9:.1f} B parameters) are not Linear modules and stay half "
            f"({half * fmt.other / 2**30:.1f} GiB)"]


def _serving_casts(spec: ModelSpec) -> tuple[int, int, int]:
    """(all, head, MLP) half copies autocast keeps of the fp32 weights while serving (states.autocast_copies);
    only the head's where the layers' casts are not cached (Falcon: families.Family.autocast_caches_layer_weights)."""
    cache, cache_head, cache_mlp = autocast_copies(list(spec.params), spec.vocab_size * spec.hidden_size
                                                   if tied_head(spec) else 0)
    if not family(spec.model_type).autocast_caches_layer_weights:
        return cache_head, cache_head, 0
    return cache, cache_head, cache_mlp


def serving_autocast(precision: str) -> bool:
    """fp16 / bf16 serve fp32 weights under autocast (verify/infer.py weight_dtype); -pure and quantised are half."""
    return precision in ("fp16", "bf16")


def serving_widths(spec: ModelSpec, precision: str) -> tuple[int, int, int]:
    """(matmul outputs, the residual stream, the cached keys): bytes per element while serving at `precision`."""
    fmt = WEIGHT_FORMATS[precision]
    p = FP32 if fmt.compute == "fp32" else HALF
    r = FP32 if fmt.compute == "fp32" or serving_autocast(precision) else HALF  # the fp32 weights' under autocast
    # RoPE multiplies k by cos / sin in the residual stream's dtype (LlamaRotaryEmbedding: cos.to(x.dtype)), so
    # under autocast k is fp32 and is cached so; v, a projection's output, stays in the matmul dtype
    # (transformers 5.24 DynamicLayer.lazy_initialization: each cache in its own tensor's dtype; traced)
    return p, r, r if rotary_in_stream_dtype(spec) else p


def inference_peak(spec: ModelSpec, gpu: GPUProfile, w: Workload) -> Peak:
    """The largest of the moments of a serving step (docs/estimator.md, "Inference"): inside the prefill's last
    layer (the layers' autocast copies cast, the head's not yet), at the prefill's head, the last decode step."""
    fmt = WEIGHT_FORMATS[w.precision]
    autocast = serving_autocast(w.precision)
    p, r, kv_b = serving_widths(spec, w.precision)
    weights = allocated_of([t for g in spec.params for t in served_tensors(fmt, spec, g)] + [(spec.buffer_bytes, 1)])
    cache, cache_head, cache_mlp = _serving_casts(spec) if autocast else (0, 0, 0)
    seqs = w.micro_batch * w.beams
    generate = w.max_new_tokens > 0
    ws = inference_working_set(spec, seqs, w.seq_len, p, r, w.attn, full_logits=not generate,
                               dequant=dequantised_copy(spec, fmt, seqs * w.seq_len))
    length, static = w.seq_len + w.max_new_tokens, w.kv_cache == "static"
    # StaticCache allocates each layer's whole length (a sliding layer's window) at its first update
    # (StaticLayer.lazy_initialization); DynamicCache holds the prompt
    kv_prompt = 0 if not generate else kv_cache_bytes(spec, seqs, length, kv_b, v_bytes=p) if static else \
        kv_cache_bytes(spec, seqs, w.seq_len, kv_b, prefill=True, v_bytes=p)
    # the last layer's attention runs before its MLP's weights are cast, its gate * up before down_proj's
    last_mlp = cache_mlp // max(spec.total_layers, 1)
    last_down = last_mlp // (3 if spec.mlp == "gated" else 2)
    moments = {"prefill": (cache - cache_head - last_down, kv_prompt, ws["mlp"]),
               "prefill attention": (cache - cache_head - last_mlp, kv_prompt, ws["attention"]),
               "prefill head": (cache, kv_prompt, ws["head"])}
    if "rotary" in ws:  # the last layer's RoPE: its k and v are not cached yet
        last_kv = kv_prompt // max(len(layer_windows(spec)), 1)
        moments["prefill rotary"] = (cache - cache_head - last_mlp, kv_prompt - last_kv, ws["rotary"])
    if generate:
        moments["decode"] = (cache, *_decode_step(spec, w, fmt, kv_prompt, kv_b, p, r))
    sums = {k: weights + c + kv + _rounded_total(ts) for k, (c, kv, ts) in moments.items()}
    peak_moment = max(sums, key=lambda k: sums[k])
    c, kv, work_ts = moments[peak_moment]
    peak_phase = "decode" if peak_moment == "decode" else "prefill"
    phases = {"prefill": max(v for k, v in sums.items() if k != "decode")} | (
        {"decode": sums["decode"]} if generate else {})
    notes = ([f"{w.kv_cache} KV cache for {seqs} sequences x {length} tokens"] if generate else []) + (
        _half_experts_note(spec, fmt))
    parts = {"weights": weights, "autocast_cache": c, "kv_cache": kv, "transient": _rounded_total(work_ts)}
    persistent = segments_of([t for g in by_shape(spec.params) for t in served_tensors(fmt, spec, g)])
    act_segments = segments_of(_arithmetic_items(work_ts))
    mt = meters(gpu, w.task, sum(parts.values()), persistent, act_segments, parts["transient"])
    allocated, (reserved, used) = mt.allocated, mt.mode(w.expandable_segments)
    parts |= {"workspace": gpu_workspace(gpu, w.task), "allocator_overhead": reserved - allocated,
              "cuda_context": gpu.cuda_context_bytes}
    saved, state = parts["transient"], parts["weights"] + parts["kv_cache"]
    return Peak(parts, phases, peak_phase, notes, {}, allocated, reserved, used, 0, spec.params_total, saved, state,
                _speed(spec, gpu, w, saved, kv_b, p), mt.report())


def _decode_step(spec: ModelSpec, w: Workload, fmt: WeightFormat, kv_prompt: int, kv_b: int, p: int,
                 r: int) -> tuple[int, list[Tensors]]:
    """(KV cache, live tensors) of the last decode step, or the first (sliding layers still hold the prompt):
    DynamicLayer.update's torch.cat makes a layer's old and new keys live together, then its old and new values.
    StaticCache writes in place (index_copy_), but a full sliding layer rolls its window through a torch.cat
    (StaticSlidingWindowLayer.update)."""
    seqs, length = w.micro_batch * w.beams, w.seq_len + w.max_new_tokens
    kv = max(kv_cache_bytes(spec, seqs, length, kv_b, v_bytes=p), kv_prompt)
    windows = [x for x in layer_windows(spec) if x]
    grow_tokens = (min(max(windows), length) if windows else 0) if w.kv_cache == "static" else length
    key_width = spec.kv_lora_rank if spec.is_mla else spec.num_kv_heads * spec.head_dim  # MLA's keys: the latent
    grow = key_width * kv_b * seqs * grow_tokens
    step = inference_working_set(spec, seqs, 1, p, r, w.attn, full_logits=False, context=length,
                                 dequant=dequantised_copy(spec, fmt, seqs))
    cat = [Tensors("one layer's keys as torch.cat copies them", grow)]
    return kv, max(step["mlp"], step["attention"], step["head"], cat, key=total)


def _speed(spec: ModelSpec, gpu: GPUProfile, w: Workload, working: int, kv_bytes: int, v_bytes: int):
    """The speed model's figures for this serving step (search/cost.py inference_throughput)."""
    traffic = decode_kv_traffic(spec, w.micro_batch * w.beams, w.seq_len, w.max_new_tokens, kv_bytes, v_bytes,
                                w.kv_cache == "static")
    return inference_throughput(spec, gpu, w, working, traffic)


def _rounded_total(ts: list[Tensors]) -> int:
    return allocated_of(_arithmetic_items(ts))


def _arithmetic_items(ts: list[Tensors]) -> list[tuple[float, int]]:
    """(bytes, count) the segment arithmetic charges: eager's core storages (is_core, separate for the
    serving replay) as one, as the arithmetic was calibrated (docs/estimator.md, "Reserved and device used")."""
    core = sum(t.total for t in ts if is_core(t))
    return [(t.nbytes, t.count) for t in ts if not is_core(t)] + ([(core, 1)] if core else [])
