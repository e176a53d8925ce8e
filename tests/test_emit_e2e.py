"""End to end on the CPU: a tiny model trained for two steps from what `memplan suggest --emit` wrote, by
the HF Trainer and by DeepSpeed's engine on its CPU accelerator."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture()
def tiny(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    return d


def emit(memplan_cli, model_dir, out, *extra):
    r = memplan_cli("suggest", "--model", model_dir / "config.json", "--gpu", "a100-80g", "--seq-len", "32",
                    "--batch-size", "4", "--precision", "fp32", "--optim", "adamw_torch", "--emit", "all", "-o", out,
                    *extra)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "plan.json").read_text())["plan"]


def test_trainer_trains_two_steps_with_emitted_arguments(tiny, tmp_path, memplan_cli):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    out = tmp_path / "emitted"
    plan = emit(memplan_cli, tiny, out)
    kw = json.loads((out / "training_args.json").read_text())
    # the emitted arguments as they are, plus what a CPU test run needs: the CPU, two steps, no saving
    args = TrainingArguments(**dict(kw, output_dir=str(tmp_path / "run"), use_cpu=True, max_steps=2,
                                    report_to="none", save_strategy="no"))
    assert args.per_device_train_batch_size == plan["micro_batch"]
    assert args.gradient_accumulation_steps == plan["grad_accum"]

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            x = torch.randint(0, TINY["vocab_size"], (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x.clone()}

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY))
    result = Trainer(model=model, args=args, train_dataset=Tokens()).train()
    assert result.global_step == 2 and result.training_loss > 0


DEEPSPEED_RUN = textwrap.dedent("""
    import json, os, sys, torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    config = json.load(open(sys.argv[1]))
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(sys.argv[2])))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config)
    micro = config["train_micro_batch_size_per_gpu"]
    for _ in range(2 * config["gradient_accumulation_steps"]):
        x = torch.randint(0, 256, (micro, 32))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    print("steps", engine.global_steps)
""")


def test_deepspeed_engine_trains_two_steps_with_emitted_config(tiny, tmp_path, memplan_cli):
    pytest.importorskip("deepspeed")
    out = tmp_path / "emitted"
    emit(memplan_cli, tiny, out, "--zero", "1")
    cfg = out / "ds_config.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    with socket.socket() as free:  # a port no other run on this machine holds (a fixed one collides)
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    r = subprocess.run([sys.executable, "-c", DEEPSPEED_RUN, str(cfg), json.dumps(TINY), port],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "steps 2" in r.stdout
