"""What several emitted files share: their names, which plans run DeepSpeed, the layer class to wrap."""

from __future__ import annotations

from memplan.errors import UserError
from memplan.inputs.modelspec import ModelSpec

DS_CONFIG = "ds_config.json"
TRAINING_ARGS = "training_args.json"
ACCELERATE_YAML = "accelerate_config.yaml"
PLAN_JSON = "plan.json"
TRAIN_PY = "train.py"
LAUNCH_SH = "launch.sh"
LORA_CONFIG = "lora_config.json"  # peft.LoraConfig kwargs (--method lora / qlora)
BNB_CONFIG = "bnb_config.json"  # transformers.BitsAndBytesConfig kwargs (--method qlora)
GRADIENT_CLIPPING = 1.0  # TrainingArguments.max_grad_norm's default, repeated in the DeepSpeed file


def uses_deepspeed(plan) -> bool:
    return plan.zero_stage > 0 or plan.pp > 1


def layer_classes(spec: ModelSpec) -> list[str]:
    """The transformer layer classes FSDP wraps: the model's `_no_split_modules` (transformers)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base = MODEL_MAPPING_NAMES.get(spec.model_type)
    if base is None:
        raise UserError(f"cannot find the transformers model class of {spec.model_type!r} for FSDP auto-wrap")
    module = importlib.import_module(f"transformers.models.{spec.model_type}.modeling_{spec.model_type}")
    return list(getattr(module, base)._no_split_modules or [])

# Each FSDP kind as (FSDP version, reshard_after_forward), the two keys transformers 5.23 and accelerate 1.15
# read (transformers/training_args.py _apply_legacy_fsdp_to_config; accelerate's FullyShardedDataParallelPlugin).
# FSDP2 spells full-shard / shard-grad-op as reshard after forward or not. Hybrid-shard is FSDP1's
# strategy: FSDP2 shards hybrid only through accelerate's ParallelismConfig object, which no JSON or
# YAML option of the Trainer carries, so it stays FSDP1 (transformers logs FSDP1's deprecation for it).
FSDP_LAYOUT = {"full-shard": (2, True), "shard-grad-op": (2, False), "hybrid-shard": (1, "hybrid_shard")}
