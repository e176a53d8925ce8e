"""Activation model: the tensors a transformers model saves for backward, per layer, with the formula
for each in view (Calculon / Megatron style), plus the transients at the moments that can be the peak.

Every term is a `Tensors(name, nbytes, count)`: `count` live tensors of `nbytes` each, so the allocator's
per-tensor rounding can be applied. Notation: b micro batch, s sequence, T = b*s tokens, h hidden,
a query heads, k kv heads, d head dim, f MLP intermediate, V vocab, E experts, K experts per token.
Byte widths: p = matmul outputs (4 fp32, 2 half), r = residual stream / norm outputs (4 under fp32 and
autocast, 2 in pure half), see rules.Precision. docs/estimator.md, "Activation terms per layer",
derives each term.

Starting point: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), 34*s*b*h + 5*a*s^2*b bytes per layer in half precision with dropout; this model refines it to
what transformers' implementations save (separate q/k/v casts under autocast, fp32 softmax up-casts,
RMSNorm's fp32 copies, gated MLPs, GQA expansion in eager attention, MoE routing).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import NamedTuple

from memplan.estimator.families import GATED_ACT_KERNEL, embedding_layernorm, family
from memplan.estimator.finetune import AdapterInput, LoraActs
from memplan.inputs.modelspec import LM_HEADS, ModelSpec
from memplan.inputs.trace import SAVED
from memplan.estimator.rules import (
    ACTIVATION_SAVES, FP32, HALF, MASK, Precision, activation_saved_bytes, fused_loss_blocks, tiled_mlp_chunk,
)


class TensorKind(Enum):
    """What the step does with a tensor beyond holding it: the label (`Tensors.name`) is for people only."""

    OTHER = "other"
    CORE = "core"  # the attention core (QK^T, softmax, dropout, PV): selective recomputation rebuilds it
    # the core's probabilities that it returns (eager_attention_forward's attn_weights, the PV matmul's input): a
    # layer binds them to `_` until it returns (LlamaDecoderLayer, BertLayer: `hidden_states, _ = self.self_attn(...)`),
    # so under selective recomputation they outlive the checkpointed core to the block's end; part of the core
    PROBS = "probs"
    # the loss's saved log_softmax output (and what the head saves after its matmul: Gemma 2's soft-capping
    # tanh output), freed by the loss's backward, before the last layer's
    LOG_SOFTMAX = "log_softmax"
    # saved only for a weight's gradient (a linear's input): autograd does not save it when that weight is
    # frozen (a derivative formula's inputs are saved only for the outputs that need a gradient:
    # torch/csrc/autograd, should_compute_output)
    WEIGHT_INPUT = "weight_input"
    # the same for a norm's weight (RMSNorm's normalised tensor); a kind of its own because LLM.int8's
    # matmul keeps its linears' inputs whatever the weight (WEIGHT_INPUT stays) while this one goes
    NORM_INPUT = "norm_input"
    # the output layer's input, saved only for its weight's gradient; transformers never quantises the output
    # layer (quantizers/base.py get_keys_to_not_convert), so no LLM.int8 matmul keeps it either
    HEAD_INPUT = "head_input"
    # a traced model's first block's storages beyond its second's (traced.py Coefficients.blocks), kept with the
    # embeddings for the step's sums; the replay makes that block's own storages instead
    FIRST_BLOCK = "first_block"


@dataclass(frozen=True)
class Tensors:
    name: str
    nbytes: float  # bytes of one tensor
    count: int = 1
    # Replicated under tensor parallelism (the residual stream side: norms, linear inputs, hidden
    # dropout masks); sequence parallelism shards these too (Korthikanti et al. 2022, section 4.2.2).
    rep: bool = False
    kind: TensorKind = TensorKind.OTHER
    # autocast's half casts of a linear input: bytes of the one input they are cast from, which a matmul that
    # bypasses autocast saves instead (bitsandbytes' LLM.int8: int8_saved_input); 0 for any other tensor
    uncast: float = 0.0

    @property
    def total(self) -> float:
        return self.nbytes * self.count


@dataclass
class ActivationModel:
    """Saved activations and the transients that matter for the peak, for one micro batch."""

    layer: list[Tensors]  # saved by one encoder (or decoder-only) layer
    decoder_layer: list[Tensors]  # saved by one decoder layer of an encoder-decoder (else empty)
    embed: list[Tensors]  # embeddings (the first pipeline stage)
    head_saved: list[Tensors]  # final norm, head, log-softmax (the last pipeline stage)
    layer_input: list[Tensors]  # what full checkpointing keeps per layer
    layer_backward: list[Tensors]  # extra live in one layer's backward (grad buffers)
    layer_core: list[Tensors]  # the attention core of one layer: rebuilt in backward under selective
    loss_forward: list[Tensors]  # transient while the loss is computed (half + fp32 logits)
    loss_backward: list[Tensors]  # transient at the start of backward (loss gradient chain)
    infer_working: list[Tensors] = field(default_factory=list)  # one layer's no-grad working set
    # freeze: what a frozen block autograd records keeps (frozen_block), encoder-or-decoder-only and decoder
    frozen_layer: list[Tensors] = field(default_factory=list)
    frozen_decoder_layer: list[Tensors] = field(default_factory=list)
    # storages in the order the step makes them, for the replay (timeline.py): (n, bytes) the n-th born, (~n, 0) its
    # death, (SAVED - k, 0) the list's k-th saved tensor born. A traced model's: its block's forward and backward
    # (traced.TracedBlock) and the loss's two windows (traced.LOSS_SEQUENCES); an analytic one's: eager attention's
    # core in a block's forward (_eager_core_sequence; under selective recomputation its no-grad run,
    # _selective_core_sequence, and its recompute in backward, "layer_core"), its other lists replayed in their order
    sequences: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # the index in `layer` the MLP's weights' autocast casts are made before (LayerOrder.mlp; 0: with the block's
    # other casts, at its start), and the routed experts' (LayerOrder.experts)
    mlp_start: int = 0
    experts_start: int = 0
    # the attention masks a decoder's forward makes once for its layers and frees as it returns, before the head,
    # where no checkpoint holds them (checkpoint_masks; traced, llama4-small bf16 eager: the chunked and the full
    # layers' fp32 masks, 2 MiB each, made before the first layer and freed after the last); only the replay makes them
    forward_masks: list[Tensors] = field(default_factory=list)
    # the KV cache a layer's forward fills where nothing saved stands for it, alive from the layer's cache update to
    # the loss's end (_cache_copies): a block autograd records, and one it does not (freeze)
    forward_cache: list[Tensors] = field(default_factory=list)
    unrecorded_cache: list[Tensors] = field(default_factory=list)
    # an analytic layer's backward in its two phases, the MLP's then the attention's, for the replay (layer_backward is
    # the larger): the MLP's transients (_mlp_backward) and eager attention's (_attention_backward; [] under SDPA)
    mlp_backward: list[Tensors] = field(default_factory=list)
    attention_backward: list[Tensors] = field(default_factory=list)


def total(ts: list[Tensors]) -> float:
    return sum(t.total for t in ts)


LOCAL_ATTENTION = ("sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class Transient:
    """A storage a layer's forward makes beside what autograd saves and frees before the layer returns: born
    right after entry `after` of the layer's list, dead right after entry `until` (entries by identity). Only the
    replay (timeline.py) makes them, in order, where they decide which segments the saved tensors after them land
    in; the step's sums leave them out."""

    nbytes: float
    after: Tensors
    until: Tensors


@dataclass
class LayerOrder:
    """What a layer's forward does beside making its saved list, in order, for the replay (timeline.py); _layer
    fills it in."""

    transients: list[Transient] = field(default_factory=list)
    # the MLP's first saved entry: the MLP's weights' autocast casts are made as it starts, after the attention's
    # tensors; the routed experts' as their matmul runs, before their first (traced, llama4-small bf16 eager: the
    # experts' 2 MiB gate_up cast after the router's tensors and the experts' input)
    mlp: Tensors | None = None
    experts: Tensors | None = None


class LayerKind(NamedTuple):
    """One layer of a stack whose layers differ (ModelSpec.dense_layer_ids, layer_types, qk_norm_layer_ids). The
    step's sums take the mean layer (a list at each kind's share of the layers, the total over the layers exact);
    the replay (timeline.py) makes each layer's own tensors, whose sizes decide how they pack into segments."""

    moe: bool  # its MLP is the routed experts' (else the dense MLP, intermediate_size wide)
    local: bool  # its attention is sliding or chunked: SDPA gets a materialised mask (_sdpa_mask_terms)
    qk_norm: bool  # it runs the family's q/k norm (Llama 4: its RoPE layers)


def mlp_kinds(spec: ModelSpec, kind: LayerKind | None) -> tuple[bool, ...]:
    """The MLPs a layer of `kind` runs, True a MoE layer's routed experts, False a dense MLP; without a kind (the
    mean layer, whose moments take the worse) each a MoE model has."""
    if not spec.is_moe:
        return (False,)
    if kind is not None:
        return (kind.moe,)
    return (True, False) if spec.dense_layers else (True,)


def layer_kinds(spec: ModelSpec) -> tuple[LayerKind, ...]:
    """Each layer's kind in a decoder-only (or encoder) stack whose layers differ; () where they are alike, or in
    an encoder-decoder (one kind a stack)."""
    if spec.arch == "encoder-decoder":
        return ()
    types, qk = spec.layer_types, spec.qk_norm_layer_ids
    if types and len(types) != spec.num_layers:  # not one per layer: the mean layer's share stands
        return ()
    kinds = tuple(LayerKind(moe=spec.is_moe and i not in spec.dense_layer_ids,
                            local=types[i] in LOCAL_ATTENTION if types else True,
                            qk_norm=qk is None or i in qk) for i in range(spec.num_layers))
    return kinds if len(set(kinds)) > 1 else ()


def _norm(spec: ModelSpec, T: int, prec: Precision) -> list[Tensors]:
    """Saved by one norm. LayerNorm (native_layer_norm) saves its input + mean/rstd (fp32, per token).
    transformers' RMSNorm upcasts: pow saves the fp32 input (a copy in pure half), the weight multiply
    saves the normalised tensor in the input dtype."""
    h, r = spec.hidden_size, prec.residual
    if spec.norm == "layernorm":
        return [Tensors("norm input", layernorm_input_bytes(prec) * h * T, rep=True),
                Tensors("norm mean/rstd", FP32 * T, 2, rep=True)]
    if family(spec.model_type).norm_weight_fp32:
        r = FP32  # the weight multiplies the fp32 normalised tensor before the cast back (Olmo2RMSNorm)
    return [Tensors("rmsnorm fp32 input", FP32 * h * T, rep=True),
            Tensors("rmsnorm normalised", r * h * T, rep=True, kind=TensorKind.NORM_INPUT),
            Tensors("rmsnorm rstd", FP32 * T, rep=True)]


def _qk_norms(spec: ModelSpec, T: int, prec: Precision, kind: LayerKind | None = None) -> list[Tensors]:
    """Saved by the RMSNorms on the query and key projections (families.Family.qk_norm), over q's a*d and
    k's k*d values per token. Each upcasts the projection's output: pow and the rstd multiply save the fp32
    copy (the output itself in an fp32 model), the multiply saves rstd (per head and token for a per-head norm,
    per token for a norm over the whole projection) and the weight multiply saves the normalised tensor, in the
    projection's dtype (Qwen3RMSNorm casts back first) or fp32 (Olmo2RMSNorm multiplies first). transformers
    5.23 models/qwen3/modeling_qwen3.py Qwen3Attention.forward, models/olmo2/modeling_olmo2.py
    Olmo2Attention.forward. RoPE after it saves only cos and sin (shared by the layers)."""
    fam = family(spec.model_type)
    if fam.qk_norm is None or spec.qk_norm_layers == 0 or (kind is not None and not kind.qk_norm):
        return []
    a, k, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    normalised = FP32 if fam.norm_weight_fp32 else prec.act
    per_head = fam.qk_norm != "full"
    # a norm over the whole projection needs all heads: transformers' TP plan gathers q, k (Olmo2Config
    # base_model_tp_plan "colwise_gather_output"), so those tensors are replicated; per-head norms split with heads
    rep = not per_head
    # Llama 4's L2 norm (Llama4TextL2Norm: x.float() * rsqrt(mean(x^2) + eps), type_as back) has no weight, so no
    # normalised tensor; it runs on the RoPE layers only: the mean layer takes their share
    share = 1.0 if kind is not None else spec.qk_norm_share
    out: list[Tensors] = []
    for name, heads in (("q", a), ("k", k)):
        out += [Tensors(f"{name}_norm fp32 input", share * FP32 * heads * d * T, rep=rep),
                Tensors(f"{name}_norm rstd", share * FP32 * (heads if per_head else 1) * T, rep=rep)]
        if fam.qk_norm != "l2":
            out.append(Tensors(f"{name}_norm normalised", share * normalised * heads * d * T, rep=rep,
                               kind=TensorKind.NORM_INPUT))
    return out


