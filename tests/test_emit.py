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
        # `fsdp` is typed `str | None` only so that a bare `--fsdp` parses; True is its documented value
        # (transformers 5.23 training_args.py, the field's comment and docstring)
        assert _type_ok(v, hints[k]) or (k, v) == ("fsdp", True), (k, v, hints[k])
    args = dict(kw)
    if ds_path:
        args["deepspeed"] = ds_path
    try:
        return TrainingArguments(**args)
    except ValueError as e:
        assert BF16_ON_CPU in str(e), e
        return TrainingArguments(**dict(args, bf16=False, use_cpu=True))


def quiet_training_arguments(kw: dict, ds_path: str | None = None, allowed: tuple[str, ...] = ()):
    """check_training_arguments, asserting that transformers neither warns nor logs a deprecation."""
    import logging
    import warnings

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, log = Keep(logging.WARNING), logging.getLogger("transformers")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = check_training_arguments(kw, ds_path)
    finally:
        log.removeHandler(handler)
    said = records + [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    said = [m for m in said if "deprecat" in m.lower() and not any(x in m for x in allowed)]
    assert not said, said
    return a


@pytest.fixture(scope="module")
def ddp_plan():
    return memplan.suggest("bert-large", "v100-16g").plans[0]


def test_bert_large_v100_training_arguments(ddp_plan, tmp_path):
    kw = ddp_plan.training_arguments()
    a = quiet_training_arguments(kw)
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


@pytest.mark.parametrize("zero,offload", [("1", "none"), ("2", "none"), ("2", "optimizer"), ("3", "none"),
                                         ("3", "optimizer"), ("3", "all")])
def test_deepspeed_config_accepted_at_world_size_8(zero, offload, monkeypatch, tmp_path):
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
    assert (zc.offload_param is not None) == (offload == "all")
    # under offload DeepSpeed builds its CPU Adam from the optimizer section (no client optimizer)
    assert (c.optimizer_name == "adamw") == (offload != "none")
    assert c.bfloat16_config.enabled if hasattr(c, "bfloat16_config") else c.bfloat16_enabled
    # the Trainer accepts it beside the emitted TrainingArguments (their batch numbers agree) and fills
    # the optimizer's "auto" values from them
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    a = quiet_training_arguments(p.training_arguments(), str(path))
    hf = a.hf_deepspeed_config.config
    assert hf["train_micro_batch_size_per_gpu"] == p.micro_batch
    if offload != "none":
        assert hf["optimizer"]["params"] == {"lr": a.learning_rate, "betas": [a.adam_beta1, a.adam_beta2],
                                             "eps": a.adam_epsilon, "weight_decay": a.weight_decay}


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
    # DeepSpeed derives the batch from its data-parallel ranks; the HF check would count the TP ranks too
    assert "train_batch_size" not in cfg
    c = _ds_config(cfg, p.dp, monkeypatch)
    assert c.train_batch_size == p.micro_batch * p.grad_accum * p.dp == 64
    assert c.tensor_parallel_config.autotp_size == 2  # DeepSpeed's TPTrainingConfig read the section


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
    assert names == ["accelerate_config.yaml", "launch.sh", "plan.json", "train.py", "training_args.json",
                     "training_args.py"]
    side = json.loads((out / "plan.json").read_text())
    assert side["memplan_version"] == memplan.__version__ and side["predicted_device_used_bytes"] > 0
    before = (out / "training_args.json").read_text()
    r = run("suggest", "--model", "bert-large", "--gpu", "v100-16g", "--emit", "all", "-o", str(out))
    assert r.returncode == 2 and "--force" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == ""  # refused before the search ran and printed
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


@pytest.mark.parametrize("kind", ["full-shard", "shard-grad-op", "hybrid-shard"])
def test_fsdp_training_arguments_in_the_form_transformers_wants(kind):
    """`fsdp=True` with everything in fsdp_config: no deprecation for the string form. Hybrid-shard is
    FSDP1's strategy, whose own deprecation transformers logs (docs/emit.md says why it stays)."""
    s = memplan.suggest("llama-3.1-8b", "a100-80g", gpus=8, nodes=2 if kind == "hybrid-shard" else 1, seq_len=2048,
                        global_batch=64, fsdp=kind, top=1)
    p = s.plans[0]
    kw = p.training_arguments()
    assert kw["fsdp"] is True
    a = quiet_training_arguments(kw, allowed=("FSDP1",) if kind == "hybrid-shard" else ())
    version, reshard = {"full-shard": (2, True), "shard-grad-op": (2, False), "hybrid-shard": (1, "hybrid_shard")}[kind]
    assert a.fsdp_plugin_args["fsdp_version"] == version and a.fsdp_plugin_args["reshard_after_forward"] == reshard
    assert a.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"


@pytest.mark.parametrize("kind", ["full-shard", "hybrid-shard"])
def test_fsdp_plugin_the_trainer_builds_keeps_the_accelerate_yaml_settings(kind, monkeypatch):
    """Under launch.sh the Trainer builds its own FullyShardedDataParallelPlugin from TrainingArguments
    (transformers 5.23 _process_fsdp_args), replacing the YAML's: sharded state dicts and CPU-RAM-efficient
    loading must reach it from fsdp_config, and the YAML's fsdp_config is the same settings renamed."""
    from accelerate import FullyShardedDataParallelPlugin

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # TrainingArguments sets it; restored after
    p = memplan.suggest("llama-3.1-8b", "a100-80g", gpus=8, nodes=2 if kind == "hybrid-shard" else 1, seq_len=2048,
                        global_batch=64, fsdp=kind, top=1).plans[0]
    a = quiet_training_arguments(p.training_arguments(), allowed=("FSDP1",) if kind == "hybrid-shard" else ())
    args = a.fsdp_plugin_args
    assert args["state_dict_type"] == "SHARDED_STATE_DICT" and args["cpu_ram_efficient_loading"] is True
    if kind == "full-shard":  # FSDP1's plugin (sync_module_states) needs an accelerator device to build
        plugin = FullyShardedDataParallelPlugin(**args)  # as transformers' Trainer builds it
        assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and plugin.cpu_ram_efficient_loading is True
    kw, doc = p.training_arguments()["fsdp_config"], p.accelerate_config()["fsdp_config"]
    assert doc["fsdp_state_dict_type"] == kw["state_dict_type"] and doc["fsdp_cpu_ram_efficient_loading"] is True
    assert doc["fsdp_version"] == kw["version"] and doc["fsdp_activation_checkpointing"] == kw["activation_checkpointing"]


def test_launch_section_carries_what_the_plan_needs():
    """Kernels, the loading kwargs and checkpointing reach plan.json as data; train.py reads them."""
    # offload needs ~150 GiB of host RAM; the kernels asked for, so that they are in the plan to carry
    p = memplan.suggest("llama-3.1-8b", "rtx4090", top=1, cpu_mem=256 << 30, kernels=True, tiled_mlp=True).plans[0]
    files = emit.render(p, memplan.resolve_model("llama-3.1-8b"), ("trainer", "deepspeed", "accelerate"))
    launch = json.loads(files["plan.json"])["launch"]
    assert launch["model"] == "meta-llama/Llama-3.1-8B" and launch["auto_class"] == "AutoModelForCausalLM"
    assert launch["model_kwargs"] == {"attn_implementation": {"flash": "flash_attention_2", "sdpa": "sdpa",
                                                              "eager": "eager"}[p.attn], "dtype": "float32"}
    assert launch["kernels"] == {"loss": True, "mlp": True, "attention": False}
    assert launch["checkpointing"] == p.grad_ckpt and launch["not_expressed"] == []
    assert launch["command"] == "accelerate launch --config_file accelerate_config.yaml train.py"
    assert launch["command"] in files["launch.sh"]
    trainer_only = emit.render(p, memplan.resolve_model("llama-3.1-8b"), ("trainer", "deepspeed"))
    assert json.loads(trainer_only["plan.json"])["launch"]["command"] == "deepspeed --num_nodes 1 --num_gpus 1 train.py"


def test_a_layout_no_file_expresses_is_said_in_plan_json(monkeypatch):
    """TP + SP and an interleaved pipeline: ds_config.json carries what DeepSpeed accepts (AutoTP, the
    pipeline section); SP and interleaving are listed in launch.not_expressed; a pipeline has no Trainer files."""
    s = memplan.suggest("llama-3.1-70b", "h100-80g", gpus=8, nodes=4, seq_len=4096, global_batch=256, tp="2", sp="on",
                        pp="4", vpp="2", zero="0,1", top=1)
    p = s.plans[0]
    files = emit.render(p, memplan.resolve_model("llama-3.1-70b"), ("trainer", "deepspeed", "accelerate"))
    assert "training_args.json" not in files and "train.py" not in files and "launch.sh" not in files
    cfg = json.loads(files["ds_config.json"])
    assert cfg["tensor_parallel"] == {"autotp_size": 2} and cfg["pipeline"]["stages"] == 4
    c = _ds_config(cfg, p.dp, monkeypatch)
    assert c.pipeline["stages"] == 4 and c.tensor_parallel_config.autotp_size == 2
    launch = json.loads(files["plan.json"])["launch"]
    assert {x["setting"] for x in launch["not_expressed"]} == {"sp", "vpp", "pp"} and launch["command"] is None


def test_verify_reads_the_plan_json_emit_wrote(ddp_plan, tmp_path):
    from memplan.verify.run import read_plan

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(emit.sidecar(ddp_plan)))
    model, gpu, work = read_plan(str(path), 0)
    assert model == "google-bert/bert-large-uncased" and gpu == "v100-16g"
    assert work["micro_batch"] == ddp_plan.micro_batch and work["precision"] == ddp_plan.precision


