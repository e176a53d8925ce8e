"""The parameter table of a fine-tuning method: which tensors are trained, how each is stored on the GPU,
and the LoRA adapters PEFT adds (docs/finetune.md). No torch.

Sources (read for each rule): peft 0.21.2 (tuners/lora/model.py, tuners/lora/layer.py, tuners/tuners_utils.py
`_maybe_include_all_linear_layers`, utils/other.py `prepare_model_for_kbit_training` and
`ModulesToSaveWrapper`), bitsandbytes 0.50.2 (functional.py `quantize_4bit`, nn/modules.py `Int8Params`),
transformers 5.23 (integrations/bitsandbytes.py `replace_with_bnb_linear`, quantizers/base.py
`get_keys_to_not_convert`).

- full: the model's table as it is.
- freeze: the last K blocks of the stack next to the head, the head (and the final norm) trainable; the
  rest, embeddings included, frozen unless named in modules_to_save. Stored as in full fine-tuning.
- lora: every base parameter frozen and stored in the load dtype (the precision's half type, or fp32);
  for each targeted linear weight (out x in) an A (r x in) and a B (out x r) adapter, up-cast to fp32
  (LoraConfig.autocast_adapter_dtype=True) and trained.
- qlora: as lora, and the linear layers transformers converts (`type(module) is nn.Linear` or Conv1D, not
  in spec.unquantised) stored as bitsandbytes 4-bit (or LLM.int8) weights; prepare_model_for_kbit_training
  casts every other fp16 / bf16 parameter to fp32.
- modules_to_save (and, for classification heads, PEFT's own "classifier" / "score"): PEFT's
  ModulesToSaveWrapper keeps the original module (frozen) and trains a deep copy: both are on the GPU.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from memplan.estimator.families import family
from memplan.estimator.rules import (
    DYNAMIC_CODE_BYTES, FP32, HALF, INT8_SCALE_BYTES, NF4_BLOCK, NF4_CODE_BYTES, NF4_NESTED_BLOCK, PRECISIONS,
)
from memplan.inputs.modelspec import LM_HEADS, ModelSpec, ParamGroup

ALL_LINEAR = "all-linear"
# PEFT's task type per memplan head, and the modules its PeftModel class adds to modules_to_save (peft
# 0.21 peft_model.py: PeftModelForSequenceClassification / ForTokenClassification classifier_module_names,
# ForQuestionAnswering qa_module_names). The emitted lora_config.json and verify pass the same task type.
PEFT_TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "causal-lm": ("CAUSAL_LM", ()), "seq2seq-lm": ("SEQ_2_SEQ_LM", ()),
    "sequence-classification": ("SEQ_CLS", ("classifier", "score")),
    "token-classification": ("TOKEN_CLS", ("classifier", "score")),
    "question-answering": ("QUESTION_ANS", ("qa_outputs",)),
}
# Linears that read an inner tensor of their block (the attention context, the MLP intermediate), not the
# block's normed input: their LoRA input is not shared with the q / k / v or up projections.
OUTPUT_PROJECTIONS = frozenset({"o_proj", "out_proj", "o", "out_lin", "c_proj", "dense", "wo", "down_proj", "fc2",
                                "dense_4h_to_h", "lin2"})


def uses_adapters(method: str) -> bool:
    """Whether the fine-tuning method adds LoRA adapters (lora, and qlora over its quantised base)."""
    return method in ("lora", "qlora")


class Tuning(NamedTuple):
    """Every workload field the fine-tuning table reads (a frozen, hashable cache key)."""

    method: str
    half_load: bool  # lora / qlora: the base is loaded in the precision's half type (else fp32)
    r: int
    targets: tuple[str, ...]
    modules_to_save: tuple[str, ...]
    quant: str
    double_quant: bool
    trainable_layers: int

    @classmethod
    def of(cls, w) -> "Tuning":
        return cls(w.method, load_dtype(w) != "fp32", w.lora_r, w.lora_targets, w.modules_to_save, w.quant,
                   w.double_quant, w.trainable_layers or 0)

    @property
    def adapters(self) -> bool:
        return uses_adapters(self.method)


def load_dtype(w) -> str:
    """The dtype the model's weights load in ("fp32", "fp16", "bf16"): LoRA and QLoRA load the frozen base in
    the precision's half type (fp32 under fp32); full fine-tuning and freeze hold fp32 weights (autocast makes
    the half copies), except pure bf16 training."""
    half = PRECISIONS[w.precision].half
    if uses_adapters(w.method):
        return half or "fp32"
    return "bf16" if w.precision == "bf16-pure" else "fp32"


def compute_dtype(w) -> str:
    """bnb_4bit_compute_dtype: the user's, or ("auto") the precision's half type, fp32 under fp32."""
    return w.compute_dtype if w.compute_dtype != "auto" else (PRECISIONS[w.precision].half or "fp32")


def default_targets(spec: ModelSpec) -> tuple[str, ...]:
    """The target_modules PEFT applies by default for the model type; () where it applies none."""
    return family(spec.model_type).lora_targets


def targets_of(spec: ModelSpec, t: Tuning) -> tuple[str, ...]:
    return t.targets or default_targets(spec)


def linear_names(spec: ModelSpec) -> list[str]:
    """The last path component of every linear layer of the model, in table order, once each."""
    return list(dict.fromkeys(g.module.rsplit(".", 1)[-1] for g in spec.params if g.weight_of))


def matches(path: str, names: tuple[str, ...]) -> bool:
    """PEFT's target_modules test on a module path: the name is the whole path or its dotted suffix
    (tuners_utils.check_target_module_exists)."""
    return any(path == n or path.endswith("." + n) for n in names)


def under(path: str, names: tuple[str, ...]) -> bool:
    """PEFT's modules_to_save test: some module on the path (the module itself or an ancestor) ends with
    one of the names (utils/other.py _set_trainable: key.endswith(target_key))."""
    parts = path.split(".")
    return any(".".join(parts[:i]).endswith(n) for i in range(1, len(parts) + 1) for n in names)


def is_output_layer(spec: ModelSpec, g: ParamGroup) -> bool:
    """The LM head that produces the vocabulary logits: all-linear leaves it out (PEFT excludes the
    model's output embeddings)."""
    return g.category == "head" and spec.vocab_size in g.shape and spec.head in LM_HEADS


def in_saved(path: str, names: tuple[str, ...]) -> bool:
    """PEFT never puts an adapter on or under a modules_to_save module: a whole path component sequence
    equals the name (tuners_utils.check_target_module_exists, regex (^|.*\\.)NAME($|\\..*))."""
    parts = path.split(".")
    return any(".".join(parts[i:j]) == n for n in names for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))