def layernorm_input_bytes(prec: Precision) -> int:
    """Width of the input a LayerNorm saves: autocast runs layer_norm in fp32 (torch 2.13
    ATen/autocast_mode.h AT_FORALL_FP32: layer_norm, native_layer_norm), so a half residual stream (LoRA over
    a half base, GPT-2's) is cast to fp32 first and native_layer_norm saves the cast (traced); else the
    residual stream's width."""
    return FP32 if prec.autocast else prec.residual


def _linear_inputs(n_linears: int, width: int, T: int, prec: Precision, name: str) -> list[Tensors]:
    """Inputs saved by `n_linears` linears reading one norm output. Under autocast each linear casts
    the fp32 input to half itself (autocast caches only leaf weights), so there are n copies."""
    if prec.autocast and prec.residual != HALF:
        return [Tensors(f"{name} (half cast)", HALF * width * T, n_linears, rep=True, kind=TensorKind.WEIGHT_INPUT,
                        uncast=prec.residual * width * T)]
    return [Tensors(name, prec.residual * width * T, rep=True, kind=TensorKind.WEIGHT_INPUT)]


def _attention(spec: ModelSpec, b: int, s_q: int, s_kv: int, prec: Precision, attn: str,
               selective: bool = False, kv_cache: bool = False, kind: LayerKind | None = None) -> list[Tensors]:
    """Saved by one attention block after its input projection: q, k, v, the core, the output input.
    Tensors of kind CORE belong to the attention core (QK^T, softmax, dropout, PV), which selective
    recomputation (Korthikanti et al. 2022, section 5) drops and rebuilds in backward; the core's inputs
    q, k, v (k, v at kv heads) and its output stay."""
    # under autocast attention runs on half casts whatever width the projections return
    a, k, d, p = spec.num_heads, spec.num_kv_heads, spec.head_dim, HALF if prec.autocast else prec.act
    Tq, Tkv = b * s_q, b * s_kv
    # The core's inputs as the checkpoint holds them under selective recomputation: rotary embeddings multiply q
    # and k by cos / sin in the hidden states' dtype (LlamaRotaryEmbedding returns cos.to(x.dtype)), so over an
    # fp32 model under autocast they are fp32 (not Llama 4's: rotary_in_stream_dtype); without the checkpoint the
    # kernels save their half casts instead.
    # Traced: Qwen3-0.6B b2 s512 bf16 sdpa held q (8 MiB) and k (4 MiB) per layer in fp32 (-1.4 % before).
    qk = prec.residual if selective and rotary_in_stream_dtype(spec) and prec.autocast else p
    out: list[Tensors] = [Tensors("q", qk * a * d * Tq)]
    if attn == "eager" and a != k:
        # repeat_kv materialises k and v at `a` heads and the matmuls save those copies; the k, v at kv
        # heads are saved only as the checkpointed core's inputs under selective recomputation.
        out.append(Tensors("core: k, v expanded to all heads", p * a * d * Tkv, 2, kind=TensorKind.CORE))
        if selective:
            out += [Tensors("k", qk * k * d * Tkv), Tensors("v", p * k * d * Tkv)]
    elif qk != p:
        out += [Tensors("k", qk * k * d * Tkv), Tensors("v", p * k * d * Tkv)]
    else:
        out.append(Tensors("k, v", p * k * d * Tkv, 2))
        if kv_cache and attn != "eager" and not selective and family(spec.model_type).query_views_fused_qkv \
                and query_is_view(prec):
            # Decoders build a DynamicCache in training too (use_cache defaults to True; only gradient
            # checkpointing turns it off), and attention gets the cache's torch.cat copies of k and v.
            # The SDPA / flash kernel saves the query, a view that keeps the whole fused QKV output
            # alive, so the k and v it holds survive beside their copies (traced, GPT-2).
            out.append(Tensors("k, v before the cache copy (fused QKV)", p * k * d * Tkv, 2))
    if attn == "eager":
        out += _eager_scores(spec, b * a * s_q, s_kv, prec, p)
    else:
        # SDPA (flash / memory-efficient) and FlashAttention-2 save q, k, v, the output and the
        # log-sum-exp; GQA is native (enable_gqa) so k, v stay at k heads.
        # The kernel's saved output is laid out (b, s, heads, d), so transpose(1, 2).contiguous() is a
        # view and the o_proj input below is the same storage: counted once, as the context (traced).
        out += [Tensors("core: logsumexp", FP32 * b * a * s_q, kind=TensorKind.CORE)]
        out += _sdpa_mask_terms(spec, b, s_q, s_kv, p, kind)
        if spec.position == "relative" and prec.autocast:
            # T5 passes its position bias (1 x heads x s_q x s_kv, shared by the layers) to SDPA as a
            # float attn_bias; autocast casts it per call and the memory-efficient kernel saves the cast.
            out.append(Tensors("position bias (half cast)", HALF * a * s_q * s_kv))
    # SDPA's kernels save their output, which is the o_proj input; eager's PV matmul does not save its output
    out.append(Tensors("context (o_proj input)", p * a * d * Tq,
                       kind=TensorKind.WEIGHT_INPUT if attn == "eager" else TensorKind.OTHER))
    if spec.hidden_dropout > 0:
        out.append(Tensors("output dropout mask", MASK * spec.hidden_size * Tq, rep=True))
    return [t for t in out if not is_core(t)] if selective else out


def _eager_scores(spec: ModelSpec, rows: int, s_kv: int, prec: Precision, p: int) -> list[Tensors]:
    """What eager attention's core saves of its scores (`rows` = b x a x s_q, by s_kv): the softmax output, Gemma 2's
    soft-capping tanh, the dropout mask, and the PV matmul's input where it is not the softmax output itself.
    GPT-OSS's softmax runs over one more column, the sink (sink_columns)."""
    sm = _softmax_bytes(spec, prec)
    scores = rows * s_kv
    matmul_input = spec.attention_dropout > 0 or sm != p  # the PV matmul's input is not the softmax output itself
    out = [Tensors("core: softmax output", sm * rows * (s_kv + sink_columns(spec)),
                   kind=TensorKind.CORE if matmul_input else TensorKind.PROBS)]
    if spec.attn_logit_softcapping:
        # Gemma 2's eager core soft-caps the scores, tanh(scores / cap) * cap, before the mask (transformers
        # 5.24 models/gemma2/modeling_gemma2.py eager_attention_forward); tanh saves its output, in the
        # scores' dtype (traced: gemma-2-2b b1 s1024 bf16-pure eager, 16 MiB a layer)
        out.append(Tensors("core: logit soft-capping tanh output", p * scores, kind=TensorKind.CORE))
    if spec.attention_dropout > 0:
        out.append(Tensors("core: attention dropout mask", MASK * scores, kind=TensorKind.CORE))
    if matmul_input:
        # the PV matmul saves its own input: the dropout output or the cast back to p
        out.append(Tensors("core: attention probs (matmul input)", p * scores, kind=TensorKind.PROBS))
    return out


def _latent_norm(name: str, width: int, T: int, p: int, whole: int = 0) -> list[Tensors]:
    """Saved by an RMSNorm over a latent of `width` values per token that a linear of output width p made
    (DeepseekV3RMSNorm: x.to(float32), pow, the rstd multiply, then weight * x.to(input_dtype)): the fp32 input
    (the upcast copy of a half input; an fp32 input is saved as it is: `whole` values per token when it is a
    split view of a wider output), the rstd and the normalised tensor in the input's dtype p. Its output is fp32
    under autocast (the fp32 weight times a half tensor), which the next linear casts to half."""
    src = whole if (p == FP32 and whole) else width
    return [Tensors(f"{name} fp32 input", FP32 * src * T),
            Tensors(f"{name} normalised", p * width * T, kind=TensorKind.NORM_INPUT),
            Tensors(f"{name} rstd", FP32 * T)]


def _mla_attention(spec: ModelSpec, b: int, s: int, prec: Precision, attn: str, selective: bool) -> list[Tensors]:
    """Saved by multi-head latent attention after the layer's input norm (transformers 5.23
    models/deepseek_v3/modeling_deepseek_v3.py DeepseekV3Attention.forward / expand_kv). Notation: a heads, dq =
    qk_nope + qk_rope (spec.head_dim), dv = v_head_dim, rq = q_lora_rank, rkv = kv_lora_rank, rope = qk_rope.
    - q_a_proj (or q_proj without q_lora_rank) and kv_a_proj_with_mqa read the norm output: 2 linear inputs;
    - q_a_layernorm over rq and kv_a_layernorm over rkv (_latent_norm), q_b_proj's input (rq) and kv_b_proj's
      input (rkv), in the matmul width p (under autocast the norms' fp32 outputs cast to half);
    - the attention's query cat(q_pass, rotated q_rot) and key (new_empty, k_nope and the shared k_rot copied
      in), a * dq each; RoPE multiplies by cos / sin, which need no gradient, so it saves nothing per layer;
    - SDPA (memory-efficient: flash needs one head width for q, k, v): the value is a view of kv_b_proj's output,
      so the kernel keeps that whole output, a * (qk_nope + dv), alive; its logsumexp; its output (the o_proj
      input, a * dv);
    - eager: the QK^T matmul saves q and k; softmax's fp32 output; the probabilities cast back to p; the PV
      matmul copies the strided value into a contiguous a * dv tensor (its reshape) and saves that; the
      transpose(1, 2).contiguous() output is the o_proj input. transformers keeps the latent in the KV cache
      (past_key_values.update(kv_nope, k_rot)): in training these copies are not saved by autograd.
    Traced: benchmarks/accuracy/results/accuracy-deepseek.md."""
    h, a, T = spec.hidden_size, spec.num_heads, b * s
    dq, dv, nope = spec.head_dim, spec.value_head_dim, spec.qk_nope_head_dim
    rq, rkv, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
    p = HALF if prec.autocast else prec.act  # linear outputs; attention runs on half casts under autocast
    out = _linear_inputs(2, h, T, prec, "q_a / kv_a input")
    if rq:
        out += _latent_norm("q_a_layernorm", rq, T, p)
        out.append(Tensors("q_b_proj input", p * rq * T, kind=TensorKind.WEIGHT_INPUT))
    out += _latent_norm("kv_a_layernorm", rkv, T, p, whole=rkv + rope)
    out.append(Tensors("kv_b_proj input", p * rkv * T, kind=TensorKind.WEIGHT_INPUT))
    out.append(Tensors("query (q_pass, q_rot), key (k_nope, k_rot)", p * a * dq * T, 2))
    if attn == "eager":
        scores = b * a * s * s
        out += [Tensors("core: softmax output", _softmax_bytes(spec, prec) * scores, kind=TensorKind.CORE),
                Tensors("core: attention probs (matmul input)", p * scores, kind=TensorKind.PROBS),
                Tensors("core: value (contiguous copy)", p * a * dv * T, kind=TensorKind.CORE)]
        if selective:  # the checkpointed core's input is the value view of kv_b_proj's output
            out.append(Tensors("kv_b_proj output (value's storage)", p * a * (nope + dv) * T))
    else:
        out += [Tensors("kv_b_proj output (k_nope and value, value's storage)", p * a * (nope + dv) * T),
                Tensors("core: logsumexp", FP32 * b * a * s, kind=TensorKind.CORE)]
    out.append(Tensors("context (o_proj input)", p * a * dv * T,
                       kind=TensorKind.WEIGHT_INPUT if attn == "eager" else TensorKind.OTHER))
    return [t for t in out if not is_core(t)] if selective else out


def sdpa_masked(spec: ModelSpec, s_kv: int) -> bool:
    """Whether SDPA gets a materialised mask instead of is_causal (families.Family.sdpa_mask)."""
    rule = family(spec.model_type).sdpa_mask
    window = spec.sliding_window or spec.attention_chunk_size
    # masking_utils' sdpa_mask skips the mask (is_causal) only while the keys are fewer than the local size:
    # _ignore_causal_mask_sdpa returns False once kv_length >= local_attention_size (sliding_window, or
    # attention_chunk_size for create_chunked_causal_mask)
    return rule == "always" or (rule == "window" and window is not None and window <= s_kv)