@pytest.mark.parametrize("out", ["", "   ", "/proc/memplan-x", "/dev/null/sub"])
def test_cli_emit_refuses_an_unwritable_directory_before_searching(out, memplan_cli):
    r = memplan_cli("suggest", "--model", "bert-large", "--gpu", "v100-16g", "--emit", "all", "-o", out)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, (r.stdout, r.stderr)
    assert "-o" in r.stderr


def test_cli_emit_refuses_before_searching_every_file_it_may_write(tmp_path, memplan_cli):
    """train.py (and ds_config.json, which a DeepSpeed plan's TrainingArguments name) are checked with the
    rest before the search prints anything; -o without --emit and a name no file system takes are refused."""
    (tmp_path / "train.py").write_text("mine")
    r = memplan_cli("suggest", "--model", "bert-large", "--gpu", "v100-16g", "--emit", "trainer", "-o", str(tmp_path))
    assert r.returncode == 2 and r.stdout == "" and "train.py" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    for argv in (("-o", str(tmp_path / "x")), ("--force",), ("--emit", "all", "-o", "x" * 300)):
        r = memplan_cli("suggest", "--model", "bert-large", "--gpu", "v100-16g", *argv)
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)


def test_emit_accelerate_claims_only_the_files_it_writes(ddp_plan, tmp_path):
    """The accelerate YAML alone starts nothing (launch.sh runs train.py, the trainer kind's): it writes no
    launch.sh, so an -o holding one is not refused for it; --emit all still checks launch.sh."""
    files = emit.render(ddp_plan, memplan.resolve_model("bert-large"), ("accelerate",))
    assert "launch.sh" not in files and "accelerate_config.yaml" in files
    assert "launch.sh" not in emit.emit_names("accelerate") and "launch.sh" in emit.emit_names("all")
    (tmp_path / "launch.sh").write_text("mine")
    emit.check_directory(str(tmp_path), emit.emit_names("accelerate"))
    with pytest.raises(UserError, match="launch.sh"):
        emit.check_directory(str(tmp_path), emit.emit_names("all"))


