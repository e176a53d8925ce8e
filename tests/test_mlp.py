"""memplan.kernels.mlp: the tiled MLP and the fused gated activation against the plain computation.

Tolerance rule (as tests/test_kernels.py): in fp32 the tiled values and gradients equal the untiled ones
to fp32 rounding (rel 1e-5, plus 1e-6 of the largest value: the sums run in another order).
In bf16 both are compared with an fp64 computation from the same bf16 inputs; the tiled (or fused)
result's error may be at most twice the untiled (or plain) result's own error, plus one bf16 ulp
(2^-8 relative) of the largest value.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from tolerance import assert_within_own_error  # tests/tolerance.py

from memplan.kernels.mlp import gated_act, gated_mlp, patch_mlp, reference_gated, tiled_mlp, unpatch_mlp

H, I = 16, 40


def gpt2_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def swiglu(x, wg, wu, wd):
    return gated_mlp(x, wg, wu, wd, "silu")


def geglu(x, wg, wu, wd):
    return gated_mlp(x, wg, wu, wd, "gelu_tanh")


MLPS = {"gpt2": (gpt2_mlp, [(I, H), (I,), (H, I), (H,)]), "llama": (swiglu, [(I, H), (I, H), (H, I)]),
        "gemma": (geglu, [(I, H), (I, H), (H, I)])}


def weights(kind, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * s[-1] ** -0.5).to(dtype) for s in MLPS[kind][1]]


def run(kind, x, ps, g, chunk=None):
    """(output, d x, d params...) of the MLP, tiled over `chunk` tokens or (chunk None) plain."""
    fn = MLPS[kind][0]
    x = x.detach().clone().requires_grad_()
    ps = [p.detach().clone().requires_grad_() for p in ps]
    out = tiled_mlp(lambda h: fn(h, *ps), x, ps, chunk) if chunk else fn(x, *ps)
    return [out.detach(), *torch.autograd.grad(out, [x, *ps], g)]


def assert_fp32_close(got, want):
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * max(1.0, y.abs().max().item()))


# -- tiled_mlp -------------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 60), chunk=st.integers(1, 25), kind=st.sampled_from(sorted(MLPS)))
def test_fp32_equals_untiled(n, chunk, kind):
    """Any token count, multiple of the chunk or not (a last short chunk, one chunk, one token each)."""
    gen = torch.Generator().manual_seed(n * 100 + chunk)
    x, g = torch.randn(n, H, generator=gen), torch.randn(n, H, generator=gen)
    ps = weights(kind, seed=n)
    assert_fp32_close(run(kind, x, ps, g, chunk), run(kind, x, ps, g))


@pytest.mark.parametrize("kind", sorted(MLPS))
def test_batched_input_and_default_chunk(kind):
    """(b, s, H) input over chunks that straddle the sequences; default chunk (H tokens) too."""
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(3, 11, H, generator=gen), torch.randn(3, 11, H, generator=gen)
    ps = weights(kind)
    plain = run(kind, x, ps, g)
    assert plain[0].shape == (3, 11, H)
    for chunk in (4, None):
        assert_fp32_close(run(kind, x, ps, g, chunk), plain)


@pytest.mark.parametrize("kind", sorted(MLPS))
def test_bf16_within_the_untiled_error(kind):
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(45, H, generator=gen).bfloat16(), torch.randn(45, H, generator=gen).bfloat16()
    ps = weights(kind, torch.bfloat16)
    tiled, plain = run(kind, x, ps, g, chunk=7), run(kind, x, ps, g)
    exact = run(kind, x.double(), [p.double() for p in ps], g.double())
    assert all(t.dtype == torch.bfloat16 for t in tiled)
    assert_within_own_error(tiled, plain, exact)


def test_tiled_mlp_errors_and_empty_input():
    x = torch.randn(6, H)
    with pytest.raises(ValueError, match="positive"):
        tiled_mlp(lambda h: h, x, [], chunk_tokens=0)
    with pytest.raises(TypeError, match="one tensor"):
        tiled_mlp(lambda h: (h, h), x, [], chunk_tokens=4)
    assert tiled_mlp(lambda h: 2 * h, torch.randn(0, 5, H), []).shape == (0, 5, H)


def test_autocast_state_is_replayed_in_backward():
    """The recompute runs under the forward's autocast state, whatever state backward is called in."""
    kind = "llama"
    fn, ps = MLPS[kind][0], [p.requires_grad_() for p in weights(kind)]
    x = torch.randn(2, 9, H, requires_grad=True)
    seen = []

    def spy(h):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return fn(h, *ps)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiled_mlp(spy, x, ps, chunk_tokens=4)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()  # outside autocast
    assert len(seen) == 2 * 5 and set(seen) == {(True, torch.bfloat16)}
    seen.clear()
    out = tiled_mlp(spy, x, ps, chunk_tokens=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.sum().backward()  # inside autocast: the fp32 forward is still recomputed in fp32
    assert len(seen) == 10 and not any(on for on, _ in seen)


def test_autocast_bf16_within_the_untiled_error():
    """fp32 weights under autocast(cpu, bf16): the tiled step against the untiled one, both against fp64
    from the bf16 values autocast computes with."""
    kind = "llama"
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(30, H, generator=gen), torch.randn(30, H, generator=gen)
    ps = weights(kind)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tiled, plain = run(kind, x, ps, g, chunk=8), run(kind, x, ps, g)
    assert tiled[0].dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in tiled[1:])
    exact = run(kind, x.bfloat16().double(), [p.bfloat16().double() for p in ps], g.double())
    assert_within_own_error(tiled, plain, exact)


