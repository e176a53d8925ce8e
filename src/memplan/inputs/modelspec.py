"""ModelSpec: the architecture facts and the exact parameter table of one model.

The parameter table is a list of `ParamGroup` rows (category, shape, how many tensors of that shape),
read off the real transformers model built on the meta device (see `memplan.inputs.hf`). Keeping shapes, not
only totals, lets the byte rules be exact: the allocator rounds each tensor, 8-bit Adam only quantises
tensors with >= 4096 elements, Adafactor factors each matrix into rows + cols.

This module imports no torch: catalog specs are stored as JSON and loaded here.
"""

from __future__ import annotations

import math
from functools import cached_property
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# adapter: LoRA's A and B matrices, which the fine-tuning table (estimator/finetune.py) adds
Category = Literal["embeddings", "attention", "mlp", "experts", "router", "norms", "head", "other", "adapter"]
# heads whose output is a vocabulary: the logits and their loss scale with it, a tied matrix can serve it
LM_HEADS = ("causal-lm", "seq2seq-lm", "masked-lm")
CATEGORIES: tuple[str, ...] = ("embeddings", "attention", "mlp", "experts", "router", "norms", "head", "other",
                               "adapter")
# How a tensor is stored on the GPU. "model": in the width the training precision gives parameters
# (rules.Precision.param), as in full fine-tuning; the rest are set by the fine-tuning table
# (estimator/finetune.py): a frozen base in its load dtype, fp32 adapters, bitsandbytes' 4-bit (nf4 or fp4,
# with or without double quantisation) and 8-bit formats.
Store = Literal["model", "fp32", "half", "4bit", "4bit-dq", "int8"]

Arch = Literal["encoder", "decoder", "encoder-decoder", "vision"]



def category_totals(groups: Iterable[ParamGroup]) -> dict[str, int]:
    """Parameters by category, in CATEGORIES order, the empty ones left out (a model's table or a
    fine-tuning method's)."""
    out = {c: 0 for c in CATEGORIES}
    for g in groups:
        out[g.category] += g.total
    return {c: n for c, n in out.items() if n}

class Derived(BaseModel):
    """A frozen model whose cached_property values are derived from its fields: a copy with changed fields
    must derive them again (pydantic's model_copy copies __dict__, where the cached values live)."""

    def model_copy(self, *, update=None, deep: bool = False):
        copy = super().model_copy(update=update, deep=deep)
        for cls in type(self).__mro__:
            for name, attr in vars(cls).items():
                if isinstance(attr, cached_property):
                    copy.__dict__.pop(name, None)
        return copy


class ParamGroup(Derived):
    """`count` parameter tensors of one shape and category, owned by modules of one path."""

    model_config = ConfigDict(frozen=True)

    category: Category
    shape: tuple[int, ...]
    count: int = 1
    trainable: bool = True
    # The owning module's dotted path with every index as "*" ("model.layers.*.self_attn.q_proj"): what
    # PEFT's target_modules and modules_to_save match, and where a block's parameters are ("*").
    module: str = ""
    # The weight of an nn.Linear (shape out x in) or of transformers' Conv1D (in x out), else "": what LoRA
    # adapts and bitsandbytes quantises.
    weight_of: Literal["", "Linear", "Conv1D"] = ""
    store: Store = "model"
    # The blocks of its stack that hold it (the module path's first index) where that is not every block: a MoE
    # model's experts and its dense layers' MLP (Llama 4 interleaves them, DeepSeek-V3's first layers are
    # dense), T5's relative_attention_bias in block 0; (): every block, or outside the blocks.
    layers: tuple[int, ...] = ()

    def holding(self, blocks: int) -> tuple[int, ...] | range:
        """The blocks of its stack (`blocks` of them) that hold it (`layers`, or every one)."""
        return self.layers or range(blocks)

    # cached: the search reads them for every layout's stage (pydantic allows cached_property on a
    # frozen model; it is not a field)
    @cached_property
    def numel(self) -> int:
        """Elements of one tensor of this group."""
        return math.prod(self.shape)

    @cached_property
    def total(self) -> int:
        return self.numel * self.count


