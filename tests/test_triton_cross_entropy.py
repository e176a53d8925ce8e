"""The Triton fused linear + cross-entropy (kernels/triton_cross_entropy.py) against the plain computation.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET=1
before they are imported); with one, the same tests run the compiled kernels on CUDA tensors.

Tolerance rule, as tests/test_kernels.py: in fp32 equal to the reference to fp32 rounding (rel 1e-5,
plus 1e-6 of the largest value: the sums run in another order). In bf16 both are compared with an fp64
computation from the same bf16 inputs; the kernel's error may be at most twice the reference's own
error, plus one bf16 ulp (2^-8 relative) of the largest value.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

import memplan.kernels.cross_entropy as lce  # noqa: E402
import memplan.kernels.triton_cross_entropy as tce  # noqa: E402
from memplan.kernels import linear_cross_entropy  # noqa: E402
from memplan.kernels.cross_entropy import reference  # noqa: E402
import lce_data  # noqa: E402  (tests/lce_data.py)
from tolerance import assert_within_own_error  # noqa: E402  (tests/tolerance.py)
from lce_data import bias_for, run, run_bias, tokens_and_reduction  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_kernels = pytest.mark.skipif(DEVICE == "cpu" and not tce.INTERPRETED,
                                      reason="no CUDA and the kernels were not imported under TRITON_INTERPRET=1")
pytestmark = requires_kernels


def triton_loss(h, w, t, **kw):
    return linear_cross_entropy(h, w, t, backend="triton", **kw)


def with_tiles(tiles):
    def fn(h, w, t, ignore_index=-100, reduction="mean", softcap=None, num_items_in_batch=None, bias=None):
        return tce.TritonLinearCrossEntropy.apply(h, w, t, ignore_index, reduction, softcap, num_items_in_batch,
                                                  tiles, bias)
    return fn


def data(n, hid, vocab, dtype, seed=0, ignore_every=5):
    return tuple(x.to(DEVICE) for x in lce_data.data(n, hid, vocab, dtype, seed, ignore_every))


def assert_fp32_close(a, b):
    for x, y in zip(a, b):
        # fp32 sums in another order: the error scales with the largest term, not with each element
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6 * max(1.0, y.abs().max().item()))


# Tile sets whose sizes the shapes below are rarely multiples of; programs < blocks, so the backward's
# persistent programs each take several blocks and reuse their fp32 scratch.
TILES = [tce.Tiles(block_n=16, block_v=32, block_h=16, programs=2),
         tce.Tiles(block_n=32, block_v=16, block_h=32, programs=3)]


@settings(max_examples=20, deadline=None)
@given(n_reduction=tokens_and_reduction(40), hid=st.integers(1, 80), vocab=st.integers(2, 90),
       tiles=st.sampled_from(TILES), softcap=st.sampled_from([None, 30.0, 5.0]))
def test_fp32_odd_sizes_match_reference(n_reduction, hid, vocab, tiles, softcap):
    n, reduction = n_reduction
    h, w, t = data(n, hid, vocab, torch.float32, seed=n * 1000 + vocab)
    g = torch.randn(n, device=DEVICE) if reduction == "none" else torch.tensor(1.3, device=DEVICE)
    a = run(with_tiles(tiles), h, w, t, g, reduction=reduction, softcap=softcap)
    b = run(reference, h, w, t, g, reduction=reduction, softcap=softcap)
    assert_fp32_close(a, b)


@pytest.mark.parametrize("reduction,softcap", [("mean", None), ("sum", 30.0), ("none", None), ("none", 30.0)])
def test_bf16_within_the_references_own_error(reduction, softcap):
    h, w, t = data(40, 48, 100, torch.bfloat16)
    g = torch.randn(40, device=DEVICE) if reduction == "none" else torch.tensor(1.0, device=DEVICE)
    kernel = run(triton_loss, h, w, t, g, reduction=reduction, softcap=softcap)
    ref = run(reference, h, w, t, g, reduction=reduction, softcap=softcap)
    exact = run(reference, h.double(), w.double(), t, g.double(), reduction=reduction, softcap=softcap)
    assert_within_own_error(kernel, ref, exact)


@settings(max_examples=12, deadline=None)
@given(n_reduction=tokens_and_reduction(40), hid=st.integers(1, 60), vocab=st.integers(2, 90),
       tiles=st.sampled_from(TILES), softcap=st.sampled_from([None, 30.0, 5.0]))
def test_bias_fp32_odd_sizes_match_reference(n_reduction, hid, vocab, tiles, softcap):
    """With an LM-head bias: loss and the gradients of hidden states, weight and bias."""
    n, reduction = n_reduction
    h, w, t = data(n, hid, vocab, torch.float32, seed=n * 1000 + vocab)
    b = bias_for(vocab, torch.float32, seed=hid, device=DEVICE)
    g = torch.randn(n, device=DEVICE) if reduction == "none" else torch.tensor(1.3, device=DEVICE)
    a = run_bias(with_tiles(tiles), h, w, b, t, g, reduction=reduction, softcap=softcap)
    r = run_bias(reference, h, w, b, t, g, reduction=reduction, softcap=softcap)
    assert_fp32_close(a, r)


@pytest.mark.parametrize("reduction,softcap", [("mean", None), ("none", 30.0)])
def test_bias_bf16_within_the_references_own_error(reduction, softcap):
    h, w, t = data(40, 48, 100, torch.bfloat16)
    b = bias_for(100, torch.bfloat16, device=DEVICE)
    g = torch.randn(40, device=DEVICE) if reduction == "none" else torch.tensor(1.0, device=DEVICE)
    kernel = run_bias(triton_loss, h, w, b, t, g, reduction=reduction, softcap=softcap)
    ref = run_bias(reference, h, w, b, t, g, reduction=reduction, softcap=softcap)
    exact = run_bias(reference, h.double(), w.double(), b.double(), t, g.double(), reduction=reduction,
                     softcap=softcap)
    assert_within_own_error(kernel, ref, exact)


def test_bias_matches_the_torch_path_and_is_deterministic():
    h, w, t = data(33, 20, 45, torch.float32)
    b = bias_for(45, torch.float32, device=DEVICE)
    kernel = run_bias(triton_loss, h, w, b, t, softcap=5.0)
    torch_path = run_bias(linear_cross_entropy, h, w, b, t, softcap=5.0, backend="torch")
    assert_fp32_close(kernel, torch_path)
    assert all(torch.equal(x, y) for x, y in zip(kernel, run_bias(triton_loss, h, w, b, t, softcap=5.0)))


@pytest.mark.parametrize("which", ["bias", "weight"])
def test_bias_gradient_alone_or_with_the_weights(which, monkeypatch):
    """The weight kernel gives the bias's gradient; it runs for it alone too (GRAD_W off, no matmul)."""
    h, w, t = data(20, 16, 40, torch.float32)
    b = bias_for(40, torch.float32, device=DEVICE).requires_grad_()
    ran = []
    grad = tce._grad
    monkeypatch.setattr(tce, "_grad", lambda kernel, *a: ran.append(kernel) or grad(kernel, *a))
    w.requires_grad_(which == "weight")
    xs = (w, b) if which == "weight" else (b,)
    got = torch.autograd.grad(triton_loss(h, w, t, bias=b, softcap=5.0), xs)
    _, _, gw, gb = run_bias(reference, h, w, b, t, softcap=5.0)
    assert ran == [tce._grad_weight_kernel]
    for x, y in zip(got, (gw, gb) if which == "weight" else (gb,)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    no_tokens = data(0, 16, 40, torch.float32)
    (gb0,) = torch.autograd.grad(triton_loss(*no_tokens, bias=b, reduction="sum"), b)
    assert torch.equal(gb0, torch.zeros_like(gb0))


@triton.jit
def _round_kernel(x_ptr, y_ptr, UPCAST: tl.constexpr):
    r = tl.arange(0, 1024)
    tl.store(y_ptr + r, tce._to(tl.load(x_ptr + r), y_ptr.dtype.element_ty, UPCAST))


def test_bf16_stores_round_to_nearest_even():
    """The kernels' fp32 -> bf16 casts round as torch and the GPU do (the interpreter's own cast truncates)."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0)) * torch.logspace(-40, 38, 1024)
    x[:8] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -1e-40, 3.3e38, float("nan"),
                          float("inf"), 0.0])  # ties to even (down, up), above a tie, subnormal, overflow, ...
    x = x.to(DEVICE)
    y = torch.empty(1024, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(1,)](x, y, UPCAST=tce.INTERPRETED)
    torch.testing.assert_close(y, x.bfloat16(), rtol=0, atol=0, equal_nan=True)


def test_all_ignored():
    h, w, t = data(9, 16, 33, torch.float32)
    t[:] = -100
    loss, gh, gw = run(triton_loss, h, w, t, reduction="sum")
    assert loss.item() == 0 and gh.abs().max() == 0 and gw.abs().max() == 0
    # mean: 0 / 0, a NaN loss and zero gradients, as torch's cross_entropy and the PyTorch path
    mean = run(triton_loss, h, w, t)
    torch_path = run(linear_cross_entropy, h, w, t, backend="torch")
    assert torch.isnan(mean[0]) and torch.isnan(reference(h, w, t))
    assert mean[1].abs().max() == 0 and mean[2].abs().max() == 0
    for x, y in zip(mean, torch_path):
        torch.testing.assert_close(x, y, equal_nan=True)


def test_no_tokens():
    h, w, t = data(0, 16, 20, torch.float32)
    loss, gh, gw = run(triton_loss, h, w, t, reduction="sum")
    assert loss.item() == 0 and gh.shape == (0, 16) and torch.equal(gw, torch.zeros_like(gw))


def test_accumulation_equals_one_batch():
    """Two micro batches normalised by the whole batch's token count (transformers' num_items_in_batch)
    give the gradients of one batch."""
    h, w, t = data(40, 24, 50, torch.float32)
    n_items = int((t != -100).sum())
    _, gh_all, gw_all = run(triton_loss, h, w, t)
    parts = [run(triton_loss, h[s], w, t[s], num_items_in_batch=n_items) for s in (slice(0, 23), slice(23, 40))]
    torch.testing.assert_close(parts[0][2] + parts[1][2], gw_all, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), gh_all, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_one_gradient_runs_one_kernel(which, monkeypatch):
    h, w, t = data(20, 16, 40, torch.float32)
    ran = []
    grad = tce._grad
    monkeypatch.setattr(tce, "_grad", lambda kernel, *a: ran.append(kernel) or grad(kernel, *a))
    h.requires_grad_(which == "hidden")
    w.requires_grad_(which == "weight")
    x = h if which == "hidden" else w
    (got,) = torch.autograd.grad(triton_loss(h, w, t, softcap=5.0), x)
    _, gh, gw = run(reference, h, w, t, softcap=5.0)
    assert ran == [tce._grad_hidden_kernel if which == "hidden" else tce._grad_weight_kernel]
    torch.testing.assert_close(got, gh if which == "hidden" else gw, rtol=1e-5, atol=1e-6)


def test_deterministic():
    h, w, t = data(33, 20, 45, torch.float32)
    a, b = run(triton_loss, h, w, t), run(triton_loss, h, w, t)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_batched_shapes_and_autocast():
    h, w, t = data(24, 16, 40, torch.float32)
    out = triton_loss(h.reshape(2, 12, 16), w, t.reshape(2, 12), reduction="none")
    assert out.shape == (2, 12)
    torch.testing.assert_close(out.reshape(-1), reference(h, w, t, reduction="none"))
    # autocast: hidden states and weight are cast to the autocast dtype once, outside the kernels
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        cast = triton_loss(h, w, t)
    torch.testing.assert_close(cast, triton_loss(h.bfloat16(), w.bfloat16(), t), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one dtype"):
        triton_loss(h, w.double(), t)


def test_backend_choice(monkeypatch):
    h, w, t = data(8, 16, 20, torch.float32)
    h.requires_grad_()
    picked = type(linear_cross_entropy(h, w, t).grad_fn).__name__
    assert picked == ("TritonLinearCrossEntropyBackward" if DEVICE == "cuda" else "LinearCrossEntropyBackward")
    assert type(triton_loss(h, w, t).grad_fn).__name__ == "TritonLinearCrossEntropyBackward"
    assert type(linear_cross_entropy(h, w, t, backend="torch").grad_fn).__name__ == "LinearCrossEntropyBackward"
    with pytest.raises(ValueError, match="backend must be"):
        linear_cross_entropy(h, w, t, backend="cuda")
    with FakeTensorMode():  # memplan's tracer: fake CUDA tensors keep the PyTorch path
        fake = torch.empty(8, 16, device="cuda"), torch.empty(20, 16, device="cuda")
        assert lce._triton_loss("auto", *fake) is None
    if DEVICE == "cpu":  # CPU tensors without the interpreter: a clear error, not a crash inside triton
        monkeypatch.setattr(tce, "INTERPRETED", False)
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            triton_loss(h, w, t)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_autotuned_kernel_at_a_realistic_size():
    """Llama-2-sized head in bf16 (N 4096, H 4096, V 32,000): the autotuned kernels against the tiled
    PyTorch path, both held to an fp64 computation from the same inputs; backward twice, bitwise equal."""
    n, hid, vocab = 4096, 4096, 32000
    h, w, t = data(n, hid, vocab, torch.bfloat16, ignore_every=7)
    kernel = run(triton_loss, h, w, t)
    assert all(torch.equal(x, y) for x, y in zip(kernel, run(triton_loss, h, w, t)))
    torch_path = run(linear_cross_entropy, h, w, t, backend="torch")
    exact = run(reference, h.double(), w.double(), t)
    assert_within_own_error(kernel, torch_path, exact)
