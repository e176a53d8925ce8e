"""memplan.kernels.linear_cross_entropy against the plain computation.

Tolerance rule: in fp32 the tiled loss and gradients equal the reference to fp32 rounding (rel 1e-5, plus
1e-6 of the largest value: the sums run in another order).
In bf16 both are compared with an fp64 computation from the same bf16 inputs; the tiled result's error
may be at most twice the reference's own error, plus one bf16 ulp (2^-8 relative) of the largest value.
"""

import json
import pathlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import memplan
import memplan.kernels.cross_entropy as lce
from memplan.kernels import linear_cross_entropy
from memplan.kernels.cross_entropy import reference

from lce_data import bias_for, data, run, run_bias, tokens_and_reduction  # tests/lce_data.py
from tolerance import assert_within_own_error  # tests/tolerance.py

QWEN2_SMALL = pathlib.Path(__file__).parent.parent / "benchmarks" / "accuracy" / "configs" / "qwen2-small.json"




@pytest.fixture()
def small_blocks(monkeypatch):
    """Blocks of a few hundred bytes, so these small shapes cross many token chunks and vocabulary blocks."""
    monkeypatch.setattr(lce, "CHUNK_BYTES", 4 * 16 * 24)


@settings(max_examples=30, deadline=None)
@given(n_reduction=tokens_and_reduction(70), vocab=st.integers(2, 150), chunk=st.integers(1, 40),
       softcap=st.sampled_from([None, 30.0, 5.0]))
def test_fp32_matches_reference(n_reduction, vocab, chunk, softcap):
    saved, lce.CHUNK_BYTES = lce.CHUNK_BYTES, 4 * 16 * 24  # many vocabulary blocks at these sizes
    try:
        _check_fp32(*n_reduction, vocab, chunk, softcap)
    finally:
        lce.CHUNK_BYTES = saved


def _check_fp32(n, reduction, vocab, chunk, softcap):
    h, w, t = data(n, 16, vocab, torch.float32, seed=n * 1000 + vocab)
    g = torch.randn(n) if reduction == "none" else torch.tensor(1.3)
    a = run(linear_cross_entropy, h, w, t, g, reduction=reduction, chunk_size=chunk, softcap=softcap)
    b = run(reference, h, w, t, g, reduction=reduction, softcap=softcap)
    for x, y in zip(a, b):
        # fp32 sums in another order: the error scales with the largest term, not with each element
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * max(1.0, y.abs().max().item()))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_bf16_within_the_references_own_error(reduction, softcap, small_blocks):
    h, w, t = data(96, 32, 257, torch.bfloat16)
    g = torch.randn(96) if reduction == "none" else torch.tensor(1.0)
    tiled = run(linear_cross_entropy, h, w, t, g, reduction=reduction, chunk_size=7, softcap=softcap)
    ref = run(reference, h, w, t, g, reduction=reduction, softcap=softcap)
    exact = run(reference, h.double(), w.double(), t, g.double(), reduction=reduction, softcap=softcap)
    assert_within_own_error(tiled, ref, exact)


@settings(max_examples=20, deadline=None)
@given(n_reduction=tokens_and_reduction(70), vocab=st.integers(2, 150), chunk=st.integers(1, 40),
       softcap=st.sampled_from([None, 30.0, 5.0]))
def test_bias_fp32_matches_reference(n_reduction, vocab, chunk, softcap):
    """With an LM-head bias: loss and the gradients of hidden states, weight and bias, across many token
    chunks and vocabulary blocks."""
    n, reduction = n_reduction
    saved, lce.CHUNK_BYTES = lce.CHUNK_BYTES, 4 * 16 * 24  # many vocabulary blocks at these sizes
    try:
        h, w, t = data(n, 16, vocab, torch.float32, seed=n * 1000 + vocab)
        b = bias_for(vocab, torch.float32, seed=n)
        g = torch.randn(n) if reduction == "none" else torch.tensor(1.3)
        a = run_bias(linear_cross_entropy, h, w, b, t, g, reduction=reduction, chunk_size=chunk, softcap=softcap)
        r = run_bias(reference, h, w, b, t, g, reduction=reduction, softcap=softcap)
        for x, y in zip(a, r):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * max(1.0, y.abs().max().item()))
    finally:
        lce.CHUNK_BYTES = saved