def test_trainer_files_of_a_deepspeed_plan_bring_the_ds_config_they_name():
    p = memplan.suggest("llama-3.1-8b", "rtx4090", top=1, cpu_mem=256 << 30).plans[0]
    files = emit.render(p, memplan.resolve_model("llama-3.1-8b"), ("trainer",))
    assert json.loads(files["training_args.json"])["deepspeed"] == "ds_config.json" and "ds_config.json" in files


# -- fine-tuning methods (docs/finetune.md): the files train.py reads --------------------------------
def with_method(plan, **fields):
    """The plan with its workload's method fields set (one search shared by the methods' tests)."""
    from memplan.inputs.workload import Workload

    return plan.model_copy(update={"workload": Workload(**{**plan.workload.model_dump(), **fields})})


@pytest.fixture(scope="module")
def llama_plans():
    """llama-3.2-1b on one A100 under each precision, one replica, no memplan kernels."""
    def first(precision):
        return memplan.suggest("llama-3.2-1b", "a100-80g", precision=precision, zero="0", grad_ckpt="full",
                               kernels=False, optim="adamw_torch", top=1).plans[0]

    return {p: first(p) for p in ("bf16", "fp16", "fp32", "bf16-pure")}


@pytest.mark.parametrize("precision,fields,expected", [
    ("bf16", {}, dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                      bnb_4bit_compute_dtype="bfloat16", bnb_4bit_quant_storage="uint8")),
    ("fp16", dict(quant="fp4", double_quant=False, quant_storage="fp16"),
     dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False,
          bnb_4bit_compute_dtype="float16", bnb_4bit_quant_storage="float16")),
    ("fp32", {}, dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                      bnb_4bit_compute_dtype="float32", bnb_4bit_quant_storage="uint8")),
    ("bf16", dict(compute_dtype="fp32", quant_storage="bf16"),
     dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
          bnb_4bit_compute_dtype="float32", bnb_4bit_quant_storage="bfloat16")),
    ("bf16", dict(quant="int8"), dict(load_in_8bit=True)),
])
def test_qlora_bnb_config_builds_the_planned_bitsandbytes_config(precision, fields, expected, llama_plans):
    import torch
    from transformers import BitsAndBytesConfig

    plan = with_method(llama_plans[precision], method="qlora", **fields)
    files = emit.render(plan, memplan.resolve_model("llama-3.2-1b"), ("trainer",))
    bnb = json.loads(files["bnb_config.json"])
    assert bnb == expected
    c = BitsAndBytesConfig(**bnb)
    assert c.load_in_4bit == bnb.get("load_in_4bit", False) and c.load_in_8bit == bnb.get("load_in_8bit", False)
    if c.load_in_4bit:
        assert c.bnb_4bit_quant_type == bnb["bnb_4bit_quant_type"]
        assert c.bnb_4bit_compute_dtype == getattr(torch, bnb["bnb_4bit_compute_dtype"])
        assert c.bnb_4bit_quant_storage == getattr(torch, bnb["bnb_4bit_quant_storage"])
    launch = json.loads(files["plan.json"])["launch"]
    half = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[precision]
    assert launch["model_kwargs"]["dtype"] == half  # the base loads in the precision's half type
    assert (launch["method"], launch["lora_config"], launch["quantization_config"]) == ("qlora", "lora_config.json",
                                                                                     "bnb_config.json")