def unadapted_target(spec: ModelSpec, targets: tuple[str, ...]) -> tuple[str, str] | None:
    """The first LoRA target (other than all-linear) that names a module owning parameters but no linear weight (an
    embedding, a convolution, a norm; a MoE layer's fused experts aside), with that module's path: PEFT 0.21 puts its
    own embedding or convolution LoRA there (tuners/lora/layer.py dispatch_default) or refuses it, and memplan models
    the linear layers' adapters and the fused experts' only."""
    linear: dict[str, bool] = {}
    for p in spec.params:
        linear[p.module] = linear.get(p.module, False) or bool(p.weight_of) or p.category == "experts"
    for t in targets:
        if t == ALL_LINEAR:
            continue
        module = next((mod for mod, lin in linear.items() if not lin and matches(mod, (t,))), None)
        if module is not None:
            return t, module
    return None


def wrapped_adapter(spec: ModelSpec, targets: tuple[str, ...], modules_to_save: tuple[str, ...]) -> str | None:
    """A linear PEFT adapts and a modules_to_save wrapper then wraps, which get_peft_model refuses (TypeError:
    "modules_to_save cannot be applied to modules of type ...Linear", utils/other.py); None where there is none.
    The adapters skip a module whose path holds a modules_to_save name as whole components (in_saved), the task's
    names only for sequence classification, whose model adds them to the config before injecting the adapters
    (peft_model.py PeftModelForSequenceClassification; token classification and question answering add theirs
    after); the wrapper takes any module whose path ends with a name (under). Traced: DistilBERT's pre_classifier
    under all-linear (it ends with "classifier"), BERT's token classifier under all-linear."""
    names, wrap = targets or default_targets(spec), wrapped_names(spec, modules_to_save)
    skip = wrap if PEFT_TASKS.get(spec.head, ("", ()))[0] == "SEQ_CLS" else modules_to_save
    for g in spec.params:
        if not g.weight_of or in_saved(g.module, skip) or g.module.rsplit(".", 1)[-1] in renamed_targets(spec):
            continue
        targeted = not is_output_layer(spec, g) if names == (ALL_LINEAR,) else matches(g.module, names)
        if targeted and under(g.module, wrap):
            return g.module
    return None


