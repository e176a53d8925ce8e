"""End to end on the CPU: the files `memplan suggest --emit` wrote, started as they are, through the emitted
train.py, for two steps of a tiny model of the planned family (random weights): the plain Trainer in this
process, and the HF Trainer with DeepSpeed (its CPU accelerator) in one subprocess that runs every DeepSpeed
case in turn, sharing its imports and the DeepSpeedCPUAdam build (g++, on first use: about 150 s on this
two-core machine, then cached in ~/.cache/torch_extensions)."""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
SEQ = 32
# What a CPU test run changes in the emitted TrainingArguments: the CPU, two steps, no saving, no worker
# processes; and adam_beta2 0.95 (not the default) to see the value reach DeepSpeed's optimizer.
CPU_RUN = {"use_cpu": True, "max_steps": 2, "report_to": "none", "save_strategy": "no", "dataloader_num_workers": 0,
           "dataloader_persistent_workers": False, "dataloader_pin_memory": False, "torch_compile": False,
           "adam_beta2": 0.95}
NO_FLASH = {"attn_implementation": "sdpa"}  # the CPU has no FlashAttention-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps(TINY))
    return d


def emit(memplan_cli, model_dir, out, *extra):
    r = memplan_cli("suggest", "--model", model_dir / "config.json", "--gpu", "a100-80g", "--seq-len", str(SEQ),
                    "--batch-size", "4", "--precision", "fp32", "--optim", "adamw_torch", "--emit", "all", "-o", out,
                    *extra)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "plan.json").read_text())["plan"]


def load_train_py(directory):
    spec = importlib.util.spec_from_file_location(f"train_{abs(hash(str(directory)))}", directory / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Tokens:
    """Synthetic token blocks (a torch Dataset by protocol)."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        import torch

        x = torch.randint(0, TINY["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x.clone()}


def test_plain_trainer_trains_two_steps_from_the_emitted_files(tiny, tmp_path, memplan_cli):
    from transformers import AutoConfig

    out = tmp_path / "emitted"
    plan = emit(memplan_cli, tiny, out)
    assert plan["zero_stage"] == 0 and not (out / "ds_config.json").exists()
    assert "accelerate launch --config_file accelerate_config.yaml train.py" in (out / "launch.sh").read_text()
    train = load_train_py(out)
    trainer = train.build_trainer(Tokens(), out, config=AutoConfig.for_model(**TINY),
                                  args_overrides=dict(CPU_RUN, output_dir=str(tmp_path / "run")))
    assert trainer.args.per_device_train_batch_size == plan["micro_batch"]
    assert trainer.args.gradient_accumulation_steps == plan["grad_accum"]
    result = trainer.train()
    assert result.global_step == 2 and result.training_loss > 0


DEEPSPEED_RUN = textwrap.dedent("""
    import importlib.util, json, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    import torch
    from accelerate.state import AcceleratorState
    from transformers import AutoConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    job = json.loads(sys.argv[1])

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            x = torch.randint(0, 256, (job["seq"],), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x.clone()}

    for case in job["cases"]:
        spec = importlib.util.spec_from_file_location("train", os.path.join(case, "train.py"))
        train = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train)
        trainer = train.build_trainer(Tokens(), case, config=AutoConfig.for_model(**job["tiny"]),
                                      args_overrides=dict(job["args"], output_dir=os.path.join(case, "run")),
                                      model_overrides=job["model"])
        result = trainer.train()
        opt = trainer.deepspeed.basic_optimizer
        trained = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                      for p in trainer.model.parameters() if p.requires_grad)
        print("RESULT", json.dumps({"case": case, "steps": result.global_step, "loss": result.training_loss,
                                    "optimizer": type(opt).__name__, "betas": list(opt.param_groups[0]["betas"]),
                                    "trained": trained}))
        AcceleratorState._reset_state(True)  # the next case builds its own accelerator and DeepSpeed plugin
        unset_hf_deepspeed_config()
