"""Build a ModelSpec from a transformers config: the real model on the meta device gives the exact
parameter table (no weights are allocated or downloaded).

This is the only module on the model path that imports torch/transformers; the catalog stores its output.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections import Counter
from typing import Any

from memplan.errors import UserError
from memplan.estimator.families import family
from memplan.inputs.modelspec import LM_HEADS, ModelSpec, ParamGroup

# Default head per architecture, and the Auto class that builds it (sequence classification with 2
# labels for encoders, causal LM for decoders, seq2seq LM for T5, image classification for ViT).
HEADS: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
    "base": "AutoModel",
}
DEFAULT_HEAD = {
    "encoder": "sequence-classification",
    "decoder": "causal-lm",
    "encoder-decoder": "seq2seq-lm",
    "vision": "image-classification",
}
DEFAULT_NUM_LABELS = 2

# Parameter name -> category; first match wins (norms before attention: "attention.output.LayerNorm").
# DistilBERT's `pre_classifier` is head; OPT's `project_in/out` (word_embed_proj_dim <-> hidden) belong to the
# embeddings; transformers 5 names the Mixtral/Qwen-MoE router `mlp.gate` (not `mlp.gate_proj`); Falcon's
# new_decoder_architecture names its LayerNorms ln_attn / ln_mlp (before `attn` makes them attention).
CATEGORY_RULES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(lm_head|classifier|pre_classifier|score|pooler|qa_outputs|embed_out|cls)\.", "head"),
    (r"(norm|ln_\d|ln_f|ln_attn|ln_mlp|layernorm|layer_norm)", "norms"),
    (r"(embed|wte|wpe|\.shared\.|^shared\.|patch_embeddings|cls_token|relative_attention_bias|project_in|project_out)",
     "embeddings"),
    (r"\.experts\.", "experts"),
    (r"((block_sparse_moe|\.moe|\.mlp)\.gate|feed_forward\.router)\.", "router"),
    (r"(attn|attention|Attention|q_lin|k_lin|v_lin|out_lin)", "attention"),
    (r"(mlp|intermediate|\.output\.dense|ffn|fc1|fc2|DenseReluDense|lin1|lin2|block_sparse_moe|feed_forward)", "mlp"),
)


def categorize(name: str) -> str:
    low = name.lower()
    for pattern, category in CATEGORY_RULES:
        if re.search(pattern, name) or re.search(pattern, low):
            return category
    return "other"


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` the config sets (a transformers config object or a config.json dict)."""
    get = cfg.get if isinstance(cfg, dict) else lambda n: getattr(cfg, n, None)
    for n in names:
        v = get(n)
        if v is not None:
            return v
    return default


# What each family calls a dimension (first set wins), read by _architecture and checked by check_config.
HIDDEN = ("hidden_size", "d_model", "n_embd", "dim")
ATTN_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
INTER = ("intermediate_size", "d_ff", "ffn_dim", "n_inner", "hidden_dim")
HEAD_DIM = ("head_dim", "d_kv")
KV_HEADS = ("num_key_value_heads",)
EXPERTS = ("num_local_experts", "n_routed_experts", "num_experts")
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx")
# (names, low, high, why high refuses no real model). The bounds keep every byte count of a step inside
# int64 together with constraints.BOUNDS (measured there: 256 layers x 256 heads at the sequence and
# token bounds, 2.6e18 bytes < 2**63).
CONFIG_DIMS: tuple[tuple[tuple[str, ...], int, int, str], ...] = (
    (HIDDEN, 1, 2**16, "llama-3.1-405b: 16,384"),
    (ATTN_HEADS, 1, 256, "Falcon-180B: 232, llama-3.1-405b: 128"),
    (LAYERS, 1, 256, "llama-3.1-405b: 126"),
    (("num_decoder_layers",), 0, 256, "t5-11b: 24"),
    (INTER, 1, 2**18, "llama-3.1-405b: 53,248"),
    (HEAD_DIM, 1, 1024, "gemma: 256"),
    (KV_HEADS, 1, 256, "at most the attention heads"),
    (("vocab_size",), 1, 2**21, "gemma-2: 256,000"),
    (EXPERTS, 0, 1024, "DeepSeek-V3: 256 routed experts"),
    (("num_experts_per_tok",), 0, 1024, "at most the experts"),
    (POSITIONS, 0, 2**24, "Llama 4 Scout: 10,485,760"),
    (("image_size",), 1, 2**14, "ViT: 224-518"),
    (("patch_size",), 1, 2**14, "ViT: 14-32"),
)


