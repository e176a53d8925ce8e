"""ds_config.json for DeepSpeed plans (ZeRO 1-3, offload, AutoTP, a pipeline)."""

from __future__ import annotations

from memplan.emit.common import GRADIENT_CLIPPING, uses_deepspeed
from memplan.errors import UserError
from memplan.estimator.parallel import STAGE3_MAX_REUSE_DISTANCE, SUB_GROUP_SIZE, ds_buckets
from memplan.inputs.modelspec import ModelSpec

# Under ZeRO-Offload DeepSpeed must step a CPU optimizer: given the Trainer's torch AdamW it raises
# "ZeRO-Offload with a client provided optimizer" (deepspeed 0.19.8 runtime/engine.py _configure_optimizer),
# unless accelerate 1.15 swaps it first (accelerate/utils/deepspeed.py map_pytorch_optim_to_deepspeed), which
# keeps lr and weight decay and drops the betas and eps. With an `optimizer` section the HF integration
# builds no optimizer of its own (transformers 5.23 integrations/deepspeed.py deepspeed_optim_sched) and
# fills each "auto" from TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon, weight_decay:
# HfTrainerDeepSpeedConfig.trainer_config_process); DeepSpeed then builds DeepSpeedCPUAdam in AdamW mode
# (engine.get_optimizer_configuration). Without offload the Trainer's own optimizer (TrainingArguments.optim,
# the one the estimate counts) runs: no FusedAdam to JIT-compile with nvcc on the user's machine.
OFFLOAD_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}


def zero_section(plan, spec: ModelSpec) -> dict:
    """zero_optimization: the stage, the bucket sizes the estimator counted, the offload devices."""
    b = ds_buckets(spec)
    zero: dict = {"stage": plan.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": b["reduce_bucket_size"]}
    if plan.zero_stage in (1, 2):
        zero["allgather_bucket_size"] = b["allgather_bucket_size"]
    if plan.zero_stage == 3:
        zero |= {"stage3_prefetch_bucket_size": b["stage3_prefetch_bucket_size"],
                 "stage3_param_persistence_threshold": b["stage3_param_persistence_threshold"],
                 "stage3_max_live_parameters": b["stage3_max_live_parameters"],
                 "stage3_max_reuse_distance": STAGE3_MAX_REUSE_DISTANCE, "sub_group_size": SUB_GROUP_SIZE,
                 "stage3_gather_16bit_weights_on_model_save": True}
    if plan.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def deepspeed_config(plan, spec: ModelSpec) -> dict:
    """ds_config.json for the plan. train_batch_size = micro x accumulation x data-parallel ranks."""
    if not uses_deepspeed(plan):
        raise UserError("this plan does not use DeepSpeed (ZeRO stage 0, no pipeline): there is no ds_config.json")
    cfg: dict = {
        "train_batch_size": plan.micro_batch * plan.grad_accum * plan.dp,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": GRADIENT_CLIPPING,
        "zero_optimization": zero_section(plan, spec),
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if plan.tp > 1:
        # DeepSpeed derives train_batch_size from its data-parallel ranks (runtime/config.py
        # _configure_train_batch_size); the HF integration would check it against every process, TP ranks
        # included (integrations/deepspeed.py trainer_config_process), and refuse the right number
        del cfg["train_batch_size"]
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    if plan.offload != "none":
        cfg["optimizer"] = OFFLOAD_OPTIMIZER
    if plan.precision in ("bf16", "bf16-pure"):
        cfg["bf16"] = {"enabled": True}
    elif plan.precision == "fp16":
        # dynamic loss scaling (loss_scale 0), DeepSpeed's defaults spelled out
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    if plan.grad_ckpt == "full":
        # for models that checkpoint through deepspeed.checkpointing (PipelineModule, Megatron-DeepSpeed);
        # HF models checkpoint through TrainingArguments
        cfg["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False}
    if plan.pp > 1:
        cfg["pipeline"] = {"stages": plan.pp, "partition": "parameters"}
    return cfg