""")


@pytest.fixture(scope="module")
def deepspeed_runs(tiny, tmp_path_factory):
    """Emit the DeepSpeed cases, then train each for two steps in one subprocess: {case name: result}."""
    pytest.importorskip("deepspeed")
    if shutil.which("g++") is None:
        pytest.skip("DeepSpeedCPUAdam builds with g++")
    from memplan.cli.commands import main

    root = tmp_path_factory.mktemp("ds")
    cases = {  # name: suggest arguments
        # the offload plan of full fine-tuning an 8B on a 24 GB card: it pins ~150 GiB, so a 256 GiB host
        "llama-3.1-8b-rtx4090": ["--model", "llama-3.1-8b", "--gpu", "rtx4090", "--cpu-mem", "256"],
        "zero2-offload-optimizer": ["--model", str(tiny / "config.json"), "--gpu", "a100-80g", "--seq-len", str(SEQ),
                                    "--batch-size", "4", "--precision", "bf16", "--zero", "2", "--offload", "optimizer"],
        "zero1": ["--model", str(tiny / "config.json"), "--gpu", "a100-80g", "--seq-len", str(SEQ), "--batch-size", "4",
                  "--precision", "fp32", "--optim", "adamw_torch", "--zero", "1"],
        # LoRA under ZeRO-3: the frozen base partitioned with the adapters (docs/finetune.md, multi-GPU)
        "lora-zero3": ["--model", str(tiny / "config.json"), "--gpu", "a100-80g", "--seq-len", str(SEQ),
                       "--batch-size", "4", "--precision", "bf16", "--optim", "adamw_torch", "--zero", "3",
                       "--method", "lora", "--lora-r", "4"],
    }
    plans = {}
    for name, argv in cases.items():
        with pytest.raises(SystemExit) as done:
            main(["suggest", *argv, "--emit", "all", "-o", str(root / name)])
        assert done.value.code in (0, None)
        plans[name] = json.loads((root / name / "plan.json").read_text())["plan"]
    with socket.socket() as free:  # a port no other run on this machine holds (a fixed one collides)
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    job = {"cases": [str(root / n) for n in cases], "tiny": TINY, "seq": SEQ, "args": CPU_RUN, "model": NO_FLASH}
    r = subprocess.run([sys.executable, "-c", DEEPSPEED_RUN, json.dumps(job), port], capture_output=True, text=True,
                       env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    results = [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    return {os.path.basename(x["case"]): (plans[os.path.basename(x["case"])], x) for x in results}


def test_the_llama_8b_rtx4090_offload_plan_trains_through_the_hf_trainer_and_deepspeed(deepspeed_runs):
    """`suggest --model llama-3.1-8b --gpu rtx4090 --cpu-mem 256 --emit all` is an offload plan whose
    files start training (on a tiny llama): DeepSpeed builds DeepSpeedCPUAdam from ds_config.json's
    optimizer section, with the TrainingArguments' betas."""
    plan, run = deepspeed_runs["llama-3.1-8b-rtx4090"]
    assert plan["offload"] != "none" and plan["zero_stage"] >= 1
    assert run["steps"] == 2 and run["loss"] > 0
    assert run["optimizer"] == "DeepSpeedCPUAdam" and run["betas"] == [0.9, 0.95]


def test_zero2_optimizer_offload_trains(deepspeed_runs):
    plan, run = deepspeed_runs["zero2-offload-optimizer"]
    assert (plan["zero_stage"], plan["offload"]) == (2, "optimizer")
    assert run["steps"] == 2 and run["optimizer"] == "DeepSpeedCPUAdam" and run["betas"] == [0.9, 0.95]


def test_lora_under_zero3_trains_only_the_adapters(deepspeed_runs, tiny):
    import memplan

    plan, run = deepspeed_runs["lora-zero3"]
    assert (plan["zero_stage"], plan["estimate"]["workload"]["method"]) == (3, "lora")
    est = memplan.estimate(str(tiny / "config.json"), "a100-80g", seq_len=SEQ, precision="bf16", zero=3,
                           method="lora", lora_r=4)
    assert run["steps"] == 2 and run["loss"] > 0 and run["trained"] == est.model.params_trainable


def test_zero1_without_offload_trains_with_the_trainers_optimizer(deepspeed_runs):
    plan, run = deepspeed_runs["zero1"]
    assert (plan["zero_stage"], plan["offload"]) == (1, "none")
    assert run["steps"] == 2 and run["optimizer"] == "AdamW" and run["betas"] == [0.9, 0.95]