def test_micro_batches_accumulate_like_one_batch():
    """Gradients reach .grad through autograd: two micro batches sum to one batch's gradient, and a
    post-accumulate-grad hook (what DDP and FSDP hook) fires once per backward, not once per chunk."""
    torch.manual_seed(4)
    plain = torch.nn.Sequential(torch.nn.Linear(H, I), torch.nn.GELU(), torch.nn.Linear(I, H))
    tiled = patch_mlp(torch.nn.Sequential(torch.nn.Linear(H, I), torch.nn.GELU(), torch.nn.Linear(I, H)),
                      chunk_tokens=5)
    tiled.load_state_dict(plain.state_dict())
    fired = []
    for p in tiled.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    x, w = torch.randn(4, 7, H), torch.randn(H)
    (plain(x) @ w).sum().backward()
    for part in (x[:1], x[1:]):
        (tiled(part) @ w).sum().backward()
    assert len(fired) == 2 * 4
    for a, b in zip(tiled.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_frozen_and_unused_params_get_no_gradient():
    kind = "llama"
    wg, wu, wd = weights(kind)
    wu.requires_grad_()
    wd.requires_grad_()  # wg frozen (as the base weights under LoRA)
    unused = torch.zeros(3, requires_grad=True)
    x = torch.randn(13, H, requires_grad=True)
    out = tiled_mlp(lambda h: swiglu(h, wg, wu, wd), x, [wg, wu, wd, unused], chunk_tokens=4)
    out.square().sum().backward()
    assert wg.grad is None and unused.grad is None
    got = [x.grad, wu.grad, wd.grad]
    x2, wu2, wd2 = (t.detach().clone().requires_grad_() for t in (x, wu, wd))
    swiglu(x2, wg, wu2, wd2).square().sum().backward()
    assert_fp32_close(got, [x2.grad, wu2.grad, wd2.grad])
    # nothing but x needs a gradient
    x3 = x.detach().clone().requires_grad_()
    tiled_mlp(lambda h: swiglu(h, wg, wu.detach(), wd.detach()), x3, [wg], chunk_tokens=4).sum().backward()
    assert x3.grad.shape == x.shape


def test_the_incoming_gradient_is_left_intact():
    """A (1, H) parameter broadcast over one-token chunks gets the incoming gradient itself from
    autograd; summing the chunks must not write into it."""
    p = torch.zeros(1, H, requires_grad=True)
    x, g = torch.randn(5, H, requires_grad=True), torch.randn(5, H)
    kept = g.clone()
    gx, gp = torch.autograd.grad(tiled_mlp(lambda h: 2 * h + p, x, [p], chunk_tokens=1), (x, p), g)
    assert torch.equal(g, kept)
    torch.testing.assert_close(gp, g.sum(0, keepdim=True))
    torch.testing.assert_close(gx, 2 * g)


def test_dropout_masks_are_replayed():
    """Backward recomputes each chunk with the forward's RNG state, so dropout draws the same masks: the
    gradient of x follows the kept outputs of the forward."""
    torch.manual_seed(5)
    w = torch.randn(I, H)
    x = torch.randn(23, H, requires_grad=True)
    out = tiled_mlp(lambda h: F.dropout(F.linear(h, w), p=0.5, training=True), x, [w], chunk_tokens=6)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    kept = (out != 0).float() * 2.0  # 1 / (1 - p) where kept
    torch.testing.assert_close(gx, (g * kept) @ w, rtol=1e-5, atol=1e-5)
    out = tiled_mlp(lambda h: F.dropout(h, 0.5), x, [], 6)
    after_forward = torch.get_rng_state()
    torch.autograd.grad(out.sum(), x)
    assert torch.equal(after_forward, torch.get_rng_state())  # the replay leaves the generator as it was


def test_fake_tensors_and_peak_memory():
    """Forward + backward under FakeTensorMode (memplan's tracer), and the tracker sees the intermediate
    activations shrink from every token's to one chunk's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.verify.tracer import LiveTracker

    hid, inter, n = 64, 256, 4096

    def peak(chunk):
        with FakeTensorMode():
            tracker = LiveTracker()
            with tracker:
                tracker.set_phase("data")
                x = torch.empty(n, hid, requires_grad=True)
                ps = [torch.empty(inter, hid, requires_grad=True) for _ in range(2)]
                ps.append(torch.empty(hid, inter, requires_grad=True))
                tracker.set_phase("forward")
                f = lambda h: swiglu(h, *ps)  # noqa: E731
                out = tiled_mlp(f, x, ps, chunk) if chunk else f(x)
                tracker.set_phase("backward")
                grads = torch.autograd.grad(out, [x, *ps], torch.ones_like(out))
            assert [g.shape for g in grads] == [x.shape, *(p.shape for p in ps)]
            assert type(out).__name__ == "FakeTensor"
            s = tracker.summarize()
        return s.peak_allocated - s.breakdown.get("inputs", 0)

    untiled, tiled = peak(None), peak(64)
    intermediate = n * inter * 4
    assert untiled > 4 * intermediate  # gate, up and act(gate) saved, their gradients in backward
    assert tiled < untiled / 3


# -- gated_act -------------------------------------------------------------------------------------------


def gated_inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if shape == "fused":  # the two halves of one gate_up projection: strided views, no copy
        fused = torch.randn(19, 66, generator=gen).to(dtype) * 2
        gate, up = fused.chunk(2, dim=-1)
        return gate, up, torch.randn(19, 33, generator=gen).to(dtype)
    return (torch.randn(shape, generator=gen).to(dtype) * 2, torch.randn(shape, generator=gen).to(dtype),
            torch.randn(shape, generator=gen).to(dtype))


def gated_run(f, gate, up, g):
    gate, up = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    out = f(gate, up)
    return [out.detach(), *torch.autograd.grad(out, (gate, up), g)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", [(37, 53), (3, 5, 17), "fused"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_act_matches_reference(act, shape, backend):
    """The Triton kernels (in Triton's interpreter without a GPU) and the PyTorch path, fp32 and bf16."""
    gate, up, g = gated_inputs(shape, torch.float32, seed=len(str(shape)))
    fused = gated_run(lambda a, b: gated_act(a, b, act, backend), gate, up, g)
    assert_fp32_close(fused, gated_run(lambda a, b: reference_gated(a, b, act), gate, up, g))
    gate, up, g = (t.bfloat16() for t in (gate, up, g))
    fused = gated_run(lambda a, b: gated_act(a, b, act, backend), gate, up, g)
    plain = gated_run(lambda a, b: reference_gated(a, b, act), gate, up, g)
    exact = gated_run(lambda a, b: reference_gated(a, b, act), gate.double(), up.double(), g.double())
    assert all(t.dtype == torch.bfloat16 for t in fused)
    assert_within_own_error(fused, plain, exact)


def test_gated_act_saves_only_its_inputs():
    gate, up = torch.randn(8, 12, requires_grad=True), torch.randn(8, 12, requires_grad=True)

    def saved(f):
        n = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: n.append(t.numel()) or t, lambda t: t):
            f(gate, up)
        return n

    assert saved(lambda a, b: gated_act(a, b, "silu")) == [96, 96]
    assert sum(saved(lambda a, b: reference_gated(a, b, "silu"))) == 3 * 96  # gate, silu(gate), up


def test_gated_act_errors(monkeypatch):
    gate, up = torch.randn(4, 6), torch.randn(4, 6)
    with pytest.raises(ValueError, match="act must be"):
        gated_act(gate, up, "relu")
    with pytest.raises(ValueError, match="backend must be"):
        gated_act(gate, up, backend="cuda")
    with pytest.raises(ValueError, match="same shape"):
        gated_act(gate, up[:, :5])
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        gated_act(gate.double(), up.double(), backend="triton")
    import memplan.kernels.triton_mlp as triton_mlp

    monkeypatch.setattr(triton_mlp, "INTERPRETED", False)  # as if imported without TRITON_INTERPRET=1
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        gated_act(gate, up, backend="triton")
    torch.testing.assert_close(gated_act(gate, up), reference_gated(gate, up))  # auto: PyTorch on CPU


# -- patch_mlp on transformers models ----------------------------------------------------------------------

TINY = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                 bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_patched_model_gives_the_same_loss_and_gradients(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY[family])).eval()
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    assert len(mlps) == 2
    x = torch.randint(0, 128, (2, 16))
    params = list(model.parameters())

    def loss_and_grads():
        loss = model(input_ids=x, labels=x).loss
        return [loss.detach(), *torch.autograd.grad(loss, params, allow_unused=True)]

    base = loss_and_grads()
    for m in mlps:
        patch_mlp(m, chunk_tokens=64)
        patch_mlp(m, chunk_tokens=5)  # idempotent: one tiling, the last chunk size
    tiled = loss_and_grads()
    assert_fp32_close([t for t, b in zip(tiled, base) if b is not None], [b for b in base if b is not None])
    # inside activation-checkpointed layers (transformers checkpoints in training mode only; no dropout
    # in these configs): the tiled Function runs again in each layer's recompute
    model.train().activation_checkpointing_enable({"use_reentrant": False})
    tiled = loss_and_grads()
    model.activation_checkpointing_disable()
    model.eval()
    assert_fp32_close([t for t, b in zip(tiled, base) if b is not None], [b for b in base if b is not None])
    for m in mlps:
        unpatch_mlp(m)
        unpatch_mlp(m)
        assert "forward" not in vars(m) and not any(k.startswith("_memplan") for k in vars(m))
    torch.testing.assert_close(model(input_ids=x, labels=x).loss.detach(), base[0], rtol=0, atol=0)


# -- CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_triton_gated_act_on_cuda_at_llama_size(act):
    """Llama-3-8B's intermediate (14336) over 4096 tokens in bf16, and the tiled MLP on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate, up, g = (torch.randn(4096, 14336, generator=gen, device="cuda").bfloat16() for _ in range(3))
    fused = gated_run(lambda a, b: gated_act(a, b, act, "triton"), gate, up, g)
    plain = gated_run(lambda a, b: reference_gated(a, b, act), gate, up, g)
    exact = gated_run(lambda a, b: reference_gated(a, b, act), gate.double(), up.double(), g.double())
    assert_within_own_error(fused, plain, exact)
    kind = "llama" if act == "silu" else "gemma"
    x, g = (torch.randn(3, 700, H, generator=gen, device="cuda").bfloat16() for _ in range(2))
    ps = [p.cuda() for p in weights(kind, torch.bfloat16)]
    tiled, plain = run(kind, x, ps, g, chunk=256), run(kind, x, ps, g)
    exact = run(kind, x.double(), [p.double() for p in ps], g.double())
    assert_within_own_error(tiled, plain, exact)