def check_config(config: dict[str, Any] | Any) -> None:
    """Refuse a config whose dimensions no model has (not a positive integer, past CONFIG_DIMS' bounds,
    heads that do not divide the width where no head_dim says otherwise): before transformers builds
    it (it would fail with a traceback, or, for a negative width, only on the meta device)."""
    for names, low, high, why in CONFIG_DIMS:
        key = next((n for n in names if _get(config, n) is not None), None)  # the name this config uses
        if key is None:
            continue
        v = _get(config, key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise UserError(f"config {key!r} must be an integer, got {v!r:.40}")
        if not low <= v <= high:
            raise UserError(f"config {key!r} is {v:,}: memplan reads {low:,} to {high:,} (largest real: {why})")
    hidden, heads, kv = _get(config, *HIDDEN), _get(config, *ATTN_HEADS), _get(config, *KV_HEADS)
    if hidden and heads and _get(config, *HEAD_DIM) is None and hidden % heads:
        raise UserError(f"config: {heads} attention heads do not divide the hidden size {hidden} (and no head_dim)")
    if heads and kv and heads % kv:
        raise UserError(f"config: {kv} key-value heads do not divide the {heads} attention heads")


def load_config(config: dict[str, Any] | Any, trust_remote_code: bool = False) -> Any:
    """A transformers PretrainedConfig from a config.json dict (or pass one through)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    d = copy.deepcopy(dict(config))  # transformers mutates nested dicts (rope_scaling gains rope_theta)
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise UserError("config has no 'model_type'; is it a transformers config.json?")
    if not isinstance(model_type, str):
        raise UserError(f"config 'model_type' must be a string, got {model_type!r:.40}")
    try:
        return AutoConfig.for_model(model_type, **d)
    except (KeyError, ValueError) as e:
        raise UserError(f"transformers does not know model_type {model_type!r}: {_last_line(e)}") from None
    except StrictDataclassError as e:  # transformers' own validation of the fields (huggingface_hub dataclasses)
        raise UserError(f"config of {model_type!r}: {_last_line(e)}") from None


def _last_line(e: Exception) -> str:
    """The innermost line of an exception's message ('ValueError: The hidden size ... is not a multiple')."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(e).__name__


def prepare_config(config: dict[str, Any] | Any, head: str | None, trust_remote_code: bool = False) -> tuple[Any, str]:
    """The transformers config and the head, checked: shared by the spec reader and the model builder."""
    check_config(config)
    cfg = load_config(config, trust_remote_code)
    check_config(cfg)  # what transformers filled in (defaults, attribute aliases)
    arch = family(cfg.model_type).arch or traced_arch(cfg)
    head = head or DEFAULT_HEAD[arch]
    if head not in HEADS:
        raise UserError(f"unknown head {head!r} (choose from {', '.join(HEADS)})")
    if head in ("sequence-classification", "token-classification") and "num_labels" not in (
        config if isinstance(config, dict) else {}
    ):
        if getattr(cfg, "num_labels", 2) == 2 and not getattr(cfg, "id2label", None):
            cfg.num_labels = DEFAULT_NUM_LABELS
    return cfg, head


# Model types transformers builds whose blocks are not attention over text tokens: state-space and hybrid
# layers (transformers 5.23 models/<type>), which a traced attention block would not describe
STATE_SPACE = ("mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba", "falcon_h1",
               "granitemoehybrid", "lfm2", "xlstm", "nemotron_h", "plamo2", "minimax", "qwen3_next", "recurrent_gemma")


def traced_arch(cfg: Any) -> str:
    """The architecture of a model_type without an analytic model, for the traced path (estimator/traced.py):
    encoder-decoder (config.is_encoder_decoder), encoder (transformers has a masked-LM head for it and no plain
    causal one of its own), decoder (a causal-LM head); vision-language, speech, vision and state-space models
    are refused by name."""
    from transformers.models.auto import modeling_auto as auto

    mt = cfg.model_type
    if mt in STATE_SPACE or any(hasattr(cfg, k) for k in ("ssm_state_size", "mamba_d_state", "state_size")):
        raise UserError(f"model_type {mt!r} has state-space (recurrent) layers: memplan models attention blocks "
                        "only, analytic or traced")
    if getattr(cfg, "vision_config", None) is not None or mt in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        raise UserError(f"model_type {mt!r} is a vision-language model: memplan traces text models only "
                        "(pass its text model's config, e.g. the text_config's model_type)")
    speech = (auto.MODEL_FOR_CTC_MAPPING_NAMES, auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
              auto.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES)
    if any(mt in names for names in speech):
        raise UserError(f"model_type {mt!r} is a speech model: memplan traces text models only")
    if mt in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES and mt not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"model_type {mt!r} is a vision model: memplan traces text models only (ViT is analytic)")
    if _get(cfg, *HIDDEN) is None or _get(cfg, *ATTN_HEADS) is None or _get(cfg, *LAYERS) is None:
        raise UserError(f"model_type {mt!r}: its config names no hidden size, attention heads or layers that "
                        "memplan reads; it is not a transformer text model memplan can trace")
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder"
    if mt in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder"
    if mt in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "decoder"
    raise UserError(f"model_type {mt!r} has no causal-LM, masked-LM or seq2seq head in transformers: memplan "
                    "traces text models with one")


