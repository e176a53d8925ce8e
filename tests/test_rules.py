"""Every byte rule, checked against the number its source gives."""

import pytest

from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.estimator.rules import (
    BNB_BLOCK, OPTIMIZERS, PRECISIONS, optimizer_state_bytes,
)
from memplan.estimator import step as estimator
from memplan.estimator.allocation import round_block, round_segment
from memplan.estimator.inference import kv_cache_bytes
from memplan.inputs.workload import Workload

MiB = 1 << 20


def state(optim, shape, param_bytes=4, momentum=False):
    return optimizer_state_bytes(OPTIMIZERS[optim], shape, param_bytes, momentum)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_adamw_two_fp32_moments(optim):
    assert state(optim, (1024, 1024)) == 8 * 1024 * 1024
    assert state(optim, (1024,), param_bytes=2) == 4 * 1024  # states follow the param dtype


def test_mixed_precision_adamw_is_18_bytes_per_param():
    # HF docs: fp32 weights 4 + half copy 2 + fp32 grads 4 + AdamW 8 = 18 B/param
    n = 1_000_000
    p = PRECISIONS["fp16"]
    assert p.param + 2 + p.grad + state("adamw_torch_fused", (n,)) / n == 18


def test_bnb_8bit_threshold_and_blocks():
    big = (4096, 4096)
    n = 4096 * 4096
    assert state("adamw_bnb_8bit", big) == 2 * (n + 4 * n // BNB_BLOCK)  # ~2 B/param + absmax
    assert state("adamw_bnb_8bit", (4095,)) == 2 * 4095 * 4  # < 4096 elements stay 32-bit
    assert state("adamw_bnb_8bit", (4096,)) == 2 * (4096 + 4 * 16)


def test_sgd_momentum_and_plain():
    assert state("sgd", (10, 10)) == 0
    assert state("sgd", (10, 10), momentum=True) == 400


def test_adafactor_factored_rows_plus_cols():
    assert state("adafactor", (1024, 4096)) == (1024 + 4096) * 4
    assert state("adafactor", (4096,)) == 4096 * 4  # vectors are not factored
    assert state("adafactor", (8, 16, 32)) == (8 * 16 + 8 * 32) * 4


def test_allocator_rounding():
    assert round_block(1) == 512 and round_block(512) == 512 and round_block(513) == 1024
    assert round_segment(100) == 2 * MiB  # small pool segment
    assert round_segment(4 * MiB) == 20 * MiB  # 1-10 MiB requests get a 20 MiB segment
    assert round_segment(11 * MiB) == 12 * MiB  # large requests rounded to 2 MiB


def _tiny_spec(**kw):
    base = dict(name="tiny", model_type="llama", arch="decoder", head="causal-lm", num_layers=2, hidden_size=64,
                num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=128, vocab_size=1000, max_position=128,
                mlp="gated", activation="silu", norm="rmsnorm", position="rotary",
                params=(ParamGroup(category="embeddings", shape=(1000, 64)),
                        ParamGroup(category="attention", shape=(64, 64), count=8),
                        ParamGroup(category="mlp", shape=(128, 64), count=6),
                        ParamGroup(category="norms", shape=(64,), count=5),
                        ParamGroup(category="head", shape=(1000, 64))))
    base.update(kw)
    return ModelSpec(**base)


def test_training_components_follow_the_rules(v100):
    spec = _tiny_spec()
    n = spec.params_total
    w = Workload(micro_batch=1, seq_len=16, precision="fp16", optim="adamw_torch_fused", zero_grad="zeros")
    e = estimator.estimate(spec, v100, w)
    b = e.breakdown
    assert b["weights"] == pytest.approx(4 * n, rel=0.01)
    assert b["optimizer_states"] == pytest.approx(8 * n, rel=0.01)
    assert b["gradients"] == pytest.approx(4 * n, rel=0.01)  # zeros: grads persist through forward


def test_foreach_adamw_temporaries(v100):
    spec = _tiny_spec()
    w = Workload(micro_batch=1, seq_len=8, precision="fp32", optim="adamw_torch")
    e = estimator.estimate(spec, v100, w)
    assert e.phases["optimizer-step"] >= 20 * spec.params_total * 0.99  # 4 + 4 + 8 + 4 (sqrt temp)
    fused = estimator.estimate(spec, v100, w.model_copy(update={"optim": "adamw_torch_fused"}))
    assert fused.phases["optimizer-step"] < e.phases["optimizer-step"]


def test_kv_cache_formula():
    spec = _tiny_spec(num_kv_heads=2)
    # 2 * layers * seqs * len * kv_heads * head_dim * bytes
    assert kv_cache_bytes(spec, 3, 100, 2) == 2 * 2 * 3 * 100 * 2 * 16 * 2


def test_sliding_window_layers_follow_the_layer_types():
    """Past the window, a model whose every layer slides (mistral v0.1: a window, no layer_types) keeps the
    window per layer after a decode step; one whose layer_types alternate sliding and full layers (gemma2)
    keeps the whole length on the full ones; right after the prefill every layer still holds the whole prompt
    (DynamicSlidingWindowLayer keeps a view of torch.cat's output); chunked layers slide by the chunk."""
    spec = _tiny_spec(model_type="mistral", num_layers=4, sliding_window=10)
    per_token_layer = 2 * 4 * 16 * 2  # k and v, kv heads, head dim, bytes
    assert kv_cache_bytes(spec, 1, 100, 2) == per_token_layer * 4 * 10
    assert kv_cache_bytes(spec, 1, 100, 2, prefill=True) == per_token_layer * 4 * 100
    gemma2 = spec.model_copy(update={"layer_types": ("sliding_attention", "full_attention") * 2})
    assert kv_cache_bytes(gemma2, 1, 100, 2) == per_token_layer * (2 * 10 + 2 * 100)
    assert kv_cache_bytes(gemma2, 1, 10, 2) == per_token_layer * 4 * 10  # within the window
    llama4 = spec.model_copy(update={"sliding_window": None, "attention_chunk_size": 20,
                                     "layer_types": ("chunked_attention",) * 3 + ("full_attention",)})
    assert kv_cache_bytes(llama4, 1, 100, 2) == per_token_layer * (3 * 20 + 100)


def test_unknown_family_gets_the_defaults():
    """A model_type without a row (a hand-built spec) is a plain transformers model: every attention
    implementation but memplan's, no kernels, and the same activations as a family with default facts."""
    from memplan.estimator.families import Family, family, fused_loss_supported, supported_attn, tiled_mlp_supported

    spec = _tiny_spec(model_type="no_such_family")
    assert family("no_such_family") == Family()
    assert supported_attn(spec) == ("flash", "sdpa", "eager")
    assert not fused_loss_supported(spec) and not tiled_mlp_supported(spec)
    assert "memplan" in supported_attn(_tiny_spec()) and fused_loss_supported(_tiny_spec())


def _list_sums(am) -> dict[str, float]:
    """The bytes of each list the step sums (estimator/activation_arrays.py), the log_softmax output among them."""
    from memplan.estimator.activation_arrays import LISTS, tensor_lists

    ts, member = tensor_lists(am)
    return {name: sum(t.total for t, row in zip(ts, member) if row[i]) for i, name in enumerate(LISTS)}


def test_labels_do_not_change_an_estimate():
    """Tensors carry a kind (the attention core, the loss's log_softmax output); their names are labels:
    renaming every tensor leaves every sum the estimator takes unchanged."""
    import dataclasses

    from memplan.estimator.activations import is_core, training_activations

    spec = _tiny_spec(attention_dropout=0.1)
    for selective in (False, True):
        am = training_activations(spec, 2, 16, PRECISIONS["bf16"], "eager", selective=selective)
        renamed = dataclasses.replace(am, **{
            f.name: [dataclasses.replace(t, name=f"tensor {i}") for i, t in enumerate(getattr(am, f.name))]
            for f in dataclasses.fields(am) if isinstance(getattr(am, f.name), list)})
        sums = {name: (a, b) for (name, a), b in zip(_list_sums(am).items(), _list_sums(renamed).values())}
        assert all(a == b for a, b in sums.values()), sums
        assert sums["lsm"][0] > 0 and (sums["layer_core"][0] > 0) == selective
        assert [is_core(t) for t in am.layer] == [is_core(t) for t in renamed.layer]
        assert any(is_core(t) for t in am.layer) != selective  # selective drops the core from the layer