def test_plan_json_names_only_the_method_files_written(llama_plans):
    """--emit accelerate writes no lora_config.json / bnb_config.json (no train.py reads them): plan.json's
    launch names none; --emit trainer writes and names both."""
    plan = with_method(llama_plans["bf16"], method="qlora")
    spec = memplan.resolve_model("llama-3.2-1b")
    files = emit.render(plan, spec, ("accelerate",))
    assert "lora_config.json" not in files and "bnb_config.json" not in files
    launch = json.loads(files["plan.json"])["launch"]
    assert (launch["method"], launch["lora_config"], launch["quantization_config"]) == ("qlora", None, None)
    launch = json.loads(emit.render(plan, spec, ("trainer",))["plan.json"])["launch"]
    assert (launch["lora_config"], launch["quantization_config"]) == ("lora_config.json", "bnb_config.json")


def test_lora_config_resolves_peft_defaults_and_builds_a_lora_config(llama_plans):
    from peft import LoraConfig, TaskType
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    spec = memplan.resolve_model("llama-3.2-1b")
    plan = with_method(llama_plans["bf16"], method="lora", lora_r=16, lora_alpha=32.0, lora_dropout=0.05)
    files = emit.render(plan, spec, ("trainer", "deepspeed", "accelerate"))
    assert "bnb_config.json" not in files
    cfg = json.loads(files["lora_config.json"])
    c = LoraConfig(**cfg)
    assert c.target_modules == set(PEFT_DEFAULTS["llama"])  # PEFT's own default, written out
    assert (c.r, c.lora_alpha, c.lora_dropout, c.bias, c.task_type) == (16, 32, 0.05, "none", TaskType.CAUSAL_LM)
    assert c.modules_to_save is None
    wide = with_method(llama_plans["bf16"], method="lora", lora_targets=("all-linear",), modules_to_save=("lm_head",))
    cfg = emit.lora_config(wide, spec)
    assert cfg["target_modules"] == "all-linear" and LoraConfig(**cfg).modules_to_save == ["lm_head"]
    assert json.loads(files["plan.json"])["launch"]["model_kwargs"]["dtype"] == "bfloat16"
    assert "lora_config.json" in emit.emit_names("trainer") and "bnb_config.json" in emit.emit_names("all")


