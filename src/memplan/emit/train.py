"""Train as memplan planned, with the HF Trainer and the files beside this script (copied there by
`memplan suggest --emit`): training_args.json, plan.json's "launch" section, ds_config.json where the
plan uses DeepSpeed, lora_config.json (and bnb_config.json) for LoRA (QLoRA). Start it with launch.sh.
The data is yours: --data FILE (plain text) gives causal LMs blocks of the planned sequence length; for
anything else, call build_trainer with your dataset."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def read_files(directory: Path) -> tuple[dict, dict]:
    """(plan.json's launch section, the TrainingArguments keyword arguments), file names made absolute."""
    launch = json.loads((directory / "plan.json").read_text())["launch"]
    kw = json.loads((directory / "training_args.json").read_text())
    if kw.get("deepspeed"):
        kw["deepspeed"] = str(directory / kw["deepspeed"])
    return launch, kw


def prepare(model, launch: dict):
    """What the plan needs besides TrainingArguments: memplan's kernels, selective checkpointing."""
    if launch["kernels"]:
        import memplan.kernels

        memplan.kernels.apply(model, **launch["kernels"])
    if launch["checkpointing"] == "selective":
        from memplan.selective import enable_selective

        enable_selective(model)
    return model


def build_trainer(train_dataset, directory: Path = HERE, *, config=None, args_overrides: dict | None = None,
                  model_overrides: dict | None = None, **trainer_kwargs):
    """The Trainer for the plan. `config`: build the model from it with random weights instead of loading
    plan.json's model (tests); the overrides replace emitted values (e.g. use_cpu for a CPU run)."""
    import transformers

    directory = Path(directory)
    launch, kw = read_files(directory)
    # TrainingArguments first: under ZeRO-3 DeepSpeed partitions the model while it loads
    args = transformers.TrainingArguments(**{**kw, **(args_overrides or {})})
    model = load_model(launch, directory, args, config, model_overrides)
    model = tune(prepare(model, launch), launch, directory, hf_checkpointing(args))
    return transformers.Trainer(model=model, args=args, train_dataset=train_dataset, **trainer_kwargs)


def load_model(launch: dict, directory: Path, args, config=None, overrides: dict | None = None):
    """The model with plan.json's loading kwargs; for QLoRA quantised by bitsandbytes as it loads, which
    only from_pretrained does: random weights (`config`) are saved to a temporary directory and loaded
    back."""
    import torch
    import transformers

    kw = {**launch["model_kwargs"], **(overrides or {})}
    kw["dtype"] = getattr(torch, kw["dtype"])
    auto = getattr(transformers, launch["auto_class"])
    if not launch.get("quantization_config"):
        return auto.from_config(config, **kw) if config is not None else auto.from_pretrained(launch["model"], **kw)
    from transformers.integrations import is_deepspeed_zero3_enabled

    quant = transformers.BitsAndBytesConfig(**json.loads((directory / launch["quantization_config"]).read_text()))
    # each process quantises onto its own GPU (bitsandbytes quantises as the weights move there); under
    # ZeRO-3 transformers refuses a device_map (integrations/accelerate.py check_and_set_device_map) and
    # DeepSpeed places and partitions the weights when it wraps the model
    device = "cpu" if args.use_cpu or not torch.cuda.is_available() else int(os.environ.get("LOCAL_RANK", 0))
    placement = {} if is_deepspeed_zero3_enabled() else {"device_map": {"": device}}
    with tempfile.TemporaryDirectory() as tmp:
        source = launch["model"]
        if config is not None:
            auto.from_config(config, **kw).save_pretrained(tmp)
            source = tmp
        return auto.from_pretrained(source, quantization_config=quant, **placement, **kw)


def hf_checkpointing(args) -> bool:
    """Whether the Trainer checkpoints the model itself (memplan leaves it to FSDP's wrapper under FSDP)."""
    return bool(getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", False)))


def tune(model, launch: dict, directory: Path, checkpointing: bool):
    """The fine-tuning method: LoRA adapters (PEFT), after prepare_model_for_kbit_training for QLoRA, or
    the frozen layers of --method freeze; full fine-tuning trains the model as it is. checkpointing: the
    Trainer's own (hf_checkpointing); under FSDP the wrapper checkpoints, so PEFT must not as well."""
    if launch.get("freeze"):
        return freeze(model, launch["freeze"])
    if not launch.get("lora_config"):
        return model
    import peft

    if launch.get("quantization_config"):
        # fp32 copies of the non-quantised parameters, checkpointing as planned (non-reentrant: the
        # frozen inputs need no requires_grad hook)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                                     gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(**json.loads((directory / launch["lora_config"]).read_text()))
    model = peft.get_peft_model(model, lora)
    model.print_trainable_parameters()
    return model


def freeze(model, section: dict):
    """Train only the modules plan.json names (the last K blocks, the head, the final norm) and those
    under a modules_to_save name."""
    trained = mark_trainable(model, section)
    print(f"trainable params: {trained:,} (the last {section['trainable_layers']} blocks, the head, the final norm)")
    return model


def mark_trainable(model, section: dict) -> int:
    """requires_grad on the parameters under plan.json's launch.freeze modules or under a modules_to_save
    name, off elsewhere; returns the trainable count (memplan verify applies a frozen plan with it too).
    PEFT's modules_to_save rule (some module on the path ends with the name) is written out here rather
    than imported from memplan (estimator/finetune.py `under`): this script runs where the user trains and
    imports memplan only for the features that are memplan's code (its kernels, selective checkpointing)."""
    keep, saved = section["trainable_modules"], section["modules_to_save"]
    trained = 0
    for name, param in model.named_parameters():
        parts = name.split(".")[:-1]
        path = ".".join(parts)
        ancestors = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        param.requires_grad = (any(path == k or path.startswith(k + ".") for k in keep)
                               or any(a.endswith(n) for a in ancestors for n in saved))
        trained += param.numel() if param.requires_grad else 0
    return trained


def text_blocks(path: str, model: str, seq_len: int):
    """A causal-LM dataset: the file's tokens in blocks of seq_len, each its own labels."""
    import torch
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(Path(path).read_text())["input_ids"]
    blocks = [torch.tensor(ids[i:i + seq_len]) for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not blocks:
        raise SystemExit(f"{path}: fewer than {seq_len} tokens")
    return [{"input_ids": b, "labels": b} for b in blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="a plain-text file to train a causal LM on")
    opts, _ = parser.parse_known_args()  # launchers add their own (deepspeed passes --local_rank)
    launch, _ = read_files(HERE)
    if launch["auto_class"] != "AutoModelForCausalLM":
        raise SystemExit(f"--data feeds causal LMs; for {launch['auto_class']} call build_trainer with your dataset")
    build_trainer(text_blocks(opts.data, launch["model"], launch["seq_len"])).train()


if __name__ == "__main__":
    main()