def spec_from_config(
    config: dict[str, Any] | Any,
    name: str,
    head: str | None = None,
    hf_id: str | None = None,
    trust_remote_code: bool = False,
) -> ModelSpec:
    """Build the real model on the meta device and read its architecture and parameter table."""
    cfg, head = prepare_config(config, head, trust_remote_code)
    model = _meta_model(cfg, head, name, trust_remote_code)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    arch = _architecture(cfg, head)
    if not family(cfg.model_type).arch:  # the traced path: its facts read off the built model
        arch |= _traced_facts(cfg, model)
    return ModelSpec(name=name, hf_id=hf_id, model_type=cfg.model_type, head=head, params=_param_table(model),
                     unquantised=_unquantised(model), buffer_bytes=buffers, **arch)


def _traced_facts(cfg: Any, model) -> dict[str, Any]:
    """A traced model's descriptive facts (its activations come from the traces, estimator/traced.py): RMSNorm
    or LayerNorm by the classes its modules have, a gated MLP by a gate projection among its parameters, its
    positions (`_traced_position`) and the config itself (the traces' key)."""
    classes = {type(m).__name__.lower() for m in model.modules()}
    names = {n.rpartition(".")[0].rpartition(".")[2] for n, _ in model.named_parameters()}
    gated = bool(names & {"gate_proj", "gate_up_proj", "w1", "wi_0"})
    return dict(norm="rmsnorm" if any("rmsnorm" in c for c in classes) else "layernorm",
                mlp="gated" if gated else "plain", position=_traced_position(cfg, model, classes),
                traced_config=config_json(cfg))


def _traced_position(cfg: Any, model, classes: set[str]) -> str:
    """rotary (a rotary-embedding module), learned (a position table among the parameters: BART's
    embed_positions, ELECTRA's position_embeddings; the positions-learned constraint bounds the sequence by its
    rows), else relative (T5-style buckets, ALiBi: no table, no bound)."""
    if any("rotary" in c for c in classes):
        return "rotary"
    if any("position" in n for n, _ in model.named_parameters()):
        return "learned"
    return "relative"


def config_json(cfg: Any) -> str:
    """A transformers config as canonical JSON: the traced coefficients' key (estimator/traced.py)."""
    import json

    return json.dumps(cfg.to_dict(), sort_keys=True, default=str)


def _meta_model(cfg: Any, head: str, name: str, trust_remote_code: bool):
    import torch
    import transformers

    auto = getattr(transformers, HEADS[head])
    try:
        with torch.device("meta"):
            return auto.from_config(cfg, trust_remote_code=trust_remote_code)
    except (ValueError, AssertionError) as e:  # AssertionError: torch's own checks (nn.Embedding's padding_idx)
        raise UserError(f"{name}: transformers cannot build head {head!r}: {_last_line(e)}") from None


