"""The CLI contract (docs/contract.md): --json documents, one-line errors with exit 2."""

import json
import subprocess
import sys

import pytest


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
    assert abs(d["device_used_bytes"] / 2**20 / 14949 - 1) < 0.05


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
def test_user_errors_are_one_line_exit_2(args):
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
