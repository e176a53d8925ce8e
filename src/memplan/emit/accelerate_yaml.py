"""accelerate_config.yaml: the `accelerate launch --config_file` file (DeepSpeed, FSDP, multi-GPU, one GPU)."""

from __future__ import annotations

from memplan.emit.common import DS_CONFIG, uses_deepspeed
from memplan.emit.trainer import fsdp_config
from memplan.inputs.modelspec import ModelSpec


def fsdp_section(plan, spec: ModelSpec) -> dict:
    """The YAML's fsdp_config: TrainingArguments' (trainer.py fsdp_config, which the Trainer's plugin applies
    under launch.sh in any case) in accelerate's launch option names: an fsdp_ prefix, the layer classes
    comma-joined, FSDP1's strategy as fsdp_sharding_strategy; no parameter offload."""
    cfg = fsdp_config(plan, spec)
    fsdp = {f"fsdp_{k}": v for k, v in cfg.items()}
    fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(cfg["transformer_layer_cls_to_wrap"])
    fsdp["fsdp_offload_params"] = False
    if cfg["version"] == 1:  # FSDP1 names its strategy: shard inside a node, replicate across
        fsdp["fsdp_sharding_strategy"] = fsdp.pop("fsdp_reshard_after_forward").upper()
    return fsdp


def accelerate_config(plan, spec: ModelSpec) -> dict:
    """The `accelerate launch --config_file` YAML as a dict."""
    world = plan.gpus * plan.nodes
    cfg: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0,
                 "main_training_function": "main", "num_machines": plan.nodes, "num_processes": world,
                 "rdzv_backend": "static", "same_network": True, "use_cpu": False,
                 "mixed_precision": {"bf16": "bf16", "fp16": "fp16"}.get(plan.precision, "no"),
                 "downcast_bf16": "no", "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False}
    if uses_deepspeed(plan):
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {"deepspeed_config_file": DS_CONFIG, "zero3_init_flag": plan.zero_stage == 3,
                                   "deepspeed_multinode_launcher": "standard"}
    elif plan.fsdp != "none":
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = fsdp_section(plan, spec)
    else:
        cfg["distributed_type"] = "MULTI_GPU" if world > 1 else "NO"
    return cfg