def _sdpa_mask_terms(spec: ModelSpec, b: int, s_q: int, s_kv: int, p: int,
                     kind: LayerKind | None = None) -> list[Tensors]:
    """What a materialised mask adds to an SDPA layer: the additive mask the memory-efficient kernel saves
    (b x 1 x s_q x s_kv in the query's dtype, made from the boolean mask by each call: torch's
    convert_boolean_attn_mask) and, where the kv heads are fewer, k and v repeated to every head before the
    kernel (transformers 5.23 integrations/sdpa_attention.py repeat_kv; FalconAttention's multi-query k, v, which
    the memory-efficient kernel takes only at the query's heads), saved by the kernel (traced)."""
    if not sdpa_masked(spec, s_kv) or (kind is not None and not kind.local):
        return []
    a, k, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    # where layer_types mix sliding and full layers (Gemma 3), only the sliding ones get the mask: the mean layer
    # (the step multiplies it by the layer count) takes the sliding share
    local = sum(t in LOCAL_ATTENTION for t in spec.layer_types)
    share = local / len(spec.layer_types) if spec.layer_types and kind is None else 1.0
    out = [Tensors("core: SDPA additive mask (query dtype)", share * p * b * s_q * s_kv, kind=TensorKind.CORE)]
    if a != k:
        out.append(Tensors("core: k, v repeated to all heads", share * p * a * d * b * s_kv, 2, kind=TensorKind.CORE))
    return out


def checkpoint_masks(spec: ModelSpec, b: int, s: int, prec: Precision, attn: str) -> list[Tensors]:
    """The attention masks a decoder's forward makes once and passes to every layer. Under full checkpointing each
    checkpointed layer holds its arguments until its backward recomputes it, so they live through the step
    (without it autograd saves no mask: SDPA's additive copy is in _sdpa_mask_terms). eager: a float mask
    (b x 1 x s x s, in the embeddings' dtype: masking_utils eager_mask) per attention kind (full, sliding,
    chunked); SDPA: a boolean one per kind it is materialised for (sdpa_masked). Traced: Llama eager, an fp32
    mask of 8 MiB at b2 s1024 under autocast; StarCoder 2's sliding-window mask; Gemma 3 and Llama 4 hold a
    second boolean tensor of the same size (and_masks' intermediate) that this leaves out."""
    if spec.arch != "decoder":
        return []
    kinds = set(spec.attention_kinds)
    if attn == "eager":
        return [Tensors("attention masks (held by the checkpointed layers)", prec.residual * b * s * s, len(kinds))]
    if not sdpa_masked(spec, s):
        return []
    n = 1 if family(spec.model_type).sdpa_mask == "always" else max(1, len(kinds - {"full_attention"}))
    return [Tensors("SDPA boolean masks (held by the checkpointed layers)", b * s * s, n)]


def query_is_view(prec: Precision) -> bool:
    """Whether the attention kernel gets the projection's output as it is (the query a view of it), or
    autocast's half cast of it: QLoRA's quantised projections return fp32 under autocast (bitsandbytes 0.50.2
    nn/modules.py Linear4bit.forward `.to(inp_dtype)`; Linear8bitLt's matmul returns its fp32 input's dtype),
    so SDPA casts q, k and v and saves the casts, and the fused fp32 output dies with the forward (traced:
    GPT-2 QLoRA, benchmarks/accuracy/results/accuracy-qlora.md)."""
    return not prec.autocast or prec.act == HALF


def sink_columns(spec: ModelSpec) -> int:
    """Columns eager attention concatenates to its scores before the softmax: GPT-OSS's one learned sink logit a
    head (transformers 5.24 models/gpt_oss/modeling_gpt_oss.py eager_attention_forward, `torch.cat([attn_weights,
    sinks], dim=-1)`; traced, gpt-oss-small b2 s512: 16,809,984-byte fp32 tensors, 2 x 8 x 512 x 513 x 4)."""
    return 1 if family(spec.model_type).attention_sinks else 0


def _softmax_bytes(spec: ModelSpec, prec: Precision) -> int:
    """Width of eager attention's softmax output: fp32 under autocast (softmax is on its fp32 list), in an
    fp32 model, and where the family's softmax up-casts; else the compute dtype. GPT-OSS passes the dtype
    (`softmax(combined_logits, dtype=combined_logits.dtype)`), which autocast keeps: the residual stream's, the
    mask's sum's (bf16 over a half LoRA base under autocast, fp32 over an fp32 model)."""
    if family(spec.model_type).attention_sinks:
        return prec.residual
    fp32 = prec.autocast or family(spec.model_type).softmax_fp32 or prec.act == FP32
    return FP32 if fp32 else prec.act


def is_core(t: Tensors) -> bool:
    return t.kind in (TensorKind.CORE, TensorKind.PROBS)


def is_log_softmax(t: Tensors) -> bool:
    """Saved by the loss (its log_softmax output, a soft-capping tanh output): part of head_saved, freed
    before the last layer's backward."""
    return t.kind is TensorKind.LOG_SOFTMAX


def _mlp(spec: ModelSpec, tokens: int, prec: Precision, width: int = 0, fused: bool = False) -> list[Tensors]:
    """Saved by the MLP after its input projection(s), for `tokens` tokens, `width` wide (0: the dense MLP's).
    fused: gate and up are the halves of one gate_up output (transformers 5's fused experts: MixtralExperts,
    Llama4TextExperts, ... `gate, up = gate_up.chunk(2, dim=-1)`), views that keep its storage, 2f wide, alive:
    where the activation saves only its input (gate), that storage is all the two leave (traced, llama4-small
    bf16: one 8 MiB gate_up storage beside the 4 MiB act(gate) and product, where separate gate and up had been
    counted)."""
    f, p, h = width or spec.intermediate_size, prec.act, spec.hidden_size
    # what the activation function saves (its input, or the pieces of a Python-composed GELU)
    saves = [Tensors("act input / saved pieces", w * f * tokens)
             for w in activation_saved_bytes(spec.activation, p, prec.autocast)]
    out: list[Tensors] = []
    if spec.mlp == "gated" and fused and ACTIVATION_SAVES.get(spec.activation, ("act",)) == ("act",):
        out += [Tensors("gate_up output (gate and up, its views)", 2 * p * f * tokens),
                Tensors("act output", p * f * tokens),
                Tensors("gate*up (down input)", p * f * tokens, kind=TensorKind.WEIGHT_INPUT)]
    elif spec.mlp == "gated":
        out += saves + [Tensors("act output, up output", p * f * tokens, 2),
                        Tensors("gate*up (down input)", p * f * tokens, kind=TensorKind.WEIGHT_INPUT)]
    else:
        inner_dropout = family(spec.model_type).mlp_inner_dropout and spec.hidden_dropout > 0
        if spec.activation == "relu" and not inner_dropout:
            saves = []  # relu saves its output, which is also the down projection's input (traced)
        out += saves
        if inner_dropout:
            out.append(Tensors("mlp dropout mask", MASK * f * tokens))
        # relu (without a dropout after it) saves its output, which is also the down projection's input
        relu_saves = spec.activation == "relu" and not inner_dropout
        out.append(Tensors("act output (down input)", p * f * tokens,
                           kind=TensorKind.OTHER if relu_saves else TensorKind.WEIGHT_INPUT))
    if spec.hidden_dropout > 0:
        out.append(Tensors("mlp dropout mask", MASK * h * tokens, rep=True))
    return out


def _moe(spec: ModelSpec, T: int, prec: Precision, order: LayerOrder | None = None) -> list[Tensors]:
    """Top-K routing (transformers Mixtral): router softmax in fp32, each token's hidden state gathered
    for each of its K experts, the expert MLP on K*T tokens, the weighted expert output."""
    h, E, K, r = spec.hidden_size, spec.num_experts, spec.experts_per_token, prec.residual
    routed = K * T
    out = _linear_inputs(1, h, T, prec, "router input")
    out.append(Tensors("router softmax", FP32 * E * T, rep=True))
    n_in = family(spec.model_type).gated_up_linears if spec.mlp == "gated" else 1
    experts = _linear_inputs(n_in, h, routed, prec, "expert inputs")
    if not prec.autocast:
        experts = [Tensors("expert inputs (gathered)", r * h * routed, rep=True)]
    extra = family(spec.model_type).expert_act_extra
    mlp = _mlp(spec, routed, prec, spec.expert_width, fused=not extra)
    experts += mlp
    if extra:
        experts.append(Tensors("experts' composed activation pieces", prec.residual * spec.expert_width * routed,
                               extra))
    output = Tensors("expert output (weighted)", prec.act * h * routed, rep=True)
    experts.append(output)
    if prec.autocast and prec.param == FP32 and biased_experts(spec):
        # GptOssExperts adds an fp32 bias to each expert matmul's half output (current_state @ W[e] + bias[e]),
        # which promotes gate_up (2f) and the down output (h) to fp32: the saved gate_up halves and the weighted
        # output's input are twice the half width counted above (traced, CPU: 12 MiB of gpt-oss-small's 384); over a
        # half base (LoRA) the bias is half and promotes nothing
        experts.append(Tensors("biased experts' outputs promoted to fp32", (FP32 - prec.act)
                               * (2 * spec.expert_width + h) * routed, rep=True))
    if expert_loop(spec, prec):
        experts = [replace(t, nbytes=t.nbytes / E, count=t.count * E) for t in experts]
    elif order is not None:  # a grouped matmul's casts are made as it runs (the loop's are per expert)
        order.experts = mlp[0]
        # transformers 5.24 integrations/moe.py grouped_mm_experts_forward: the output times the routing weights,
        # then its copy back in token order (weighted_out[inv_perm], the product dying with its name), freed as the
        # experts return their sum (traced, glm4_moe-small bf16-pure: two 4 MiB storages before the shared experts)
        w = FP32 if family(spec.model_type).moe_router_fp32 else prec.act  # fp32 routing weights promote it
        order.transients += [Transient(w * h * routed, output, output) for _ in range(2)]
        if w != prec.act:  # the sum over each token's experts, in fp32, before its cast to the hidden dtype
            order.transients.append(Transient(w * h * T, output, output))
    out += experts
    if spec.shared_expert_intermediate_size:
        # the shared expert(s) every token runs beside the routed ones: one dense MLP of their total width
        # (DeepseekV3MoE / Glm4MoeMoE shared_experts, Llama4TextMoe shared_expert)
        n_up = family(spec.model_type).gated_up_linears if spec.mlp == "gated" else 1
        out += _linear_inputs(n_up, h, T, prec, "shared expert input")
        out += _mlp(spec, T, prec, spec.shared_expert_intermediate_size)
    return out


def _moe_all_experts(spec: ModelSpec, T: int, prec: Precision, order: LayerOrder | None = None) -> list[Tensors]:
    """Llama4TextMoe (transformers 5.24 models/llama4/modeling_llama4.py), R = E * T rows:
    - the router (Llama4Router, a Linear over the norm output), the shared expert's gate_proj and up_proj read
      the same input: three half casts under autocast, else the norm output once;
    - the router's top-k indices (int64, which topk and scatter_ save), the sigmoid's fp32 output and the scores'
      transposed copy (E * T in the router's dtype) that the multiply below saves;
    - hidden_states.repeat(E, 1) (R x h in the stream's dtype), saved by its multiply by the scores, and that
      product (fp32 under autocast: an fp32 stream times half scores), which the experts' bmm saves (its half
      cast under autocast);
    - Llama4TextExperts: the gated MLP over all R rows (gate_up, act(gate), the product before down_proj); its
      output is summed over the experts (reshape(E, T, h).sum(0)) and added in place to the shared expert's,
      neither saving anything;
    - the shared expert (Llama4TextMLP) on the T tokens.
    order: where given, the forward's own storages are added to its transients (Transient): under autocast the fp32
    product (its half cast is what the bmm saves), the experts' output (R x h) and its sum over the experts, all
    freed as Llama4TextMoe.forward returns (traced, llama4-small bf16 b2 s512: the 8 MiB product and the 4 MiB
    output, freed after the shared expert)."""
    h, E, K, r, p = spec.hidden_size, spec.num_experts, spec.experts_per_token, prec.residual, prec.act
    R = E * T
    out = _linear_inputs(3, h, T, prec, "router, shared gate / up input")
    repeated = Tensors("hidden states repeated per expert", r * h * R, rep=True)
    out += [Tensors("router top-k indices (int64)", 8 * K * T, rep=True),
            Tensors("router sigmoid output", FP32 * E * T, rep=True),
            Tensors("router scores (the multiply's copy)", p * E * T, rep=True), repeated]
    scaled = _linear_inputs(1, h, R, prec, "experts' input (scaled copies)")
    experts = _mlp(spec, R, prec, spec.expert_width, fused=True)
    if order is not None:
        order.experts = experts[0]
    out += scaled + experts + _mlp(spec, T, prec, spec.shared_expert_intermediate_size)
    if order is not None:
        last = out[-1]
        # the experts' sum, added into the shared expert's output
        order.transients += [Transient(p * h * T, last, last)]
        if scaled[0].uncast:  # the product the bmm casts
            order.transients.append(Transient(scaled[0].uncast, repeated, last))
        order.transients.append(Transient(p * h * R, experts[-1], last))
    return out