@pytest.mark.parametrize("reduction,softcap", [("mean", None), ("sum", 30.0), ("none", 30.0)])
def test_bias_bf16_within_the_references_own_error(reduction, softcap, small_blocks):
    h, w, t = data(96, 32, 257, torch.bfloat16)
    b = bias_for(257, torch.bfloat16)
    g = torch.randn(96) if reduction == "none" else torch.tensor(1.0)
    tiled = run_bias(linear_cross_entropy, h, w, b, t, g, reduction=reduction, chunk_size=7, softcap=softcap)
    ref = run_bias(reference, h, w, b, t, g, reduction=reduction, softcap=softcap)
    exact = run_bias(reference, h.double(), w.double(), b.double(), t, g.double(), reduction=reduction,
                     softcap=softcap)
    assert_within_own_error(tiled, ref, exact)


def test_zero_bias_gives_the_biasless_results(small_blocks):
    """A zero bias gives the loss and hidden/weight gradients of no bias, and the bias gradient is d
    summed over tokens (reference's)."""
    h, w, t = data(37, 16, 61, torch.float32)
    for kw in (dict(), dict(softcap=5.0, reduction="sum")):
        plain = run(linear_cross_entropy, h, w, t, chunk_size=6, **kw)
        zero = run_bias(linear_cross_entropy, h, w, torch.zeros(61), t, chunk_size=6, **kw)
        for x, y in zip(zero[:3], plain):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(zero[3], run_bias(reference, h, w, torch.zeros(61), t, **kw)[3],
                                   rtol=1e-5, atol=1e-6)


def test_bias_only_gradient_autocast_and_errors(small_blocks):
    h, w, t = data(30, 16, 45, torch.float32)
    b = bias_for(45, torch.float32).requires_grad_()
    # only the bias's gradient wanted: the others are not formed
    (gb,) = torch.autograd.grad(linear_cross_entropy(h, w, t, bias=b, softcap=5.0), b)
    torch.testing.assert_close(gb, run_bias(reference, h, w, b, t, softcap=5.0)[3], rtol=1e-5, atol=1e-6)
    # autocast: the bias is cast once with the weight; its gradient comes back in its own dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = linear_cross_entropy(h, w, t, bias=b)
    (gb16,) = torch.autograd.grad(cast, b)
    assert gb16.dtype == torch.float32
    plain = linear_cross_entropy(h.bfloat16(), w.bfloat16(), t, bias=b.detach().bfloat16())
    torch.testing.assert_close(cast, plain, rtol=0, atol=0)
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(h, w, t, bias=b[:44])


def test_all_ignored(small_blocks):
    h, w, t = data(9, 16, 33, torch.float32)
    t[:] = -100
    loss, gh, gw = run(linear_cross_entropy, h, w, t, reduction="sum")
    assert loss.item() == 0 and gh.abs().max() == 0 and gw.abs().max() == 0
    # mean: 0 / 0, a NaN loss with zero gradients, as torch's cross_entropy
    mean, gh, gw = run(linear_cross_entropy, h, w, t)
    ref = run(reference, h, w, t)
    assert torch.isnan(mean) and torch.isnan(ref[0])
    assert gh.abs().max() == 0 and gw.abs().max() == 0 and ref[1].abs().max() == 0


