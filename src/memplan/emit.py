"""Emitters: a Plan as the files a user launches unchanged (docs/emit.md).

- `training_arguments(plan)`: keyword arguments for the installed `transformers.TrainingArguments`;
- `deepspeed_config(plan, spec)`: ds_config.json, with the bucket and stage-3 numbers the estimator
  counted (memplan.estimator.parallel.ds_buckets), explicit rather than "auto" so the file and the estimate agree;
- `accelerate_config(plan, spec)`: the YAML for `accelerate launch --config_file` (DeepSpeed, FSDP,
  multi-GPU or single GPU);
- `write(files, directory, force=False)`: the files, written atomically, never over a user's file without
  `force`, with a `plan.json` sidecar carrying the memplan version, the plan and the predicted peak.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from memplan import __version__
from memplan.errors import UserError
from memplan.inputs.modelspec import ModelSpec
from memplan.estimator.parallel import STAGE3_MAX_REUSE_DISTANCE, SUB_GROUP_SIZE, ds_buckets

DS_CONFIG = "ds_config.json"
# DataLoader settings that keep the GPU fed: pinned host memory for async copies, worker processes
# kept alive across epochs (torch.utils.data.DataLoader docs).
DATALOADER_WORKERS = 4
GRADIENT_CLIPPING = 1.0  # TrainingArguments.max_grad_norm's default, repeated in the DeepSpeed file


def uses_deepspeed(plan) -> bool:
    return plan.zero_stage > 0 or plan.pp > 1


def _checkpointing_field() -> str:
    """transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name is a
    deprecated alias); read the installed version's fields rather than guess."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def training_arguments(plan, spec: ModelSpec | None = None, output_dir: str = "out") -> dict:
    """TrainingArguments keyword arguments for the plan (Trainer runs DDP, DeepSpeed and FSDP plans)."""
    if plan.pp > 1:
        raise UserError("pipeline-parallel plans need a DeepSpeed PipelineModule; the HF Trainer cannot run them "
                        "(emit --emit deepspeed for the ds_config.json)")
    kw: dict = {
        "output_dir": output_dir,
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "optim": plan.optim,
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
        _checkpointing_field(): plan.grad_ckpt == "full",
        "max_grad_norm": GRADIENT_CLIPPING,
        "dataloader_pin_memory": True,
        "dataloader_num_workers": DATALOADER_WORKERS,
        "dataloader_persistent_workers": True,
    }
    if uses_deepspeed(plan):
        kw["deepspeed"] = DS_CONFIG
    if plan.fsdp != "none":
        if spec is None:
            raise ValueError("FSDP plans need the model spec (the layer class to wrap)")
        strategy = {"full-shard": "full_shard", "shard-grad-op": "shard_grad_op", "hybrid-shard": "hybrid_shard"}
        kw["fsdp"] = f"{strategy[plan.fsdp]} auto_wrap"
        kw["fsdp_config"] = {"transformer_layer_cls_to_wrap": layer_classes(spec),
                             "activation_checkpointing": plan.grad_ckpt == "full"}
        kw[_checkpointing_field()] = False  # FSDP checkpoints inside its wrapper (fsdp_config above)
    if spec is not None and compile_pays(plan, spec):
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
    """The same keyword arguments as a Python snippet."""
    lines = [f"# memplan {__version__}: {plan.estimate.model.name} on {plan.gpus * plan.nodes} x {plan.estimate.gpu}; "
             f"predicted peak {plan.estimate.device_used_bytes / 2**30:.2f} GiB per GPU (device used)",
             "from transformers import TrainingArguments", "", "args = TrainingArguments("]
    lines += [f"    {k}={v!r}," for k, v in kw.items()]
    if plan.precision == "bf16-pure":
        lines.insert(2, "# load the model with torch_dtype=torch.bfloat16 (pure bf16 training)")
    if plan.grad_ckpt == "selective":
        lines.insert(2, "# selective checkpointing: memplan.selective.enable_selective(model) before training")
    if plan.kernels or plan.tiled_mlp or plan.attn == "memplan":
        lines.insert(2, f"# memplan's kernels: memplan.kernels.apply(model, loss={plan.kernels}, mlp={plan.tiled_mlp}, "
                        f"attention={plan.attn == 'memplan'}) before training")
    return "\n".join(lines + [")", ""])


