"""TrainingArguments for a plan: the keyword arguments (training_args.json) and the same as a Python snippet."""

from __future__ import annotations

import dataclasses

from memplan import __version__
from memplan.emit.common import DS_CONFIG, FSDP_LAYOUT, GRADIENT_CLIPPING, layer_classes, uses_deepspeed
from memplan.errors import UserError
from memplan.inputs.modelspec import ModelSpec

# DataLoader settings that keep the GPU fed: pinned host memory for async copies, worker processes
# kept alive across epochs (torch.utils.data.DataLoader docs).
DATALOADER_WORKERS = 4


def checkpointing_field() -> str:
    """transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name is a
    deprecated alias); read the installed version's fields rather than guess."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def fsdp_config(plan, spec: ModelSpec) -> dict:
    """TrainingArguments.fsdp_config: transformers 5.23 wants `fsdp=True` and every setting here (a string
    `fsdp` such as "full_shard auto_wrap" is deprecated: training_args.py _apply_legacy_fsdp_to_config).
    The one source of the FSDP settings: the accelerate YAML's fsdp_config is this, renamed
    (accelerate_yaml.py fsdp_section). It must carry all of them: the Trainer builds its own
    FullyShardedDataParallelPlugin from these (training_args.py _process_fsdp_args, trainer.py), which
    replaces the one `accelerate launch` made from the YAML, and fills what is missing with its defaults
    (state_dict_type FULL_STATE_DICT, cpu_ram_efficient_loading False). Sharded state dicts: each rank saves
    its shard, no full gather onto one rank; CPU-RAM-efficient loading: only rank 0 reads the checkpoint."""
    version, reshard = FSDP_LAYOUT[plan.fsdp]
    cfg = {"version": version, "reshard_after_forward": reshard, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
           "transformer_layer_cls_to_wrap": layer_classes(spec), "state_dict_type": "SHARDED_STATE_DICT",
           "cpu_ram_efficient_loading": True, "activation_checkpointing": plan.grad_ckpt == "full"}
    if version == 1:  # FSDP1 only: trained and frozen parameters may share a unit; rank 0's weights broadcast
        cfg |= {"use_orig_params": True, "sync_module_states": True}
    return cfg


def training_arguments(plan, spec: ModelSpec, output_dir: str = "out") -> dict:
    """TrainingArguments keyword arguments for the plan (Trainer runs DDP, DeepSpeed and FSDP plans)."""
    if plan.pp > 1:
        raise UserError("pipeline-parallel plans need a DeepSpeed PipelineModule; the HF Trainer cannot run them "
                        "(emit --emit deepspeed for the ds_config.json)")
    ckpt = checkpointing_field()
    kw: dict = {
        "output_dir": output_dir,
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "optim": plan.optim,  # under offload DeepSpeed builds the optimizer (ds_config.json's section) instead
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
        ckpt: plan.grad_ckpt == "full",
        "max_grad_norm": GRADIENT_CLIPPING,
        "dataloader_pin_memory": True,
        "dataloader_num_workers": DATALOADER_WORKERS,
        "dataloader_persistent_workers": True,
    }
    if uses_deepspeed(plan):
        kw["deepspeed"] = DS_CONFIG
    if plan.fsdp != "none":
        kw["fsdp"] = True
        kw["fsdp_config"] = fsdp_config(plan, spec)
        kw[ckpt] = False  # FSDP checkpoints inside its wrapper (fsdp_config above)
    if kw[ckpt]:
        # non-reentrant checkpointing, explicit: with frozen layers below (LoRA, freeze) the reentrant
        # kind sees no input that requires grad and returns no gradient for the layers it recomputes
        # (torch.utils.checkpoint docs); transformers 5.23 defaults to it (modeling_utils.py
        # _activation_checkpointing_enable), earlier versions did not
        kw[ckpt + "_kwargs"] = {"use_reentrant": False}
    if compile_pays(plan, spec):
        kw["torch_compile"] = True
    # little headroom left: return cached blocks between steps so fragmentation cannot grow into an OOM
    if plan.estimate.headroom_bytes < 0.02 * plan.estimate.capacity_bytes:
        kw["torch_empty_cache_steps"] = 1
    return kw


def compile_pays(plan, spec: ModelSpec) -> bool:
    """torch.compile for the Trainer where the published evidence says it pays: PyTorch 2.0's
    announcement measured training 43 % faster on average over 163 models (HF, TIMM, TorchBench) on an
    A100 under AMP. So: Ampere or newer, bf16 / fp16 autocast, a dense model (MoE routing has
    data-dependent shapes that break graphs), and no DeepSpeed (its engine has its own compile path).
    The compile time, minutes, is paid once per run."""
    from memplan.inputs.profiles import load_gpu

    try:
        gpu = load_gpu(plan.estimate.gpu)
    except UserError:  # a profile file of the user's that is not at hand: no evidence either way
        return False
    return (gpu.compute_capability >= (8, 0) and plan.precision in ("bf16", "fp16") and not spec.is_moe
            and not uses_deepspeed(plan))


def training_arguments_py(plan, kw: dict) -> str:
    """The same keyword arguments as a Python snippet; what else the plan needs is in plan.json's `launch`."""
    lines = [f"# memplan {__version__}: {plan.estimate.model.name} on {plan.gpus * plan.nodes} x {plan.estimate.gpu}; "
             f"predicted peak {plan.estimate.device_used_bytes / 2**30:.2f} GiB per GPU (device used)",
             "# the model's loading kwargs, kernels and checkpointing are in plan.json's \"launch\" (train.py reads them)",
             "from transformers import TrainingArguments", "", "args = TrainingArguments("]
    lines += [f"    {k}={v!r}," for k, v in kw.items()]
    return "\n".join(lines + [")", ""])
