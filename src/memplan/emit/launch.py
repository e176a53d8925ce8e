"""plan.json's `launch` section: everything the plan depends on beyond TrainingArguments, machine-readable
(the model's loading kwargs, memplan's kernels, checkpointing, what no emitted file can express), and the
command that starts train.py with the emitted files (launch.sh)."""

from __future__ import annotations

import shlex

from memplan.emit.common import ACCELERATE_YAML, BNB_CONFIG, DS_CONFIG, LORA_CONFIG, TRAIN_PY, uses_deepspeed
from memplan.emit.finetune import freeze_section
from memplan.estimator.finetune import load_dtype, uses_adapters
from memplan.estimator.rules import DTYPE_NAMES
from memplan.inputs.hf import HEADS
from memplan.inputs.modelspec import ModelSpec

# transformers' attn_implementation for each memplan attention (transformers 5.23 modeling_utils.py
# _check_and_adjust_attn_implementation). memplan's tiled attention is installed over sdpa by
# memplan.kernels.apply(attention=True), which sets the model's implementation to "memplan".
ATTN_IMPLEMENTATION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2", "memplan": "sdpa"}

# What a plan may hold that no emitted file expresses: (setting, whether the plan uses it, why).
NOT_EXPRESSED = (
    ("sp", lambda p: p.sp,
     "sequence parallelism with TP (Megatron style): DeepSpeed AutoTP (tensor_parallel) and the HF Trainer have "
     "no such option; train without it (more activation memory per GPU than planned) or with Megatron"),
    ("vpp", lambda p: p.vpp > 1,
     "interleaved pipeline stages: DeepSpeed's PipelineEngine runs plain 1F1B (deepspeed 0.19.8 "
     "runtime/pipe/schedule.py TrainSchedule); the plan's bubble assumes interleaving"),
    ("pp", lambda p: p.pp > 1,
     "a pipeline needs a deepspeed.pipe.PipelineModule, which the HF Trainer cannot run: ds_config.json carries "
     "the pipeline section for a script that builds one; no TrainingArguments, train.py or launch command"),
)


# the allocator settings' names: torch 2.13 reads PYTORCH_ALLOC_CONF first and its older alias only without it
# (c10/core/AllocatorConfig.cpp; pytorch/pytorch PR 167659, which also warns the alias is deprecated); torch
# 2.9.1 read only the alias for CUDA (pytorch/pytorch issue 183387). launch.sh sets both.
ALLOC_CONF = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def model_kwargs(plan) -> dict:
    """Keyword arguments for from_pretrained / from_config. The dtype is always explicit: transformers 5.23
    from_pretrained defaults to dtype="auto", the checkpoint's own (modeling_utils.py), which would load bf16
    weights where an autocast plan counted fp32 master weights; memplan's load dtype
    (estimator/finetune.py load_dtype) is fp32 but for pure bf16 training and LoRA / QLoRA's half base."""
    return {"attn_implementation": ATTN_IMPLEMENTATION[plan.attn], "dtype": DTYPE_NAMES[load_dtype(plan.workload)]}


def kernels(plan) -> dict | None:
    """memplan.kernels.apply(model, **this) before training, or None; the plan's batch fits only with them."""
    if not (plan.kernels or plan.tiled_mlp or plan.attn == "memplan"):
        return None
    return {"loss": plan.kernels, "mlp": plan.tiled_mlp, "attention": plan.attn == "memplan"}


def command(plan, files: set[str]) -> str | None:
    """The launch command for train.py with the files written, or None where no file set can start it."""
    if plan.pp > 1 or TRAIN_PY not in files:
        return None
    if ACCELERATE_YAML in files:
        multi = " --machine_rank \"$MACHINE_RANK\" --main_process_ip \"$MAIN_PROCESS_IP\"" if plan.nodes > 1 else ""
        return f"accelerate launch --config_file {ACCELERATE_YAML}{multi} {TRAIN_PY}"
    if uses_deepspeed(plan) and DS_CONFIG in files:
        multi = " --hostfile hostfile" if plan.nodes > 1 else ""
        return f"deepspeed{multi} --num_nodes {plan.nodes} --num_gpus {plan.gpus} {TRAIN_PY}"
    if plan.gpus * plan.nodes > 1:
        multi = " --node_rank \"$NODE_RANK\" --master_addr \"$MASTER_ADDR\"" if plan.nodes > 1 else ""
        return f"torchrun --nnodes {plan.nodes} --nproc_per_node {plan.gpus}{multi} {TRAIN_PY}"
    return f"python {TRAIN_PY}"


def launch_section(plan, files: set[str], spec: ModelSpec) -> dict:
    """plan.json's `launch`: what train.py reads, and what it cannot do, as data. `spec`: the model's (the
    module paths --method freeze trains)."""
    model = plan.estimate.model
    method = plan.workload.method
    return {
        "model": model.hf_id or model.name,
        "auto_class": HEADS[model.head],  # the transformers Auto class that builds the planned head
        "seq_len": plan.seq_len,
        "model_kwargs": model_kwargs(plan),
        "kernels": kernels(plan),
        # full: TrainingArguments' checkpointing field; selective: memplan.selective.enable_selective(model)
        "checkpointing": plan.grad_ckpt,
        # the fine-tuning method: lora / qlora read lora_config.json (and bnb_config.json), freeze reads `freeze`;
        # a file is named only where it was written (the trainer kind writes them, with train.py)
        "method": method,
        "lora_config": LORA_CONFIG if uses_adapters(method) and LORA_CONFIG in files else None,
        "quantization_config": BNB_CONFIG if method == "qlora" and BNB_CONFIG in files else None,
        "freeze": freeze_section(plan.workload, spec),  # None but for --method freeze
        "not_expressed": [{"setting": name, "reason": why} for name, used, why in NOT_EXPRESSED if used(plan)],
        # the environment the command needs: the allocator mode the plan's memory was estimated under (it must be
        # set before CUDA initialises, so launch.sh exports it for the launcher and every rank it starts)
        "env": dict.fromkeys(ALLOC_CONF, "expandable_segments:True") if plan.workload.expandable_segments else {},
        "command": command(plan, files),
    }


def launch_script(section: dict) -> str:
    """launch.sh: run from the directory that holds the files."""
    multi = ("# several nodes: run this on each with MACHINE_RANK / NODE_RANK and MAIN_PROCESS_IP / MASTER_ADDR set\n"
             if "$" in section["command"] else "")
    env = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in section.get("env", {}).items())
    return (f"#!/bin/sh\n# memplan: train {shlex.quote(section['model'])} as planned (plan.json)\n"
            f"# usage: ./launch.sh --data FILE (see train.py)\n{multi}{env}"
            f"cd \"$(dirname \"$0\")\" && exec {section['command']} \"$@\"\n")