def deepspeed_config(plan, spec: ModelSpec) -> dict:
    """ds_config.json for the plan. train_batch_size = micro x accumulation x data-parallel ranks."""
    if not uses_deepspeed(plan):
        raise UserError("this plan does not use DeepSpeed (ZeRO stage 0, no pipeline): there is no ds_config.json")
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
    cfg: dict = {
        "train_batch_size": plan.micro_batch * plan.grad_accum * plan.dp,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": GRADIENT_CLIPPING,
        "zero_optimization": zero,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
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
    if plan.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    if plan.pp > 1:
        cfg["pipeline"] = {"stages": plan.pp, "partition": "parameters"}
    return cfg


def layer_classes(spec: ModelSpec) -> list[str]:
    """The transformer layer classes FSDP wraps: the model's `_no_split_modules` (transformers)."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base = MODEL_MAPPING_NAMES.get(spec.model_type)
    if base is None:
        raise UserError(f"cannot find the transformers model class of {spec.model_type!r} for FSDP auto-wrap")
    module = importlib.import_module(f"transformers.models.{spec.model_type}.modeling_{spec.model_type}")
    return list(getattr(module, base)._no_split_modules or [])


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
        fsdp: dict = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                      "fsdp_transformer_layer_cls_to_wrap": ",".join(layer_classes(spec)),
                      "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
                      "fsdp_offload_params": False, "fsdp_activation_checkpointing": plan.grad_ckpt == "full"}
        if plan.fsdp == "hybrid-shard":  # FSDP1's strategy: shard inside a node, replicate across
            fsdp |= {"fsdp_version": 1, "fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_use_orig_params": True,
                     "fsdp_sync_module_states": True}
        else:
            fsdp |= {"fsdp_version": 2, "fsdp_reshard_after_forward": plan.fsdp == "full-shard"}
        cfg["fsdp_config"] = fsdp
    else:
        cfg["distributed_type"] = "MULTI_GPU" if world > 1 else "NO"
    return cfg


def sidecar(plan) -> dict:
    """plan.json: the memplan version, the plan and its estimate (formats that cannot carry comments)."""
    return {"memplan_version": __version__, "predicted_device_used_bytes": plan.estimate.device_used_bytes,
            "predicted_peak_allocated_bytes": plan.estimate.peak_allocated_bytes, "plan": plan.model_dump(mode="json")}


def render(plan, spec: ModelSpec, what: tuple[str, ...]) -> dict[str, str]:
    """File name -> text for the requested kinds (trainer, deepspeed, accelerate), plus plan.json."""
    import yaml

    out: dict[str, str] = {}
    if "trainer" in what:
        kw = training_arguments(plan, spec)
        out["training_args.json"] = json.dumps(kw, indent=1) + "\n"
        out["training_args.py"] = training_arguments_py(plan, kw)
    if "deepspeed" in what and uses_deepspeed(plan):
        out[DS_CONFIG] = json.dumps(deepspeed_config(plan, spec), indent=1) + "\n"
    if "accelerate" in what:
        head = (f"# memplan {__version__}: {plan.estimate.model.name}, predicted peak "
                f"{plan.estimate.device_used_bytes / 2**30:.2f} GiB per GPU; see plan.json\n")
        out["accelerate_config.yaml"] = head + yaml.safe_dump(accelerate_config(plan, spec), sort_keys=False)
    out["plan.json"] = json.dumps(sidecar(plan), indent=1) + "\n"
    return out


def write(files: dict[str, str], directory: str, force: bool = False) -> list[str]:
    """Write each file atomically (a temporary file renamed over the target); refuse to overwrite an
    existing file unless `force`. `directory` '-' prints them to stdout instead."""
    if directory == "-":
        for name, text in files.items():
            print(f"# ---- {name}\n{text}", end="" if text.endswith("\n") else "\n")
        return []
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise UserError(f"-o {directory}: not a directory")
    clash = [name for name in files if (d / name).exists()]
    if clash and not force:
        raise UserError(f"-o {directory}: {', '.join(clash)} already exist(s); pass --force to overwrite")
    d.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        target = d / name
        tmp = d / f".{name}.memplan-tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
        written.append(str(target))
    return written