def adapted(spec: ModelSpec, t: Tuning, g: ParamGroup) -> bool:
    """Whether LoRA adapts the linear whose weight is `g`."""
    if not g.weight_of or in_saved(g.module, saved_modules(spec, t)):
        return False
    names = targets_of(spec, t)
    if g.module.rsplit(".", 1)[-1] in renamed_targets(spec):
        # PEFT moved the name to target_parameters (the fused experts): no nn.Linear of it keeps an adapter
        return False
    if names == (ALL_LINEAR,):
        # PEFT excludes the output embedding; for SEQ_CLS its classifier / score, which modules_to_save
        # holds anyway (tuners_utils._maybe_include_all_linear_layers)
        return not is_output_layer(spec, g)
    return matches(g.module, names)


def moe_targets(spec: ModelSpec, t: Tuning) -> set[str]:
    """The fused MoE parameters ("router", "gate_up", "down") PEFT adapts for these targets."""
    table = dict(family(spec.model_type).lora_fused_experts)
    names = targets_of(spec, t)
    return set(table.values()) if names == (ALL_LINEAR,) else {table[n] for n in names if n in table}


def renamed_targets(spec: ModelSpec) -> tuple[str, ...]:
    """The v4 target names PEFT moves from target_modules to the fused MoE tensors, by model type
    (families.Family.lora_fused_experts), whether or not this model's layers have experts."""
    return tuple(n for n, _ in family(spec.model_type).lora_fused_experts)


def fused_names(spec: ModelSpec) -> tuple[str, ...]:
    """The renamed targets that adapt something: none where the model has no experts (PEFT then finds no target,
    NoMatchingPeftModuleError)."""
    return renamed_targets(spec) if any(g.category == "experts" for g in spec.params) else ()


def unpaired_fused(spec: ModelSpec, names: tuple[str, ...]) -> tuple[str, str, str] | None:
    """(named, missing, fused) where `names` names one of two targets PEFT fuses into one tensor without the other
    (w1 without w3, gate_proj without up_proj): PEFT 0.21 raises ValueError there, by model type ("Cannot convert
    PEFT target(s) w1 without also targeting w3 because they are fused into gate_up_proj"; checked on mixtral-small,
    glm4_moe-small and DeepSeek-V3 cut to dense blocks). None where it can run."""
    if names == (ALL_LINEAR,):
        return None
    table = family(spec.model_type).lora_fused_experts
    for name, fused in table:
        missing = [n for n, f in table if f == fused and n not in names]
        if name in names and missing:
            return name, missing[0], fused
    return None


def moe_adapters(spec: ModelSpec, t: Tuning, g: ParamGroup) -> list[ParamGroup]:
    """PEFT's ParamWrapper LoRA on a fused expert tensor (E, out, in): A (E*r, in) and B (out, E*r), r
    doubled on gate_up_proj (w1 and w3, rank_pattern); on the router weight (E, in): A (r, in), B (E, r)."""
    kinds = moe_targets(spec, t) if t.adapters else set()
    if g.category == "router" and "router" in kinds:
        return _lora_pair(g, g.shape[1], g.shape[0], t.r)
    if g.category != "experts" or len(g.shape) != 3:
        return []
    e, n_out, n_in = g.shape
    # by (out, in): gate_up (2 f, h), down (h, f); the out side alone is ambiguous where h = 2 f (deepseek_v3-moe-small)
    kind = "gate_up" if (n_out, n_in) == (2 * spec.expert_width, spec.hidden_size) else "down"
    return _lora_pair(g, n_in, n_out, e * t.r * (2 if kind == "gate_up" else 1)) if kind in kinds else []


