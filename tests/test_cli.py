"""The CLI contract (docs/contract.md): --json documents, one-line errors with exit 2."""

import json
import subprocess
import sys

import pytest

import memplan


def run(*args):
    return subprocess.run([sys.executable, "-m", "memplan", *args], capture_output=True, text=True)


def test_estimate_json_contract():
    r = run("estimate", "--model", "bert-large", "--gpu", "v100-16g", "--micro-batch", "4", "--seq-len", "512",
            "--precision", "fp32", "--optim", "adamw_torch_fused", "--attn", "eager", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"]["params_total"] == d["model"]["params_trainable"] == 335_143_938
    for k in ("weights", "gradients", "optimizer_states", "activations", "cuda_context"):
        assert k in d["breakdown"]
    for k in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "fits"):
        assert k in d
    # the CLI is the API's estimate, whose calibration tests/test_estimator.py holds (the replay, reserved_from)
    api = memplan.estimate("bert-large", "v100-16g", micro_batch=4, seq_len=512, precision="fp32",
                           optim="adamw_torch_fused", attn="eager")
    assert d["reserved_from"] == "replay" and d["device_used_bytes"] == api.device_used_bytes


def test_suggest_json_contract():
    r = run("suggest", "--model", "bert-large", "--gpu", "v100-16g", "--json")
    assert r.returncode == 0, r.stderr
    plans = json.loads(r.stdout)["plans"]
    assert plans
    for k in ("micro_batch", "grad_accum", "global_batch", "dp", "tp", "pp", "zero_stage", "precision", "optim",
              "grad_ckpt", "attn", "samples_per_s", "tokens_per_s", "estimate"):
        assert k in plans[0]


def test_human_output_shows_plan_and_meters():
    r = run("suggest", "--model", "bert-large", "--gpu", "v100-16g")
    assert r.returncode == 0 and "best: micro batch" in r.stdout and "fp16" in r.stdout
    r = run("estimate", "-m", "gpt2", "-g", "a100", "--precision", "bf16")
    assert r.returncode == 0 and "device used" in r.stdout and "peak allocated" in r.stdout


@pytest.mark.parametrize("args", [
    ("estimate", "-m", "bert-lage", "-g", "v100"),
    ("estimate", "-m", "gpt2", "-g", "v10"),
    ("estimate", "-m", "gpt2", "-g", "t4", "--precision", "bf16"),
    ("estimate", "-m", "gpt2", "-g", "v100", "--attn", "flash", "--precision", "fp16"),
    ("estimate", "-m", "gpt2", "-g", "v100", "--micro-batch", "0"),
    ("estimate", "-m", "gpt2", "-g", "v100", "--optim", "adamq"),
    ("estimate", "-m", "gpt2"),
    ("estimate", "-m", "gpt2", "-g", "v100", "--micro-batch", "many"),
    ("suggest", "-m", "gpt2", "-g", "a100", "--precision", "fp8"),
    ("estimate", "-m", "/nonexistent/config.json", "-g", "a100"),
    ("estimate", "-m", "gpt2", "-g", "/nonexistent/gpu.json"),
    ("estimate", "-m", "llama-3.1-8b", "-g", "h100", "--gpus", "8", "--tp", "3"),
    ("estimate", "-m", "llama-3.1-8b", "-g", "h100", "--gpus", "8", "--zero", "3", "--pp", "2"),
    ("estimate", "-m", "llama-3.1-8b", "-g", "h100", "--gpus", "8", "--offload", "optimizer"),
    ("estimate", "-m", "llama-3.1-8b", "-g", "h100", "--gpus", "8", "--zero", "two"),
    ("suggest", "-m", "llama-3.1-8b", "-g", "h100", "--gpus", "8", "--tp", "x"),
    ("suggest", "-m", "llama-3.1-8b", "-g", "h100", "--gpus", "0"),
    ("suggest", "-m", "llama-3.1-8b", "-g", "h100", "--cpu-mem", "-1"),
    ("frobnicate",),
])
def test_user_errors_are_one_line_exit_2(args, memplan_cli):
    """In this process (the CLI's main, as `python -m memplan` runs it): an uncaught exception fails the test
    as a traceback would; test_a_user_error_through_the_entry_point covers the subprocess."""
    r = memplan_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [("estimate", "-m", "bert-lage", "-g", "v100"), ("frobnicate",)])