class ModelSpec(Derived):
    """What the estimator needs to know about a model; field names follow transformers' configs."""

    model_config = ConfigDict(frozen=True)

    name: str
    hf_id: str | None = None
    model_type: str  # transformers `config.model_type`
    arch: Arch
    head: str  # "causal-lm", "sequence-classification", "seq2seq-lm", "image-classification", "base", ...
    num_layers: int  # encoder layers for encoder-decoders
    num_decoder_layers: int = 0
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    mlp: Literal["plain", "gated"]
    activation: str  # transformers' activation name: gelu, gelu_new, silu, relu, gelu_pytorch_tanh, ...
    norm: Literal["layernorm", "rmsnorm"]
    position: Literal["learned", "rotary", "relative", "sinusoidal"]
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    tie_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    num_labels: int = 0
    image_size: int = 0
    patch_size: int = 0
    num_channels: int = 0
    sliding_window: int | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: tanh(scores / cap) * cap in the eager core
    # Each layer's attention as transformers' config.layer_types names it ("full_attention",
    # "sliding_attention" (at most sliding_window keys), "chunked_attention" (Llama 4: attention_chunk_size
    # keys)); (): the config has no layer_types.
    layer_types: tuple[str, ...] = ()
    attention_chunk_size: int | None = None
    # The layers with the family's q/k norm (families.Family.qk_norm) where not all have it: Llama 4's L2 norm runs
    # on its RoPE layers under use_qk_norm (Llama4TextAttention); None: every layer.
    qk_norm_layer_ids: tuple[int, ...] | None = None
    # -- mixture of experts (num_experts > 1) ------------------------------------------------------------
    # intermediate_size is the dense MLP's width; a routed expert's may differ (Qwen3-MoE, DeepSeek-V3,
    # GLM-4-MoE: moe_intermediate_size; Llama 4: intermediate_size, its dense layers intermediate_size_mlp).
    # 0: the experts are intermediate_size wide (Mixtral, gpt-oss).
    expert_intermediate_size: int = 0
    # The shared expert(s) every token also runs, their total width (DeepSeek-V3 / GLM-4-MoE: n_shared_experts
    # * moe_intermediate_size; Llama 4: one of intermediate_size); 0: none.
    shared_expert_intermediate_size: int = 0
    # The layers of a MoE model whose MLP is dense, intermediate_size wide (DeepSeek-V3 first_k_dense_replace,
    # Qwen3-MoE mlp_only_layers and decoder_sparse_step, Llama 4 layers outside moe_layers).
    dense_layer_ids: tuple[int, ...] = ()
    params: tuple[ParamGroup, ...] = Field(default_factory=tuple)
    # The model's buffers, in bytes as transformers builds them (float ones in fp32; bool / int masks and ids as
    # they are): GPT-BigCode's non-persistent n_positions^2 causal mask is 64 MiB on OctoCoder, the rest (rotary
    # inv_freq, position ids) kilobytes. They sit beside the weights on the GPU (verify counts them as weights).
    buffer_bytes: int = 0
    # Modules transformers leaves unquantised when it loads the model in 4 or 8 bit (the output embedding,
    # tied weights, the last parameter's module: transformers/quantizers/base.py get_keys_to_not_convert;
    # and the model's _keep_in_fp32_modules, e.g. T5's wo)
    unquantised: tuple[str, ...] = ()
    # -- multi-head latent attention (DeepSeek-V2 / V3: transformers 5.23 models/deepseek_v3/
    # modeling_deepseek_v3.py DeepseekV3Attention); 0 everywhere else. With MLA, head_dim is the query / key
    # head width qk_nope_head_dim + qk_rope_head_dim (config.qk_head_dim; the config's own head_dim is the
    # rotary width) and num_kv_heads = num_heads (the latent is decompressed to every head).
    kv_lora_rank: int = 0  # the compressed key / value latent's width (kv_a_proj_with_mqa -> kv_a_layernorm)
    q_lora_rank: int = 0  # the compressed query's width (q_a_proj -> q_a_layernorm -> q_b_proj); 0: one q_proj
    qk_rope_head_dim: int = 0  # the rotary part of each query / key head (k's is one head shared by all)
    qk_nope_head_dim: int = 0  # the part of each query / key head without position
    v_head_dim: int = 0  # the value head width (0: head_dim)
    # -- code families (issue 16: starcoder2, gpt_bigcode, falcon) ----------------------------------------
    # LayerNorms per layer where the config decides it (Falcon: one input_layernorm shared by attention and MLP
    # under parallel_attn, two otherwise); 0: the family's (families.Family.norms_per_layer)
    layer_norms: int = 0
    # -- traced coefficients (estimator/traced.py) ----------------------------------------------------------
    # The transformers config as canonical JSON, for a model_type without an analytic activation model: its
    # activations are fitted to traces of the real model built from it; "": the family's analytic model.
    traced_config: str = ""

    # A spec is a cache key of the estimator's per-stage results (estimator/states.py, activation_arrays.py), looked
    # up for every row of a search: its hash is computed once (the model is frozen, so it cannot change).
    @cached_property
    def fields_hash(self) -> int:
        return hash((type(self), tuple(self.__dict__[k] for k in type(self).model_fields)))

    def __hash__(self) -> int:
        return self.fields_hash

    # -- parameter totals -------------------------------------------------------------------------
    @property
    def params_total(self) -> int:
        return sum(g.total for g in self.params)

    @property
    def params_trainable(self) -> int:
        return sum(g.total for g in self.params if g.trainable)

    def params_by_category(self) -> dict[str, int]:
        return category_totals(self.params)

    @property
    def num_tensors(self) -> int:
        return sum(g.count for g in self.params)

    @property
    def largest_tensor(self) -> int:
        return max((g.numel for g in self.params), default=0)

    # -- derived architecture facts ---------------------------------------------------------------
    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_decoder_layers

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        """Each decoder layer's attention kind: config.layer_types, or what transformers infers without them
        (every layer slides when there is a window, is chunked with Llama 4's attention_chunk_size; cache_utils.py
        get_layer_types_and_kwargs)."""
        if self.layer_types:
            return self.layer_types
        layers = self.num_decoder_layers if self.arch == "encoder-decoder" else self.num_layers
        return ("sliding_attention" if self.sliding_window else
                "chunked_attention" if self.attention_chunk_size else "full_attention",) * layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_width(self) -> int:
        """A routed expert's intermediate width."""
        return self.expert_intermediate_size or self.intermediate_size

    @property
    def dense_layers(self) -> int:
        """Layers of a MoE model whose MLP is dense."""
        return len(self.dense_layer_ids)

    @property
    def qk_norm_layers(self) -> int | None:
        """Layers with the q/k norm where not all have it (None: every layer)."""
        return None if self.qk_norm_layer_ids is None else len(self.qk_norm_layer_ids)

    @property
    def qk_norm_share(self) -> float:
        """The share of the layers with the q/k norm (Llama 4: its RoPE layers), for a mean layer's terms."""
        return 1.0 if self.qk_norm_layer_ids is None else len(self.qk_norm_layer_ids) / self.num_layers

    @property
    def moe_layers(self) -> int:
        """Layers with routed experts (all of them in Mixtral)."""
        return self.num_layers - self.dense_layers if self.is_moe else 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: keys and values decompressed from a per-token latent."""
        return self.kv_lora_rank > 0

    @property
    def value_head_dim(self) -> int:
        """A value head's width: head_dim but in MLA (v_head_dim)."""
        return self.v_head_dim or self.head_dim

    @property
    def seq_positions(self) -> int:
        """Tokens per sample the model sees: patches (+1 CLS) for ViT, else the max position."""
        if self.arch == "vision":
            return (self.image_size // self.patch_size) ** 2 + 1
        return self.max_position


def megatron_gpt(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelSpec:
    """The GPT of the Megatron-LM papers (Narayanan et al. 2021, Korthikanti et al. 2022): LayerNorm,
    fused QKV with biases, a 4h GeLU MLP, learned positions, a head tied to the embeddings, dropout.
    For planning architectures that have no config file, and for comparing with published numbers."""
    h, L = hidden, layers
    params = (
        ParamGroup(category="embeddings", shape=(vocab, h)), ParamGroup(category="embeddings", shape=(seq, h)),
        ParamGroup(category="attention", shape=(3 * h, h), count=L), ParamGroup(category="attention", shape=(3 * h,), count=L),
        ParamGroup(category="attention", shape=(h, h), count=L), ParamGroup(category="attention", shape=(h,), count=L),
        ParamGroup(category="mlp", shape=(4 * h, h), count=L), ParamGroup(category="mlp", shape=(4 * h,), count=L),
        ParamGroup(category="mlp", shape=(h, 4 * h), count=L), ParamGroup(category="mlp", shape=(h,), count=L),
        ParamGroup(category="norms", shape=(h,), count=4 * L + 2),
    )
    return ModelSpec(name=f"megatron-gpt-{L}x{h}", model_type="megatron_gpt", arch="decoder", head="causal-lm",
                     num_layers=L, hidden_size=h, num_heads=heads, num_kv_heads=heads, head_dim=h // heads,
                     intermediate_size=4 * h, vocab_size=vocab, max_position=seq, mlp="plain", activation="gelu",
                     norm="layernorm", position="learned", hidden_dropout=0.1, attention_dropout=0.1,
                     tie_embeddings=True, params=params)