def test_accumulation_equals_one_batch(small_blocks):
    """Two micro batches normalised by the whole batch's token count (transformers' num_items_in_batch)
    give the gradients of one batch."""
    h, w, t = data(64, 16, 50, torch.float32)
    n_items = int((t != -100).sum())
    _, gh_all, gw_all = run(linear_cross_entropy, h, w, t, chunk_size=5)
    parts = [run(linear_cross_entropy, h[s], w, t[s], chunk_size=5, num_items_in_batch=n_items)
             for s in (slice(0, 40), slice(40, 64))]
    torch.testing.assert_close(parts[0][2] + parts[1][2], gw_all, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), gh_all, rtol=1e-5, atol=1e-7)


def test_batched_shapes_and_errors(small_blocks):
    h, w, t = data(24, 16, 40, torch.float32)
    out = linear_cross_entropy(h.reshape(2, 12, 16), w, t.reshape(2, 12), reduction="none")
    assert out.shape == (2, 12)
    torch.testing.assert_close(out.reshape(-1), reference(h, w, t, reduction="none"))
    with pytest.raises(ValueError):
        linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(ValueError):
        linear_cross_entropy(h, w[:, :8], t)


TINY = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97, max_position_embeddings=64),
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
                   head_dim=16, final_logit_softcapping=30.0),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64,
                 bos_token_id=0, eos_token_id=0),
    # q/k RMSNorm per head (qwen3) and over the whole projection with post-norm layers (olmo2)
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=97, max_position_embeddings=64),
    "olmo2": dict(model_type="olmo2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
                  pad_token_id=1, eos_token_id=2),
    # multi-head latent attention with both layers dense (first_k_dense_replace = layers): the fused loss and the
    # tiled DeepseekV3MLP apply; the tiled attention does not (q/k and v head widths differ)
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2,
                        n_routed_experts=0, n_group=1, topk_group=1, vocab_size=97, max_position_embeddings=64),
    # four norms, per-head q/k norms, a sliding and a full layer, scaled embeddings, a tied head
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=97,
                        max_position_embeddings=64, sliding_window=8, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"]),
    # llama's layer with RoPE off on its second layer (no_rope_layers)
    "smollm3": dict(model_type="smollm3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
                    no_rope_layers=[1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # plain MLPs (c_fc / c_proj, dense_h_to_4h / dense_4h_to_h); GPT-BigCode and Falcon multi-query, Falcon's
    # parallel attention on one LayerNorm; StarCoder 2 with its sliding window
    "starcoder2": dict(model_type="starcoder2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
                       sliding_window=8, bos_token_id=0, eos_token_id=0),
    "gpt_bigcode": dict(model_type="gpt_bigcode", n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64,
                        multi_query=True, bos_token_id=0, eos_token_id=0),
    "falcon": dict(model_type="falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=97,
                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0),
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_patched_model_gives_the_same_loss_and_gradients(family, small_blocks, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from memplan.kernels import applied, apply, revert
    from memplan.kernels.mlp import GatedAct

    gated = []  # the gated MLPs (llama SwiGLU, gemma2 GeGLU) run act(gate) * up through gated_act
    monkeypatch.setattr(GatedAct, "apply", lambda *a, f=GatedAct.apply: gated.append(a[2]) or f(*a))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY[family])).eval()
    x = torch.randint(0, 97, (2, 16))
    labels = x.clone()
    labels[0, :3] = -100
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(**kw):
        loss = model(input_ids=x, labels=labels, **kw).loss
        return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

    base, base_g = loss_and_grads()
    base_n, base_ng = loss_and_grads(num_items_in_batch=40)
    apply(model, mlp_chunk=7)  # 32 tokens in 5 chunks
    assert applied(model) == {"loss": True, "mlp": 2, "attention": False}
    out = model(input_ids=x, labels=labels)
    assert out.logits is None  # no b x s x V tensor
    fused, fused_g = loss_and_grads()
    fused_n, fused_ng = loss_and_grads(num_items_in_batch=40)
    torch.testing.assert_close(fused, base, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_n, base_n, rtol=1e-6, atol=1e-6)
    for a, b in list(zip(fused_g, base_g)) + list(zip(fused_ng, base_ng)):
        if b is not None:  # fp32 sums in another order: gemma3's tied, scaled embedding is 1.1e-7 off in 1 of 6208
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-7)
    assert model(input_ids=x).logits.shape == (2, 16, 97)  # inference is the original forward
    plain = {"gpt2", "starcoder2", "gpt_bigcode", "falcon"}  # c_fc -> act -> c_proj: no gated_act
    assert set(gated) == (set() if family in plain else {"gemma2": {"gelu_tanh"}, "gemma3_text": {"gelu_tanh"}}.get(
        family, {"silu"}))
    revert(model)
    first = model.transformer.h[0] if hasattr(model, "transformer") else model.model.layers[0]
    assert applied(model)["mlp"] == 0 and "forward" not in vars(first.mlp)
    torch.testing.assert_close(model(input_ids=x, labels=labels).loss.detach(), base)


