"""memplan.kernels.attention (tiled PyTorch path and Triton kernels) against the plain computation.

Tolerance rule (as tests/test_kernels.py):
- fp32: equal to the reference to fp32 rounding, rel 1e-5 plus 1e-6 of the largest value. Both compute in
  fp32, but the tiled paths sum the softmax and P V in another order (blocks, rescaled by the online
  maximum) and the gradients through another formula (D = rowsum(dO * O) instead of softmax's backward),
  so an element's error scales with the largest terms of its sums, not with the element itself.
- bf16: both are compared with an fp64 computation from the same bf16 inputs; the tiled result's error
  may be at most twice the reference's own error plus one bf16 ulp (2^-8) of the largest value.

The Triton kernels run in Triton's interpreter without a GPU (conftest.py sets TRITON_INTERPRET=1), at
small shapes: the interpreter runs every program of the grid one after the other in numpy.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tolerance import assert_within_own_error  # tests/tolerance.py

from memplan.kernels import attention as attn_mod
from memplan.kernels.backend import triton_module
from memplan.kernels.attention import attention, reference

TRITON = triton_module("triton_attention") is not None
needs_triton = pytest.mark.skipif(not TRITON, reason="triton does not import")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton tests: the GPU, or the interpreter on CPU


def data(b, hq, hkv, sq, sk, d, dtype=torch.float32, seed=0, device="cpu", pad=None):
    """q, k, v, the output gradient and a key padding mask (pad: None, "some" or "one_empty", which
    also pads every key of the last sequence)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=gen) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    g = torch.randn(b, hq, sq, d, generator=gen)
    kpm = None
    if pad is not None:
        kpm = torch.rand(b, sk, generator=gen) > 0.3
        kpm[0, :] = True
        kpm[0, sk // 2:] = False  # a right-padded sequence
        if pad == "one_empty":
            kpm[-1] = False
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (*(move(t.to(dtype)) for t in (q, k, v, g)), move(kpm))


def run(fn, q, k, v, g, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kw)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), g.to(out.dtype)))


def assert_fp32_close(got, want):
    for x, y, name in zip(got, want, ("out", "dq", "dk", "dv")):
        assert not torch.isnan(x).any(), name
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * max(1.0, y.abs().max().item()), msg=name)


def assert_bf16_within(tiled, ref, exact):
    assert_within_own_error(tiled, ref, exact, ("out", "dq", "dk", "dv"))


def check_fp32(q, k, v, g, kpm, causal, **kw):
    got = run(attention, q, k, v, g, causal=causal, key_padding_mask=kpm, **kw)
    want = run(reference, q, k, v, g, causal=causal, key_padding_mask=kpm)
    assert_fp32_close(got, want)


def check_bf16(q, k, v, g, kpm, causal, **kw):
    tiled = run(attention, q, k, v, g, causal=causal, key_padding_mask=kpm, **kw)
    ref = run(reference, q, k, v, g, causal=causal, key_padding_mask=kpm)
    exact = run(reference, q.double(), k.double(), v.double(), g.double(), causal=causal, key_padding_mask=kpm)
    assert_bf16_within(tiled, ref, exact)


# -- the reference itself ---------------------------------------------------------------------------------

def test_reference_is_sdpa():
    """Where they agree on semantics (no row without keys, sq == sk for causal), the reference is torch's
    SDPA (whose causal mask is top-left: the same lower triangle when sq == sk)."""
    q, k, v, _, kpm = data(2, 4, 2, 33, 33, 16, pad="some")
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.testing.assert_close(reference(q, k, v, causal=True), sdpa(q, kr, vr, is_causal=True))
    torch.testing.assert_close(reference(q, k, v, key_padding_mask=kpm), sdpa(q, kr, vr, attn_mask=kpm[:, None, None]))


# -- the PyTorch tiled path ------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_path_fp32_at_realistic_shapes(d, causal):
    q, k, v, g, kpm = data(2, 4, 2, 300, 300, d, seed=d, pad="some")
    check_fp32(q, k, v, g, kpm, causal, block_q=64, block_k=96, backend="torch")