def test_lora_config_of_a_classifier_gives_peft_the_task_memplan_counted(tmp_path):
    """A sequence classifier: task_type SEQ_CLS, so PEFT trains a copy of the classifier beside the adapters,
    as memplan counts (get_peft_model on the meta device)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from memplan.estimator.finetune import Tuning, params_trainable

    tiny = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
            "max_position_embeddings": 64, "num_labels": 3}
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    spec = memplan.resolve_model(str(tmp_path / "config.json"), head="sequence-classification")
    plan = memplan.suggest(spec, "a100-80g", seq_len=64, global_batch=8, precision="bf16", zero="0", top=1).plans[0]
    plan = with_method(plan, method="lora", grad_ckpt="none")
    cfg = emit.lora_config(plan, spec)
    assert cfg["task_type"] == "SEQ_CLS" and cfg["target_modules"] == ["query", "value"]
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**tiny))
    peft_model = get_peft_model(model, LoraConfig(**cfg))
    assert peft_model.get_nb_trainable_parameters()[0] == params_trainable(spec, Tuning.of(plan.workload))


def test_training_arguments_of_a_qlora_plan(llama_plans):
    """The plan's optimizer (paged 8-bit AdamW), bf16 autocast over the bf16 base, and non-reentrant
    checkpointing under the installed transformers' field names."""
    plan = with_method(llama_plans["bf16"], method="qlora", optim="paged_adamw_8bit")
    kw = plan.training_arguments()
    assert kw["optim"] == "paged_adamw_8bit" and kw["bf16"] is True and kw["fp16"] is False
    assert kw["activation_checkpointing"] is True and kw["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    a = quiet_training_arguments(kw)
    assert a.optim == "paged_adamw_8bit" and a.activation_checkpointing_kwargs == {"use_reentrant": False}
    pure = with_method(llama_plans["bf16-pure"], method="lora", grad_ckpt="none").training_arguments()
    assert not pure["bf16"] and not pure["fp16"] and "activation_checkpointing_kwargs" not in pure