def test_bert_gets_the_tiled_mlp_with_the_same_loss_and_gradients():
    from transformers import AutoConfig, AutoModelForMaskedLM

    from memplan.kernels import applied, apply, revert

    torch.manual_seed(0)
    bert = AutoModelForMaskedLM.from_config(AutoConfig.for_model(
        "bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=50,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    x = torch.randint(0, 50, (2, 24))
    labels = torch.full_like(x, -100)
    labels[:, ::3] = x[:, ::3]
    params = list(bert.parameters())

    def loss_and_grads():
        loss = bert(input_ids=x, labels=labels).loss
        return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

    base, base_g = loss_and_grads()
    apply(bert, mlp_chunk=7)  # 48 tokens in 7 chunks
    # the masked-LM head's loss is fused too: the decoder's weight and bias
    assert applied(bert) == {"loss": True, "mlp": 2, "attention": False}
    assert bert(input_ids=x, labels=labels).logits is None
    tiled, tiled_g = loss_and_grads()
    torch.testing.assert_close(tiled, base, rtol=1e-6, atol=1e-6)
    for a, b in zip(tiled_g, base_g):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    revert(bert)
    assert applied(bert)["mlp"] == 0 and "feed_forward_chunk" not in vars(bert.bert.encoder.layer[0])


def test_unsupported_models_get_a_clear_message():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from memplan.kernels import apply

    opt = AutoModelForCausalLM.from_config(AutoConfig.for_model("opt", hidden_size=32, num_hidden_layers=1,
                                                                num_attention_heads=2, ffn_dim=64, vocab_size=50))
    with pytest.raises(ValueError, match=r"supports (\w+, )+\w+; not OPTForCausalLM"):
        apply(opt)
    bert = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(
        "bert", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match=r"the fused loss is for the causal LMs of (\w+, )+\w+"):
        apply(bert, mlp=False)  # a classifier has no LM head
    # Falcon calls SDPA / its own eager code, StarCoder 2's sliding window is not a mask the tiled kernel takes
    for model_type, cfg in (("falcon", dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)),
                            ("starcoder2", dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                num_key_value_heads=1, intermediate_size=64, sliding_window=8))):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=50, **cfg))
        with pytest.raises(ValueError, match=rf"tiled attention is for (\w+, )+\w+; not \w+ \({model_type}\)"):
            apply(model, attention=True)


@pytest.fixture(scope="module")
def gpt2_4_layers(tmp_path_factory) -> str:
    """GPT-2's config at 4 of its 12 layers: the fused loss is the head's, and the trace takes a third of the time."""
    from memplan.inputs.catalog import resolve_config

    path = tmp_path_factory.mktemp("gpt2") / "config.json"
    path.write_text(json.dumps({**resolve_config("gpt2")[0], "n_layer": 4}))
    return str(path)


