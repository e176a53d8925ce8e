"""The fine-tuning method's files: lora_config.json (peft.LoraConfig), bnb_config.json
(transformers.BitsAndBytesConfig) and plan.json's `launch.freeze` (docs/emit.md, docs/finetune.md).

Every value is the one memplan's parameter table counted (memplan.estimator.finetune): the targets PEFT
resolves for the model type written out, the quantisation and its dtypes, the modules a frozen run trains."""

from __future__ import annotations

from memplan.estimator.finetune import (
    ALL_LINEAR, PEFT_TASKS, Tuning, compute_dtype, freeze_trains, head_stack, stack_blocks, targets_of,
)
from memplan.estimator.rules import DTYPE_NAMES
from memplan.inputs.modelspec import ModelSpec, ParamGroup


def lora_kwargs(w, spec: ModelSpec, resolve_default: bool) -> dict:
    """peft.LoraConfig keyword arguments of a workload. target_modules: "all-linear", the workload's list, or,
    where it names none, PEFT's default for the model type written out (resolve_default: the emitted
    lora_config.json, the same list peft 0.21 would pick, TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
    or None, for PEFT to apply its own as a script that names none does (verify; tests/test_finetune.py holds
    memplan's copy of those defaults to PEFT's). task_type from the head (estimator/finetune.py PEFT_TASKS:
    the PeftModel class, and the modules it adds to modules_to_save, which memplan counts); heads without one
    get a plain PeftModel."""
    names = targets_of(spec, Tuning.of(w)) if resolve_default else w.lora_targets
    if names == (ALL_LINEAR,):
        targets = ALL_LINEAR
    else:
        targets = list(names) if names or resolve_default else None
    alpha = int(w.lora_alpha) if float(w.lora_alpha).is_integer() else w.lora_alpha
    cfg: dict = {"r": w.lora_r, "lora_alpha": alpha, "lora_dropout": w.lora_dropout, "target_modules": targets,
                 "bias": "none"}
    if w.modules_to_save:
        cfg["modules_to_save"] = list(w.modules_to_save)
    if spec.head in PEFT_TASKS:
        cfg["task_type"] = PEFT_TASKS[spec.head][0]
    return cfg


def bnb_kwargs(w) -> dict:
    """transformers.BitsAndBytesConfig keyword arguments of a workload: 4-bit nf4 / fp4, or LLM.int8. Dtypes as
    the torch names transformers 5.23's BitsAndBytesConfig accepts (getattr(torch, name):
    quantization_config.py BitsAndBytesConfig.__init__)."""
    if w.quant == "int8":
        return {"load_in_8bit": True}
    return {"load_in_4bit": True, "bnb_4bit_quant_type": w.quant, "bnb_4bit_use_double_quant": w.double_quant,
            "bnb_4bit_compute_dtype": DTYPE_NAMES[compute_dtype(w)],
            "bnb_4bit_quant_storage": DTYPE_NAMES[w.quant_storage]}


def lora_config(plan, spec: ModelSpec) -> dict:
    """lora_config.json: target_modules resolved (lora_kwargs)."""
    return lora_kwargs(plan.workload, spec, resolve_default=True)


def freeze_section(w, spec: ModelSpec) -> dict | None:
    """plan.json's launch.freeze for a workload of --method freeze: the module paths train.py leaves
    trainable and modules_to_save, which train.py matches as PEFT does (a module on the parameter's path ends
    with the name); estimator/finetune.py freeze_trains decides both. verify applies it with train.py's own
    mark_trainable. None for other methods."""
    if w.method != "freeze":
        return None
    t, blocks = Tuning.of(w), stack_blocks(spec)
    stacks = dict.fromkeys(g.module.split(".*", 1)[0] for g in spec.params if head_stack(spec, g.module))
    trained = [f"{s}.{i}" for s in stacks for i in range(blocks) if freeze_trains(spec, t, _in_block(s), i)]
    trained += [g.module for g in spec.params if "*" not in g.module and freeze_trains(spec, t, g, -1)]
    return {"trainable_layers": w.trainable_layers, "trainable_modules": list(dict.fromkeys(trained)),
            "modules_to_save": list(w.modules_to_save)}


def _in_block(stack: str):
    """A stand-in parameter of a block of `stack` (freeze_trains reads its module path only)."""
    return ParamGroup(category="other", shape=(), module=stack + ".*")
