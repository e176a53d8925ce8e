"""Emitters: a Plan as the files a user launches unchanged (docs/emit.md).

- `training_arguments(plan, spec)`: keyword arguments for the installed `transformers.TrainingArguments`
  (trainer.py);
- `deepspeed_config(plan, spec)`: ds_config.json, with the bucket and stage-3 numbers the estimator
  counted (memplan.estimator.parallel.ds_buckets), explicit rather than "auto" so the file and the
  estimate agree, and DeepSpeed's own optimizer under offload (ds_config.py);
- `accelerate_config(plan, spec)`: the YAML for `accelerate launch --config_file` (accelerate_yaml.py);
- `launch_section(plan, files, spec)`: plan.json's `launch`: the model's loading kwargs, the kernels, the
  checkpointing, what no file can express, the launch command (launch.py);
- `lora_config(plan, spec)`, `bnb_kwargs(workload)`, `freeze_section(workload, spec)`: the fine-tuning method's
  peft.LoraConfig and transformers.BitsAndBytesConfig keyword arguments, and what a frozen run trains
  (finetune.py);
- `render(plan, spec, what)` and `write(files, directory, force=False)`: the files, with plan.json,
  train.py (train.py here, copied) and launch.sh, written atomically (files.py).
"""

from memplan.emit.accelerate_yaml import accelerate_config
from memplan.emit.common import DS_CONFIG, layer_classes, uses_deepspeed
from memplan.emit.ds_config import deepspeed_config
from memplan.emit.finetune import bnb_kwargs, freeze_section, lora_config
from memplan.emit.files import check_directory, emit_kinds, emit_names, render, sidecar, write
from memplan.emit.launch import launch_section
from memplan.emit.trainer import compile_pays, training_arguments, training_arguments_py

__all__ = ["DS_CONFIG", "accelerate_config", "bnb_kwargs", "check_directory", "compile_pays", "deepspeed_config",
           "emit_kinds", "emit_names", "freeze_section", "launch_section", "layer_classes", "lora_config", "render",
           "sidecar", "training_arguments", "training_arguments_py", "uses_deepspeed", "write"]