@pytest.mark.parametrize("kw", [dict(precision="fp32"), dict(precision="bf16-pure"), dict(precision="bf16"),
                                dict(precision="bf16", grad_ckpt="full"), dict(precision="bf16", tiled_mlp=True)])
def test_estimate_with_the_fused_loss_agrees_with_the_trace(kw, gpt2_4_layers):
    """`--kernels`: the estimate against the fake-tensor trace of the patched model (within 2 %; the
    accuracy suite's bound is 5 %), and far below the same plan without the fused loss."""
    from memplan.verify.run import run

    r = run(model=gpt2_4_layers, gpu="a100-80g", device="fake", steps=2, micro_batch=4, seq_len=512, attn="sdpa",
            kernels=True, **kw)
    allocated = r.meters[0]
    assert abs(allocated.error_pct) <= 2, allocated
    plain = memplan.estimate(gpt2_4_layers, "a100-80g", micro_batch=4, seq_len=512, attn="sdpa", **kw)
    assert allocated.predicted_bytes < plain.peak_allocated_bytes


def test_suggest_offers_the_fused_loss_where_it_fits_more():
    """The kernels are off unless asked (memplan.inputs.defaults.KERNELS); suggest says what they buy."""
    s = memplan.suggest("llama-3.2-1b", "a10g-24g", seq_len=4096, global_batch=16, top=1)
    assert not s.plans[0].kernels and "kernels" not in s.searched
    alt = next(a for a in s.alternatives if a.change.startswith("--kernels"))
    assert alt.plan.kernels and "memplan.kernels.apply" in alt.gain
    assert alt.plan.samples_per_s > s.plans[0].samples_per_s
    asked = memplan.suggest("llama-3.2-1b", "a10g-24g", seq_len=4096, global_batch=16, top=1, kernels=True)
    assert asked.plans[0].kernels and any("memplan.kernels.apply" in n for n in asked.notes)


@pytest.mark.parametrize("name, mb, seq, kw", [
    ("gpt2", 4, 1024, dict(precision="bf16")),  # gpt2 has 1,024 learned positions
    ("gpt2", 4, 1024, dict(precision="fp32")),
    ("bert-base", 16, 512, dict(precision="bf16")),  # 11 chunks of 768 tokens per layer
    ("bert-base", 16, 512, dict(precision="bf16-pure", grad_ckpt="full")),
])
def test_estimate_with_the_tiled_mlp_agrees_with_the_trace(name, mb, seq, kw, tmp_path):
    """`--tiled-mlp`: each layer keeps the MLP's input, one chunk is recomputed in backward; against the
    fake-tensor trace of the patched model, and below the same plan without it. The catalog model at 4 of its 12
    layers (each layer is traced alike; the full depth takes three times as long)."""
    from memplan.inputs.catalog import get_entry
    from memplan.verify.run import run

    layers = {"gpt2": "n_layer", "bert-base": "num_hidden_layers"}[name]
    model = tmp_path / f"{name}.json"
    model.write_text(json.dumps(dict(get_entry(name).config) | {layers: 4}))
    model = str(model)
    r = run(model=model, gpu="a100-80g", device="fake", steps=2, micro_batch=mb, seq_len=seq, attn="sdpa",
            tiled_mlp=True, **kw)
    allocated = r.meters[0]
    assert abs(allocated.error_pct) <= 5, allocated
    plain = memplan.estimate(model, "a100-80g", micro_batch=mb, seq_len=seq, attn="sdpa", **kw)
    assert allocated.predicted_bytes < plain.peak_allocated_bytes