def _param_table(model) -> tuple[ParamGroup, ...]:
    """Parameters grouped by (category, owning module's path, shape, linear weight, trainable), with counts."""
    from transformers.pytorch_utils import Conv1D
    from torch import nn

    modules = dict(model.named_modules())
    groups: Counter[tuple[str, str, tuple[int, ...], str, bool]] = Counter()
    held: dict[tuple, tuple[str, set[int]]] = {}  # a group's stack and blocks
    stacks: dict[str, int] = {}  # a stack's path -> its blocks
    for pname, p in model.named_parameters():  # named_parameters() yields tied tensors once
        owner, leaf = pname.rpartition(".")[::2]
        kind = type(modules[owner]).__name__ if isinstance(modules[owner], (nn.Linear, Conv1D)) else ""
        weight_of = {"Conv1D": "Conv1D", "": ""}.get(kind, "Linear") if leaf == "weight" else ""
        key = (categorize(pname), module_path(owner), tuple(p.shape), weight_of, p.requires_grad)
        groups[key] += 1
        stack, block = _block_of(owner)
        if stack is not None:
            held.setdefault(key, (stack, set()))[1].add(block)
            stacks[stack] = max(stacks.get(stack, 0), block + 1)

    def layers(key: tuple) -> tuple[int, ...]:
        """The blocks holding the group where not every block of its stack does (ParamGroup.layers)."""
        if key not in held:
            return ()
        stack, blocks = held[key]
        return () if blocks == set(range(stacks[stack])) else tuple(sorted(blocks))

    return tuple(
        ParamGroup(category=c, shape=s, count=n, trainable=t, module=m, weight_of=lin,  # type: ignore[arg-type]
                   layers=layers((c, m, s, lin, t)))
        for (c, m, s, lin, t), n in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1]))
    )


def _unquantised(model) -> tuple[str, ...]:
    """transformers' own list of the modules its bitsandbytes loading keeps in float, as module paths: the
    quantizers pass get_keys_to_not_convert's keys and the model's _keep_in_fp32_modules
    (quantizers/quantizer_bnb_4bit.py, HfQuantizer.get_modules_to_not_convert)."""
    from transformers.quantizers.base import HfQuantizer

    keys = HfQuantizer.get_modules_to_not_convert(model, None, model._keep_in_fp32_modules)
    return tuple(sorted(module_path(k) for k in keys))


def _block_of(owner: str) -> tuple[str | None, int]:
    """A module's stack (its path before the first index: "model.layers") and its block there; (None, 0) outside
    any block."""
    parts = owner.split(".")
    first = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return (None, 0) if first is None else (".".join(parts[:first]), int(parts[first]))


