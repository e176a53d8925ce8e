"""Train as memplan planned, with the HF Trainer and the files beside this script (copied there by
`memplan suggest --emit`): training_args.json, plan.json's "launch" section, ds_config.json where the
plan uses DeepSpeed. Start it with launch.sh. The data is yours: --data FILE (plain text) gives causal LMs
blocks of the planned sequence length; for anything else, call build_trainer with your dataset."""

from __future__ import annotations

import argparse
import json
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
    import torch
    import transformers

    launch, kw = read_files(Path(directory))
    # TrainingArguments first: under ZeRO-3 DeepSpeed partitions the model while it loads
    args = transformers.TrainingArguments(**{**kw, **(args_overrides or {})})
    model_kw = {**launch["model_kwargs"], **(model_overrides or {})}
    model_kw["dtype"] = getattr(torch, model_kw["dtype"])
    auto = getattr(transformers, launch["auto_class"])
    model = auto.from_config(config, **model_kw) if config is not None else auto.from_pretrained(launch["model"], **model_kw)
    return transformers.Trainer(model=prepare(model, launch), args=args, train_dataset=train_dataset, **trainer_kwargs)


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
