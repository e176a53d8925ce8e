"""One set of defaults, said the same way by estimate, suggest, verify and the API; host RAM is a limit
like GPU memory (memplan.inputs.defaults)."""

from __future__ import annotations

import json
import os

import pytest

import memplan
from memplan.inputs import defaults
from memplan.inputs.catalog import list_models

GIB = 2**30


def _line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("defaults: "))


@pytest.fixture(scope="module")
def three():
    """estimate, suggest and verify (fake trace: one short run) --json for the same question."""
    import contextlib
    import io

    from memplan.cli.commands import main

    args = ["--model", "gpt2", "--gpu", "a100-80g", "--seq-len", "64", "--json"]
    out = {}
    for cmd in ("estimate", "suggest", "verify"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            try:
                main([cmd, *args, *(["--device", "fake"] if cmd == "verify" else [])])
            except SystemExit as e:
                assert e.code in (0, None), (cmd, e.code)
        out[cmd] = json.loads(buf.getvalue())
    return out


def test_the_defaults_are_the_same_in_every_command(three):
    said = three["estimate"]["defaults"]
    assert said == three["suggest"]["defaults"] == three["verify"]["defaults"]
    assert any(s.startswith("precision bf16 ") for s in said) and any("adamw_torch_fused" in s for s in said)
    assert any(s.startswith("host RAM 144 GiB per node") for s in said)
    assert three["estimate"]["workload"]["precision"] == three["suggest"]["plans"][0]["precision"] == "bf16"
    assert three["estimate"]["workload"]["kernels"] is False and not three["suggest"]["plans"][0]["kernels"]


def test_the_printed_line_is_the_json_list(memplan_cli, three):
    e = memplan_cli("estimate", "-m", "gpt2", "-g", "a100-80g", "--seq-len", "64")
    s = memplan_cli("suggest", "-m", "gpt2", "-g", "a100-80g", "--seq-len", "64")
    assert _line(e.stdout) == _line(s.stdout) == defaults.line(three["estimate"]["defaults"])


def test_the_api_fills_what_the_cli_fills():
    """seq-len: the model's (2048 for a decoder), not the Workload's 512; precision as suggest's."""
    api = memplan.estimate("llama-3.2-1b", "a100-80g")
    assert api.workload.seq_len == 2048 and api.workload.precision == "bf16" and api.workload.optim == "adamw_torch_fused"
    assert api.defaults == defaults.choose(memplan.resolve_model("llama-3.2-1b"), memplan.load_gpu("a100-80g"), {}).said
    given = memplan.estimate("llama-3.2-1b", "a100-80g", seq_len=512, precision="fp32", cpu_mem=64 * GIB)
    assert not any(s.startswith(("seq-len", "precision", "host RAM")) for s in given.defaults)
    v100 = memplan.estimate("bert-base", "v100-16g")
    assert v100.workload.precision == "fp16" and v100.workload.seq_len == 512


def test_inference_defaults_to_half_weights_and_says_what_autocast_costs():
    pure = memplan.estimate("llama-3.1-8b", "a100-80g", task="infer")
    assert pure.workload.precision == "bf16-pure"
    autocast = memplan.estimate("llama-3.1-8b", "a100-80g", task="infer", precision="bf16")
    assert autocast.breakdown["weights"] > 1.9 * pure.breakdown["weights"]
    assert any("autocast over fp32 weights" in n for n in autocast.notes)
    assert not any("autocast" in n for n in pure.notes)


def test_the_default_prompt_leaves_the_new_tokens_room_in_learned_positions(memplan_cli):
    """GPT-2's 1,024 learned positions index the prompt and the generated tokens: --max-new-tokens 10 alone was
    refused for a --seq-len the user never gave. The default prompt is 1,014 now, in estimate, suggest and verify's
    defaults; a rotary model keeps its default."""
    e = memplan.estimate("gpt2", "a100-80g", task="infer", max_new_tokens=10)
    assert e.workload.seq_len == 1014 and "seq-len 1014 (1,024 learned positions less --max-new-tokens 10)" in e.defaults
    s = memplan.suggest("gpt2", "a100-80g", task="infer", max_new_tokens=10)
    assert s.plans and all(p.workload.seq_len == 1014 for p in s.plans)
    assert memplan.estimate("llama-3.2-1b", "a100-80g", task="infer", max_new_tokens=10).workload.seq_len == 2048
    r = memplan_cli("estimate", "-m", "gpt2", "-g", "a100-80g", "--task", "infer", "--max-new-tokens", "10")
    assert r.returncode == 0, r.stderr


# -- host RAM ---------------------------------------------------------------------------------------
def test_every_bundled_profile_states_its_host_with_a_source():
    for p in memplan.list_gpus():
        assert p.host_ram is not None and p.host_ram.per_gpu_bytes, p.name
        assert "http" in p.host_ram.source and p.host_ram.host, p.name
        assert 16 * GIB <= p.host_ram.per_gpu_bytes <= 512 * GIB


def test_auto_gets_this_machines_ram(monkeypatch):
    import memplan.inputs.profiles as prof

    monkeypatch.setattr(prof, "read_nvml", lambda: ("NVIDIA A100-SXM4-80GB", 85899345920, (8, 0)))
    prof.load_gpu.cache_clear()
    try:
        gpu = prof.load_gpu("auto")
    finally:
        prof.load_gpu.cache_clear()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert gpu.host_ram.per_node_bytes == total == defaults.host_ram(gpu, 8) == defaults.host_ram(gpu, 1)
    assert any(s.startswith("host RAM") and "this machine" in s
               for s in defaults.choose(memplan.resolve_model("gpt2"), gpu, {}).said)


def test_the_8b_on_a_4090_needs_more_host_ram_than_a_desktop_has(memplan_cli):
    """The reproducer: full fine-tuning needs ~150 GiB pinned; the 4090's host has 45 GiB."""
    s = memplan.suggest("llama-3.1-8b", "rtx4090")
    assert not s.plans and s.host_ram_limit_bytes == 48 * 10**9
    assert "offload would fit with 135 GiB of host RAM per node" in s.notes[-1]
    given = memplan.suggest("llama-3.1-8b", "rtx4090", cpu_mem=200 * GIB)
    assert given.plans and all(0 < p.host_ram_per_node_bytes <= 200 * GIB for p in given.plans)
    assert all(p.estimate.host_ram_fits and p.estimate.host_ram_limit_bytes == 200 * GIB for p in given.plans)
    out = memplan_cli("suggest", "-m", "llama-3.1-8b", "-g", "rtx4090", "--cpu-mem", "200", "--top", "1")
    assert out.returncode == 0 and "host RAM" in out.stdout and "149.57 GiB" in out.stdout
    doc = json.loads(memplan_cli("suggest", "-m", "llama-3.1-8b", "-g", "rtx4090", "--cpu-mem", "200", "--top", "1",
                                 "--json").stdout)
    assert doc["host_ram_limit_bytes"] == 200 * GIB and doc["plans"][0]["host_ram_per_node_bytes"] > 140 * GIB


def test_estimate_says_whether_the_host_ram_fits(memplan_cli):
    e = memplan.estimate("llama-3.1-8b", "rtx4090", zero=3, offload="all")
    assert e.host_ram_limit_bytes == 48 * 10**9 and not e.host_ram_fits and not e.fits
    assert e.headroom_bytes > 0  # the GPU has room: it is the host that does not
    out = memplan_cli("estimate", "-m", "llama-3.1-8b", "-g", "rtx4090", "--zero", "3", "--offload", "all")
    assert "does not fit in 44.70 GiB" in out.stdout
    ok = memplan.estimate("llama-3.1-8b", "rtx4090", zero=3, offload="all", cpu_mem=256 * GIB)
    assert ok.host_ram_fits and ok.fits


def test_min_gpus_respects_the_host_ram():
    """A 70B on one H100 with 1,314 GiB pinned is not an answer: the host has 256 GiB per GPU."""
    s = memplan.suggest("llama-3.1-70b", "h100", gpus=8, global_batch=64, objective="min-gpus", top=3)
    assert s.plans and s.gpus * s.nodes > 1
    assert all(p.host_ram_per_node_bytes <= s.host_ram_limit_bytes == 256 * GIB * s.gpus for p in s.plans)


def test_kernels_are_an_alternative_not_a_default():
    s = memplan.suggest("llama-3.2-1b", "a10g", seq_len=2048, global_batch=64)
    assert s.plans and not any(p.kernels or p.tiled_mlp for p in s.plans)
    alt = [a for a in s.alternatives if "--kernels" in a.change or "--tiled-mlp" in a.change]
    assert alt and "memplan.kernels.apply" in alt[0].gain and (alt[0].plan.kernels or alt[0].plan.tiled_mlp)


# -- verify, suggest's refusals, piped tables ---------------------------------------------------------
def test_verify_compares_like_with_like(memplan_cli):
    r = memplan_cli("verify", "-m", "gpt2", "--steps", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--steps 2" in r.stderr


def test_suggest_gives_the_constraints_reason_for_bf16_on_v100(memplan_cli):
    e = memplan_cli("estimate", "-m", "bert-large", "-g", "v100", "--precision", "bf16")
    for prec in ("bf16", "fp16,bf16"):
        s = memplan_cli("suggest", "-m", "bert-large", "-g", "v100", "--precision", prec)
        assert s.returncode == e.returncode == 2 and s.stderr == e.stderr and "no bf16 support" in s.stderr
    assert memplan_cli("suggest", "-m", "bert-large", "-g", "v100", "--precision", "bf17").returncode == 2


def test_piped_tables_are_not_cut(memplan_cli):
    out = memplan_cli("models").stdout
    assert "…" not in out and all(e.name in out for e in list_models())
    s = memplan_cli("suggest", "-m", "gpt2", "-g", "t4", "--seq-len", "256", "--precision", "any", "--optim", "any",
                    "--gpus", "2").stdout
    assert "…" not in s and "adamw_torch_fused" in s


def test_models_lists_family_and_activation_method(memplan_cli):
    """memplan models --json: each entry's family line (attention kind, windows, experts) and how its activations
    are modelled (every catalog family has an analytic row)."""
    rows = {m["name"]: m for m in json.loads(memplan_cli("models", "--json").stdout)["models"]}
    assert rows["deepseek-v3"]["family"] == "decoder, MLA, MoE 256 x 8 + shared"
    assert rows["octocoder"]["family"] == "decoder, MQA" and rows["llama-3.1-8b"]["family"] == "decoder, GQA 32/8"
    assert "sliding window" in rows["gemma-2-2b"]["family"]
    assert {m["activations"] for m in rows.values()} == {"analytic"}
