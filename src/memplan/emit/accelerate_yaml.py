"""accelerate_config.yaml: the `accelerate launch --config_file` file (DeepSpeed, FSDP, multi-GPU, one GPU)."""

from __future__ import annotations

from memplan.emit.common import DS_CONFIG, FSDP_LAYOUT, layer_classes, uses_deepspeed
from memplan.inputs.modelspec import ModelSpec


def fsdp_section(plan, spec: ModelSpec) -> dict:
    version, reshard = FSDP_LAYOUT[plan.fsdp]
    fsdp: dict = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                  "fsdp_transformer_layer_cls_to_wrap": ",".join(layer_classes(spec)),
                  "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
                  "fsdp_offload_params": False, "fsdp_activation_checkpointing": plan.grad_ckpt == "full",
                  "fsdp_version": version}
    if version == 1:  # FSDP1 names its strategy: shard inside a node, replicate across
        fsdp |= {"fsdp_sharding_strategy": reshard.upper(), "fsdp_use_orig_params": True,
                 "fsdp_sync_module_states": True}
    else:
        fsdp["fsdp_reshard_after_forward"] = reshard
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
