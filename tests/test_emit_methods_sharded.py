"""The files of a fine-tuning method under ZeRO 1-3 and FSDP2 are accepted by the real libraries, as
tests/test_emit.py checks them for full fine-tuning: DeepSpeedConfig at the plan's world size, TrainingArguments
beside ds_config.json, accelerate's config loader and FullyShardedDataParallelPlugin, peft's LoraConfig and
transformers' BitsAndBytesConfig (quant_storage = the dtype the model is sharded in)."""

import json

import pytest
import yaml
from test_emit import _ds_config, _launch_options, quiet_training_arguments  # tests/test_emit.py

import memplan
from memplan import emit

MODEL = "llama-3.1-8b"
QLORA = dict(method="qlora", quant_storage="bf16")


def plan_of(**kw):
    """The best plan with the sharding asked for (the search also keeps plain DDP beside --fsdp)."""
    s = memplan.suggest(MODEL, "a100-80g", gpus=8, seq_len=2048, global_batch=64, top=50, **kw)
    fits = [p for p in s.plans if p.fsdp == kw.get("fsdp", "none") and str(p.zero_stage) == kw.get("zero", "0")]
    assert fits, s.notes
    return fits[0]


@pytest.fixture(scope="module")
def spec():
    return memplan.resolve_model(MODEL)


@pytest.mark.parametrize("zero,method", [("1", dict(method="lora")), ("2", QLORA), ("3", dict(method="lora")),
                                         ("3", QLORA), ("3", dict(method="freeze", trainable_layers=2))],
                         ids=["zero1-lora", "zero2-qlora", "zero3-lora", "zero3-qlora", "zero3-freeze"])
def test_deepspeed_files_of_a_method(zero, method, spec, monkeypatch, tmp_path):
    p = plan_of(zero=zero, offload="none", tp="1", pp="1", **method)
    assert p.workload.method == method["method"] and p.zero_stage == int(zero)
    files = emit.render(p, spec, ("trainer", "deepspeed", "accelerate"))
    cfg = json.loads(files["ds_config.json"])
    c = _ds_config(cfg, 8, monkeypatch)
    assert c.zero_optimization_stage == int(zero) and c.train_batch_size == 64
    path = tmp_path / "ds_config.json"
    path.write_text(files["ds_config.json"])
    a = quiet_training_arguments(json.loads(files["training_args.json"]), str(path))
    assert a.hf_deepspeed_config.config["zero_optimization"]["stage"] == int(zero)
    launch = json.loads(files["plan.json"])["launch"]
    assert launch["method"] == method["method"]
    assert launch["command"] == "accelerate launch --config_file accelerate_config.yaml train.py"
    if method["method"] == "qlora":
        _check_bnb(files, launch)


def _check_bnb(files: dict, launch: dict) -> None:
    """bnb_config.json stores the 4-bit weights in bf16, the dtype the base loads in: ZeRO-3 and FSDP shard
    them with the other bf16 parameters."""
    import torch
    from transformers import BitsAndBytesConfig

    bnb = json.loads(files["bnb_config.json"])
    c = BitsAndBytesConfig(**bnb)
    assert c.bnb_4bit_quant_storage == torch.bfloat16 == getattr(torch, launch["model_kwargs"]["dtype"])


@pytest.mark.parametrize("fsdp,method", [("full-shard", dict(method="lora")), ("full-shard", QLORA),
                                         ("shard-grad-op", dict(method="freeze", trainable_layers=2))],
                         ids=["full-shard-lora", "full-shard-qlora", "shard-grad-op-freeze"])
def test_fsdp_files_of_a_method(fsdp, method, spec, tmp_path):
    """FSDP2 (fsdp_version 2): every parameter its own DTensor, so frozen and trained parameters mix in a unit
    without FSDP1's use_orig_params; the plugin the Trainer builds from the arguments takes them."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.commands.config.config_args import ClusterConfig

    p = plan_of(fsdp=fsdp, **method)
    assert p.workload.method == method["method"] and p.fsdp == fsdp
    files = emit.render(p, spec, ("trainer", "accelerate"))
    a = quiet_training_arguments(json.loads(files["training_args.json"]))
    plugin = FullyShardedDataParallelPlugin(**a.fsdp_plugin_args)  # as transformers' Trainer builds it
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward == (fsdp == "full-shard")
    path = tmp_path / "accelerate_config.yaml"
    path.write_text(files["accelerate_config.yaml"])
    c = ClusterConfig.from_yaml_file(str(path))
    assert str(c.distributed_type).endswith("FSDP") and c.fsdp_config["fsdp_version"] == 2
    options = _launch_options()
    assert all(k in options for k in yaml.safe_load(path.read_text())["fsdp_config"])
    launch = json.loads(files["plan.json"])["launch"]
    if method["method"] == "qlora":
        _check_bnb(files, launch)


def test_train_py_loads_qlora_without_a_device_map_under_zero3(tmp_path, monkeypatch):
    """transformers refuses a device_map under ZeRO-3: the emitted train.py leaves placement to DeepSpeed."""
    import importlib.util

    spec_ = importlib.util.spec_from_file_location("train_emitted", emit.files.Path(emit.files.__file__).parent / "train.py")
    train = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(train)
    seen = {}

    class Auto:
        @staticmethod
        def from_pretrained(source, **kw):
            seen.update(kw)

    import transformers
    import transformers.integrations

    monkeypatch.setattr(transformers, "AutoModelForCausalLM", Auto)
    (tmp_path / "bnb_config.json").write_text(json.dumps({"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}))
    launch = {"model_kwargs": {"dtype": "bfloat16"}, "auto_class": "AutoModelForCausalLM", "model": "m",
              "quantization_config": "bnb_config.json"}
    args = type("Args", (), {"use_cpu": True})()
    for zero3 in (False, True):
        seen.clear()
        monkeypatch.setattr(transformers.integrations, "is_deepspeed_zero3_enabled", lambda: zero3)
        train.load_model(launch, tmp_path, args)
        assert ("device_map" in seen) == (not zero3) and "quantization_config" in seen