def expert_loop(spec: ModelSpec, prec: Precision) -> bool:
    """fp32 expert weights run transformers' eager loop over the experts (torch._grouped_mm takes half weights
    only: inputs/hf.py build_model): each expert's tensors are its own storages, of its K*T/E rows on average,
    where the grouped matmul makes one of all K*T. At gpt-oss-small's 256 rows an expert they are <= 1 MiB
    (the small pool), one storage of the layer's routed rows is not. Llama 4's experts run one bmm over all of
    them whatever the weights (moe_all_experts). The parameter width read is the precision row's: a row that
    does not store the model's width (FSDP's halfbase) errs toward the grouped matmul."""
    return prec.param == FP32 and not family(spec.model_type).moe_all_experts


def biased_experts(spec: ModelSpec) -> bool:
    """The fused experts carry biases (gpt-oss: gate_up_proj_bias E x 2f, down_proj_bias E x h)."""
    return any(g.category == "experts" and len(g.shape) == 2 for g in spec.params)


def routed_rows(spec: ModelSpec, T: int) -> int:
    """Rows the experts run on: each token once per chosen expert, or once per expert (moe_all_experts)."""
    return T * (spec.num_experts if family(spec.model_type).moe_all_experts else spec.experts_per_token)


def _moe_layers(spec: ModelSpec, T: int, prec: Precision, kind: LayerKind | None = None,
                order: LayerOrder | None = None) -> list[Tensors]:
    """The MLP part of the mean layer of a MoE model: its routed layers' terms and, where the first layers (or
    mlp_only_layers) are dense, theirs, each at its share of the layers (Tensors.nbytes may be fractional; the
    step multiplies the mean layer by the layer count, so the total over the layers is exact; one layer's
    recomputation under full checkpointing and a pipeline stage's share take the mean); a layer of `kind`: its own.
    order: a whole layer's order (LayerOrder), where the layer is not a mean."""
    if kind is not None and not kind.moe:
        return _mlp_block(spec, T, prec)
    whole = not spec.dense_layers or kind is not None
    if family(spec.model_type).moe_all_experts:
        moe = _moe_all_experts(spec, T, prec, order if whole else None)
    else:
        moe = _moe(spec, T, prec, order if whole else None)
    if whole:
        return moe
    share = spec.moe_layers / spec.num_layers
    return [replace(t, nbytes=t.nbytes * share) for t in moe] + [
        replace(t, nbytes=t.nbytes * (1 - share)) for t in _mlp_block(spec, T, prec)]


def norms_per_layer(spec: ModelSpec, cross_attending: bool = False) -> int:
    """LayerNorms / RMSNorms in one layer: the config's count where it decides (Falcon), else the family's, else
    2 (3 in a cross-attending decoder layer)."""
    return spec.layer_norms or family(spec.model_type).norms_per_layer or (3 if cross_attending else 2)


def _layer(spec: ModelSpec, b: int, s: int, prec: Precision, attn: str, decoder: bool = False,
           s_enc: int = 0, selective: bool = False, kv_cache: bool = False, tiled_mlp: bool = False,
           kind: LayerKind | None = None, order: LayerOrder | None = None) -> list[Tensors]:
    h, T, fam = spec.hidden_size, b * s, family(spec.model_type)
    n_norms = norms_per_layer(spec, decoder)
    if tiled_mlp and not spec.is_moe:  # the norms inside the tiled region keep nothing
        n_norms -= fam.tiled_mlp_norms
    out: list[Tensors] = []
    for _ in range(n_norms):
        out += _norm(spec, T, prec)
    if spec.is_mla:
        out += _mla_attention(spec, b, s, prec, attn, selective)
    else:
        out += _linear_inputs(fam.qkv_linears, h, T, prec, "qkv input")
        out += _qk_norms(spec, T, prec, kind)
        out += _attention(spec, b, s, s, prec, attn, selective, kv_cache and spec.arch == "decoder", kind)
    if decoder:  # cross-attention: q from the decoder, k/v from the encoder output
        out += _linear_inputs(1, h, T, prec, "cross q input")
        out += _attention(spec, b, s, s_enc, prec, attn, selective)
    mlp_at = len(out)
    if spec.is_moe:
        out += _moe_layers(spec, T, prec, kind, order)
    elif tiled_mlp:
        # memplan.kernels.mlp.tiled_mlp: the MLP runs without autograd and keeps only its input (the
        # norm output, in the residual dtype)
        if not _mlp_reads_saved_qkv_input(spec, prec):
            out.append(Tensors("tiled mlp input", prec.residual * h * T, rep=True))
    else:
        out += _mlp_block(spec, T, prec)
    if order is not None and mlp_at < len(out):
        order.mlp = out[mlp_at]
    return out


def _mlp_block(spec: ModelSpec, T: int, prec: Precision) -> list[Tensors]:
    """The MLP's linear inputs and what it saves after them."""
    fam = family(spec.model_type)
    n_up = fam.gated_up_linears if spec.mlp == "gated" else 1
    if fam.parallel_residual:
        n_up = 1
    inputs = [] if _mlp_reads_saved_qkv_input(spec, prec) else _linear_inputs(n_up, spec.hidden_size, T, prec,
                                                                              "mlp input")
    return inputs + _mlp(spec, T, prec)


def _mlp_reads_saved_qkv_input(spec: ModelSpec, prec: Precision) -> bool:
    """Falcon's parallel layer with one LayerNorm: the MLP reads the attention's norm output (transformers 5.23
    models/falcon/modeling_falcon.py FalconDecoderLayer: mlp_layernorm_out = attention_layernorm_out), already
    saved as the qkv input, unless autocast casts it for each linear."""
    return spec.layer_norms == 1 and not (prec.autocast and prec.residual != HALF)


def _tiled_mlp_backward(spec: ModelSpec, T: int, prec: Precision) -> list[Tensors]:
    """One layer's tiled-MLP backward: one chunk's recomputed MLP (what it saves, its output and its
    gradient buffers) and, over several chunks, x's gradient and the fp32 sums of the MLP's parameter
    gradients (kernels/mlp.py, TiledMLP.backward)."""
    h, f, p = spec.hidden_size, spec.intermediate_size, prec.act
    c = min(T, tiled_mlp_chunk(h))
    if spec.mlp == "gated" and spec.activation in GATED_ACT_KERNEL:
        # apply() runs act(gate) * up through memplan.kernels.gated_act, which saves gate and up only
        n_up = family(spec.model_type).gated_up_linears
        chunk = _linear_inputs(n_up, h, c, prec, "mlp input") + [Tensors("gate, up (gated_act inputs)", p * f * c, 2),
                                                                  Tensors("gate*up (down input)", p * f * c)]
    else:
        chunk = _mlp_block(spec, c, prec)
    out = chunk + [Tensors("tiled mlp: chunk output", p * h * c), Tensors("mlp grad buffers (one chunk)", p * f * c, 2)]
    if T > c:
        mlp_params = (3 if spec.mlp == "gated" else 2) * h * f
        out += [Tensors("tiled mlp: input gradient", prec.residual * h * T, rep=True),
                Tensors("tiled mlp: parameter-gradient sums (fp32)", FP32 * mlp_params)]
    return out


def _larger(mlp: list[Tensors], att: list[Tensors]) -> list[Tensors]:
    """One layer's backward peak: the larger of its MLP's transients (_mlp_backward) and its eager attention's
    (_attention_backward)."""
    return att if total(att) > total(mlp) else mlp


def _mlp_backward(spec: ModelSpec, b: int, s: int, prec: Precision, tiled_mlp: bool = False,
                  kind: LayerKind | None = None) -> list[Tensors]:
    """The MLP's backward transients: the gradient of its largest intermediate and the gradient it produces (dA,
    dB), or the tiled MLP's recomputed chunk. A MoE model's: a routed layer's experts' or a dense layer's MLP's, by
    `kind`; the mean layer takes the larger (the peak is the worst layer's: DeepSeek-V3-MoE small's dense layer 0
    has three times its routed layer's)."""
    T, p = b * s, prec.act
    shapes = {True: (routed_rows(spec, T), spec.expert_width), False: (T, spec.intermediate_size)}
    mlp = max(([Tensors("mlp grad buffers", p * shapes[x][1] * shapes[x][0], 2)] for x in mlp_kinds(spec, kind)),
              key=total)
    if tiled_mlp and not spec.is_moe:
        mlp = _tiled_mlp_backward(spec, T, prec)
    return mlp


def _attention_backward(spec: ModelSpec, b: int, s: int, prec: Precision, attn: str) -> list[Tensors]:
    """Eager attention's backward transients: dP and dS over the s x s scores (GPT-OSS's with the sink column);
    none under SDPA's kernels, whose backward works in tiles."""
    if attn != "eager":
        return []
    scores = b * spec.num_heads * s * (s + sink_columns(spec))
    return [Tensors("attention grad buffers", _softmax_bytes(spec, prec) * scores, 2)]


def _embeddings(spec: ModelSpec, b: int, s: int, prec: Precision) -> list[Tensors]:
    h, T = spec.hidden_size, b * s
    out: list[Tensors] = []
    if spec.arch == "vision":
        pixels = b * spec.num_channels * spec.image_size ** 2
        out.append(Tensors("pixel values (patch conv input)", FP32 * pixels, rep=True))
    if embedding_layernorm(spec):
        out += [Tensors("embedding norm input", layernorm_input_bytes(prec) * h * T, rep=True),
                Tensors("embedding norm mean/rstd", FP32 * T, 2, rep=True)]
    if spec.hidden_dropout > 0:
        out.append(Tensors("embedding dropout mask", MASK * h * T, rep=True))
    if spec.position == "relative":
        # T5's relative position bias, computed once per stack and shared by its layers (fp32,
        # 1 x heads x s x s): encoder self-attention, decoder self-attention, cross-attention
        stacks = 3 if spec.num_decoder_layers else 1
        out.append(Tensors("position bias (shared)", FP32 * spec.num_heads * s * s, stacks))
    return out


def head_tokens(spec: ModelSpec, b: int, T: int) -> int:
    """Tokens the layers after the last block read: every token for an LM head or token classification,
    one per sequence (the pooler's / the CLS token) for the other classification heads - LoRA adapters on
    those layers (a pooler under all-linear) see as many."""
    return T if spec.head in LM_HEADS or spec.head == "token-classification" else b


def _head(spec: ModelSpec, b: int, s: int, prec: Precision,
          fused: bool = False) -> tuple[list[Tensors], list[Tensors], list[Tensors]]:
    """(saved, loss forward transient, loss backward transient) of the head and its loss."""
    h, T, V, p = spec.hidden_size, b * s, spec.vocab_size, prec.act
    mlm_raw = spec.head == "masked-lm" and family(spec.model_type).mlm_raw_logits_loss
    saved: list[Tensors] = []
    if spec.arch in ("decoder", "encoder-decoder", "vision"):
        saved += _norm(spec, T, prec)  # final norm
    if mlm_raw:
        # the masked-LM head's transform before the decoder: dense, activation, LayerNorm
        saved += _linear_inputs(1, h, T, prec, "mlm transform input")
        saved += [Tensors("mlm transform act input / saved pieces", w * h * T)
                  for w in activation_saved_bytes(spec.activation, p, prec.autocast)]
        saved += _norm(spec, T, prec)
    if fused and spec.head in ("causal-lm", "masked-lm"):
        return _fused_loss(spec, T, prec, saved)
    if spec.head in LM_HEADS:
        saved += [replace(t, kind=TensorKind.HEAD_INPUT) for t in _linear_inputs(1, h, T, prec, "lm_head input")]
        # transformers' ForCausalLMLoss: logits.float() then cross_entropy; log_softmax saves its fp32
        # output until backward. While the loss runs, the half logits and the fp32 copy are alive too.
        # BERT-style masked LMs call CrossEntropyLoss on the logits as they are: fp32 under autocast
        # (log_softmax is on its fp32 list), but half in a pure half model (traced).
        lp = p if (mlm_raw and not prec.autocast) else FP32
        saved.append(Tensors("log_softmax output", lp * T * V, kind=TensorKind.LOG_SOFTMAX))
        if spec.final_logit_softcapping:
            # Gemma 2's final soft-capping, logits = tanh(logits / cap) * cap (transformers 5.23
            # models/gemma2/modeling_gemma2.py Gemma2ForCausalLM.forward): tanh saves its output, in the
            # lm_head's output width, until the loss's backward reaches it (traced); the scalar divide and
            # multiply save nothing
            saved.append(Tensors("logit soft-capping tanh output", p * T * V, kind=TensorKind.LOG_SOFTMAX))
        fwd = [Tensors("logits", p * T * V)]
        if p != lp:
            fwd.append(Tensors("logits fp32 up-cast", FP32 * T * V))
        # backward of nll + log_softmax: dL/dlogp and dL/dlogits in fp32 while the saved log_softmax
        # output is still alive: the peak of the loss backward (traced). The cast of the gradient back
        # to half comes after dL/dlogp and the saved output are freed, so it never adds to this peak.
        bwd = [Tensors("loss grad buffers", lp * T * V, 2)]
        return saved, fwd, bwd
    n_tok = head_tokens(spec, b, T)
    saved.append(Tensors("head input", prec.residual * h * n_tok, rep=True))
    return saved, [Tensors("logits", FP32 * n_tok * max(spec.num_labels, 1))], []