def test_torch_path_default_tiles_and_no_kv_groups():
    q, k, v, g, _ = data(2, 4, 4, 300, 300, 64)
    check_fp32(q, k, v, g, None, True, backend="torch")


@pytest.mark.parametrize("d", [64, 128])
def test_torch_path_bf16_within_the_references_own_error(d):
    q, k, v, g, kpm = data(2, 4, 2, 300, 300, d, torch.bfloat16, pad="some")
    check_bf16(q, k, v, g, kpm, True, block_q=64, block_k=96, backend="torch")


HEADS = [(1, 1), (2, 1), (4, 2), (3, 3), (4, 1)]  # (hq, hkv): MHA, MQA, GQA


@settings(max_examples=25, deadline=None)
@given(sq=st.integers(1, 70), sk=st.integers(1, 70), heads=st.sampled_from(HEADS), d=st.sampled_from([8, 16, 24]),
       block_q=st.integers(1, 40), block_k=st.integers(1, 40), causal=st.booleans(),
       pad=st.sampled_from([None, "some", "one_empty"]))
def test_torch_path_odd_sizes(sq, sk, heads, d, block_q, block_k, causal, pad):
    q, k, v, g, kpm = data(2, *heads, sq, sk, d, seed=sq * 100 + sk, pad=pad)
    check_fp32(q, k, v, g, kpm, causal, block_q=block_q, block_k=block_k, backend="torch")


def test_torch_path_saves_no_score_matrix():
    """Saved for backward: q, k, v, out, the fp32 lse and the padding mask; nothing of sq x sk."""
    q, k, v, _, kpm = data(1, 4, 2, 96, 96, 16, pad="some")
    q.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        attention(q, k, v, causal=True, key_padding_mask=kpm, block_q=32, block_k=32, backend="torch")
    assert sorted(t.numel() for t in saved) == [96, 4 * 96, 2 * 96 * 16, 2 * 96 * 16, 4 * 96 * 16, 4 * 96 * 16]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_rows_without_keys_give_zero_and_zero_gradients(backend):
    """A fully padded sequence, and (causal, sq > sk, bottom-right) the first sq - sk queries."""
    dev = DEV if backend == "triton" else "cpu"
    q, k, v, g, kpm = data(2, 2, 1, 40, 24, 16, pad="one_empty", device=dev)
    out, dq, dk, dv = run(attention, q, k, v, g, causal=True, key_padding_mask=kpm, block_q=16, block_k=16,
                          backend=backend)
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    assert out[1].abs().max() == 0 and dq[1].abs().max() == 0 and dk[1].abs().max() == 0 and dv[1].abs().max() == 0
    assert out[0, :, :16].abs().max() == 0 and dq[0, :, :16].abs().max() == 0  # query i sees key j <= i - 16
    assert_fp32_close((out, dq, dk, dv), run(reference, q, k, v, g, causal=True, key_padding_mask=kpm))