def module_path(name: str) -> str:
    """A module's dotted name with its indices as "*": one path for the same module of every block."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _architecture(cfg: Any, head: str) -> dict[str, Any]:
    """ModelSpec's architecture fields from a config, whatever each family calls them."""
    fam = family(cfg.model_type)
    arch, mlp = fam.arch or traced_arch(cfg), fam.mlp
    hidden, heads = _get(cfg, *HIDDEN), _get(cfg, *ATTN_HEADS)
    inter = _get(cfg, *INTER, default=4 * hidden)
    if fam.mlp_width_4h_when_unset and cfg.n_inner is None:
        inter = 4 * hidden
    act = _get(cfg, "hidden_act", "activation_function", "feed_forward_proj", "hidden_activation", "activation")
    prefix = fam.gated_act_prefix
    if prefix and str(act).startswith(prefix):  # T5 v1.1 "gated-gelu"; original T5's "relu" is a plain MLP
        mlp, act = "gated", str(act)[len(prefix):]
    max_pos = _get(cfg, *POSITIONS, default=0)
    if arch == "encoder-decoder" and not max_pos:
        max_pos = 512  # T5 has relative positions; 512 is its pre-training length
    vision = arch == "vision"
    return dict(
        arch=arch, mlp=mlp, norm=fam.norm, position=fam.position, activation=str(act),
        num_layers=int(_get(cfg, *LAYERS)),
        num_decoder_layers=int(_get(cfg, "num_decoder_layers", "decoder_layers", default=0) or 0) if arch == "encoder-decoder" else 0,
        hidden_size=int(hidden), num_heads=int(heads), num_kv_heads=int(_get(cfg, *KV_HEADS, default=heads)),
        head_dim=int(_get(cfg, *HEAD_DIM, default=hidden // heads)), intermediate_size=int(inter),
        vocab_size=int(_get(cfg, "vocab_size", default=0)), max_position=int(max_pos),
        hidden_dropout=float(_get(cfg, "hidden_dropout_prob", "resid_pdrop", "dropout", "dropout_rate",
                                  "hidden_dropout", default=0.0)),
        attention_dropout=float(_get(cfg, "attention_probs_dropout_prob", "attn_pdrop", "attention_dropout",
                                     "dropout_rate", default=0.0)),
        tie_embeddings=bool(_get(cfg, "tie_word_embeddings", default=False)) and head in LM_HEADS,
        num_experts=int(_get(cfg, *EXPERTS, default=0)),
        experts_per_token=int(_get(cfg, "num_experts_per_tok", default=0)),
        num_labels=int(cfg.num_labels) if head in ("sequence-classification", "token-classification",
                                                    "image-classification") else 0,
        image_size=int(_get(cfg, "image_size", default=0)) if vision else 0,
        patch_size=int(_get(cfg, "patch_size", default=0)) if vision else 0,
        num_channels=int(_get(cfg, "num_channels", default=0)) if vision else 0,
        sliding_window=_get(cfg, "sliding_window") if getattr(cfg, "use_sliding_window", True) else None,
        final_logit_softcapping=_get(cfg, "final_logit_softcapping"),
        attn_logit_softcapping=_get(cfg, "attn_logit_softcapping"),
    ) | _layer_fields(cfg) | _moe_fields(cfg) | _mla_fields(cfg) | _kv_fields(cfg)


def _layer_fields(cfg: Any) -> dict[str, Any]:
    """Per-layer attention kinds (config.layer_types, which transformers 5 fills in for the families that mix
    them) and Llama 4's attention chunk."""
    types = getattr(cfg, "layer_types", None) or ()
    out = dict(layer_types=tuple(str(t) for t in types), attention_chunk_size=_get(cfg, "attention_chunk_size"))
    if family(cfg.model_type).qk_norm == "l2":  # Llama4TextAttention: qk_norm only if use_qk_norm and use_rope
        # no_rope_layers: 1 = RoPE
        out["qk_norm_layer_ids"] = tuple(i for i, r in enumerate(cfg.no_rope_layers) if r and cfg.use_qk_norm)
    return out


def _moe_fields(cfg: Any) -> dict[str, Any]:
    """The experts' and shared experts' widths and the dense layers of a MoE model, whatever each family calls
    them (configuration_{qwen3_moe,deepseek_v3,glm4_moe,llama4}.py of transformers 5.23)."""
    if not is_moe_config(cfg):
        return {}
    L = int(_get(cfg, *LAYERS))
    expert = _get(cfg, "moe_intermediate_size", default=0)
    shared = _get(cfg, "n_shared_experts", default=0) * expert
    first_k = _get(cfg, "first_k_dense_replace", default=0)
    mlp_only, step = set(_get(cfg, "mlp_only_layers", default=())), _get(cfg, "decoder_sparse_step", default=1)
    # Qwen3-MoE: layer i has experts unless in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    dense = tuple(i for i in range(L) if i < first_k or i in mlp_only or (i + 1) % step)
    moe_layers = _get(cfg, "moe_layers")
    if moe_layers is not None:  # Llama 4: the experts are intermediate_size, dense layers intermediate_size_mlp
        routed = set(moe_layers)
        expert, shared, dense = cfg.intermediate_size, cfg.intermediate_size, tuple(
            i for i in range(L) if i not in routed)
    out = dict(expert_intermediate_size=int(expert), shared_expert_intermediate_size=int(shared), dense_layer_ids=dense)
    if moe_layers is not None:
        out["intermediate_size"] = int(cfg.intermediate_size_mlp)
    return out


def _mla_fields(cfg: Any) -> dict[str, Any]:
    """Multi-head latent attention's widths (transformers 5.23 configuration_deepseek_v3.py: q_lora_rank None
    means one q_proj; __post_init__ sets head_dim = qk_rope_head_dim, the rotary width, so the spec's head_dim
    is qk_head_dim = qk_nope_head_dim + qk_rope_head_dim, the query / key head width the attention runs at)."""
    kv_rank = _get(cfg, "kv_lora_rank")
    if not kv_rank:
        return {}
    rope, nope = int(cfg.qk_rope_head_dim), int(cfg.qk_nope_head_dim)
    return dict(kv_lora_rank=int(kv_rank), q_lora_rank=int(_get(cfg, "q_lora_rank", default=0)),
                qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=int(cfg.v_head_dim), head_dim=nope + rope)


def _kv_fields(cfg: Any) -> dict[str, Any]:
    """The code families' (issue 16) attention and layer facts that their configs name their own way
    (transformers 5.23 models/{starcoder2,gpt_bigcode,falcon}). GPTBigCodeConfig sets num_key_value_heads itself
    (1 under multi_query), which KV_HEADS reads. Starcoder2 calls its residual dropout residual_dropout.
    Falcon: the heads its attention and KV cache hold (FalconAttention.forward: num_heads under
    new_decoder_architecture, which broadcasts each kv head to its query group before the cache; 1 under
    multi_query; else num_kv_heads), its LayerNorms per layer (FalconDecoderLayer: one input_layernorm under
    parallel_attn without the new architecture, else two) and no attention-probability dropout with rotary
    positions (FalconAttention passes dropout_p=0.0 to SDPA and applies none in its eager path)."""
    out: dict[str, Any] = {}
    if cfg.model_type == "starcoder2":
        out["hidden_dropout"] = float(cfg.residual_dropout)
    if cfg.model_type != "falcon":
        return out
    new = bool(cfg.new_decoder_architecture)
    heads = cfg.num_attention_heads
    out["num_kv_heads"] = heads if new else 1 if cfg.multi_query else int(cfg.num_kv_heads)
    out["layer_norms"] = 1 if cfg.parallel_attn and not new else 2
    if not cfg.alibi:
        out["attention_dropout"] = 0.0
    return out


def meta_param_count(config: dict[str, Any], head: str) -> int:
    """sum(p.numel() for p in model.parameters()) of the meta-device model: the exactness oracle."""
    import torch
    import transformers

    cfg = load_config(config)
    if head in ("sequence-classification", "token-classification") and "num_labels" not in config:
        cfg.num_labels = DEFAULT_NUM_LABELS
    with torch.device("meta"):
        model = getattr(transformers, HEADS[head]).from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def is_moe_config(config: dict[str, Any] | Any) -> bool:
    """Whether a config (dict or transformers object) has routed experts."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return bool(get("num_local_experts") or get("n_routed_experts") or get("num_experts"))


def build_model(config: dict[str, Any] | Any, head: str | None, attn: str = "sdpa", trust_remote_code: bool = False,
                half_weights: bool = False, dtype=None):
    """The transformers model of `head` for this config, with random weights in the current device / mode; dtype:
    the parameters' dtype from the start (from_config's, as from_pretrained's: float buffers such as RoPE's
    inv_freq stay fp32), None: transformers' default (the config's dtype, else fp32).

    attn: transformers' attn_implementation ("eager", "sdpa", or "memplan": memplan.kernels' tiled
    attention; memplan's flash runs as sdpa with the flash kernel forced, which keeps the same tensors as
    FlashAttention-2)."""
    import transformers

    cfg, head = prepare_config(config, head, trust_remote_code)
    cfg = copy.deepcopy(cfg)
    auto = getattr(transformers, HEADS[head])
    impl = attn if attn in ("eager", "memplan") else "sdpa"
    if impl == "memplan":
        from memplan.kernels import register

        register()
    extra = {} if dtype is None else {"dtype": dtype}
    if is_moe_config(cfg) and not half_weights:
        # transformers' default MoE path (torch._grouped_mm) takes bf16 weights only; fp32 weights
        # (fp32 and autocast training) run the per-expert loop
        extra["experts_implementation"] = "eager"
    try:
        return auto.from_config(cfg, attn_implementation=impl, trust_remote_code=trust_remote_code, **extra), head
    except (ValueError, AssertionError) as e:
        raise UserError(f"transformers cannot build head {head!r}: {_last_line(e)}") from None


@contextlib.contextmanager
def quiet():
    """transformers' warnings about a built model (the reduced config's layer counts, an unset loss_type, a
    deprecated argument of its own generate) are not the user's business: its logger at ERROR and its
    FutureWarnings ignored while the model is built and run, both restored after (the trace; verify's runs)."""
    import warnings

    # transformers' own setter: its root logger is configured (to WARNING) on first use, which a level set on the
    # logging module's logger before that would not survive
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
            yield
    finally:
        hf_logging.set_verbosity(level)