def _lora_pair(g: ParamGroup, n_in: int, n_out: int, r: int) -> list[ParamGroup]:
    """The adapter of group g, in the blocks that hold it."""
    return [ParamGroup(category="adapter", shape=(r, n_in), count=g.count, module=g.module + ".lora_A",
                       weight_of="Linear", store="fp32", layers=g.layers),
            ParamGroup(category="adapter", shape=(n_out, r), count=g.count, module=g.module + ".lora_B",
                       weight_of="Linear", store="fp32", layers=g.layers)]


def quantised(spec: ModelSpec, g: ParamGroup) -> bool:
    """transformers converts nn.Linear and Conv1D layers outside get_keys_to_not_convert's modules and the
    model's _keep_in_fp32_modules (quantizers_utils.should_convert_module: prefix at a module boundary, or
    suffix)."""
    keep = spec.unquantised
    return bool(g.weight_of) and not any(g.module == k or g.module.startswith(k + ".") or g.module.endswith(k)
                                         for k in keep)


def in_out(g: ParamGroup) -> tuple[int, int]:
    """(in_features, out_features) of a linear weight: nn.Linear stores out x in, Conv1D in x out."""
    return (g.shape[0], g.shape[1]) if g.weight_of == "Conv1D" else (g.shape[1], g.shape[0])


def saved_modules(spec: ModelSpec, t: Tuning) -> tuple[str, ...]:
    return wrapped_names(spec, t.modules_to_save) if t.adapters else t.modules_to_save


def wrapped_names(spec: ModelSpec, modules_to_save: tuple[str, ...]) -> tuple[str, ...]:
    """The names PEFT's modules_to_save wrappers take under LoRA: the user's and the task's (PEFT_TASKS)."""
    return modules_to_save + PEFT_TASKS.get(spec.head, ("", ()))[1]


@lru_cache(maxsize=1024)
def tuned_params(spec: ModelSpec, t: Tuning) -> tuple[ParamGroup, ...]:
    """The GPU's parameter table under the method: frozen, trained, quantised and added tensors."""
    if t.method == "full":
        return spec.params
    if t.method == "freeze":
        return _frozen_blocks(spec, t)
    return _with_adapters(spec, t)


def _frozen_blocks(spec: ModelSpec, t: Tuning) -> tuple[ParamGroup, ...]:
    """freeze: the groups of the stack next to the head split into the last K blocks (trained) and the rest
    (frozen); every other group trained or frozen whole (freeze_trains)."""
    blocks = stack_blocks(spec)
    out: list[ParamGroup] = []
    for g in spec.params:
        if not (head_stack(spec, g.module) and not under(g.module, t.modules_to_save)):
            out.append(g.model_copy(update={"trainable": freeze_trains(spec, t, g, -1)}))
            continue
        # a group in some blocks only (ParamGroup.layers: a MoE model's experts, its dense layers' MLP): its tensors
        # in the trained ones (a DeepSeek-V3 freeze counted none of its experts trainable, the count over every block
        # rounding down to 0)
        held = g.holding(blocks)
        k = g.count // len(held) * sum(1 for b in held if b >= blocks - trained_blocks(spec, t))
        out += [g.model_copy(update={"count": k, "trainable": True})] if k else []
        out += [g.model_copy(update={"count": g.count - k, "trainable": False})] if g.count > k else []
    return tuple(out)


def freeze_trains(spec: ModelSpec, t: Tuning, g: ParamGroup, block: int) -> bool:
    """freeze's rule for one parameter (a group's category, shape and module path; block: the index of its
    block in its stack, -1 outside the blocks): the last K blocks of the stack next to the head, the head,
    the final norm, the tied embedding (the head's weight) and modules_to_save. verify and the emitted
    train.py apply it to the real model."""
    if under(g.module, t.modules_to_save):
        return True
    if "*" in g.module:
        return head_stack(spec, g.module) and block >= stack_blocks(spec) - t.trainable_layers
    return g.category == "head" or final_norm(spec, g) or tied_embedding(spec, g)


def head_stack(spec: ModelSpec, module: str) -> bool:
    """A module of a block of the stack next to the head (the decoder's of an encoder-decoder)."""
    return "*" in module and (not spec.num_decoder_layers or in_decoder(spec, module))


