"""What memplan emits is accepted by the real libraries: transformers.TrainingArguments, DeepSpeed's
DeepSpeedConfig at the plan's world size, accelerate's config file loader and launch options."""

import dataclasses
import enum
import json
import types
import typing

import pytest
import yaml

import memplan
from memplan import emit
from memplan.errors import UserError

BF16_ON_CPU = "doesn't support bf16"


def _type_ok(value, hint) -> bool:
    """Whether `value` is a valid value of the dataclass annotation `hint`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin is not None:
        return isinstance(value, origin)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return value in {e.value for e in hint} or isinstance(value, hint)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


def check_training_arguments(kw: dict, ds_path: str | None = None):
    """Every field name and value type against the TrainingArguments dataclass, then construct it. On
    a CPU-only machine transformers refuses bf16: then the rest is constructed with use_cpu."""
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    unknown = set(kw) - fields
    assert not unknown, f"not TrainingArguments fields: {unknown}"
    hints = typing.get_type_hints(TrainingArguments)
    for k, v in kw.items():
        assert _type_ok(v, hints[k]), (k, v, hints[k])
    args = dict(kw)
    if ds_path:
        args["deepspeed"] = ds_path
    try:
        return TrainingArguments(**args)
    except ValueError as e:
        assert BF16_ON_CPU in str(e), e
        return TrainingArguments(**dict(args, bf16=False, use_cpu=True))


@pytest.fixture(scope="module")
def ddp_plan():
    return memplan.suggest("bert-large", "v100-16g").plans[0]


def test_bert_large_v100_training_arguments(ddp_plan, tmp_path):
    import warnings

    kw = ddp_plan.training_arguments()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = check_training_arguments(kw)
    deprecated = [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))
                  and any(k in str(w.message) for k in kw)]
    assert not deprecated, deprecated
    assert a.per_device_train_batch_size == ddp_plan.micro_batch
    assert a.gradient_accumulation_steps == ddp_plan.grad_accum and a.fp16
    # the .py snippet is valid Python and builds the same kwargs
    files = emit.render(ddp_plan, memplan.resolve_model("bert-large"), ("trainer",))
    ns: dict = {}
    code = files["training_args.py"].replace("from transformers import TrainingArguments", "")
    exec(code, {"TrainingArguments": lambda **k: k}, ns)
    assert ns["args"] == kw


def test_a_wrong_key_or_type_fails_the_check():
    with pytest.raises(AssertionError):
        check_training_arguments({"output_dir": "out", "per_device_train_batch_sizes": 4})
    with pytest.raises(AssertionError):
        check_training_arguments({"output_dir": "out", "per_device_train_batch_size": "4"})
    with pytest.raises(AssertionError):
        check_training_arguments({"output_dir": "out", "bf16": "yes"})


def _ds_top_level_keys() -> set[str]:
    """The top-level keys DeepSpeed reads: its config constants, plus the sections read elsewhere
    (zero_optimization: runtime/zero/config.py; activation_checkpointing:
    runtime/activation_checkpointing/config.py; tensor_parallel: runtime/tensor_parallel; pipeline:
    DeepSpeedConfig._initialize_params). DeepSpeedConfig ignores unknown top-level keys (nested
    sections are pydantic models that forbid extras), so the test checks them."""
    from deepspeed.runtime import constants
    from deepspeed.runtime.activation_checkpointing import config as ckpt_config
    from deepspeed.runtime.zero import config as zero_config

    keys = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
    return keys | {zero_config.ZERO_OPTIMIZATION, ckpt_config.ACT_CHKPT, "tensor_parallel", "pipeline"}


def _ds_config(cfg: dict, dp: int, monkeypatch):
    """DeepSpeedConfig as the engine builds it on rank 0 of `dp` data-parallel ranks."""
    ds = pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    unknown = set(cfg) - _ds_top_level_keys()
    assert not unknown, f"DeepSpeed reads no top-level key {unknown}"

    monkeypatch.setattr(ds.comm, "get_rank", lambda *a, **k: 0)

    class MPU:
        def get_data_parallel_world_size(self):
            return dp

    return DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=MPU())


@pytest.mark.parametrize("zero,offload", [("1", "none"), ("2", "optimizer"), ("3", "none"), ("3", "all")])
def test_deepspeed_config_accepted_at_world_size_8(zero, offload, monkeypatch):
    s = memplan.suggest("llama-3.1-8b", "a100-80g", gpus=8, seq_len=2048, global_batch=64, zero=zero,
                        offload=offload, tp="1", pp="1", top=1)
    p = s.plans[0]
    cfg = p.deepspeed_config()
    c = _ds_config(cfg, 8, monkeypatch)
    assert c.train_batch_size == p.micro_batch * p.grad_accum * 8 == 64
    assert c.zero_optimization_stage == int(zero)
    zc = c.zero_config
    assert zc.reduce_bucket_size == 4096 * 4096  # the number the estimator counted (hidden x hidden)
    if zero == "3":
        assert zc.param_persistence_threshold == 10 * 4096
    assert (zc.offload_optimizer is not None) == (offload != "none")
    assert c.bfloat16_config.enabled if hasattr(c, "bfloat16_config") else c.bfloat16_enabled
    # the Trainer accepts it beside the emitted TrainingArguments (their batch numbers agree)
    path = "ds_config_test.json"
    with open(path, "w") as f:
        json.dump(cfg, f)
    try:
        a = check_training_arguments(p.training_arguments(), path)
        assert a.hf_deepspeed_config.config["train_micro_batch_size_per_gpu"] == p.micro_batch
    finally:
        import os
        os.remove(path)


def test_a_wrong_deepspeed_key_fails_the_check(monkeypatch):
    good = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
    with pytest.raises(AssertionError):
        _ds_config(dict(good, zero_optimisation={"stage": 2}), 1, monkeypatch)  # misspelled section
    with pytest.raises(Exception):
        _ds_config(dict(good, zero_optimization={"stage": 2, "reduce_bucket_sizes": 5}), 1, monkeypatch)


def test_tensor_parallel_plan_counts_data_parallel_ranks(monkeypatch):
    s = memplan.suggest("llama-3.1-8b", "a100-40g", gpus=8, seq_len=2048, global_batch=64, zero="1,2,3", tp="2", pp="1",
                        top=1)
    p = s.plans[0]
    cfg = p.deepspeed_config()
    assert cfg["tensor_parallel"] == {"autotp_size": 2}
    c = _ds_config(cfg, p.dp, monkeypatch)
    assert c.train_batch_size == p.micro_batch * p.grad_accum * p.dp == 64


def _launch_options() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return {a.dest for a in launch_command_parser()._actions}


@pytest.mark.parametrize("kind", ["ddp", "deepspeed", "fsdp", "hybrid"])
def test_accelerate_config_loads(kind, tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig

    kw = dict(ddp=dict(zero="0", fsdp="none", tp="1", pp="1"), deepspeed=dict(zero="3", fsdp="none"),
              fsdp=dict(fsdp="full-shard"), hybrid=dict(fsdp="hybrid-shard"))[kind]
    model = "llama-3.2-1b" if kind == "ddp" else "llama-3.1-8b"
    s = memplan.suggest(model, "a100-80g", gpus=8, nodes=2 if kind == "hybrid" else 1, seq_len=2048,
                        global_batch=64, top=1, offload="none", **kw)
    p = s.plans[0]
    files = emit.render(p, memplan.resolve_model(model), ("accelerate",))
    path = tmp_path / "accelerate_config.yaml"
    path.write_text(files["accelerate_config.yaml"])
    c = ClusterConfig.from_yaml_file(str(path))  # unknown top-level keys raise
    assert c.num_processes == p.gpus * p.nodes and c.num_machines == p.nodes
    doc = yaml.safe_load(path.read_text())
    options = _launch_options()
    for section in ("fsdp_config", "deepspeed_config"):
        for key in doc.get(section, {}):
            assert key in options, f"{section}.{key} is not an accelerate launch option"
    expected = {"ddp": "MULTI_GPU", "deepspeed": "DEEPSPEED", "fsdp": "FSDP", "hybrid": "FSDP"}[kind]
    assert str(c.distributed_type).endswith(expected)
    if kind in ("fsdp", "hybrid"):
        assert doc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"


def test_cli_emit_writes_files_atomically_and_never_overwrites(tmp_path, memplan_cli):
    run = memplan_cli
    out = tmp_path / "out"
    r = run("suggest", "--model", "bert-large", "--gpu", "v100-16g", "--emit", "all", "-o", str(out))
    assert r.returncode == 0, r.stderr
    names = sorted(x.name for x in out.iterdir())
    assert names == ["accelerate_config.yaml", "plan.json", "training_args.json", "training_args.py"]
    side = json.loads((out / "plan.json").read_text())
    assert side["memplan_version"] == memplan.__version__ and side["predicted_device_used_bytes"] > 0
    before = (out / "training_args.json").read_text()
    r = run("suggest", "--model", "bert-large", "--gpu", "v100-16g", "--emit", "all", "-o", str(out))
    assert r.returncode == 2 and "--force" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert (out / "training_args.json").read_text() == before
    r = run("suggest", "--model", "bert-large", "--gpu", "v100-16g", "--emit", "all", "-o", str(out), "--force")
    assert r.returncode == 0, r.stderr
    r = run("suggest", "--model", "bert-large", "--gpu", "v100-16g", "--emit", "trainer", "-o", "-")
    assert r.returncode == 0 and "# ---- training_args.json" in r.stdout


@pytest.mark.parametrize("extra", [(), ("--tp", "1", "--pp", "1")])
def test_cli_emit_deepspeed_must_show(extra, tmp_path, monkeypatch, memplan_cli):
    """llama-3.1-8b on 8 x A100 40 GB with --emit deepspeed. memplan may choose AutoTP (tp 2 x dp 4): DeepSpeed counts the 4
    data-parallel ranks in train_batch_size; with --tp 1 the plan is ZeRO over all 8."""
    out = tmp_path / "out"
    r = memplan_cli("suggest", "--model", "llama-3.1-8b", "--gpu", "a100-40g", "--gpus", "8", "--emit", "deepspeed", "-o",
            str(out), *extra)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "ds_config.json").read_text())
    plan = json.loads((out / "plan.json").read_text())["plan"]
    assert cfg["zero_optimization"]["stage"] == plan["zero_stage"] >= 1
    c = _ds_config(cfg, plan["dp"], monkeypatch)
    assert c.train_batch_size == plan["micro_batch"] * plan["grad_accum"] * plan["dp"]
    if extra:
        assert plan["dp"] == 8 and c.train_batch_size == plan["micro_batch"] * plan["grad_accum"] * 8


def test_pipeline_plans_have_no_trainer_file():
    s = memplan.suggest("llama-3.1-70b", "h100-80g", gpus=8, nodes=2, seq_len=4096, global_batch=64, pp="2", tp="8",
                        zero="0,1", top=1)
    with pytest.raises(UserError, match="PipelineModule"):
        s.plans[0].training_arguments()
