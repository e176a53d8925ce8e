"""The CLI contract of DESIGN.md: --json documents, one-line errors with exit 2."""

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