def _fused_loss(spec: ModelSpec, T: int, prec: Precision, saved: list[Tensors]):
    """memplan.kernels.linear_cross_entropy (docs/kernels.md): it saves the final hidden states (the
    lm_head input) and one log-sum-exp per token; forward holds one token chunk
    of logits (half, its fp32 up-cast, logsumexp's fp32 working copy) and the per-token losses;
    backward holds the head weight's gradient (allocated before the blocks are summed into it), the fp32
    hidden-state gradient sum, one vocabulary block's fp32 weight-gradient sum and, at its largest, the moment
    `torch.exp(logits - lse)` runs: the block's fp32 logits, their difference from the log-sum-exp and its exp
    (the half block is gone once up-cast), and tanh's output too under soft-capping (traced: llama-small, where
    the earlier list, a half and two fp32 blocks and the fp32 token block, was 3.3 % under)."""
    h, V, p = spec.hidden_size, spec.vocab_size, prec.act
    chunk, vblock, tblock = fused_loss_blocks(T, h, V)
    # under autocast the kernel takes half copies of the hidden states and of the head's weight (the
    # weight copy is the head's autocast copy the estimator already counts)
    saved = saved + [Tensors("fused loss input (hidden states)", (p if prec.autocast else prec.residual) * h * T,
                             rep=True),
                     Tensors("fused loss logsumexp", FP32 * T)]
    fwd = [Tensors("fused loss: logits chunk (half)", p * chunk * V),
           Tensors("fused loss: logits chunk (fp32) and logsumexp's working copy", FP32 * chunk * V, 2),
           Tensors("fused loss: per-token losses", FP32 * T)]
    bwd = [Tensors("fused loss: weight gradient (allocated first, in the weight's compute dtype)", p * V * h),
           Tensors("fused loss: hidden-state gradient sum (fp32)", FP32 * T * h),
           Tensors("fused loss: weight-gradient block sum (fp32)", FP32 * vblock * h),
           Tensors("fused loss: logits block (fp32), logits - lse and its exp (+ tanh when soft-capped)",
                   FP32 * tblock * vblock, 3 + bool(spec.final_logit_softcapping))]
    return saved, fwd, bwd


def lora_terms(adapters: tuple[AdapterInput, ...], T: int, prec: Precision, lora: LoraActs,
               blocks: int) -> list[Tensors]:
    """What PEFT's LoRA layers save, for the adapted linears of one block (peft 0.21 tuners/lora/layer.py
    Linear.forward: x = x.to(lora_A.weight.dtype); result + lora_B(lora_A(dropout(x))) * scaling; the
    bitsandbytes layers in tuners/lora/bnb.py cast only without autocast). Adapters are fp32, or half in
    a half model (lora.adapter_bytes).
    - Under autocast over fp32 adapters, lora_A's matmul casts its input to half: one copy per adapted linear,
      saved. Half adapters (FSDP's, under accelerate's autocast) take a half input as it is.
    - Otherwise, an input of another width than the adapters' is cast per adapted linear (saved by
      lora_A); an input of their width is saved once for the linears that read it, unless dropout makes
      one output per linear.
    - Dropout (p > 0) saves its mask (native_dropout) per adapted linear.
    - lora_B saves lora_A's output, the rank-r intermediate (half under autocast, else the adapters').
    Adapters only some of the stack's `blocks` have (AdapterInput.layers) count at their share in the mean layer."""
    out: list[Tensors] = []
    ad = lora.adapter_bytes
    r_bytes = HALF if prec.autocast else ad
    for a in adapters:
        x_bytes = prec.act if a.inner else prec.residual
        share = len(a.layers) / blocks if a.layers else 1.0
        n, x = a.count, a.width * T * share
        if prec.autocast and ad > HALF:
            out.append(Tensors("lora: A input (autocast half copy)", HALF * x, n))
        elif lora.dropout:
            out.append(Tensors("lora: A input (dropout output)", ad * x, n))
        elif x_bytes != ad:
            out.append(Tensors("lora: A input (cast to the adapters' width)", ad * x, n))
        else:
            out.append(Tensors("lora: A input (the linear's input)", ad * x))
        if lora.dropout:
            out.append(Tensors("lora: dropout mask", MASK * x, n))
        out.append(Tensors("lora: rank-r intermediate (B input)", r_bytes * lora.r * T * share, n))
    return out


def frozen_block(ts: list[Tensors], int8: bool = False) -> list[Tensors]:
    """What frozen weights leave of a block's saved tensors when its input requires a gradient (LoRA's base,
    freeze's blocks before the trained ones when a trained embedding makes them record): none of the tensors
    saved only for a weight's gradient (kinds WEIGHT_INPUT, NORM_INPUT, HEAD_INPUT; autograd saves a
    derivative formula's input only for the outputs that need a gradient), except that bitsandbytes'
    LLM.int8 matmul keeps the input of each quantised linear whatever the weight (int8_saved_input)."""
    if int8:
        return [int8_saved_input(t) for t in ts if t.kind not in (TensorKind.NORM_INPUT, TensorKind.HEAD_INPUT)]
    return [t for t in ts if t.kind not in (TensorKind.NORM_INPUT, TensorKind.WEIGHT_INPUT, TensorKind.HEAD_INPUT)]


def int8_saved_input(t: Tensors) -> Tensors:
    """LLM.int8's training matmul saves its input A as it comes (bitsandbytes 0.50.2 autograd/_functions.py
    MatMul8bitLt.forward: ctx.tensors = (CAt, subA, A); a custom autograd Function, which autocast does not
    cast): where the estimate has autocast's half casts of a linear input, one tensor of the input's own
    width (QLoRA: the fp32 norm output) shared by the linears that read it (traced: one per norm output)."""
    if not t.uncast:
        return t
    return replace(t, name=t.name.replace("(half cast)", "(LLM.int8 saved input)"), nbytes=t.uncast, count=1,
                   uncast=0.0)


def _tuned(ts: list[Tensors], lora: LoraActs | None) -> list[Tensors]:
    """Under LoRA / QLoRA every block is a frozen one (with adapters, lora_terms)."""
    return ts if lora is None else frozen_block(ts, lora.int8)


def shard(ts: list[Tensors], tp: int, sp: bool) -> list[Tensors]:
    """One tensor-parallel rank's share: heads, the MLP intermediate and the vocabulary are split t
    ways (Megatron column / row parallel linears, vocab-parallel cross-entropy); the residual side is
    replicated unless sequence parallelism splits it along the sequence. Korthikanti et al. 2022,
    eq. 2 (TP: s*b*h*(10 + 24/t + 5*a*s/(h*t))) and eq. 4 (TP + SP: s*b*h*(34 + 5*a*s/h)/t)."""
    if tp == 1:
        return ts
    return [t if (t.rep and not sp) else replace(t, nbytes=t.nbytes / tp) for t in ts]


def _add_lora(spec: ModelSpec, b: int, s: int, prec: Precision, lora: LoraActs, kind: LayerKind | None,
              layer: list[Tensors], dec: list[Tensors], saved_head: list[Tensors]) -> None:
    """The adapters' saved tensors added to the layer, decoder layer and head lists (lora_terms)."""
    T = b * s
    layer += lora_terms(lora.layer, T, prec, lora, spec.num_layers)
    # the merged weights are the MoE layers' (the mean layer holds their share)
    merged = lora.merged_experts * (1 if kind is None else spec.num_layers / spec.moe_layers if kind.moe else 0)
    if merged:
        layer.append(Tensors("lora: merged expert weights (W + B A)", merged))
    dec += lora_terms(lora.decoder_layer, T, prec, lora, spec.num_decoder_layers) if dec else []
    saved_head += lora_terms(lora.head, head_tokens(spec, b, T), prec, lora, 1)


def training_activations(spec: ModelSpec, b: int, s: int, prec: Precision, attn: str,
                         selective: bool = False, kv_cache: bool = True, tp: int = 1,
                         sp: bool = False, fused_loss: bool = False, tiled_mlp: bool = False,
                         lora: LoraActs | None = None, embed_grad: bool = True,
                         frozen_blocks: bool = False, kind: LayerKind | None = None) -> ActivationModel:
    """selective: the layers keep everything but their attention core (Megatron selective recompute).
    kv_cache: the model runs with use_cache (transformers turns it off under gradient checkpointing).
    tp, sp: one tensor-parallel rank's share (`shard`). fused_loss, tiled_mlp: memplan.kernels' loss
    and MLP. lora: the base is frozen and these adapters are trained (estimator/finetune.py);
    embed_grad: the embeddings' output requires a gradient (else their list is empty); frozen_blocks
    (freeze): autograd records frozen blocks too (their lists: frozen_block). kind: the layer lists of one kind of
    layer (layer_kinds), else the mean layer."""
    if spec.arch == "vision":
        s = spec.seq_positions
    T = b * s
    # the attention core is rebuilt in backward only under selective recomputation
    whole = _layer(spec, b, s, prec, attn, kind=kind) if selective else []
    order = LayerOrder()
    block = _layer(spec, b, s, prec, attn, selective=selective, kv_cache=kv_cache, tiled_mlp=tiled_mlp, kind=kind,
                   order=order)
    dec_block = _layer(spec, b, s, prec, attn, decoder=True, s_enc=s, selective=selective) \
        if spec.num_decoder_layers else []
    layer, dec = _tuned(block, lora), _tuned(dec_block, lora)
    saved_head, loss_fwd, loss_bwd = _head(spec, b, s, prec, fused_loss)
    saved_head = _tuned(saved_head, lora)
    if lora is not None:
        _add_lora(spec, b, s, prec, lora, kind, layer, dec, saved_head)
    kept = _kept_at(block, layer)
    masks = checkpoint_masks(spec, b, s, prec, attn)
    mlp_bwd, att_bwd = _mlp_backward(spec, b, s, prec, tiled_mlp, kind), _attention_backward(spec, b, s, prec, attn)
    dequant = [Tensors("quantised weight dequantised (transient)", lora.dequant)] if lora and lora.dequant else []
    return ActivationModel(
        layer=shard(layer, tp, sp),
        decoder_layer=shard(dec, tp, sp),
        # full checkpointing (kv_cache off) keeps the masks with the layers' inputs, and selective recomputation with
        # the checkpointed cores' inputs, on the first stage's list (traced: qwen3-small eager selective -1.15 ->
        # -0.14 %)
        embed=shard((_embeddings(spec, b, s, prec) if embed_grad else [])
                    + ([] if kv_cache and not selective else masks), tp, sp),
        head_saved=shard(saved_head, tp, sp),
        layer_input=shard([Tensors("checkpointed layer input", prec.residual * spec.hidden_size * T, rep=True)],
                          tp, sp),
        layer_backward=shard(_larger(mlp_bwd, att_bwd) + dequant, tp, sp),
        layer_core=shard([t for t in whole if is_core(t)], tp, sp),
        loss_forward=shard(loss_fwd, tp, sp),
        loss_backward=shard(loss_bwd, tp, sp),
        frozen_layer=shard(frozen_block(block), tp, sp) if frozen_blocks else [],
        frozen_decoder_layer=shard(frozen_block(dec_block), tp, sp) if frozen_blocks else [],
        sequences=_sequences(spec, _tuned(whole, lora), layer, b, s, prec, attn, tp, order.transients, block, kept),
        mlp_start=_start_of(order.mlp, block, layer, kept),
        experts_start=_start_of(order.experts, block, layer, kept),
        forward_masks=shard([] if selective or not kv_cache else masks, tp, sp),
        forward_cache=shard(_cache_copies(spec, b, s, prec, attn, selective, kv_cache), tp, sp),
        unrecorded_cache=shard(_cache_copies(spec, b, s, prec, attn, selective, kv_cache, recorded=False), tp, sp),
        mlp_backward=shard(mlp_bwd, tp, sp),
        attention_backward=shard(att_bwd, tp, sp),
    )