def test_a_user_error_through_the_entry_point(args):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_list_commands():
    r = run("models", "--json")
    assert r.returncode == 0 and len(json.loads(r.stdout)["models"]) >= 36
    r = run("gpus", "--json")
    assert r.returncode == 0 and len(json.loads(r.stdout)["gpus"]) >= 14


def test_estimate_multi_gpu_flags():
    r = run("estimate", "-m", "llama-3.1-8b", "-g", "a100-40g", "--gpus", "4", "--nodes", "2", "--zero", "3",
            "--offload", "optimizer", "--micro-batch", "2", "--seq-len", "2048", "--precision", "bf16",
            "--grad-ckpt", "full", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    w = d["workload"]
    assert (w["gpus"], w["nodes"], w["zero"], w["offload"]) == (4, 2, 3, "optimizer")
    assert d["cpu_ram_per_node_bytes"] > 0 and d["fits"]
    for k in ("comm_buffers", "gathered_params"):
        assert k in d["breakdown"]
    r = run("estimate", "-m", "llama-3.1-70b", "-g", "h100", "--gpus", "8", "--nodes", "4", "--tp", "8", "--pp", "4",
            "--sp", "on", "--zero", "1", "--grad-accum", "16", "--seq-len", "4096", "--precision", "bf16")
    assert r.returncode == 0 and "dp 1 x tp 8 + SP x pp 4" in r.stdout and "per GPU" in r.stdout, r.stderr
    assert "replayed" not in r.stdout  # the replay covers one whole replica on one GPU (timeline.replayable)


def test_estimate_table_shows_the_replayed_reserved():
    """Peak reserved is the replay; the search's segment arithmetic is shown under it. On the lent H200
    (benchmarks/results/gpu_lease) this step measured 31,894 MiB, replayed 31,704; the arithmetic says 36,410."""
    r = run("estimate", "-m", "llama-3.2-1b", "-g", "h200", "--seq-len", "1024", "--micro-batch", "4",
            "--precision", "bf16", "--attn", "sdpa")
    assert r.returncode == 0, r.stderr
    lines = [line.strip() for line in r.stdout.splitlines()]
    row = next(line for line in lines if line.startswith("peak reserved"))
    assert float(row.split()[2]) * 1024 == pytest.approx(31894, rel=0.02) and "(replay)" in row
    arithmetic = next(line for line in lines if line.startswith("segment arithmetic"))
    assert float(arithmetic.split()[2]) * 1024 == pytest.approx(36410, rel=0.02)


def test_suggest_multi_gpu_json_and_why():
    r = run("suggest", "-m", "llama-3.1-8b", "-g", "a100-40g", "--gpus", "8", "--seq-len", "2048",
            "--batch-size", "64", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["plans"] and d["why"] and d["pareto"]
    for p in d["plans"]:
        assert p["micro_batch"] * p["grad_accum"] * p["dp"] == 64 and p["dp"] * p["tp"] * p["pp"] == 8
    r = run("suggest", "-m", "llama-3.1-8b", "-g", "a100-40g", "--gpus", "8", "--seq-len", "2048",
            "--batch-size", "64")
    assert r.returncode == 0 and "why this plan" in r.stdout and "Pareto front" in r.stdout


# -- issue 14's "Bad input": every reproducer refused in one line, exit 2, within 5 s -------------------
HUGE = str(2**63)
LONG = "x" * 300
REPRODUCERS = [  # (command line, what the one line says)
    ("suggest -m gpt2 -g a100 --optim galore_adamw", "unknown optimizer 'galore_adamw'"),
    ("suggest -m gpt2 -g a100 --optim ,", "unknown optimizer ''"),
    ("estimate -m gpt2 -g a100 --cpu-mem nan", "--cpu-mem: must be a finite number"),
    ("suggest -m gpt2 -g a100 --cpu-mem inf", "--cpu-mem: must be a finite number"),
    ("estimate -m gpt2 -g a100 --cpu-mem 1e300", "--cpu-mem 1e+300 GiB: reads 1 MiB to 1,048,576 GiB"),
    ("estimate -m gpt2 -g a100 --cpu-mem -1", "--cpu-mem -1.0 GiB: reads 1 MiB to"),  # was said in bytes
    ("estimate -m gpt2 -g a100 --headroom inf", "headroom: Input should be a finite number"),
    ("suggest -m gpt2 -g a100 --headroom inf", "--headroom: Input should be a finite number"),
    ("estimate -m gpt2 -g a100 --pp 0", "pp: must be at least 1"),
    ("estimate -m gpt2 -g a100 --tp 0", "tp: must be at least 1"),
    ("estimate -m gpt2 -g a100 --vpp 0", "vpp: must be at least 1"),
    (f"estimate -m gpt2 -g a100 --seq-len {HUGE}", "seq_len: 9,223,372,036,854,775,808 is over memplan's bound"),
    (f"estimate -m llama-3.1-8b -g a100 --task infer --max-new-tokens {HUGE}", "max_new_tokens: "),
    ("estimate -m gpt2 -g a100 -b 99999999999999999999", "micro_batch: "),
    (f"estimate -m {LONG} -g a100", "unknown model"),
    (f"suggest -m gpt2 -g {LONG}", "unknown GPU"),
    ("suggest -m gpt2 -g a100 --batch-size 1000000000", "--batch-size: 1,000,000,000 is over memplan's bound"),
    (f"suggest -m gpt2 -g a100 --gpus {HUGE}", "--gpus: "),
    ("estimate -m gpt2 -g a100 -b 100000000", "micro_batch: 100,000,000 is over"),
    ("suggest -m gpt2 -g a100 --zero 5", "unknown zero '5'"),
    ("suggest -m gpt2 -g a100 --tp 3", "--tp 3 x --pp 1 must divide the 1 GPUs"),
    ("suggest -m gpt2 -g a100 --tp -2 --gpus 2", "--tp: a degree is at least 1"),
    ("suggest -m gpt2 -g a100 --gpus 2 --tp 16", "--tp 16 x --pp 1 must divide the 2 GPUs"),
    ("suggest -m gpt2 -g a100 --pp 3 --gpus 2", "--tp 1 x --pp 3 must divide the 2 GPUs"),
    ("suggest -m gpt2 -g a100 --pp -1", "--pp: a degree is at least 1"),
    ("suggest -m gpt2 -g a100 --headroom 1.5", "--headroom: "),
    ("suggest -m gpt2 -g a100 --headroom -0.1", "--headroom: "),
    ("suggest -m gpt2 -g a100 --net-gbs 0", "--net-gbs: "),
    ("suggest -m gpt2 -g a100 --net-gbs -1", "--net-gbs: "),
    ("suggest -m gpt2 -g a100 --net-gbs nan", "--net-gbs: Input should be a finite number"),
    ("suggest -m gpt2 -g a100 --optim sgd --optim-args momentum=-1", "--momentum: "),
    ("estimate -m gpt2 -g a100 --seq-len 0", "seq_len: must be at least 1, got 0"),
    ("estimate -m gpt2 -g a100 -b 0", "micro_batch: must be at least 1, got 0"),
    ("suggest -m gpt2 -g a100 --seq-len 0", "--seq-len: must be at least 1, got 0"),
    ("suggest -m gpt2 -g a100 --batch-size 0", "--batch-size: must be at least 1, got 0"),
    ("estimate -m llama-3.1-8b -g a100 --seq-len 100000000", "seq_len: 100,000,000 is over memplan's bound"),
    ("suggest -m llama-3.1-8b -g a100 --seq-len 100000000", "--seq-len: 100,000,000 is over memplan's bound"),
    ("estimate -m gpt2 -g a100 --seq-len 2048", "--seq-len 2,048 exceeds gpt2's 1,024 learned positions"),
    ("estimate -m gpt2 -g a100 --task infer --seq-len 1000 --max-new-tokens 100", "+ --max-new-tokens 100 exceeds"),
    ("estimate -m vit-base -g a100 --seq-len 1000", "vit-base reads a 224x224 image as 197 tokens"),
    ("suggest -m vit-base -g a100 --seq-len 1000", "vit-base reads a 224x224 image as 197 tokens"),
    ("suggest -m gpt2 -g a100 --sp on", "--sp (sequence parallel) needs --tp > 1"),
    ("estimate -m gpt2 -g a100 -b 4097 --seq-len 1024", "micro batch 4,097 x 1 beams x 1,024 tokens is over"),
    # a helper's probe of the CLI (this session): each had been accepted, coerced or echoed unused
    ("estimate -m gpt2 -g a100 --optim sgd --optim-args momentum=0.9,momentum=0", "--optim-args names momentum twice"),
    ("estimate -m gpt2 -g a100 --optim sgd --optim-args momentum=0.9,,", "'' is not key=value"),
    ("estimate -m gpt2 -g a100 --optim-args momentum=0.9", "momentum= applies to sgd, rmsprop"),
    ("estimate -m gpt2 -g a100 --task infer --optim sgd", "--optim applies to training only"),
    ("estimate -m gpt2 -g a100 --task infer --seq-len 128 --beams 4", "--beams applies to generation"),
    ("estimate -m gpt2 -g a100 --gpus 2 --tp 2 --sp on --seq-len 127", "--seq-len 127 does not divide"),
    ("estimate -m gpt2 -g a100 --head sequence-classification --task infer --seq-len 64 --max-new-tokens 4",
     "needs a language-model head"),
    ("suggest -m gpt2 -g a100 --gpus 2 --nodes 2 --net-gbs 1e-300", "--net-gbs: must be at least 0.1"),
    ("estimate -m gpt2 -g a100 --attn flash_attention_3", "flash_attention_3 (FlashAttention-3, Hopper only) is not"),
    ("estimate -m gpt2 -g v100 --task infer --precision bf16-pure", "use --precision fp16-pure"),
    ("estimate -m /dev/null -g a100", "not a regular file (a config.json or its folder)"),
]


@pytest.mark.parametrize("line, says", REPRODUCERS, ids=[r[0][:60] for r in REPRODUCERS])
def test_issue_14_reproducers_exit_2_with_one_line(memplan_cli, line, says):
    import time

    t0 = time.perf_counter()
    r = memplan_cli(*line.split())
    assert time.perf_counter() - t0 < 5
    assert r.returncode == 2 and r.stderr.count("\n") == 1, (r.stdout[-300:], r.stderr)
    assert says in r.stderr


@pytest.mark.parametrize("config, says", [
    ({"hidden_size": -256}, "config 'hidden_size' is -256"),
    ({"num_attention_heads": 3}, "3 attention heads do not divide the hidden size 256"),
    ({"hidden_size": "abc"}, "config 'hidden_size' must be an integer, got 'abc'"),
    ({"num_hidden_layers": 10_000}, "config 'num_hidden_layers' is 10,000"),
    ({"num_key_value_heads": 3}, "3 key-value heads do not divide the 4 attention heads"),
])
def test_bad_config_json_is_refused_before_transformers(memplan_cli, tmp_path, config, says):
    base = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    r = memplan_cli("estimate", "-m", str(tmp_path / "config.json"), "-g", "a100")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


def test_gpt2_config_with_a_string_width(memplan_cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": "abc", "n_head": 4}))
    r = memplan_cli("estimate", "-m", str(tmp_path / "config.json"), "-g", "a100")
    assert r.returncode == 2 and "config 'n_embd' must be an integer, got 'abc'" in r.stderr


def test_a_hub_id_offline_fails_fast_in_one_line():
    """No network: one line within a few seconds (transformers' retries took 28-34 s), and no transformers
    import when the config is not cached. A fresh process: the CLI as a user runs it."""
    import os
    import time

    env = dict(os.environ, HF_HUB_OFFLINE="0", HTTPS_PROXY="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "memplan", "estimate", "-m", "someorg/not-a-model", "-g", "a100"],
                       capture_output=True, text=True, env=env)
    assert time.perf_counter() - t0 < 5
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "the Hugging Face hub is unreachable (offline)" in r.stderr


def test_estimate_speaks_of_host_ram_only_where_offload_pins_some(memplan_cli):
    plain = memplan_cli("estimate", "--model", "gpt2", "--gpu", "a100-80g")
    assert plain.returncode == 0 and "offload pins" not in plain.stdout
    offload = memplan_cli("estimate", "--model", "gpt2", "--gpu", "a100-80g", "--zero", "2", "--offload", "optimizer")
    assert "offload pins" in offload.stdout and "of host RAM per node (1 GPUs): fits in" in offload.stdout
    short = memplan_cli("estimate", "--model", "gpt2", "--gpu", "a100-80g", "--zero", "2", "--offload", "optimizer",
                        "--cpu-mem", "0.5")
    assert "does not fit in 512 MiB" in short.stdout


@pytest.mark.parametrize("option, says", [("--fsdp", "fsdp: Input should be"), ("--offload", "offload: Input should be"),
                                          ("--head", "empty --head")])
def test_an_empty_option_is_refused_not_read_as_its_default(memplan_cli, option, says):
    r = memplan_cli("estimate", "-m", "gpt2", "-g", "a100", option, "")
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