def in_decoder(spec: ModelSpec, module: str) -> bool:
    """A module of an encoder-decoder's decoder: a `decoder` in its path (T5's decoder.block.*, BART's
    model.decoder.layers.*)."""
    return bool(spec.num_decoder_layers) and "decoder" in module.split(".")


def stack_blocks(spec: ModelSpec) -> int:
    """Blocks in the stack next to the head."""
    return spec.num_decoder_layers or spec.num_layers


def trained_blocks(spec: ModelSpec, t: Tuning) -> int:
    """freeze: how many blocks of the stack next to the head are trained (the last K, at most all)."""
    return min(t.trainable_layers, stack_blocks(spec))


def final_norm(spec: ModelSpec, g: ParamGroup) -> bool:
    """The norm between the stack next to the head and the head: outside the blocks, not the embeddings'
    LayerNorm (BERT, DistilBERT), and of an encoder-decoder the decoder's (T5's encoder.final_layer_norm
    feeds the cross-attention, not the head)."""
    return (g.category == "norms" and "*" not in g.module and "embed" not in g.module
            and (spec.num_decoder_layers == 0 or in_decoder(spec, g.module)))


def tied_embedding(spec: ModelSpec, g: ParamGroup) -> bool:
    """The input embedding a tied output embedding shares its weight with (transformers ties the
    tensors: training the head trains it)."""
    return spec.tie_embeddings and g.category == "embeddings" and g.shape[:1] == (spec.vocab_size,)


def tied_modules(spec: ModelSpec) -> tuple[str, ...]:
    """Modules whose weight is another module's (the tied output embedding, T5's encoder / decoder
    embed_tokens): get_keys_to_not_convert lists them, the table has no group of theirs (named_parameters
    yields a tied tensor once)."""
    own = {g.module for g in spec.params}
    return tuple(k for k in spec.unquantised if spec.tie_embeddings and k not in own and "*" not in k
                 and not k.endswith((".bias", ".weight")) and not any(m.startswith(k + ".") for m in own))


def records_frozen_blocks(spec: ModelSpec, t: Tuning) -> bool:
    """Whether autograd records the frozen blocks: under LoRA each has adapters; under freeze only when a
    tensor before them requires a gradient, i.e. a trained embedding (a tied head's matrix, or
    modules_to_save), or a module inside the blocks that modules_to_save trains in every block; else the frozen
    blocks before the trained ones record nothing."""
    return t.method != "freeze" or trains_embeddings(spec, t) or any(
        "*" in g.module and under(g.module, t.modules_to_save) for g in spec.params)


def recorded_layers(spec: ModelSpec, t: Tuning) -> int:
    """Layers that have a backward: all of them, but under freeze without a trained embedding only the trained
    blocks (records_frozen_blocks; timeline.block_table's recorded flag)."""
    return spec.total_layers if records_frozen_blocks(spec, t) else trained_blocks(spec, t)


def cast_kept(spec: ModelSpec, t: Tuning, g: ParamGroup) -> bool:
    """Whether the half copy autocast makes of this fp32 weight lives through backward. Autocast caches the
    cast of a weight that requires a gradient (ATen autocast_mode.cpp cached_cast: leaf tensors that require
    grad); a frozen weight's cast is transient unless its matmul saves it for the input's gradient, in the
    blocks autograd records (records_frozen_blocks)."""
    return g.trainable or records_frozen_blocks(spec, t)


def has_module(spec: ModelSpec, name: str) -> bool:
    """Some module of the model ends with `name` (modules_to_save's test): a group's, or a tied module's,
    which has no group of its own."""
    return any(under(path, (name,)) for path in [g.module for g in spec.params] + list(tied_modules(spec)))


def _tied_copies(spec: ModelSpec, saved: tuple[str, ...], store: str) -> list[ParamGroup]:
    """ModulesToSaveWrapper deep-copies a tied module too: the copy owns a tensor of the embedding's shape."""
    emb = next((g for g in spec.params if tied_embedding(spec, g)), None)
    return [emb.model_copy(update={"trainable": True, "store": store, "count": 1, "module": k + ".modules_to_save"})
            for k in tied_modules(spec) if emb is not None and under(k, saved)]