def _cache_copies(spec: ModelSpec, b: int, s: int, prec: Precision, attn: str, selective: bool, kv_cache: bool,
                  recorded: bool = True) -> list[Tensors]:
    """A decoder layer's KV cache in training where no saved tensor is it. With use_cache on (transformers turns it
    off only under gradient checkpointing) a decoder's forward builds a DynamicCache, and each layer's update
    (DynamicLayer.update: torch.cat) copies its k and v at the kv heads; the model's output holds the cache until the
    loss is taken from it (verify's step and the Trainer's compute_loss drop the output then, before backward). In
    a block autograd records, SDPA and flash attention save those copies as their inputs, and selective
    recomputation as the core's; eager attention under GQA saves repeat_kv's copies at the query heads instead, so
    the cache's are more memory (traced: llama4-small bf16-pure eager, 0.25 MiB each per layer beside the saved
    repeat_kv copies). A block it does not record (freeze) saves nothing, so its cache is all more memory (traced:
    a frozen tiny Llama's blocks, SDPA and eager)."""
    saved_elsewhere = attn != "eager" or selective or spec.is_mla or spec.num_kv_heads == spec.num_heads
    if not (kv_cache and spec.arch == "decoder") or (recorded and saved_elsewhere):
        return []
    p = HALF if prec.autocast else prec.act
    key, value = kv_widths(spec, query_width(spec, p, prec.residual), p)  # RoPE's k, as _attention's
    return [Tensors("KV cache: k", key * b * s), Tensors("KV cache: v", value * b * s)]


def kv_widths(spec: ModelSpec, kv_bytes: int, v_bytes: int | None = None) -> tuple[int, int]:
    """One layer's cached key and value bytes per token a sequence (inference.kv_bytes_per_token)."""
    if spec.is_mla:  # the latent (after its RMSNorm) and k_rot (after RoPE): both in the residual stream's dtype
        return spec.kv_lora_rank * kv_bytes, spec.qk_rope_head_dim * kv_bytes
    width = spec.num_kv_heads * spec.head_dim
    return width * kv_bytes, width * (kv_bytes if v_bytes is None else v_bytes)


def _sequences(spec: ModelSpec, whole: list[Tensors], layer: list[Tensors], b: int, s: int, prec: Precision,
               attn: str, tp: int, transients: list[Transient], block: list[Tensors],
               kept: list[int]) -> dict[str, list[tuple[int, float]]]:
    """A block's sequences (ActivationModel.sequences): eager attention's core in the block's forward, or under
    selective recomputation (`whole`: the layer's list without it) the core's no-grad run in the forward and its
    recompute in backward, each in eager order; then the layer's transients among the block's forward
    (_with_transients: `block` is the list they are anchored in, `kept` its entries' places in `layer`)."""
    if whole:
        out = _selective_core_sequence(spec, whole, layer, b, s, prec, attn, tp)
        core = [t for t in whole if is_core(t)]
        out["layer_core"] = _eager_core_sequence(spec, core, b, s, prec, attn, tp).get("layer_forward", [])
    else:
        out = _eager_core_sequence(spec, layer, b, s, prec, attn, tp)
    if transients:
        out["layer_forward"] = _with_transients(out.get("layer_forward", []), block, layer, kept, transients)
    return out


def _start_of(entry: Tensors | None, block: list[Tensors], layer: list[Tensors], kept: list[int]) -> int:
    """The index in `layer` of `entry` of `block`, or of the first kept entry after it (_kept_at); 0: none."""
    if entry is None:
        return 0
    j = kept[next(i for i, t in enumerate(block) if t is entry)]
    return j if j >= 0 and layer[j] is entry else j + 1


def _eager_core_sequence(spec: ModelSpec, layer: list[Tensors], b: int, s: int, prec: Precision, attn: str,
                         tp: int) -> dict[str, list[tuple[int, float]]]:
    """Eager attention's core in a block's forward, in order (transformers 5 eager_attention_forward; traced: Qwen3
    bf16-pure bmm, mul, add, _to_copy, _softmax, _to_copy; Llama under autocast bmm, mul, add, _softmax; RoBERTa
    fp16 bmm, mul, _to_copy, _softmax, native_dropout, _to_copy):
    - the scores; scaled (the scores die); a decoder's causal mask added, in the residual stream's dtype
      (masking_utils; the scaled die);
    - the fp32 copy a half input gets for an fp32 softmax, the softmax output (the copy dies);
    - the probabilities: a decoder with a half query casts the softmax output to it (`.to(query.dtype)`) before the
      masked scores' name is rebound, so those die after it; otherwise they die first and the PV matmul casts
      (autocast) an encoder's dropout output, in the softmax's width, which lives to the block's end.
    The core's saved tensors (kind CORE: under GQA the expanded k and v first) and, behind a dropout output, the
    block's later ones are markers into `layer`. Multi-head latent attention runs the same function (traced,
    deepseek_v3-small bf16-pure: bmm, mul, bmm freed, add, mul freed, _to_copy, _softmax, the copy freed, _to_copy,
    add freed, then the PV matmul's contiguous value copy, the core's last marker). FalconAttention's own core
    (traced, bf16: bmm, add, _softmax, _to_copy): the scores, scaled in place, the mask added in the hidden states'
    dtype, the softmax output, then the masked and the raw scores die. GPT-OSS's (sink_columns; traced, gpt-oss-
    small bf16 and bf16-pure: bmm, mul, bmm freed, add, mul freed, cat, sub, cat freed, _softmax, [_to_copy], add
    freed, the PV bmm, the context's clone, sub freed): the masked scores, their concatenation with the sinks and
    its max-subtracted copy in the residual stream's dtype, the softmax output; the masked scores die with their
    name, the subtracted ones when the function returns, after the context."""
    fam = family(spec.model_type)
    core = [k for k, t in enumerate(layer) if is_core(t)]
    if attn != "eager" or not core:
        return {}
    p = HALF if prec.autocast else prec.act
    sm = _softmax_bytes(spec, prec)
    scores = b * spec.num_heads * s * s / tp
    # repeat_kv's k and v (one entry), before the scores; MLA decompresses k and v at every head (no such entry)
    first = 1 if spec.num_heads != spec.num_kv_heads and not spec.is_mla else 0
    seq: list[tuple[int, float]] = [(SAVED - k, 0.0) for k in core[:first]]
    softmax, rest = [(SAVED - core[first], 0.0)], [(SAVED - k, 0.0) for k in core[first + 1:]]
    if fam.attention_sinks:
        r, joined = prec.residual, scores * (s + 1) / s
        # the context (the o_proj input, the list's entry after the core) is made before the function returns
        context = [(SAVED - (core[-1] + 1), 0.0)] if core[-1] + 1 < len(layer) else []
        return {"layer_forward": seq + [(0, p * scores), (1, p * scores), (~0, 0.0), (2, r * scores), (~1, 0.0),
                                        (3, r * joined), (4, r * joined), (~3, 0.0)] + softmax + rest
                + [(~2, 0.0)] + context + [(~4, 0.0)]}
    if fam.eager_score_tensors:
        return {"layer_forward": seq + [(0, p * scores), (1, prec.residual * scores)] + softmax
                + [(~1, 0.0), (~0, 0.0)] + rest}
    decoder = spec.arch == "decoder"
    width = prec.residual if decoder else p  # the scores' last form: a decoder's masked, an encoder's scaled
    seq += [(0, p * scores), (1, p * scores), (~0, 0.0)] + ([(2, width * scores), (~1, 0.0)] if decoder else [])
    scores_at = 2 if decoder else 1
    copy = sm == FP32 and width != FP32
    seq += ([(3, FP32 * scores)] if copy else []) + softmax + ([(~3, 0.0)] if copy else [])
    half_query = query_width(spec, p, prec.residual) == HALF  # a LoRA's half base: half (traced, deepseek_v3 LoRA)
    # only where the softmax casts back to the query's dtype (not Llama 4's: traced, the masked scores die first)
    if decoder and half_query and fam.softmax_fp32:
        # the masked scores die as their name is rebound to the probabilities, before the PV matmul copies MLA's
        # strided value (the core's last entry there)
        value = rest[-1:] if spec.is_mla else []
        return {"layer_forward": seq + rest[:len(rest) - len(value)] + [(~scores_at, 0.0)] + value}
    seq += [(~scores_at, 0.0)]
    if not decoder and spec.attention_dropout > 0 and sm != p:
        later = [(SAVED - k, 0.0) for k in range(core[-1] + 1, len(layer))]
        return {"layer_forward": seq + [(4, sm * scores)] + rest + later + [(~4, 0.0)]}
    return {"layer_forward": seq + rest}


def _kept_at(block: list[Tensors], layer: list[Tensors]) -> list[int]:
    """For each entry of `block`, the index in `layer` (block less a frozen base's filter, frozen_block, plus
    adapters' terms after it) of the last entry at or before it that the filter kept (-1: none); LLM.int8's filter
    keeps a linear input as a new entry (int8_saved_input)."""
    at, j = [], -1
    for t in block:
        if j + 1 < len(layer) and (layer[j + 1] is t or layer[j + 1] == int8_saved_input(t) != t):
            j += 1
        at.append(j)
    return at


def _with_transients(seq: list[tuple[int, float]], block: list[Tensors], layer: list[Tensors], at: list[int],
                     transients: list[Transient]) -> list[tuple[int, float]]:
    """A block's forward sequence (possibly empty) with the layer's transients born and freed at their entries:
    every entry of `layer` from the first transient's (or past the sequence's last marker) on gets a marker, and a
    transient's birth and death follow the markers of its entries. `block`: the list the transients' entries are
    in (the layer before a frozen base's filter, frozen_block); an entry the filter left out stands for the last
    one before it that stayed (at: _kept_at)."""
    index = {id(t): i for i, t in enumerate(block)}
    born = [at[index[id(x.after)]] for x in transients]
    dies = [at[index[id(x.until)]] for x in transients]
    marked = {SAVED - n for n, _ in seq if n <= SAVED}
    start = max(marked) + 1 if marked else max(0, min(born))
    assert all(b in marked or b >= start for b in born), "a transient born before the sequence's markers"
    fresh = 1 + max((n for n, _ in seq if n >= 0), default=-1)
    ops = seq + [(SAVED - k, 0.0) for k in range(start, len(layer))]
    out: list[tuple[int, float]] = []
    for n, nbytes in ops:
        out.append((n, nbytes))
        k = SAVED - n if n <= SAVED else None
        out += [(fresh + i, x.nbytes) for i, x in enumerate(transients) if born[i] == k]
        out += [(~(fresh + i), 0.0) for i in range(len(transients)) if dies[i] == k]
    return out


def _selective_core_sequence(spec: ModelSpec, whole: list[Tensors], layer: list[Tensors], b: int, s: int,
                             prec: Precision, attn: str, tp: int) -> dict[str, list[tuple[int, float]]]:
    """Selective recomputation: the checkpointed eager core runs once in the block's forward without autograd
    recording it (torch.utils.checkpoint), so its tensors, the ones it would save among them, are made in
    _eager_core_sequence's order and die when it returns, between the block's tensors before it (its inputs)
    and after it (markers into `layer`, the block's selective list; `whole` is the list without selective), but for
    the probabilities it returns, which the layer holds to its end (TensorKind.PROBS; traced, olmo2-small bf16 eager
    b2 s512: the bf16 probabilities freed after the MLP; the replay was -10.7 % off the real H200 run, now -0.6 %).
    Traced: Llama-3.2-1B bf16 eager b1 s1024 makes each layer's fp32 masked scores and softmax output in the
    forward (128 MiB each); without them the replay was +6.3 % over the simulation of the trace.
    Where the query is as wide as the softmax output (RoPE's fp32 query under autocast: query_width), the
    returned probabilities are the softmax output itself (eager_attention_forward's `.to(query.dtype)` is a no-op),
    and the PV matmul's half cast of them (the PROBS entry) dies with the matmul (transformers 5.24
    modeling_llama.py; traced, Llama-3.2-1B bf16 eager b1 s1024: _softmax (128 MiB) freed after the MLP,
    _to_copy (64 MiB) freed after the bmm)."""
    seq = _eager_core_sequence(spec, whole, b, s, prec, attn, tp).get("layer_forward")
    core = [k for k, t in enumerate(whole) if is_core(t)]
    after = core[-1] + 1 if core else len(whole)
    if not seq or after >= len(whole) or whole[after] not in layer:
        return {}
    p, sm = (HALF if prec.autocast else prec.act), _softmax_bytes(spec, prec)
    # transformers' own core (inference_eager_core keeps the softmax output there too), with no dropout after it
    softmax_kept = (_shared_eager_core(spec) and spec.attention_dropout == 0 and sm != p
                    and query_width(spec, p, prec.residual) == sm)
    # the core entry _eager_core_sequence makes the softmax output from (behind GQA's expanded k and v)
    softmax_at = core[1 if spec.num_heads != spec.num_kv_heads else 0] if softmax_kept else None
    out: list[tuple[int, float]] = []
    fresh = 1 + max(n for n, _ in seq)  # ids past the sequence's own
    returned: list[int] = []  # the probabilities the core returns: the layer holds them to its end
    for n, nbytes in seq:
        if n > SAVED:
            out.append((n, nbytes))
        elif is_core(whole[SAVED - n]):  # a tensor the core would save: here one more transient
            t = whole[SAVED - n]
            out += [(fresh + i, t.nbytes / tp) for i in range(t.count)]
            if (SAVED - n == softmax_at) if softmax_kept else t.kind is TensorKind.PROBS:
                returned += [fresh + i for i in range(t.count)]
            fresh += t.count
    born = {n for n, _ in out if n >= 0}
    out += [(~n, 0.0) for n in sorted(born - {~n for n, _ in out if n < 0} - set(returned))]
    start = layer.index(whole[after])
    return {"layer_forward": out + [(SAVED - k, 0.0) for k in range(start, len(layer))] + [(~n, 0.0) for n in returned]}


