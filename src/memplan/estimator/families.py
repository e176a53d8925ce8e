"""Per-family facts: one row per transformers `model_type`, every quirk the estimator, the config reader,
memplan.kernels and memplan.selective need to know about a model family. Pure data, no torch.

Code asks `family(spec.model_type).fact`; a model_type without a row (a hand-built spec such as
modelspec.megatron_gpt) gets `Family()`'s defaults, which describe a plain transformers model.
Sources: transformers 5.23, `transformers/models/<model_type>/modeling_<model_type>.py` (and
configuration_<model_type>.py) unless a field's comment names another file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memplan.inputs.modelspec import ModelSpec


@dataclass(frozen=True)
class Family:
    # -- architecture (read by inputs/hf.py; None: no analytic model, the family is traced: estimator/traced.py)
    arch: str | None = None  # "encoder", "decoder", "encoder-decoder", "vision"
    mlp: str = "plain"  # "plain" (up, act, down) or "gated" (act(gate) * up, down)
    norm: str = "layernorm"  # "layernorm" or "rmsnorm"
    position: str = "learned"  # "learned", "rotary" or "relative"
    # The activation string that selects a gated MLP, stripped from the activation's name
    # (T5Config.feed_forward_proj "gated-gelu" -> T5DenseGatedActDense).
    gated_act_prefix: str | None = None
    # The config leaves the MLP width unset and the model uses 4 * hidden (GPT2Config.n_inner = None,
    # GPT2Block: inner_dim = 4 * hidden_size).
    mlp_width_4h_when_unset: bool = False

    # -- activation model (estimator/activations.py, docs/estimator.md) ------------------------------------
    # eager_attention_forward runs softmax(..., dtype=torch.float32).to(query.dtype)
    softmax_fp32: bool = False
    qkv_linears: int = 3  # linears reading the attention input: q, k, v projections, or one fused qkv
    gated_up_linears: int = 2  # linears reading a gated MLP's input: gate and up, or one fused gate_up
    norms_per_layer: int | None = None  # None: 2 per encoder / decoder-only layer, 3 per cross-attending layer
    mlp_inner_dropout: bool = False  # dropout between the MLP's up and down projections
    parallel_residual: bool = False  # attention and MLP read the same norm output (one MLP input cast)
    # The masked-LM head runs a transform (dense, act, LayerNorm) and its loss is CrossEntropyLoss on the
    # logits as they are, no fp32 up-cast (ForMaskedLMLoss, e.g. ModernBERT's, up-casts).
    mlm_raw_logits_loss: bool = False
    embedding_norm: bool = True  # an encoder's / vision model's embeddings end with a LayerNorm
    # The SDPA / flash query is a view of the fused QKV output (no rotary embedding makes a new tensor),
    # so the k and v in that output stay alive beside the KV cache's copies (traced).
    query_views_fused_qkv: bool = False
    # Norms inside the region memplan.kernels' tiled MLP recomputes (they save nothing under it).
    tiled_mlp_norms: int = 0
    # RMSNorm on the query and key projections before RoPE: "head" normalises each head over head_dim (one
    # rstd per head and token: Qwen3Attention.q_norm / k_norm), "full" normalises the whole projection over
    # heads * head_dim (one rstd per token: Olmo2Attention.q_norm / k_norm), "l2" is a per-head norm without a
    # weight after RoPE (Llama4TextL2Norm, on the RoPE layers only: ModelSpec.qk_norm_layers); None: no q/k norm
    qk_norm: str | None = None
    # The RMSNorm multiplies by its weight before casting back (Olmo2RMSNorm.forward: (weight * x).to(input_dtype)),
    # so the normalised tensor it saves for the weight's gradient is fp32 whatever the input (LlamaRMSNorm casts
    # first: weight * x.to(input_dtype) saves it in the input's dtype)
    norm_weight_fp32: bool = False
    # When SDPA gets a materialised attention mask rather than is_causal: "always" (FalconModel.forward calls
    # create_causal_mask with allow_is_causal_skip=False), "window" (Starcoder2Model: the sliding-window mask, once
    # the keys reach the window, or Llama 4's chunk: masking_utils' sdpa_mask skips only a mask that masks nothing
    # more than causality); None: never (is_causal). With a mask, transformers' sdpa_attention_forward repeats k, v to every
    # head (use_gqa_in_sdpa: attention_mask is None) and torch's SDPA turns the boolean mask into an additive one
    # in the query's dtype, which the memory-efficient kernel saves (verify/cudasim.py, CudaSemantics._sdpa).
    sdpa_mask: str | None = None
    # cos / sin tables the model's forward computes once and holds through the layers: Gemma 3 has a global and a
    # local rotary embedding (Gemma3TextModel: position embeddings per layer type, rope_local_base_freq)
    rope_tables: int = 1
    # The router's top-k weights stay fp32 (DeepseekV3TopkRouter: sigmoid of fp32 logits; MixtralTopKRouter: softmax
    # of router_logits.float(), renormalised), so the weighted expert outputs are fp32 (traced, mixtral-small
    # bf16-pure: 4 MiB beside the 2 MiB bf16 output); Qwen3-MoE's casts them to the logits' dtype first
    moe_router_fp32: bool = False
    # Every token runs through every expert (Llama4TextMoe: the hidden states repeated num_experts times, each
    # copy scaled by its sigmoid router score, zero off the top-k, and one bmm per expert over all tokens), so the
    # experts' tensors are num_experts * tokens long, not experts_per_token * tokens (activations._moe_all_experts)
    moe_all_experts: bool = False
    # Extra expert-width tensors the experts' own activation saves per routed token beyond act(gate) * up:
    # GptOssExperts._apply_gate clamps gate and up, multiplies by sigmoid(alpha * gate) and by up + 1, and
    # autograd keeps the clamps' inputs (gate_up's halves), the sigmoid, the glu and up + 1 (traced: 4)
    expert_act_extra: int = 0
    # -- serving (activations.inference_working_set; traced with verify --task infer) ------------------------
    # RoPE's output keeps the projections' dtype, not the residual stream's (Llama 4's apply_rotary_emb:
    # type_as(xq); FalconModel computes cos / sin from the hidden states, as llama does; OLMo 2's
    # apply_rotary_pos_emb returns q_embed.to(q_type), transformers 5.24 modeling_olmo2.py), so under autocast q, k
    # and the KV cache stay half (traced, olmo2-small bf16 serving: peak allocated +1.51 -> -0.04 %)
    rope_keeps_proj_dtype: bool = False
    # score-sized tensors alive at once in the family's own eager attention (FalconAttention: the scores in the
    # matmul dtype, then the scores plus the float mask and softmax(..., dtype=hidden_states.dtype), two results
    # at its peak, in the hidden states' dtype, fp32 under autocast); 0: transformers' eager_attention_forward
    # (the masked scores beside softmax's output and fp32 copy)
    eager_score_tensors: int = 0
    # eager attention concatenates a learned sink logit per head to the scores before its softmax (GptOssAttention's
    # eager_attention_forward): its core makes other transients than transformers' shared one, so the replay
    # (timeline.py) makes its saved list in order
    attention_sinks: bool = False
    # GPT2Block keeps the attention's output in a local through the MLP, and quantises c_proj's input at the MLP's
    # end (serving_timeline's block_end) (traced: GPT-2, GPT-BigCode)
    block_keeps_attn_output: bool = False
    # the model's forward keeps the learned position embeddings' output (1 x s x h) in a local beside the blocks to
    # the last one (GPT2Model, GPTBigCodeModel; traced serving)
    keeps_position_embeds: bool = False
    # The layers' linears are nn.Linear, whose weight autocast casts once and caches (torch caches the casts of
    # leaf tensors only); False: FalconLinear multiplies by weight.T, a view, so each matmul casts its weight anew
    # and no_grad serving keeps no copy of a layer's weights (the LM head, an nn.Linear, is cached) (traced)
    autocast_caches_layer_weights: bool = True
    # The layer normalises its sublayers' outputs, not their inputs (Olmo2DecoderLayer: post_attention_layernorm
    # and post_feedforward_layernorm before each residual add), so attention and MLP read the residual stream
    # itself: in serving no norm output lives beside it (activations.inference_working_set, as BERT's post-norm)
    post_norm_layers: bool = False
    # The module DeepSpeed ZeRO-3 fetches whole, with every descendant's parameters, as a "z3 leaf": DeepSpeed
    # 0.19.8 marks MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock and Qwen3MoeSparseMoeBlock by default
    # (runtime/zero/leaf_module_config.py; the engine applies zero_optimization.leaf_module): the block's path
    # suffix under a layer ("mlp"); "": none (each module fetches its own parameters)
    z3_leaf: str = ""


    # -- what memplan and transformers can run -------------------------------------------------------------
    # attention implementations transformers lacks (`_supports_sdpa` / `_supports_flash_attn`); eager exists
    # everywhere
    attn_unsupported: tuple[str, ...] = ()
    # attention through transformers' AttentionInterface without logit soft-capping or a position bias, so
    # memplan.kernels' tiled attention can be the attn_implementation (kernels/attention.py)
    memplan_attention: bool = False
    # memplan.kernels.apply's fused loss (kernels/patch.py): the attribute holding the base model of the
    # causal LM (ForCausalLM.model / .transformer) or of the masked LM (BertForMaskedLM.bert)
    fused_loss_causal_base: str | None = None
    fused_loss_mlm_base: str | None = None
    tiled_mlp: bool = False  # memplan.kernels.apply tiles the layers' dense MLPs (kernels/patch.py)
    # The layer class whose token-wise feed_forward_chunk apply() tiles instead of an `*MLP` module.
    tiled_ffn_layer: str | None = None
    # The attention modules call the core through ALL_ATTENTION_FUNCTIONS (transformers 5.x), so
    # memplan.selective can checkpoint it: checked by counting calls of the wrapped core and comparing
    # loss and gradients with the unpatched model (tests/test_selective.py).
    selective: bool = False

    # -- fine-tuning (estimator/finetune.py) -----------------------------------------------------------------
    # The LoRA target_modules PEFT applies by default for the model type (peft 0.21, utils/constants.py
    # TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING); (): none, PEFT asks for target_modules
    lora_targets: tuple[str, ...] = ()
    # PEFT's LoRA on transformers 5's fused MoE parameters (peft utils/transformers_weight_conversion.py
    # _MOE_TARGET_MODULE_MAPPING, _MOE_FUSED_TARGETS): (a v4 module name a target list may give, the fused
    # tensor it adapts: "router", "gate_up" (w1 and w3 fused, adapted at twice the rank) or "down")
    lora_fused_experts: tuple[tuple[str, str], ...] = ()

    @property
    def kernels(self) -> bool:
        """memplan.kernels.apply has something for this family: the fused loss or the tiled MLP."""
        return bool(self.fused_loss_causal_base or self.fused_loss_mlm_base or self.tiled_mlp)


_ENCODER = dict(arch="encoder", selective=True)
_DECODER = dict(arch="decoder", selective=True)
_ROTARY_GATED = dict(_DECODER, mlp="gated", norm="rmsnorm", position="rotary", softmax_fp32=True)
# memplan.kernels' full support: fused causal-LM loss on the base model `model`, tiled MLP, tiled attention
_KERNELS = dict(fused_loss_causal_base="model", tiled_mlp=True, memplan_attention=True)
_QV = ("q_proj", "v_proj")  # PEFT's default LoRA targets for most decoders
# transformers 5 maps these model types to qwen2_moe's conversion pattern (conversion_mapping.py
# _MODEL_TO_CONVERSION_PATTERN), and PEFT 0.21 renames their v4 targets to the fused tensors
# (transformers_weight_conversion.py _MOE_TARGET_MODULE_MAPPING["qwen2_moe"]); the names leave target_modules, so a
# dense layer's or a shared expert's nn.Linear of those names is adapted no more (finetune.adapted; traced:
# glm4_moe-small all-linear adapts q, k, v, o, the router and the experts, 610,560 parameters at r 16)
_QWEN2_MOE_LORA = (("gate", "router"), ("gate_proj", "gate_up"), ("up_proj", "gate_up"), ("down_proj", "down"))

FAMILIES: dict[str, Family] = {
    # BertOutput ends the feed-forward with its LayerNorm, inside the tiled region (BertLayer.feed_forward_chunk);
    # deberta_v2's masked LM also takes CrossEntropyLoss on raw logits (not modelled: no activation model).
    "bert": Family(**_ENCODER, lora_targets=("query", "value"), mlm_raw_logits_loss=True, tiled_mlp_norms=1,
                   memplan_attention=True, fused_loss_mlm_base="bert", tiled_mlp=True, tiled_ffn_layer="BertLayer"),
    "roberta": Family(**_ENCODER, lora_targets=("query", "value"), mlm_raw_logits_loss=True),
    "distilbert": Family(**_ENCODER),
    # GPT2Attention.c_attn is one Conv1D for q, k, v
    "gpt2": Family(**_DECODER, lora_targets=("c_attn",), mlp_width_4h_when_unset=True, qkv_linears=1,
                   block_keeps_attn_output=True, keeps_position_embeds=True,
                   query_views_fused_qkv=True, fused_loss_causal_base="transformer", tiled_mlp=True,
                   memplan_attention=True),
    "opt": Family(**_DECODER, lora_targets=_QV, softmax_fp32=True),
    # GPTNeoXAttention.query_key_value; GPTNeoXLayer: use_parallel_residual
    "gpt_neox": Family(**_DECODER, lora_targets=("query_key_value",), position="rotary", softmax_fp32=True,
                       qkv_linears=1, parallel_residual=True),
    # -- code families (issue 16) ----------------------------------------------------------------------------
    # Starcoder2DecoderLayer: LayerNorm (with bias) before attention and MLP, q/k/v/o_proj with bias (use_bias),
    # Starcoder2MLP c_fc -> gelu_pytorch_tanh -> c_proj, residual_dropout after o_proj and after the MLP,
    # embedding_dropout after the embeddings; attention through ALL_ATTENTION_FUNCTIONS with the config's
    # sliding_window (every layer); eager_attention_forward up-casts the softmax. No memplan attention: its
    # sliding-window mask function is not one kernels/attention.py hf_mask tiles, so the tiled attention would
    # run its eager fallback on every StarCoder 2 (all set a window). PEFT has no default LoRA targets for it
    # (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING has no starcoder2 entry)
    "starcoder2": Family(**_DECODER, position="rotary", softmax_fp32=True, sdpa_mask="window",
                         fused_loss_causal_base="model", tiled_mlp=True),
    # GPTBigCodeAttention: one c_attn Linear gives q (h) and, under multi_query, one k and one v head
    # (2 * head_dim; hf._kv_fields: 1 kv head), split as views of its output (the query a view of it: the
    # whole output stays alive beside the cache's k, v copies); learned positions (wpe); GPTBigCodeMLP
    # c_fc -> gelu_pytorch_tanh -> c_proj (n_inner None: 4h); attention through ALL_ATTENTION_FUNCTIONS, whose
    # eager_attention_forward always up-casts the softmax (the config's attention_softmax_in_fp32 /
    # scale_attention_softmax_in_fp32 are read into the module but no 5.23 code path uses them)
    "gpt_bigcode": Family(**_DECODER, lora_targets=("c_attn",), mlp_width_4h_when_unset=True, qkv_linears=1,
                          block_keeps_attn_output=True, keeps_position_embeds=True,
                                 query_views_fused_qkv=True, softmax_fp32=True, fused_loss_causal_base="transformer",
                          tiled_mlp=True, memplan_attention=True),
    # FalconDecoderLayer (falcon-7b: parallel_attn, one input_layernorm shared by attention and MLP;
    # new_decoder_architecture: ln_attn and ln_mlp, both on the residual; neither: input and post-attention
    # LayerNorms in sequence: hf._kv_fields gives the norms per layer); FalconAttention calls SDPA or its own
    # eager code directly (not ALL_ATTENTION_FUNCTIONS: no memplan attention, no selective checkpointing);
    # its eager softmax runs in the hidden states' dtype (no up-cast); fused query_key_value; FalconMLP
    # dense_h_to_4h -> gelu -> dense_4h_to_h. PEFT: query_key_value
    "falcon": Family(arch="decoder", lora_targets=("query_key_value",), position="rotary", qkv_linears=1, sdpa_mask="always",
                     eager_score_tensors=4, autocast_caches_layer_weights=False,
                     parallel_residual=True, fused_loss_causal_base="transformer", tiled_mlp=True),
    # T5DenseActDense: wi -> act -> dropout -> wo; flash: T5 has no _supports_flash_attn
    "t5": Family(arch="encoder-decoder", lora_targets=("q", "v"), norm="rmsnorm", position="relative",
                 gated_act_prefix="gated-", softmax_fp32=True, mlp_inner_dropout=True, attn_unsupported=("flash",),
                 selective=True),
    "llama": Family(**_ROTARY_GATED, lora_targets=_QV, **_KERNELS),
    "mistral": Family(**_ROTARY_GATED, lora_targets=_QV, **_KERNELS),
    # PEFT lists q_proj, v_proj for mixtral but, on transformers 5, converts the config for the fused MoE
    # first (transformers_weight_conversion.py _convert_peft_config_moe turns target_modules=None into an
    # empty set), so the default is never applied and get_peft_model raises "No `target_modules` passed"
    # (tests/test_finetune.py checks it still does)
    "mixtral": Family(**_ROTARY_GATED, z3_leaf="mlp", moe_router_fp32=True,
                      lora_fused_experts=(("gate", "router"), ("w1", "gate_up"), ("w3", "gate_up"), ("w2", "down"))),
    "qwen2": Family(**_ROTARY_GATED, lora_targets=_QV, **_KERNELS),
    # Glm4MoeMoE: DeepSeek-V3's MoE (sigmoid router in fp32 with group-limited top-k, a shared expert,
    # first_k_dense_replace dense layers) under llama-style attention with partial rotary (and an optional per-head
    # q/k norm, off in GLM-4.5). PEFT 0.21 has no default LoRA targets for glm4_moe
    "glm4_moe": Family(**_ROTARY_GATED, moe_router_fp32=True, fused_loss_causal_base="model",
                       lora_fused_experts=_QWEN2_MOE_LORA),
    # GptOssDecoderLayer: attention sinks (one learned logit per head, concatenated to the scores) in eager only
    # (no _supports_sdpa; its flash path needs the kernels hub), alternating sliding and full layers, biased
    # projections, fused experts with a clamped SwiGLU, top-k then softmax routing. PEFT 0.21 has no default
    # LoRA targets for gpt_oss
    "gpt_oss": Family(**{**_ROTARY_GATED, "softmax_fp32": False}, attn_unsupported=("sdpa", "flash"),
                      attention_sinks=True, expert_act_extra=4, fused_loss_causal_base="model"),
    # SmolLM3DecoderLayer: llama's layer; no_rope_layers turns RoPE off on every fourth layer, which changes no
    # saved tensor (RoPE saves only the shared cos / sin). PEFT 0.21 has no default LoRA targets for smollm3
    "smollm3": Family(**_ROTARY_GATED, **_KERNELS),
    # Qwen3MoeSparseMoeBlock: Mixtral's top-k softmax router (norm_topk_prob) over transformers 5's fused experts
    # (Qwen3MoeExperts), experts moe_intermediate_size wide, dense layers at mlp_only_layers / decoder_sparse_step;
    # qwen3's attention with per-head q/k norms. PEFT 0.21 has no default LoRA targets for qwen3_moe
    "qwen3_moe": Family(**_ROTARY_GATED, z3_leaf="mlp", qk_norm="head", fused_loss_causal_base="model",
                        memplan_attention=True, lora_fused_experts=_QWEN2_MOE_LORA),
    # Qwen3Attention: q_norm / k_norm over head_dim before RoPE, no qkv bias; otherwise llama's layer
    "qwen3": Family(**_ROTARY_GATED, lora_targets=_QV, qk_norm="head", **_KERNELS),
    # Olmo2DecoderLayer: no input norm; post_attention_layernorm after the attention and post_feedforward_layernorm
    # after the MLP, each before its residual add (2 norms per layer, as a pre-norm layer), so the q/k/v and the
    # gate/up projections read the residual stream itself; q_norm / k_norm over the whole projection. PEFT has no
    # default LoRA targets for olmo2 (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING has no entry)
    "olmo2": Family(**_ROTARY_GATED, qk_norm="full", norm_weight_fp32=True, post_norm_layers=True,
                    rope_keeps_proj_dtype=True, **_KERNELS),
    # GemmaRMSNorm / Gemma2RMSNorm multiply by 1 + weight in fp32 before casting back (norm_weight_fp32), as
    # Gemma3RMSNorm does (traced: gemma-2-2b's four norms a layer save 9 MiB fp32 each at b1 s1024, not 4.5)
    "gemma": Family(**_ROTARY_GATED, lora_targets=_QV, norm_weight_fp32=True, **_KERNELS),
    # Gemma2DecoderLayer: input, post_attention, pre_feedforward and post_feedforward norms; Gemma2Config
    # .layer_types alternates sliding and full attention; no _supports_sdpa; attention logit soft-capping
    # (no memplan attention)
    "gemma2": Family(**_ROTARY_GATED, lora_targets=_QV, norms_per_layer=4, attn_unsupported=("sdpa",),
                     norm_weight_fp32=True, fused_loss_causal_base="model", tiled_mlp=True),
    # Gemma3DecoderLayer: gemma2's four norms per layer, q_norm / k_norm over head_dim before RoPE
    # (Gemma3RMSNorm multiplies by 1 + weight in fp32 before casting back), layer_types mixing sliding and full
    # layers; no logit soft-capping in the released configs, SDPA and flash supported. memplan's tiled attention
    # is left out: five of six layers slide, and a window sends it to its eager fallback (kernels/attention.py).
    "gemma3_text": Family(**_ROTARY_GATED, lora_targets=_QV, norms_per_layer=4, qk_norm="head", norm_weight_fp32=True,
                          sdpa_mask="window", rope_tables=2, fused_loss_causal_base="model", tiled_mlp=True),
    # Llama4TextDecoderLayer (the text model of Llama 4, transformers 5.24 models/llama4/modeling_llama4.py):
    # llama's two RMSNorms per layer; Llama4TextAttention rotates q and k as complex numbers (apply_rotary_emb: an
    # fp32 copy, a complex multiply by the shared freqs_cis, type_as back: nothing saved per layer), then the
    # weightless L2 norm on the RoPE layers (use_qk_norm; ModelSpec.qk_norm_layers), scales the query on the NoPE
    # layers (attn_temperature_tuning: a multiply by a no-grad table, nothing saved); chunked attention on the
    # RoPE layers (layer_types chunked_attention: SDPA gets a materialised mask once the keys reach
    # attention_chunk_size, masking_utils create_chunked_causal_mask local_size), full attention on the NoPE
    # ones; its eager_attention_forward keeps the softmax in the scores' dtype. Llama4TextMoe: every token through
    # every expert (moe_all_experts) beside a shared expert, dense layers intermediate_size_mlp wide off
    # moe_layers. PEFT 0.21 keys its default LoRA targets by "llama4", not "llama4_text", so it has none.
    # memplan's tiled attention is left out (chunked layers send it to its eager fallback)
    "llama4_text": Family(**{**_ROTARY_GATED, "softmax_fp32": False}, qk_norm="l2", moe_all_experts=True,
                          rope_keeps_proj_dtype=True, sdpa_mask="window", fused_loss_causal_base="model"),
    # Phi3Attention.qkv_proj, Phi3MLP.gate_up_proj
    "phi3": Family(**_ROTARY_GATED, qkv_linears=1, gated_up_linears=1),
    # DeepseekV3Attention: multi-head latent attention (ModelSpec.is_mla; activations._mla_attention), RMSNorm,
    # rotary on the rope part of q and k (rope_interleave), SwiGLU MLP (DeepseekV3MLP; routed + shared experts
    # in DeepseekV3MoE after first_k_dense_replace dense layers); eager softmax in fp32; _supports_sdpa and
    # _supports_flash_attn. Its head is the standard lm_head on `model`, so the fused loss and the tiled (dense)
    # MLP apply; memplan's tiled attention does not: its q / k head width (qk_nope + qk_rope) differs from v's
    # (kernels/attention.py takes one head_dim). PEFT 0.21 has no default LoRA targets for deepseek_v3.
    # flash: transformers' flash_attention_2 pads v to the q / k width and crops the output
    # (integrations/flash_attention.py), which memplan does not model, and memplan's flash (SDPA's flash kernel)
    # needs one head width for q, k and v, so it is left out; SDPA runs the memory-efficient kernel.
    "deepseek_v3": Family(moe_router_fp32=True, **_ROTARY_GATED, qkv_linears=2, fused_loss_causal_base="model", tiled_mlp=True,
                          attn_unsupported=("flash",), lora_fused_experts=_QWEN2_MOE_LORA),
    # ViTEmbeddings: patch projection, cls token, position embeddings, no LayerNorm
    "vit": Family(arch="vision", softmax_fp32=True, embedding_norm=False, selective=True),
}

_DEFAULT = Family()

# hidden_act values of gated MLPs that memplan.kernels.apply runs through gated_act (transformers
# activations.ACT2CLS: silu -> SiLUActivation, swish -> nn.SiLU, gelu_pytorch_tanh -> GELUTanh) -> the
# name gated_act takes (kernels/mlp.py ACTS)
GATED_ACT_KERNEL: dict[str, str] = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def family(model_type: str | None) -> Family:
    """The facts of one family; the defaults for a model_type without a row."""
    return FAMILIES.get(model_type or "", _DEFAULT)


def model_types(has: Callable[[Family], object]) -> tuple[str, ...]:
    """The model_types (sorted) whose family has the fact `has` tests, e.g. lambda f: f.tiled_mlp."""
    return tuple(sorted(mt for mt, f in FAMILIES.items() if has(f)))


def embedding_layernorm(spec: ModelSpec) -> bool:
    """The embeddings end with a LayerNorm (an encoder's, BERT's): under autocast its output, and so the
    residual stream after it, is fp32 (estimator/states.py activation_precision)."""
    return spec.arch in ("encoder", "vision") and family(spec.model_type).embedding_norm


def full_attention_only(spec: ModelSpec) -> bool:
    """Every layer attends to every earlier key: no sliding-window or chunked layer (config.layer_types)."""
    return all(kind == "full_attention" for kind in spec.attention_kinds)


def supported_attn(spec: ModelSpec) -> tuple[str, ...]:
    """The attention implementations of this model; memplan's tiled attention last (kernels/attention.py), where
    every layer attends causally to all keys: a sliding-window or chunked layer's mask is a pattern the tiled
    kernels do not express, so kernels/attention.py falls back to the eager computation (hf_mask's 4-D mask),
    which keeps the scores it would save: the mistral-small accuracy config traced 54 % over the tiled estimate
    (`memplan verify --model benchmarks/accuracy/configs/mistral-small.json --gpu a100-80g --device fake -b 2
    --seq-len 1024 --precision bf16 --attn memplan --kernels --tiled-mlp`, before the refusal)."""
    fam = family(spec.model_type)
    out = tuple(a for a in ("flash", "sdpa", "eager") if a not in fam.attn_unsupported)
    return out + (("memplan",) if fam.memplan_attention and full_attention_only(spec) else ())


def tiled_mlp_supported(spec: ModelSpec) -> bool:
    return family(spec.model_type).tiled_mlp and not spec.is_moe and spec.arch != "encoder-decoder"


def fused_loss_base(spec: ModelSpec) -> str | None:
    """The base model's attribute memplan.kernels' fused loss runs for this model's head, if it has one."""
    fam = family(spec.model_type)
    return {"causal-lm": fam.fused_loss_causal_base, "masked-lm": fam.fused_loss_mlm_base}.get(spec.head)


def fused_loss_supported(spec: ModelSpec) -> bool:
    return fused_loss_base(spec) is not None


def activation_method(spec: ModelSpec) -> str:
    """How the estimator models this model's activations: "analytic" (a row of FAMILIES) or "traced"
    (coefficients fitted to a trace of the real transformers model: docs/estimator.md)."""
    return "traced" if spec.traced_config else "analytic"


def describe(spec: ModelSpec) -> str:
    """One line on the architecture: arch, attention (MHA / GQA / MQA / MLA, sliding or chunked layers) and
    experts, e.g. "decoder, GQA 32/8, MoE 128 x 8" (memplan models)."""
    a, k = spec.num_heads, spec.num_kv_heads
    attn = "MLA" if spec.kv_lora_rank else "MHA" if a == k else "MQA" if k == 1 else f"GQA {a}/{k}"
    parts = [spec.arch, attn]
    kinds = set(spec.layer_types) - {"full_attention"}
    if kinds or spec.sliding_window:
        parts.append("sliding window" if "chunked_attention" not in kinds else "chunked attention")
    if spec.is_moe:
        parts.append(f"MoE {spec.num_experts} x {spec.experts_per_token}"
                     + (" + shared" if spec.shared_expert_intermediate_size else ""))
    return ", ".join(parts)