def _with_adapters(spec: ModelSpec, t: Tuning) -> tuple[ParamGroup, ...]:
    """lora / qlora: the frozen base in its storage, the adapters, the trained copies of modules_to_save."""
    base_store = "half" if t.half_load else "fp32"
    float_store = "fp32" if t.method == "qlora" else base_store  # prepare_model_for_kbit_training
    quant_store = "int8" if t.quant == "int8" else ("4bit-dq" if t.double_quant else "4bit")
    saved = saved_modules(spec, t)
    out: list[ParamGroup] = []
    for g in spec.params:
        store = quant_store if t.method == "qlora" and quantised(spec, g) else float_store
        out.append(g.model_copy(update={"trainable": False, "store": store}))
        if under(g.module, saved):
            out.append(g.model_copy(update={"trainable": True, "store": float_store,
                                            "module": g.module + ".modules_to_save"}))
        if adapted(spec, t, g):
            out += _lora_pair(g, *in_out(g), t.r)
        out += moe_adapters(spec, t, g)
    return tuple(out + _tied_copies(spec, saved, float_store))


def params_trainable(spec: ModelSpec, t: Tuning) -> int:
    """What PEFT's get_nb_trainable_parameters() reports (its first number)."""
    return sum(g.total for g in tuned_params(spec, t) if g.trainable)