def inference_working_set(spec: ModelSpec, b: int, s: int, p: int, r: int, attn: str, full_logits: bool,
                          context: int = 0, dequant: int = 0,
                          kind: LayerKind | None = None) -> dict[str, list[Tensors]]:
    """Live tensors at the moments of a no_grad forward that can be its largest ("mlp", "attention", "rotary",
    "head") over b sequences of s tokens (nothing is saved; traced with `memplan verify --task infer`, transformers
    5.23 modeling_llama.py); and for the serving replay (serving_timeline.py) the smaller moments it walks through
    ("norm", "mlp norm", "scores") and "around", the layers' shared part of every layer moment. p: the matmul outputs' width, r: the residual stream's (fp32 under
    autocast); context: the keys each query attends to (a decode step's cache length; 0: the s tokens).
    - a layer's MLP: the residual stream held four times (the embedding output, which the model's forward
      keeps in `inputs_embeds`; the layer's input, held by the layer loop until the layer returns; the
      residual after attention; the norm output the MLP reads) and the MLP's intermediates (gated: act(gate),
      up and their product; plain: the up projection and its activation);
    - a layer's attention and RoPE (_inference_attention);
    with rotary models' cos and sin (1 x s x head_dim each, in the residual stream's dtype) and eager's masks.
    At the head, after the base model's forward has returned (its locals are gone): the final norm output and
    the logits, of every position when scoring, of the last one when generating (generate's
    logits_to_keep=1, and its fp32 copy of them: generation/utils.py). dequant: bytes of the half copy
    bitsandbytes makes of a 4-bit MLP weight for its matmul (inference.py dequantised_copy; 0: none). kind: a layer
    of that kind (layer_kinds: a MoE model's dense layer runs its dense MLP), else the worst layer's."""
    if spec.arch == "vision":
        s = spec.seq_positions
    h, T = spec.hidden_size, b * s
    # an encoder's layers are post-norm (BertLayer: the attention's LayerNorm output is the MLP input), so no
    # norm output precedes the attention and none beside the MLP's input
    post_norm = spec.arch == "encoder" or family(spec.model_type).post_norm_layers
    around = _inference_around(spec, b, s, r, attn, context)
    mlp = max((_inference_mlp(spec, T, s, p, r, post_norm, dequant, x) for x in mlp_kinds(spec, kind)), key=total)
    head: list[Tensors] = [Tensors("final norm output", r * h * T)]
    if spec.head in LM_HEADS:
        n_tok = T if full_logits else b
        head.append(Tensors("logits", p * n_tok * spec.vocab_size))
        if not full_logits:
            head.append(Tensors("logits fp32 (generate)", FP32 * n_tok * spec.vocab_size))
    if spec.arch == "vision":  # the images stay alive through the forward, in the weights' dtype
        pixels = [Tensors("pixel values", r * b * spec.num_channels * spec.image_size ** 2)]
        around, head = around + pixels, head + pixels
    layer = _shared_expert_moments(spec, T, p, r, mlp[:1], kind)
    mlp = mlp + _kept_probabilities(spec, b, s, p, r, attn, context)
    layer |= {"mlp": mlp} | _inference_attention(spec, b, s, p, r, attn, context, post_norm)
    if spec.norm == "rmsnorm" and r != FP32:
        # in pure half an RMSNorm's fp32 input copy and its fp32 normalised product, before each of a block's two
        # norms return (traced: OLMo 2 bf16-pure's small pool peaks there; under autocast the stream is fp32 already);
        # only the serving replay reads these moments (the attention's and the MLP's are larger)
        rms = [Tensors("rmsnorm fp32 input copy, normalised", FP32 * h * T, 2)]
        layer |= {"norm": [Tensors("embedding output, layer input", r * h * T, 2)] + rms,
                  "mlp norm": [Tensors("embedding output, layer input, residual", r * h * T, 3)] + rms}
    # "around": what every layer reads, the first entries of each layer moment's list (the serving replay makes them
    # once a forward: serving_timeline.py)
    return {k: around + ts for k, ts in layer.items()} | {"head": head, "around": around}


def _inference_around(spec: ModelSpec, b: int, s: int, r: int, attn: str, context: int) -> list[Tensors]:
    """What every layer of a no_grad forward reads, made once by the model's forward (inference_working_set's
    "around")."""
    fam = family(spec.model_type)
    rope_dim = spec.qk_rope_head_dim if spec.is_mla else spec.head_dim  # MLA rotates only q and k's rope part
    around = [Tensors("rotary cos, sin", r * s * rope_dim, 2 * fam.rope_tables)] if spec.position == "rotary" else []
    if fam.keeps_position_embeds:
        # GPT2Model.forward's position embeddings (wpe's output, 1 x s x h) live beside the blocks to the last one
        around.append(Tensors("position embeddings", r * spec.hidden_size * s))
    if attn != "eager" and spec.arch == "decoder" and sdpa_masked(spec, context or s):
        # masking_utils builds the sliding-window (or Falcon's) mask once per forward as booleans, broadcast over
        # the batch, and passes it to every layer's SDPA (traced: Gemma 3)
        around.append(Tensors("SDPA boolean mask", s * (context or s)))
    if attn == "eager" and spec.arch == "decoder":
        # transformers 5.23 masking_utils: eager gets the causal mask as a float (b, 1, s, s) tensor in the
        # embeddings' dtype, made once per attention kind (full, sliding) and passed to every layer (SDPA and
        # flash take is_causal instead)
        around.append(Tensors("causal masks (eager)", r * b * s * (context or s), max(1, len(set(spec.layer_types)))))
    return around


def _shared_expert_moments(spec: ModelSpec, T: int, p: int, r: int, streams: list[Tensors],
                           kind: LayerKind | None) -> dict[str, list[Tensors]]:
    """A MoE layer's shared experts, which run after the routed ones (DeepseekV3MoE, Glm4MoeMoE: hidden_states =
    experts(...) + shared_experts(residuals)), for the serving replay: the routed output (cast back to the stream's
    dtype) beside the shared MLP's intermediates, then beside its product and its down projection's output; the
    block's sum follows (traced, deepseek_v3-moe-small bf16-pure serving: the small pool peaks at that sum with the
    residual stream held four times, the routed and the shared outputs). Full checkpointing's first forward walks
    them too (timeline.walk_no_grad_block). Llama4TextMoe runs its shared expert first (moe_all_experts: not these
    moments)."""
    fam = family(spec.model_type)
    fs = spec.shared_expert_intermediate_size
    if not fs or fam.moe_all_experts or True not in mlp_kinds(spec, kind):
        return {}
    h = spec.hidden_size
    n_f = held_intermediates(spec, fam.gated_up_linears == 1)
    routed = Tensors("routed experts' output", r * h * T)
    return {"shared experts": streams + [routed, Tensors("shared experts' intermediates", p * fs * T, n_f)],
            "shared down": streams + [routed, Tensors("shared experts' product", p * fs * T),
                                      Tensors("shared experts' output", p * h * T)]}


def _kept_probabilities(spec: ModelSpec, b: int, s: int, p: int, r: int, attn: str, context: int) -> list[Tensors]:
    """A decoder layer binds eager attention's returned probabilities to `_` (hidden_states, _ =
    self.self_attn(...)), which keeps them alive through the MLP (traced: gpt-oss); in the query's width where the
    serving replay runs the core in order (inference_eager_core), else in the matmul dtype."""
    if attn != "eager" or spec.arch != "decoder":
        return []
    width = query_width(spec, p, r) if inference_eager_core(spec, b, s, p, r, attn, context) else p
    return [Tensors("attention probabilities (kept by the layer)", width * b * spec.num_heads * s * (context or s))]


def _inference_mlp(spec: ModelSpec, T: int, s: int, p: int, r: int, post_norm: bool,
                   dequant: int = 0, routed: bool = True) -> list[Tensors]:
    """A layer's MLP under no_grad: the residual stream held four times (three post-norm) and the MLP's
    intermediates, or, with a dequantised weight, each projection beside the half copy its matmul runs on
    (_dequant_moments); a MoE layer's permuted tokens and the larger of its gate_up and its combine moments
    (routed=False: a MoE model's dense layer)."""
    fam, h = family(spec.model_type), spec.hidden_size
    f, f_tok = spec.intermediate_size, T
    moe = spec.is_moe and routed
    # a fused gate_up projection (Phi-3's gate_up_proj, transformers 5's fused experts) keeps its whole output
    # alive through act(gate) * up: act, the product and both halves; separate gate and up projections free the
    # gate's output after the activation
    n_f = held_intermediates(spec, moe or fam.gated_up_linears == 1)
    # a parallel layer (GPT-NeoX, Falcon) has no residual after attention: it holds the attention's output
    # (FalconDecoderLayer: mlp_output += attention_output after the MLP) in the matmul dtype instead (traced)
    parallel = fam.parallel_residual
    mlp = [Tensors("embedding output, layer input, (residual after attention,) MLP input", r * h * T,
                   3 if post_norm or parallel else 4)]
    if parallel:
        mlp.append(Tensors("attention output (parallel layer)", p * h * T))
    if fam.block_keeps_attn_output:
        mlp += [Tensors("attention output (kept by the block)", p * h * T)]
    if not moe:
        plain = mlp + [Tensors("mlp intermediates", p * f * f_tok, n_f)]
        return max([plain] + _dequant_moments(spec, T, p, dequant, mlp), key=total)
    if fam.moe_all_experts:
        return max(_inference_all_experts(spec, T, p, r, mlp) + [mlp + [Tensors("mlp intermediates", p * f * T, n_f)]],
                   key=total)
    # the experts run on each token's copy per chosen expert (grouped_mm: sorted by expert)
    f, f_tok = spec.expert_width, T * spec.experts_per_token
    mlp.append(Tensors("tokens permuted to their experts", p * h * f_tok))
    # then the combine: the down projection's output, times the routing weights (fp32 where the router keeps
    # them fp32), put back in token order, beside the permuted tokens (traced: DeepSeek-V3)
    w = FP32 if fam.moe_router_fp32 else p
    combine = mlp + [Tensors("expert outputs (down projection)", p * h * f_tok),
                     Tensors("weighted expert outputs, unpermuted", w * h * f_tok, 2)]
    if fam.expert_act_extra:  # the composed activation's pieces (gpt-oss's clamped SwiGLU) replace act(gate)
        n_f += fam.expert_act_extra - 1
    # biased experts (gpt-oss: gate_up_proj_bias, E x 2f) gather each routed token's bias row before the
    # grouped matmul adds it (integrations/moe.py grouped_mm_experts_forward: gate_up_proj_bias[expert_ids_g]),
    # a copy as large as the gate_up output, alive through the activation (traced)
    if biased_experts(spec):
        n_f += 2 if spec.mlp == "gated" else 1
    return max(mlp + [Tensors("mlp intermediates", p * f * f_tok, n_f)], combine, key=total)


def held_intermediates(spec: ModelSpec, fused_up: bool) -> int:
    """An MLP's intermediates alive at once under no_grad: gated, act(gate), up and their product (and with a fused
    gate_up projection its whole output); plain, the up projection and its activation, where a Python-composed
    GELU (gelu_new: 0.5 * x * (1 + tanh(...))) holds the up projection and three of its pieces (traced: GPT-2)."""
    if spec.mlp == "gated":
        return 4 if fused_up else 3
    return 4 if len(ACTIVATION_SAVES.get(spec.activation, ("act",))) > 1 else 2


def _dequant_moments(spec: ModelSpec, T: int, p: int, dequant: int, mlp: list[Tensors]) -> list[list[Tensors]]:
    """A dense MLP's projections, each running on a half copy of its 4-bit weight (`dequant`: the largest one's
    bytes, taken for each): the up projection beside act(gate) and its output (a fused gate_up: its 2f-wide
    output), the down projection beside its input and output."""
    if not dequant:
        return []
    h, f = spec.hidden_size, spec.intermediate_size
    copy = Tensors("a projection's weight dequantised to half (bitsandbytes)", dequant)
    if spec.mlp != "gated":
        up = [Tensors("up projection's output", p * f * T)]
    elif family(spec.model_type).gated_up_linears == 1:
        up = [Tensors("gate_up projection's output", p * 2 * f * T)]
    else:
        up = [Tensors("act(gate), up projection's output", p * f * T, 2)]
    down = [Tensors("down projection's input", p * f * T), Tensors("down projection's output", p * h * T)]
    return [mlp + up + [copy], mlp + down + [copy]]


