"""Llama 4's text model (llama4_text) as a first-class family (issue 16): what the config reader takes from it,
every-token-through-every-expert MoE, the L2 q/k norm on the RoPE layers, chunked attention's masks and KV cache,
memplan.kernels' fused loss on it, and the estimate against the fake tracer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.estimator.activations import checkpoint_masks, routed_rows, sdpa_masked, total, training_activations
from memplan.estimator.families import family
from memplan.estimator.inference import kv_cache_bytes
from memplan.estimator.rules import PRECISIONS
from memplan.inputs.catalog import resolve_model
from memplan.inputs.hf import spec_from_config
from tolerance import assert_patch_keeps_loss_and_grads  # tests/tolerance.py

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "benchmarks/accuracy/configs/llama4-small.json"


def _small(**changes) -> dict:
    config = json.loads(CONFIG.read_text())
    config.pop("_comment")
    return config | changes


@pytest.fixture(scope="module")
def spec():
    return spec_from_config(_small(), "llama4-small")


def test_config_fields_and_categories(spec):
    """moe_layers [1, 3] (interleave 2): 2 dense layers of intermediate_size_mlp; experts and the shared expert
    intermediate_size wide; the L2 q/k norm on the three RoPE layers (no_rope_layers 1, 1, 1, 0); the router and the
    feed_forward modules in their categories, so LoRA, quantisation and TP see them."""
    assert (spec.dense_layers, spec.intermediate_size, spec.expert_width, spec.shared_expert_intermediate_size) == \
        (2, 768, 256, 256)
    assert spec.qk_norm_layers == 3 and spec.attention_chunk_size == 256
    assert spec.layer_types == ("chunked_attention",) * 3 + ("full_attention",)
    cats = {g.module: g.category for g in spec.params}
    assert cats["model.layers.*.feed_forward.router"] == "router"
    assert cats["model.layers.*.feed_forward.shared_expert.up_proj"] == "mlp"
    assert cats["model.layers.*.feed_forward.gate_proj"] == "mlp"
    assert spec_from_config(_small(use_qk_norm=False), "no-qk").qk_norm_layers == 0
    # PEFT 0.21 keys its default targets by "llama4", which the text model's model_type is not
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_targets
    assert "llama4_text" not in peft_targets and family("llama4_text").lora_targets == ()


def test_every_token_runs_through_every_expert(spec):
    """Llama4TextMoe repeats the hidden states once per expert: the experts' rows are E * T (8 x 1024 here), and
    the MoE layer's saved tensors grow with E, not with the top-k."""
    T = 2 * 512
    assert routed_rows(spec, T) == 8 * T
    prec = PRECISIONS["bf16-pure"]
    few = spec.model_copy(update={"num_experts": 4})
    grow = total(training_activations(spec, 2, 512, prec, "sdpa").layer) - \
        total(training_activations(few, 2, 512, prec, "sdpa").layer)
    # per extra expert and token, on the mean layer (2 of 4 layers are MoE): the repeat and the scaled copy (2 x h),
    # gate_up, act, the product (4 x f), in bf16, plus the router's per-expert scores (fp32 sigmoid and bf16 copy)
    assert grow == pytest.approx(0.5 * 4 * T * (2 * (2 * 256 + 4 * 256) + 4 + 2))


def test_chunked_attention_masks_and_cache(spec):
    """SDPA gets a materialised chunked mask once the keys reach attention_chunk_size (masking_utils
    _ignore_causal_mask_sdpa: kv_length >= local size); under full checkpointing the layers hold it (booleans, one
    per chunked kind), eager holds a float mask per kind. The chunked layers cache at most the chunk."""
    assert not sdpa_masked(spec, 255) and sdpa_masked(spec, 256)
    prec = PRECISIONS["bf16"]
    assert total(checkpoint_masks(spec, 2, 512, prec, "sdpa")) == 2 * 512 * 512
    assert total(checkpoint_masks(spec, 2, 512, prec, "eager")) == 2 * 4 * 2 * 512 * 512  # fp32 stream, 2 kinds
    per_token = 2 * 64 * 2  # k and v, 2 kv heads x 64, bf16
    assert kv_cache_bytes(spec, 1, 1000, 2) == per_token * 2 * (3 * 256 + 1000)
    # transformers 5.24 caches k and v each in its own dtype (autocast: an fp32 key beside a half value)
    assert kv_cache_bytes(spec, 1, 100, 4, v_bytes=2) == 2 * 64 * (4 + 2) * 4 * 100


def test_scout_catalog_entry():
    """meta-llama/Llama-4-Scout-17B-16E's text model: 107.8 B parameters, 17.2 B active (the model card's 17B)."""
    s = resolve_model("llama-4-scout-17b-16e")
    assert s.params_total == 107_769_861_120
    experts = s.params_by_category()["experts"]
    assert round((s.params_total - experts * 15 / 16) / 1e9, 1) == 17.2
    assert (s.num_experts, s.experts_per_token, s.qk_norm_layers, s.dense_layers) == (16, 1, 36, 0)


def test_the_tiled_kernels_are_refused_by_name():
    """Llama 4's MoE layers have no dense MLP to tile, and its chunked masks no memplan attention."""
    import memplan
    from memplan.errors import UserError

    for kw, says in ((dict(tiled_mlp=True), "--tiled-mlp"), (dict(attn="memplan"), "llama4_text")):
        with pytest.raises(UserError, match=says):
            memplan.estimate("llama-4-scout-17b-16e", "h100-80g", micro_batch=1, seq_len=1024, precision="bf16", **kw)


def test_fused_loss_matches_transformers():
    """memplan.kernels.apply's fused loss on Llama4ForCausalLM: the same loss and gradients as its own."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memplan.kernels import apply

    torch.manual_seed(0)
    config = AutoConfig.for_model(**(_small(hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                                            num_attention_heads=4, head_dim=16, vocab_size=97)))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert_patch_keeps_loss_and_grads(model, torch.randint(0, 97, (2, 16)), lambda m: apply(m, loss=True, mlp=False))


def test_estimate_agrees_with_the_fake_trace():
    """bf16 autocast with full checkpointing (fp32 weights run under fake: no data-dependent routing) within 2 %;
    serving and the other cases: benchmarks/accuracy/results/accuracy-llama4.md."""
    from memplan.verify.run import run

    r = run(model=str(CONFIG), gpu="a100-80g", device="fake", steps=2, micro_batch=2, seq_len=512, attn="sdpa",
            precision="bf16", grad_ckpt="full")
    assert abs(r.meters[0].error_pct) <= 2, r.meters[0]
    cache = r.breakdown["autocast_cache"]  # at backward's start autocast's copies are the head's only
    assert cache["predicted"] == cache["measured"] == 8192 * 256 * 2, cache