# -- bytes on the GPU ---------------------------------------------------------------------------------
def stored_tensors(g: ParamGroup, model_bytes: float) -> list[tuple[float, int]]:
    """(bytes, count) of the tensors one group occupies on the GPU. model_bytes: the training precision's
    parameter width (store "model").
    - nf4 / fp4 (bitsandbytes functional.quantize_4bit, blocksize 64): the packed weight, 2 values per
      byte whatever quant_storage's dtype; the 16-entry fp32 code (get_4bit_type makes one per weight);
      absmax fp32 per block of 64, or with double quantisation (compress_statistics) uint8 per block plus
      its own fp32 absmax per block of 256, an fp32 offset and the 256-entry fp32 dynamic map of the nested
      state (quantize_blockwise: `code=code.to(A.device, copy=True)`, a copy per weight, not the cached
      name2qmap tensor).
    - int8 (Int8Params, int8_vectorwise_quant): the int8 weight and one fp32 scale (SCB) per output row."""
    n, c = g.numel, g.count
    if g.store in ("4bit", "4bit-dq"):
        blocks = -(-n // NF4_BLOCK)
        packed = [(-(-n // 2), c), (NF4_CODE_BYTES, c)]
        if g.store == "4bit":
            return packed + [(FP32 * blocks, c)]
        return packed + [(blocks, c), (FP32 * -(-blocks // NF4_NESTED_BLOCK), c), (FP32, c), (DYNAMIC_CODE_BYTES, c)]
    if g.store == "int8":
        rows = g.shape[0] if g.weight_of != "Conv1D" else g.shape[1]
        return [(n, c), (INT8_SCALE_BYTES * rows, c)]
    return [(n * element_bytes(g, model_bytes), c)]


def element_bytes(g: ParamGroup, model_bytes: float) -> float:
    """Bytes per element of a float parameter (and of its gradient and Adam moments); 0 for a quantised one."""
    return {"fp32": FP32, "half": HALF, "model": model_bytes}.get(g.store, 0)


# -- what the adapters add to a block's activations (estimator/activations.py lora_terms) -------------------
class AdapterInput(NamedTuple):
    """The adapted linears of one block that read one tensor."""

    width: int  # in_features
    inner: bool  # reads an inner tensor (context, MLP intermediate: matmul width), else the block's normed input
    count: int  # adapted linears per block reading it
    layers: tuple[int, ...] = ()  # the blocks of its stack that have them (ParamGroup.layers); (): every block


class LoraActs(NamedTuple):
    """The adapters of the method, per block, as the activation model needs them (hashable: ActsKey)."""

    r: int
    dropout: bool
    layer: tuple[AdapterInput, ...]  # an encoder or decoder-only block
    decoder_layer: tuple[AdapterInput, ...]  # a decoder block of an encoder-decoder
    head: tuple[AdapterInput, ...]  # adapted linears outside the blocks (a pooler, a classifier)
    # qlora: bytes of the largest quantised weight dequantised in its linear's backward (dequant_bytes); 0 for lora
    dequant: int = 0
    int8: bool = False  # LLM.int8 keeps each quantised linear's input
    # the adapters' width at compute time: fp32 (PEFT's autocast_adapter_dtype), half in a half model -
    # DeepSpeed casts every float parameter to half, FSDP2 gathers in param_dtype (docs/finetune.md)
    adapter_bytes: int = FP32
    # bytes a block (the layers' mean) keeps of PEFT's merged fused-expert weights: ParamWrapper swaps each adapted
    # expert tensor for W + B A while the experts run (lora/layer.py ParamWrapper._activate_lora; traced: one
    # baddbmm output per adapted tensor, in the compute width, which the grouped matmul saves)
    merged_experts: float = 0.0

    def at_layer(self, i: int) -> "LoraActs":
        """Block i's own adapters (where the layers differ: activations.layer_kinds), each in every block it names."""
        return self._replace(layer=tuple(a._replace(layers=()) for a in self.layer if not a.layers or i in a.layers))


def lora_acts(spec: ModelSpec, t: Tuning, dropout: float, compute_bytes: int = HALF,
              adapter_bytes: int = FP32) -> LoraActs | None:
    """The adapted linears grouped by block and by the tensor they read (same parent module, same width)."""
    if not t.adapters:
        return None
    stacks: dict[str, dict[tuple[str, int, bool], int]] = {"layer": {}, "decoder_layer": {}, "head": {}}
    for g in spec.params:
        if not adapted(spec, t, g):
            continue
        parent, leaf = g.module.rpartition(".")[::2]
        n_in, _ = in_out(g)
        # a group in some blocks only (the experts, a MoE model's dense MLP): per block that has it
        key = (parent, n_in, leaf in OUTPUT_PROJECTIONS, g.layers)
        if "*" not in g.module:
            stack, per = "head", g.count
        elif in_decoder(spec, g.module):
            stack, per = "decoder_layer", g.count // len(g.holding(spec.num_decoder_layers))
        else:
            stack, per = "layer", g.count // len(g.holding(spec.num_layers))
        stacks[stack][key] = stacks[stack].get(key, 0) + per
    pack = lambda d: tuple(AdapterInput(w, inner, n, held) for (_, w, inner, held), n in sorted(d.items()))  # noqa: E731
    merged = sum(g.numel * g.count for g in spec.params if g.category == "experts" and moe_adapters(spec, t, g))
    return LoraActs(t.r, dropout > 0, pack(stacks["layer"]), pack(stacks["decoder_layer"]), pack(stacks["head"]),
                    dequant_bytes(spec, t, compute_bytes), t.method == "qlora" and t.quant == "int8",
                    adapter_bytes, compute_bytes * merged / spec.num_layers)


def dequant_bytes(spec: ModelSpec, t: Tuning, compute: int) -> int:
    """The largest quantised weight as its linear's backward dequantises it for the input's gradient
    (bitsandbytes 0.50.2 autograd/_functions.py; the CUDA and CPU backends run the same Python here):
    - 4-bit, MatMul4Bit.backward: dequantize_4bit(B, state).to(grad_output.dtype): the weight in
      quant_state.dtype (the dtype it was loaded in, nn/modules.py Params4bit._quantize), and a second copy
      in the compute dtype while .to() runs if they differ (bnb_4bit_compute_dtype fp32 over a half base);
    - LLM.int8, MatMul8bitLt.backward: state.CB.to(ctx.dtype_A, copy=True).mul_(SCB ...): in the input's
      dtype, fp32 under QLoRA (prepare_model_for_kbit_training's fp32 residual stream, fp32 MLP inputs).
    Its forward materialises the 4-bit weight too where CUDA's gemm_4bit falls back to dequantise + linear
    (backends/cuda/ops.py, above 512 to 1536 rows), freed before the next layer: never at a modelled peak."""
    if t.method != "qlora":
        return 0
    numel = max((g.numel for g in spec.params if quantised(spec, g)), default=0)
    if t.quant == "int8":
        return numel * FP32
    load = HALF if t.half_load else FP32
    return numel * (load + (compute if compute != load else 0))


def compute_bytes(w) -> int:
    """Width of bnb_4bit_compute_dtype."""
    return FP32 if compute_dtype(w) == "fp32" else HALF


def trains_embeddings(spec: ModelSpec, t: Tuning) -> bool:
    """Whether a tensor the embeddings make requires a gradient (a trained embedding, or full fine-tuning):
    otherwise autograd records nothing before the first trained block or adapter."""
    return t.method == "full" or any(g.trainable and g.category == "embeddings" for g in tuned_params(spec, t))


# not linear layers by design (no method quantises them; QLoRA up-casts them to fp32 like the rest): the
# note is about parameters a quantiser would be expected to take and cannot
_NOT_LINEAR_BY_DESIGN = ("embeddings", "norms", "head", "adapter", "router")


def unquantised_note(spec: ModelSpec, t: Tuning) -> str | None:
    """QLoRA quantises only linear layers (transformers' bnb quantizer replaces nn.Linear / Conv1D):
    parameters held another way - transformers 5 fuses a MoE layer's experts into 3-D nn.Parameters -
    stay in the load dtype, and prepare_model_for_kbit_training (peft 0.21.2 utils/other.py) up-casts
    every fp16 / bf16 parameter that is not Params4bit to fp32. Said when that is over 1 % of the model."""
    if t.method != "qlora":
        return None
    bulk = [g for g in tuned_params(spec, t) if not g.weight_of and g.category not in _NOT_LINEAR_BY_DESIGN]
    n = sum(g.total for g in bulk)
    if n <= 0.01 * spec.params_total:
        return None
    where = ", ".join(dict.fromkeys(g.module for g in bulk))
    return (f"4-bit quantisation leaves {n / 1e9:.1f}B parameters that are not linear layers unquantised ({where}); "
            "prepare_model_for_kbit_training up-casts them to fp32")


def assumed(spec: ModelSpec, w, given: set[str], half_model: bool | None = False) -> list[str]:
    """The defaults line's items for the method knobs `w` holds but the user did not give (`given`: the
    field names given): PEFT's LoraConfig defaults, memplan's QLoRA quantisation, and what the method
    always assumes (the adapters' dtype, which embeddings freeze trains). half_model: DeepSpeed or FSDP2 run
    the model in half (states.half_model); None: that depends on the plan (suggest), and the adapters'
    dtype is not said."""
    from memplan.inputs.workload import QUANT_KNOBS  # here: workload imports constraints, which imports this module

    said: list[str] = []
    if uses_adapters(w.method):
        if "lora_targets" not in given and default_targets(spec):
            said.append(f"LoRA targets {','.join(default_targets(spec))} (PEFT's default for {spec.model_type}; "
                        "--lora-targets)")
        knobs = [f"{name} {getattr(w, 'lora_' + name):g}" for name in ("r", "alpha", "dropout")
                 if "lora_" + name not in given]
        if knobs:
            said.append(f"LoRA {', '.join(knobs)} (LoraConfig's defaults)")
        if half_model is not None:
            said.append("adapters half in the model, fp32 in the optimizer (DeepSpeed / FSDP2 mixed precision)"
                        if half_model else "adapters fp32 (PEFT's autocast_adapter_dtype)")
    # LLM.int8 (--quant int8, never a default) reads none of the 4-bit settings: nothing to say
    if w.method == "qlora" and w.quant != "int8" and not set(QUANT_KNOBS) <= given:
        items = {"quant": w.quant, "double_quant": "double quantisation" if w.double_quant else "no double quantisation",
                 "compute_dtype": f"compute dtype {compute_dtype(w)}", "quant_storage": f"storage {w.quant_storage}"}
        quant = [item for knob, item in items.items() if knob not in given]
        said.append(f"{', '.join(quant)} (memplan's defaults, after QLoRA: BitsAndBytesConfig's own are fp4 without "
                    "double quantisation, computing in fp32, storage uint8; --quant, --double-quant, --compute-dtype, "
                    "--quant-storage)")
    if w.method == "freeze" and "modules_to_save" not in given:
        # a tied head's weight is its input embedding: freeze trains that one tensor with the head (freeze_trains)
        tied = [g.module for g in spec.params if tied_embedding(spec, g)]
        said.append(f"embeddings frozen but {tied[0]}, the tied head's weight, trained with it (--modules-to-save to "
                    "train others)" if tied else "embeddings frozen (--modules-to-save to train them)")
    return said