def _inference_all_experts(spec: ModelSpec, T: int, p: int, r: int, base: list[Tensors]) -> list[list[Tensors]]:
    """The moments of Llama4TextMoe under no_grad (_moe_all_experts), R = E * T rows: the hidden states repeated
    per expert beside their product with the scores (which replaces them in `routed_in`); inside the experts,
    routed_in beside the half cast of it under autocast and gate_up, then gate_up, act(gate) and the product, then
    gate_up, the product and the down projection's output."""
    h, f, R = spec.hidden_size, spec.expert_width, T * spec.num_experts
    routed = Tensors("hidden states repeated per expert, scaled by the router (routed_in)", r * h * R)
    out = [base + [routed, Tensors("the repeat before its scaling", r * h * R)],
           base + [routed, Tensors("gate_up, act(gate), their product", p * f * R, 4)],
           base + [routed, Tensors("gate_up, the product", p * f * R, 3), Tensors("experts' output", p * h * R)]]
    if r != p:  # autocast: the bmm's half cast of routed_in beside its gate_up output
        out.append(base + [routed, Tensors("experts' input (half cast)", p * h * R), Tensors("gate_up", p * f * R, 2)])
    return out


def _inference_sdpa_extras(spec: ModelSpec, b: int, s: int, p: int, r: int, context: int) -> list[Tensors]:
    """What an SDPA call holds beyond q, k, v and its output, under no_grad (traced: Falcon under autocast):
    - a fused QKV projection's output, which the attention's locals hold while RoPE makes new q and k from its
      views (FalconAttention fused_qkv, Phi3Attention qkv, GPTNeoXAttention qkv);
    - under autocast with RoPE in the stream's dtype, q and k are fp32 and SDPA runs on half casts of them;
    - a materialised mask (sdpa_masked): the additive copy in the query's dtype (b x 1 x s x s_kv) and, where
      the kv heads are fewer, k and v repeated to every head (integrations/sdpa_attention.py; Falcon's own
      call, which the memory-efficient kernel needs at the query's heads)."""
    a, k, d, T, s_kv = spec.num_heads, spec.num_kv_heads, spec.head_dim, b * s, context or s
    out = []
    if family(spec.model_type).qkv_linears == 1 and spec.position == "rotary":
        out.append(Tensors("fused QKV output (held by the attention)", p * (a + 2 * k) * d * T))
    if r != p and rotary_in_stream_dtype(spec):
        out.append(Tensors("q, k half casts (SDPA)", p * (a + k) * d * T))
    if sdpa_masked(spec, s_kv):
        out.append(Tensors("SDPA additive mask (query dtype)", p * b * s * s_kv))
        if a != k:
            out.append(Tensors("k, v repeated to all heads", p * a * d * b * s_kv, 2))
    return out


def rotary_in_stream_dtype(spec: ModelSpec) -> bool:
    """Whether RoPE runs in the residual stream's dtype (cos / sin cast to the hidden states': fp32 under
    autocast), which makes q, k and the KV cache fp32 there; Llama 4's keeps the projection's dtype instead
    (families.Family.rope_keeps_proj_dtype)."""
    return spec.position == "rotary" and not family(spec.model_type).rope_keeps_proj_dtype


def query_width(spec: ModelSpec, p: int, r: int) -> int:
    """The query's (and key's) width under no_grad: RoPE's output, in the residual stream's dtype
    (rotary_in_stream_dtype), else the projection's. Eager attention casts the softmax output to it
    (`.to(query.dtype)`)."""
    return r if rotary_in_stream_dtype(spec) else p


def _shared_eager_core(spec: ModelSpec) -> bool:
    """A decoder whose eager attention is transformers' shared eager_attention_forward: not multi-head latent
    attention's order, nor a family's own core (Falcon's score tensors, GPT-OSS's sinks)."""
    fam = family(spec.model_type)
    return spec.arch == "decoder" and not spec.is_mla and not fam.eager_score_tensors and not fam.attention_sinks


def inference_eager_core(spec: ModelSpec, b: int, s: int, p: int, r: int, attn: str,
                         context: int) -> list[tuple[int, int]]:
    """A decoder's eager attention core under no_grad, in order, for the serving replay (transformers 5.24
    eager_attention_forward): (slot, bytes) makes a tensor, (~slot, 0) frees it; the one left alive is the
    probabilities the layer keeps (inference_working_set: bound to `_` until the layer returns). Traced, prefill:
    StarCoder 2, Qwen3-MoE and Gemma 3 bf16-pure: bmm, mul, bmm freed, add, mul freed, _to_copy (fp32), _softmax,
    the copy freed, _to_copy (bf16), the softmax freed, the masked scores freed; Qwen3 under autocast: the add
    promoted to fp32, _softmax, the masked freed, the PV matmul's half cast made and freed; Llama 4: a bf16 softmax,
    the masked freed.
    - QK^T and its scaled copy in the matmul dtype (Gemma 2 soft-caps them: three more, each freeing the last); the
      float mask, in the residual stream's dtype, promotes the sum;
    - an fp32 softmax (the family's, or an fp32 stream) of a half input reads an fp32 copy of it;
    - `.to(query.dtype)` copies the softmax output where the widths differ, before the masked scores' name is
      rebound (so those die last); autocast casts fp32 probabilities to half for the PV matmul.
    Empty where the order is another: an encoder, multi-head latent attention, a family's own core (Falcon's score
    tensors, GPT-OSS's sinks); the serving replay then walks the core's moments."""
    if attn != "eager" or not _shared_eager_core(spec):
        return []
    fam = family(spec.model_type)
    n = b * spec.num_heads * s * (context or s)
    softmax = FP32 if (fam.softmax_fp32 or r == FP32) else r
    query = query_width(spec, p, r)
    ops, scores = [(0, p * n), (1, p * n), (~0, 0)], 1
    for slot in range(7, 10) if spec.attn_logit_softcapping else ():  # Gemma 2: / cap, tanh, * cap
        ops += [(slot, p * n), (~scores, 0)]
        scores = slot
    ops += [(2, r * n), (~scores, 0)]
    ops += [(3, FP32 * n), (4, softmax * n), (~3, 0)] if softmax != r else [(4, softmax * n)]
    ops += [(5, query * n), (~4, 0), (~2, 0)] if query != softmax else [(~2, 0)]
    if query == FP32 and p != FP32:  # autocast's half copy of the probabilities for the PV matmul
        ops += [(6, p * n), (~6, 0)]
    return ops


def _inference_eager_scores(spec: ModelSpec, b: int, s: int, p: int, r: int, s_kv: int) -> list[Tensors]:
    """Eager attention's scores and softmax under no_grad (_inference_attention's core)."""
    a = spec.num_heads
    # the scaled scores (plus a decoder's float mask, in the residual stream's dtype, so promoted to it)
    # beside the softmax output: fp32 where the family, an fp32 model or autocast computes it in fp32, after
    # an fp32 copy of a half input (traced)
    m = r if spec.arch == "decoder" else p
    fp32_softmax = family(spec.model_type).softmax_fp32 or r == FP32
    sm = (FP32 + (FP32 if m != FP32 else 0)) if fp32_softmax else m
    own = family(spec.model_type).eager_score_tensors
    # FalconAttention's eager path: QK^T in the matmul dtype, the rest in the hidden states' dtype (scores +
    # the float mask, softmax(..., dtype=hidden_states.dtype) as two _softmax results at its peak) (traced).
    # Each its own storage: the serving replay (serving_timeline.py) allocates them one by one
    widths = [p] + [r] * (own - 1) if own else [m] + ([FP32] * (sm // FP32) if fp32_softmax else [sm])
    core = [Tensors("masked scores, softmax (and its fp32 input copy)", width * b * a * s * s_kv,
                    kind=TensorKind.CORE) for width in widths]
    if family(spec.model_type).attention_sinks:  # GPT-OSS: the masked scores, then cat - max and softmax
        core = [Tensors("masked scores", r * b * a * s * s_kv, kind=TensorKind.CORE),
                Tensors("scores with the sink, less their max; softmax", r * b * a * s * (s_kv + 1), 2,
                        kind=TensorKind.CORE)]
    return core


def _inference_attention(spec: ModelSpec, b: int, s: int, p: int, r: int, attn: str, context: int,
                         post_norm: bool) -> dict[str, list[Tensors]]:
    """A layer's attention under no_grad: the embedding output, the layer input and the norm output (no norm
    output in a post-norm encoder), q, k, v and the attention output (eager: q, k and v at the query heads, the
    scores beside the softmax output); and ("rotary") RoPE before the layer's k and v reach the cache."""
    h, a, k, d, T, s_kv = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, b * s, context or s
    stream = [Tensors("embedding output, layer input, (norm output)", r * h * T, 2 if post_norm else 3)]
    # RoPE multiplies q and k by cos / sin in the residual stream's dtype, so under autocast they are fp32 (v stays
    # in the matmul dtype, and is cached so: inference.py, kv_b)
    qkv = query_width(spec, p, r)
    if spec.is_mla:
        # multi-head latent attention decompresses the cached latent at every step (modeling_deepseek_v3.py):
        # the query at a * dq per new token; the key at a * dq and kv_b_proj's output (k_nope and v, which the
        # value is a view of) per attended token
        # (kv_b_proj's output and the key built from it are two storages: traced, DeepSeek-V3-small)
        qkv_ts = [Tensors("q_b_proj output, the query built from it", qkv * a * d * T, 2),
                  Tensors("kv_b_proj output", p * b * s_kv * a * (spec.qk_nope_head_dim + spec.value_head_dim)),
                  Tensors("k", p * b * s_kv * a * d)]
    elif attn == "eager":  # repeat_kv's copies of k and v at every query head
        # repeat_kv's k and v: two storages (a lump of both would cross the allocator's 1 MiB pool boundary alone)
        qkv_ts = [Tensors("q", qkv * a * d * T), Tensors("k at the query heads", qkv * a * d * b * s_kv),
                  Tensors("v at the query heads", p * a * d * b * s_kv)]
    else:
        qkv_ts = [Tensors("q, k, v", (qkv * (a + k) + p * k) * d * T)]
    if attn == "eager":
        core = _inference_eager_scores(spec, b, s, p, r, s_kv)
    else:
        core = [Tensors("attention output", p * a * d * T)] + _inference_sdpa_extras(spec, b, s, p, r, context)
    if family(spec.model_type).block_keeps_attn_output and attn != "eager":
        # GPT2Block's attention returns its c_proj output, which the block holds to its end; c_proj runs inside the
        # attention, while the fused c_attn output and the core's output are alive (traced: GPT-2 int8 and
        # GPT-BigCode-small bf16-pure serving, the c_attn output freed after c_proj's). Eager's scores are gone by
        # then: its moment is the scores', and the output is the MLP moment's
        core = core + [Tensors("attention output (kept by the block)", p * h * T)]
    out = {"attention": stream + qkv_ts + core}
    if spec.position != "rotary" and attn != "eager":
        # without RoPE the cache update follows the projections (GPT2Attention: c_attn, split, then
        # past_key_values.update's copies, then the core): the serving replay makes the cache after this moment
        # (serving_timeline.kv_moment), whose one tensor is the projections' output. Eager's list has q, k and v
        # at the query heads instead; MLA's latent cache is rotary (DeepseekV3Attention)
        out["projection"] = stream + qkv_ts
    if attn == "eager" and not family(spec.model_type).eager_score_tensors and not inference_eager_core(
            spec, b, s, p, r, attn, context):
        # before the mask: QK^T and its scaled copy, the product freed after the sum (eager_attention_forward:
        # matmul(q, k^T) * scaling, then + mask), both in the matmul dtype (traced: StarCoder 2). Only the serving
        # replay reads this moment (the masked scores' moment is larger)
        out["scores"] = stream + qkv_ts + [Tensors("QK^T and its scaled copy", p * b * a * s * s_kv, 2)]
    if spec.position == "rotary" and not spec.is_mla:
        # apply_rotary_pos_emb: q, q * cos, rotate_half(q) (a torch.cat) and its product with sin live together
        # beside k and v (traced: Qwen3 under autocast)
        out["rotary"] = stream + [Tensors("q, q * cos, rotate_half(q), its product with sin", qkv * a * d * T, 4),
                                  Tensors("k", qkv * k * d * T), Tensors("v", p * k * d * T)]
    return out
