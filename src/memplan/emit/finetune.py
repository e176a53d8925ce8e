"""The fine-tuning method's files: lora_config.json (peft.LoraConfig), bnb_config.json
(transformers.BitsAndBytesConfig) and plan.json's `launch.freeze` (docs/emit.md, docs/finetune.md).

Every value is the one memplan's parameter table counted (memplan.estimator.finetune): the targets PEFT
resolves for the model type written out, the quantisation and its dtypes, the modules a frozen run trains."""

from __future__ import annotations

from memplan.estimator.finetune import ALL_LINEAR, Tuning, targets_of, tuned_params
from memplan.inputs.modelspec import ModelSpec

# torch dtype names (the strings transformers 5.23's BitsAndBytesConfig turns into dtypes with
# getattr(torch, name): quantization_config.py BitsAndBytesConfig.__init__)
DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "bf16-pure": "bfloat16", "uint8": "uint8"}
# peft 0.21 TaskType per memplan head: get_peft_model builds the matching PeftModelFor... class; for the
# classification heads that class adds "classifier" / "score" to modules_to_save, which memplan counts
# (estimator/finetune.py TASK_MODULES_TO_SAVE). Other heads get no task_type: a plain PeftModel, no
# module added.
TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS", "seq2seq-lm": "SEQ_2_SEQ_LM",
              "token-classification": "TOKEN_CLS"}


def adapters(plan) -> bool:
    return plan.workload.method in ("lora", "qlora")


def half_dtype(precision: str) -> str:
    """The dtype a LoRA / QLoRA base loads in: the precision's half type, float32 under fp32."""
    return DTYPE[precision]


def lora_config(plan, spec: ModelSpec) -> dict:
    """peft.LoraConfig keyword arguments. target_modules resolved: PEFT's default for the model type
    written out (the same list peft 0.21 would pick: TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING),
    or the string "all-linear"."""
    w = plan.workload
    targets = targets_of(spec, Tuning.of(w))
    alpha = int(w.lora_alpha) if float(w.lora_alpha).is_integer() else w.lora_alpha
    cfg: dict = {"r": w.lora_r, "lora_alpha": alpha, "lora_dropout": w.lora_dropout,
                 "target_modules": ALL_LINEAR if targets == (ALL_LINEAR,) else list(targets), "bias": "none"}
    if w.modules_to_save:
        cfg["modules_to_save"] = list(w.modules_to_save)
    if spec.head in TASK_TYPES:
        cfg["task_type"] = TASK_TYPES[spec.head]
    return cfg


def bnb_config(plan) -> dict:
    """transformers.BitsAndBytesConfig keyword arguments: 4-bit nf4 / fp4, or LLM.int8."""
    w = plan.workload
    if w.quant == "int8":
        return {"load_in_8bit": True}
    compute = half_dtype(w.precision) if w.compute_dtype == "auto" else DTYPE[w.compute_dtype]
    return {"load_in_4bit": True, "bnb_4bit_quant_type": w.quant, "bnb_4bit_use_double_quant": w.double_quant,
            "bnb_4bit_compute_dtype": compute, "bnb_4bit_quant_storage": DTYPE[w.quant_storage]}


def freeze_section(plan, spec: ModelSpec) -> dict | None:
    """plan.json's launch.freeze for --method freeze: the module paths train.py leaves trainable (the last
    K blocks of the stack next to the head, the head, the final norm) and modules_to_save, which train.py
    matches as PEFT does (a module on the parameter's path ends with the name). None for other methods."""
    w = plan.workload
    if w.method != "freeze":
        return None
    dec = spec.num_decoder_layers > 0
    blocks = spec.num_decoder_layers if dec else spec.num_layers
    k = min(w.trainable_layers, blocks)
    # the stack next to the head: the decoder's of an encoder-decoder (estimator/finetune.py _frozen_blocks)
    stacks = dict.fromkeys(g.module.split(".*", 1)[0] for g in spec.params
                           if "*" in g.module and (not dec or g.module.startswith("decoder.")))
    trained = [f"{s}.{i}" for s in stacks for i in range(blocks - k, blocks)]
    frozen = tuned_params(spec, Tuning.of(w))
    trained += [g.module for g in frozen if g.trainable and "*" not in g.module and g.category in ("head", "norms")]
    return {"trainable_layers": w.trainable_layers, "trainable_modules": list(dict.fromkeys(trained)),
            "modules_to_save": list(w.modules_to_save)}
