"""DeepSeek-V3's multi-head latent attention: the spec's MLA fields, the activation terms, the KV cache per token,
attention FLOPs, and the catalog entries (fast: the small accuracy config on the meta device, catalog specs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memplan
from memplan.estimator.activations import training_activations
from memplan.estimator.inference import kv_bytes_per_token, kv_cache_bytes
from memplan.estimator.rules import PRECISIONS
from memplan.inputs.catalog import resolve_model
from memplan.search.cost import flops_per_token

SMALL = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy" / "configs" / "deepseek_v3-small.json"


@pytest.fixture(scope="module")
def small():
    from memplan.inputs.hf import spec_from_config

    return spec_from_config(json.loads(SMALL.read_text()), "deepseek_v3-small")


def test_spec_reads_the_latent_widths(small):
    # transformers sets config.head_dim to the rotary width (32); the spec's head_dim is q/k's, nope + rope
    assert (small.kv_lora_rank, small.q_lora_rank, small.qk_nope_head_dim, small.qk_rope_head_dim,
            small.v_head_dim, small.head_dim) == (64, 128, 64, 32, 64, 96)
    assert small.is_mla and small.value_head_dim == 64 and not small.is_moe
    llama = resolve_model("llama-3.2-1b")
    assert not llama.is_mla and llama.value_head_dim == llama.head_dim


def test_mla_terms_by_name_and_bytes(small):
    """The small config at b=2, s=512 under autocast. Traced (saved_tensors_hooks under fake CUDA semantics, layer 1,
    sdpa): 37.08 MiB of saved storages, 5.53 of them the autocast casts of the layer's weights (counted apart)."""
    T, a = 2 * 512, 8
    acts = training_activations(small, 2, 512, PRECISIONS["bf16"], "sdpa")
    by = {t.name: t for t in acts.layer}
    assert by["query (q_pass, q_rot), key (k_nope, k_rot)"].total == 2 * 2 * a * 96 * T
    # SDPA's value is a view of kv_b_proj's output: k_nope (64) and v (64) per head stay alive
    assert by["kv_b_proj output (k_nope and value, value's storage)"].total == 2 * a * (64 + 64) * T
    assert by["q_a_layernorm fp32 input"].total == 4 * 128 * T and by["kv_b_proj input"].total == 2 * 64 * T
    assert by["q_a / kv_a input (half cast)"].count == 2
    assert by["context (o_proj input)"].total == 2 * a * 64 * T
    assert "qkv input (half cast)" not in by  # the GQA path is not taken
    eager = {t.name: t for t in training_activations(small, 2, 512, PRECISIONS["bf16"], "eager").layer}
    assert eager["core: value (contiguous copy)"].total == 2 * a * 64 * T
    assert "kv_b_proj output (k_nope and value, value's storage)" not in eager
    selective = {t.name for t in training_activations(small, 2, 512, PRECISIONS["bf16"], "eager", selective=True).layer}
    assert "kv_b_proj output (value's storage)" in selective and not any(n.startswith("core:") for n in selective)
    layer_mib = sum(t.total for t in acts.layer) / 2**20
    assert abs(layer_mib - (37.08 - 5.53)) < 0.02


def test_kv_cache_holds_the_latent_and_the_rotary_key(small):
    v3 = resolve_model("deepseek-v3")
    assert kv_bytes_per_token(v3, 2) == (512 + 64) * 2  # 1,152 bytes per token and layer, as vLLM's MLA cache
    assert kv_cache_bytes(v3, 1, 1000, 2) == 1152 * 61 * 1000
    llama = resolve_model("llama-3.1-8b")
    assert kv_bytes_per_token(llama, 2) == 2 * 8 * 128 * 2
    est = memplan.estimate("deepseek-v3", "h100-80g", task="infer", precision="bf16-pure", seq_len=4096,
                           max_new_tokens=16)
    assert est.breakdown["kv_cache"] < 2**30  # decompressed per-head k, v would be 85x more (49,152 values)


def test_attention_flops_use_both_head_widths(small):
    """QK^T at 96 wide and PV at 64: 2 * s * a * (96 + 64) per layer, not 4 * s * a * 96."""
    as_gqa = small.model_copy(update={"v_head_dim": 0})
    mla, _ = flops_per_token(small, 512, "sdpa", "none")
    gqa, _ = flops_per_token(as_gqa, 512, "sdpa", "none")
    assert gqa - mla == 3 * 2 * 512 * 8 * (96 - 64) * 2 * 0.5


def test_catalog_entries_and_refusals():
    v3, r1 = resolve_model("deepseek-ai/DeepSeek-V3"), resolve_model("deepseek-r1")
    # the README's 685B less the 14B MTP module (layer 61) transformers does not build
    assert v3.params_total == r1.params_total == 671_026_404_352
    assert (v3.num_layers, v3.dense_layers, v3.num_experts, v3.head_dim, v3.v_head_dim) == (61, 3, 256, 192, 128)
    with pytest.raises(memplan.UserError, match="no memplan attention"):
        memplan.estimate("deepseek-v3", "h100-80g", attn="memplan")
    with pytest.raises(memplan.UserError, match="no flash attention"):
        memplan.estimate("deepseek-v3", "h100-80g", attn="flash")
    big = memplan.estimate("deepseek-v3", "h100-80g", gpus=8, nodes=32, zero=3, precision="bf16", seq_len=4096,
                           grad_ckpt="full")
    # transformers 5 fuses a layer's 256 experts into one module (11.27 B parameters), which ZeRO-3 gathers whole
    # (docs/parallel.md): its coalesced fetch buffer, the copied-out parameters and their gradients, 63 GiB in
    # bf16, so ZeRO-3 alone does not fit DeepSeek-V3 on 80 GB GPUs at any scale
    unit = 256 * 3 * 7168 * 2048
    assert big.breakdown["gathered_params"] >= 3 * unit * 2
    assert big.peak_allocated_bytes > 80 * 2**30


def test_fast_accuracy_case_within_two_percent():
    from memplan.verify.run import run

    rep = run(model=str(SMALL), gpu="a100-80g", device="fake", steps=2, micro_batch=2, seq_len=512,
              precision="bf16", attn="sdpa", grad_ckpt="none")
    assert abs(rep.meters[0].error_pct) < 2