# -- fine-tuning methods ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_plan(tiny):
    """The tiny llama's first plan under bf16 with full checkpointing (what the methods below start from:
    the method is set on the plan's workload, so the three methods share one search)."""
    import memplan

    spec = memplan.resolve_model(str(tiny / "config.json"))
    s = memplan.suggest(spec, "a100-80g", seq_len=SEQ, global_batch=4, precision="bf16", optim="adamw_torch",
                        grad_ckpt="full", kernels=False, attn="sdpa", top=1)
    return s.plans[0], spec


def with_method(plan, **fields):
    from memplan.inputs.workload import Workload

    return plan.model_copy(update={"workload": Workload(**{**plan.workload.model_dump(), **fields})})


@pytest.mark.parametrize("fields", [dict(method="lora"), dict(method="qlora"),
                                    dict(method="freeze", trainable_layers=1)],
                         ids=lambda f: f["method"])
def test_a_fine_tuning_method_trains_two_steps_from_the_emitted_files(fields, bf16_plan, tmp_path, capsys):
    """LoRA (bf16 base, bf16 autocast), 4-bit QLoRA (bitsandbytes' CPU backend) and frozen layers: the
    emitted train.py trains exactly the parameters memplan counted, and the loss is finite."""
    import math

    import torch
    from transformers import AutoConfig

    from memplan import emit
    from memplan.estimator.finetune import Tuning, params_trainable

    base, spec = bf16_plan
    plan = with_method(base, **fields)
    out = tmp_path / "emitted"
    emit.write(emit.render(plan, spec, ("trainer", "deepspeed", "accelerate")), str(out))
    method = fields["method"]
    assert (out / "lora_config.json").exists() == (method in ("lora", "qlora"))
    assert (out / "bnb_config.json").exists() == (method == "qlora")
    trainer = load_train_py(out).build_trainer(Tokens(), out, config=AutoConfig.for_model(**TINY),
                                               args_overrides=dict(CPU_RUN, output_dir=str(tmp_path / "run")))
    model = trainer.model
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    expected = params_trainable(spec, Tuning.of(plan.workload))
    assert sum(p.numel() for p in trained.values()) == expected > 0
    assert f"trainable params: {expected:,}" in capsys.readouterr().out
    kinds = {type(p).__name__ for p in model.parameters()}
    assert ("Params4bit" in kinds) == (method == "qlora")
    if method == "lora":  # the frozen base in bf16, the adapters in fp32
        assert model.get_parameter("base_model.model.model.layers.0.self_attn.k_proj.weight").dtype == torch.bfloat16
        assert {p.dtype for p in trained.values()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in trained.items()}
    result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss) and result.training_loss > 0
    assert all(not torch.equal(before[n], p) for n, p in trained.items() if "lora_B" in n)  # B starts at 0


def test_freeze_trains_the_last_block_the_head_and_the_final_norm(bf16_plan, tmp_path):
    """--method freeze --trainable-layers 1 (--modules-to-save embed_tokens): train.py trains layer 1, the
    final norm, the head and the embeddings, and leaves layer 0 as it was."""
    import math

    import torch
    from transformers import AutoConfig

    from memplan import emit

    base, spec = bf16_plan
    plan = with_method(base, method="freeze", trainable_layers=1, modules_to_save=("embed_tokens",))
    out = tmp_path / "emitted"
    emit.write(emit.render(plan, spec, ("trainer",)), str(out))
    assert not (out / "lora_config.json").exists() and not (out / "bnb_config.json").exists()
    trainer = load_train_py(out).build_trainer(Tokens(), out, config=AutoConfig.for_model(**TINY),
                                               args_overrides=dict(CPU_RUN, output_dir=str(tmp_path / "run")))
    model = trainer.model
    trained = {n.rsplit(".", 1)[0].split(".layers.")[-1].split(".")[0] if ".layers." in n else n.rsplit(".", 1)[0]
               for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {"1", "model.norm", "lm_head", "model.embed_tokens"}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".layers.0." in n}
    up = "model.layers.1.mlp.up_proj.weight"
    trained_before = model.get_parameter(up).detach().clone()
    result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in frozen.items())
    assert not torch.equal(model.get_parameter(up), trained_before)