@pytest.mark.parametrize("mode", ["fake", "meta"])
def test_runs_on_fake_tensors_and_meta(mode):
    """memplan's tracer runs the kernels on fake tensors: no data-dependent shapes, forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def step(device):
        q = torch.empty(2, 4, 70, 32, device=device, requires_grad=True)
        k = torch.empty(2, 2, 70, 32, device=device, requires_grad=True)
        v = torch.empty(2, 2, 70, 32, device=device, requires_grad=True)
        kpm = torch.ones(2, 70, dtype=torch.bool, device=device)
        out = attention(q, k, v, causal=True, key_padding_mask=kpm, block_q=32, block_k=16)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        return out, grads

    if mode == "fake":
        with FakeTensorMode():
            out, grads = step("cpu")
    else:
        out, grads = step("meta")
    assert out.shape == (2, 4, 70, 32) and [t.shape[1] for t in grads] == [4, 2, 2]


def test_errors():
    q, k, v, _, _ = data(1, 4, 3, 8, 8, 16)
    with pytest.raises(ValueError, match="must divide"):
        attention(q, k, v)
    with pytest.raises(ValueError, match="backend"):
        attention(q, k[:, :2], v[:, :2], backend="cuda")
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(q, k[:, :2], v[:, :2], key_padding_mask=torch.ones(1, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="q, k, v must be"):
        attention(q[0], k, v)


@needs_triton
def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    q, k, v, _, _ = data(1, 2, 2, 8, 8, 16)
    monkeypatch.setattr(triton_module("triton_attention"), "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention(q, k, v, backend="triton")


@needs_triton
def test_triton_argument_errors():
    q, k, v, _, _ = data(1, 2, 2, 8, 8, 16, device=DEV)
    with pytest.raises(ValueError, match="powers of two"):
        attention(q, k, v, backend="triton", block_q=24)
    q, k, v, _, _ = data(1, 2, 2, 8, 8, 320, device=DEV)
    with pytest.raises(ValueError, match="head dims up to 256"):
        attention(q, k, v, backend="triton")


# -- the Triton kernels (interpreter on CPU) ---------------------------------------------------------------

TRITON_CASES = [  # b, hq, hkv, sq, sk, d, causal, pad
    (2, 2, 2, 47, 47, 16, True, None),
    (2, 4, 2, 64, 64, 32, True, "some"),  # GQA
    (1, 4, 1, 53, 53, 80, False, "some"),  # MQA, a non-power-of-two head dim
    (2, 2, 1, 40, 67, 32, True, "one_empty"),  # sq < sk: bottom-right causal
    (1, 2, 2, 70, 41, 16, True, None),  # sq > sk
]


@needs_triton
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(map(str, c)))
def test_triton_fp32_matches_reference(case):
    *shape, causal, pad = case
    q, k, v, g, kpm = data(*shape, pad=pad, device=DEV, seed=sum(shape))
    check_fp32(q, k, v, g, kpm, causal, backend="triton")


@needs_triton
def test_triton_takes_any_strides():
    """transformers hands over (b, s, h, d) projections transposed to (b, h, s, d): not contiguous."""
    q, k, v, g, kpm = (t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() == 4 else t
                       for t in data(2, 4, 2, 37, 37, 32, pad="some", device=DEV))
    assert not q.is_contiguous()
    check_fp32(q, k, v, g, kpm, True, backend="triton")


@needs_triton
@pytest.mark.parametrize("d", [32, 80])
def test_triton_bf16_within_the_references_own_error(d):
    q, k, v, g, kpm = data(2, 4, 2, 61, 61, d, torch.bfloat16, pad="some", device=DEV)
    check_bf16(q, k, v, g, kpm, True, backend="triton")


@needs_triton
@settings(max_examples=4, deadline=None)
@given(sq=st.integers(1, 50), sk=st.integers(1, 50), heads=st.sampled_from(HEADS), causal=st.booleans(),
       pad=st.sampled_from([None, "some"]), block_k=st.sampled_from([16, 32]))
def test_triton_odd_sizes(sq, sk, heads, causal, pad, block_k):
    q, k, v, g, kpm = data(1, *heads, sq, sk, 16, seed=sq * 100 + sk, pad=pad, device=DEV)
    check_fp32(q, k, v, g, kpm, causal, block_q=16, block_k=block_k, backend="triton")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pad", [None, "some"])
def test_triton_against_sdpa_on_the_gpu(pad):
    """b=2, h=16, s=2048, d=128, bf16, causal: Triton's error (from an fp32 computation on the same bf16
    inputs) at most twice SDPA's, plus one bf16 ulp; autotuned tiles."""
    q, k, v, g, kpm = data(2, 16, 16, 2048, 2048, 128, torch.bfloat16, pad=pad, device="cuda")

    def sdpa(q, k, v, causal, key_padding_mask):
        mask = None
        if key_padding_mask is not None:
            mask = key_padding_mask[:, None, None, :] & torch.ones(2048, 2048, dtype=torch.bool, device="cuda").tril()
            causal = False
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    kw = dict(causal=True, key_padding_mask=kpm)
    tiled = run(attention, q, k, v, g, backend="triton", **kw)
    ref = run(sdpa, q, k, v, g, **kw)
    exact = run(reference, q.float(), k.float(), v.float(), g.float(), **kw)
    assert_bf16_within(tiled, ref, exact)


