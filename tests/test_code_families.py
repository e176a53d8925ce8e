"""StarCoder 2, GPT-BigCode and Falcon as first-class families (issue 16): their rows of the families table, what
hf._kv_fields reads from their configs, the tensors their attention adds to the activation model, the catalog
entries offline, and the estimate against the fake tracer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import memplan
from memplan.estimator.activations import sdpa_masked, total, training_activations
from memplan.estimator.families import family, model_types
from memplan.estimator.rules import PRECISIONS
from memplan.inputs.catalog import resolve_model
from memplan.inputs.hf import spec_from_config
from tolerance import assert_patch_keeps_loss_and_grads  # tests/tolerance.py

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks/accuracy/configs"
FAMILIES = ("starcoder2", "gpt_bigcode", "falcon")


def _small(name: str, **changes) -> dict:
    config = json.loads((CONFIGS / f"{name}-small.json").read_text())
    config.pop("_comment")
    return config | changes


@pytest.fixture(scope="module")
def specs():
    return {f: spec_from_config(_small(f), f) for f in FAMILIES}


def test_rows_and_peft_defaults():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_targets

    for f in FAMILIES:
        assert tuple(peft_targets.get(f) or ()) == family(f).lora_targets
        assert family(f).arch == "decoder" and family(f).norm == "layernorm" and family(f).mlp == "plain"
    assert {f for f in FAMILIES if family(f).selective} == {"starcoder2", "gpt_bigcode"}  # Falcon: no interface
    assert set(model_types(lambda f: f.memplan_attention)) & set(FAMILIES) == {"gpt_bigcode"}
    assert set(FAMILIES) <= set(model_types(lambda f: f.fused_loss_causal_base)) & set(
        model_types(lambda f: f.tiled_mlp))


def test_kv_fields_read_each_familys_heads_and_norms(specs):
    sc, bc, fa = specs["starcoder2"], specs["gpt_bigcode"], specs["falcon"]
    assert (sc.num_kv_heads, sc.sliding_window, sc.hidden_dropout, sc.layer_norms) == (2, 256, 0.1, 0)
    assert (bc.num_kv_heads, bc.intermediate_size, bc.position) == (1, 4 * 256, "learned")  # multi-query, n_inner unset
    assert (fa.num_kv_heads, fa.layer_norms) == (1, 1)
    # falcon-40b's layout: ln_attn / ln_mlp (norms, not attention), keys broadcast to every head before the cache
    new = spec_from_config(_small("falcon", new_decoder_architecture=True, num_kv_heads=2), "falcon-new")
    assert (new.num_kv_heads, new.layer_norms) == (8, 2)
    norms = {g.module for g in new.params if g.category == "norms"}
    assert {"transformer.h.*.ln_attn", "transformer.h.*.ln_mlp"} <= norms
    sequential = spec_from_config(_small("falcon", parallel_attn=False, multi_query=False), "falcon-seq")
    assert (sequential.num_kv_heads, sequential.layer_norms) == (8, 2)


def test_sdpa_mask_terms(specs):
    """A materialised mask (Falcon always; StarCoder 2 once the keys reach its window) adds the additive
    mask (b x s x s in the query dtype) and k, v repeated to every head: exactly those bytes per layer."""
    sc, fa = specs["starcoder2"], specs["falcon"]
    # masking_utils materialises the window's mask once the keys reach it (kv_length >= sliding_window)
    assert sdpa_masked(fa, 16) and sdpa_masked(sc, 256) and not sdpa_masked(sc, 255)
    assert not sdpa_masked(specs["gpt_bigcode"], 512)
    prec, b, s = PRECISIONS["bf16"], 2, 512
    for spec in (sc, fa):
        unmasked = spec.model_copy(update={"model_type": "gpt_neox" if spec is fa else "starcoder2",
                                           "sliding_window": None if spec is sc else spec.sliding_window})
        layer = training_activations(spec, b, s, prec, "sdpa").layer
        plain = training_activations(unmasked, b, s, prec, "sdpa").layer
        mask, kv = 2 * b * s * s, 2 * 2 * spec.num_heads * spec.head_dim * b * s
        assert [t.total for t in layer if t.name.startswith("core: SDPA additive mask")] == [mask]
        assert [t.total for t in layer if t.name.startswith("core: k, v repeated")] == [kv]
        if spec is sc:
            assert total(layer) - total(plain) == mask + kv


def test_falcon_mlp_reads_the_saved_norm_output(specs):
    """One LayerNorm feeds both: in pure bf16 the MLP's input is the qkv input already saved; under autocast
    each linear saves its own half cast."""
    fa = specs["falcon"]
    two = fa.model_copy(update={"layer_norms": 2})
    h, T = fa.hidden_size, 2 * 512
    for precision, norm in (("bf16-pure", 2 * h * T + 8 * T), ("bf16", 4 * h * T + 8 * T)):
        one_layer = total(training_activations(fa, 2, 512, PRECISIONS[precision], "sdpa").layer)
        two_layer = total(training_activations(two, 2, 512, PRECISIONS[precision], "sdpa").layer)
        mlp_input = 2 * h * T if precision == "bf16-pure" else 0
        assert two_layer - one_layer == norm + mlp_input


def test_catalog_entries_work_offline():
    """bigcode/octocoder: multi-query, so its KV cache is 1 head: 40 layers x 2 x 128 x tokens x 2 bytes, with
    the prompt's 2048 tokens (peak at prefill) or 2108 (decode); 48 heads would make it 48 times that."""
    result = subprocess.run([sys.executable, "-m", "memplan", "estimate", "--model", "octocoder", "--gpu", "a100-80g",
                             "--task", "infer", "--precision", "bf16", "--max-new-tokens", "60"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "octocoder (15,517,456,384 params" in result.stdout and "kv_cache" in result.stdout
    est = memplan.estimate("octocoder", "a100-80g", task="infer", precision="bf16", max_new_tokens=60)
    assert est.breakdown["kv_cache"] in (40 * 2 * 128 * 2048 * 2, 40 * 2 * 128 * 2108 * 2)
    for name in ("starcoder2-15b", "falcon-7b"):
        assert memplan.estimate(name, "a100-80g", micro_batch=1, seq_len=512, precision="bf16").peak_allocated_bytes


def test_gpt_bigcode_memplan_attention_matches_sdpa():
    """memplan's tiled attention on GPT-BigCode's multi-query heads (1 kv head): same loss and gradients."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memplan.kernels import apply

    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt_bigcode", n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64,
                                  attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert_patch_keeps_loss_and_grads(model, torch.randint(0, 97, (2, 16)),
                                      lambda m: apply(m, loss=False, mlp=False, attention=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_estimate_agrees_with_the_fake_trace(name):
    """The fast accuracy case of each family (bf16 autocast, sdpa, no checkpointing) within 2 %."""
    from memplan.verify.run import run

    r = run(model=str(CONFIGS / f"{name}-small.json"), gpu="a100-80g", device="fake", steps=2, micro_batch=2,
            seq_len=512, attn="sdpa", precision="bf16")
    assert abs(r.meters[0].error_pct) <= 2, r.meters[0]