def test_estimate_with_all_of_memplans_kernels_agrees_with_the_trace():
    """--attn memplan --kernels --tiled-mlp on GQA decoders: the tiled attention keeps what SDPA keeps; the kernels
    see the trace's emulated CUDA autocast (kernels/amp.py) and cast their inputs once. Qwen2.5-0.5B's widths and
    tied vocabulary at 3 of its 24 layers (the full depth takes ~45 s to trace), and llama-small, untied, whose
    peak is the fused loss's backward block (3.3 % under before its three fp32 blocks were counted)."""
    from memplan.verify.run import run

    for model in (QWEN2_SMALL, QWEN2_SMALL.parent / "llama-small.json"):
        r = run(model=str(model), gpu="a100-80g", device="fake", steps=2, micro_batch=2, seq_len=1024, attn="memplan",
                precision="bf16", kernels=True, tiled_mlp=True)
        assert abs(r.meters[0].error_pct) <= 0.5, (model.name, r.meters[0])


def test_suggest_turns_the_tiled_mlp_on_where_it_fits_more_and_says_so():
    s = memplan.suggest("qwen2.5-0.5b", "a10g-24g", seq_len=8192, global_batch=16, top=1)
    alt = next(a for a in s.alternatives if a.change == "--kernels --tiled-mlp")
    assert alt.plan.kernels and alt.plan.tiled_mlp and alt.plan.zero_stage == 0  # no DeepSpeed needed
    asked = memplan.suggest("qwen2.5-0.5b", "a10g-24g", seq_len=8192, global_batch=16, top=1, kernels=True,
                            tiled_mlp=True)
    best = asked.plans[0]
    assert best.kernels and best.tiled_mlp
    note = next(n for n in asked.notes if "memplan.kernels.apply(model, loss=True, mlp=True" in n)
    assert "without them" in note
    assert best.samples_per_s >= s.plans[0].samples_per_s


def test_tiled_attention_refuses_attention_dropout_and_unsupported_families():
    from memplan.errors import UserError

    with pytest.raises(UserError, match="no attention dropout"):
        memplan.estimate("gpt2", "a100-80g", attn="memplan")  # GPT-2's attn_pdrop is 0.1
    with pytest.raises(UserError, match="choose from flash, eager"):
        memplan.estimate("gemma2-2b", "a100-80g", attn="memplan")  # logit soft-capping
    with pytest.raises(UserError, match="tiles the dense MLPs"):
        memplan.estimate("mixtral-8x7b", "a100-80g", tiled_mlp=True)
    # a sliding window is a mask the tiled kernels do not express: kernels/attention.py would run eager attention
    with pytest.raises(UserError, match="sliding-window or chunked layers"):
        memplan.estimate("mistral-7b", "a100-80g", attn="memplan")
    assert all(p.attn != "memplan" for p in memplan.suggest("mistral-7b", "a100-80g", attn="any", top=50).plans)


def test_cli_takes_the_kernel_flags():
    import json

    from click.testing import CliRunner

    from memplan.cli.commands import cli

    r = CliRunner().invoke(cli, ["estimate", "--model", "qwen2.5-0.5b", "--gpu", "a100-80g", "--precision", "bf16",
                                  "--seq-len", "4096", "--attn", "memplan", "--kernels", "--tiled-mlp", "--json"])
    assert r.exit_code == 0, r.output
    w = json.loads(r.output)["workload"]
    assert (w["attn"], w["kernels"], w["tiled_mlp"]) == ("memplan", True, True)


def test_estimate_with_the_fused_masked_lm_loss_agrees_with_the_trace():
    """BERT's masked LM with --kernels: the head's transform, then the fused loss with the decoder's bias."""
    from memplan.verify.run import run

    r = run(model="bert-base", head="masked-lm", gpu="a100-80g", device="fake", steps=2, micro_batch=16, seq_len=512,
            attn="sdpa", precision="bf16", kernels=True)
    assert abs(r.meters[0].error_pct) <= 2, r.meters[0]
    plain = memplan.estimate("bert-base", "a100-80g", head="masked-lm", micro_batch=16, seq_len=512, attn="sdpa",
                             precision="bf16")
    assert r.meters[0].predicted_bytes < plain.peak_allocated_bytes