# -- transformers ------------------------------------------------------------------------------------------

@pytest.fixture()
def registered():
    attn_mod.register()
    seen = []
    from transformers import AttentionInterface

    def spy(module, query, key, value, attention_mask, **kw):  # records the mask hf_attention is given
        seen.append(attention_mask)
        return attn_mod.hf_attention(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("memplan", spy)
    yield seen
    attn_mod.register()


def _same_loss_and_grads(model, loss_fn):
    params = [p for p in model.parameters() if p.requires_grad]
    results = {}
    for impl in ("eager", "memplan"):
        model.set_attn_implementation(impl)
        assert model.config._attn_implementation == impl
        loss = loss_fn()
        results[impl] = (loss.detach(), torch.autograd.grad(loss, params, allow_unused=True))
    (base, base_g), (tiled, tiled_g) = results["eager"], results["memplan"]
    torch.testing.assert_close(tiled, base, rtol=1e-5, atol=1e-6)
    for a, b in zip(tiled_g, base_g):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_llama_same_loss_and_gradients_as_eager(padding, registered):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    x = torch.randint(0, 128, (2, 24))
    labels = x.clone()
    kw = {}
    if padding is not None:
        mask = torch.ones_like(x)
        if padding == "right":
            mask[1, 17:] = 0
        else:
            mask[1, :5] = 0
            # a pad query sees no key: eager averages every key there, memplan (as flash-attn) gives 0, so the
            # first real token, which ForCausalLM predicts from the last pad position, is not scored
            labels[1, 5] = -100
        labels[mask == 0] = -100
        kw["attention_mask"] = mask
    _same_loss_and_grads(model, lambda: model(input_ids=x, labels=labels, **kw).loss)
    if padding is None:
        assert registered[-1] is None
    else:  # the cheap mask: b x s key padding, not b x 1 x s x s
        assert registered[-1].shape == (2, 24) and registered[-1].dtype == torch.bool


def test_bert_bidirectional_with_padding_same_as_eager(registered):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        vocab_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertModel(config).eval()
    x = torch.randint(0, 128, (2, 24))
    mask = torch.ones_like(x)
    mask[0, 17:] = 0

    def loss():
        out = model(input_ids=x, attention_mask=mask).last_hidden_state
        return (out * mask[..., None]).pow(2).mean()

    _same_loss_and_grads(model, loss)
    assert registered[-1].shape == (2, 24)
    assert not model.encoder.layer[0].attention.self.is_causal


def test_generate_with_a_cache_matches_eager(registered):
    """Decoding: one query against the cache (bottom-right causal), left padding; a static cache gets the
    4D mask and the eager fallback."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                         max_position_embeddings=64, pad_token_id=0)).eval()
    x = torch.randint(1, 128, (2, 10))
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    x[1, :3] = 0
    for cache in (None, "static"):
        outs = []
        for impl in ("eager", "memplan"):
            model.set_attn_implementation(impl)
            outs.append(model.generate(input_ids=x, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                       cache_implementation=cache))
        assert outs[0].tolist() == outs[1].tolist()


def test_dropout_in_training_is_a_clear_error():
    class Module(torch.nn.Module):
        config = type("Config", (), {"attention_dropout": 0.1})()

    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="attention_dropout"):
        attn_mod.hf_attention(Module(), q, q, q, None, dropout=0.1)
    out, weights = attn_mod.hf_attention(Module(), q, q, q, None, dropout=0.0, scaling=0.25)
    assert out.shape == (1, 4, 2, 16) and weights is None
    torch.testing.assert_close(out, reference(q, q, q, causal=True, scale=0.25).transpose(1, 2))
