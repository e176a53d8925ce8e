"""memplan.selective: Megatron-style selective recomputation of the attention core on tiny transformers
models (random weights, CPU): same loss and gradients, the core runs again in backward, the s x s
probabilities are no longer saved, and it works under FakeTensorMode and a TorchFunctionMode."""

import importlib

import pytest
import torch
import torch.utils.checkpoint
import transformers
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface

from memplan.selective import disable_selective, enable_selective, is_selective

B, S, HEADS, LAYERS, VOCAB = 2, 16, 4, 2, 128


def tiny(family: str, impl: str):
    """A 2-layer, hidden-64 model of `family` with random weights and every dropout at 0."""
    if family == "llama":
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                       num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
                                       attention_dropout=0.0)
        cls = transformers.LlamaForCausalLM
    elif family == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=128,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    elif family == "bert":
        cfg = transformers.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, vocab_size=VOCAB, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        cls = transformers.BertForMaskedLM
    elif family == "t5":  # encoder and decoder stacks keep deep copies of the config
        cfg = transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=LAYERS, num_heads=HEADS,
                                    vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        cls = transformers.T5ForConditionalGeneration
    else:
        raise AssertionError(family)
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation=impl)
    model.train()
    return model


def batch(s: int = S, padded: bool = True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (B, s), generator=g)
    mask = torch.ones(B, s, dtype=torch.long)
    if padded:
        mask[1, s - 3:] = 0  # a padded row, so the mask path is exercised
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def cores_per_step(family: str) -> int:
    return 3 * LAYERS if family == "t5" else LAYERS  # T5: encoder self, decoder self and cross attention


@pytest.fixture
def core_calls(monkeypatch):
    """Counts calls of the real attention cores: every modeling module's eager_attention_forward and the
    registered sdpa function. Both are looked up at call time by the model and by the selective wrapper."""
    calls = []

    def spy(fn):
        def counted(*args, **kwargs):
            calls.append(fn)
            return fn(*args, **kwargs)
        return counted

    for name in ("llama", "gpt2", "bert", "t5"):
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        monkeypatch.setattr(mod, "eager_attention_forward", spy(mod.eager_attention_forward))
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", spy(AttentionInterface._global_mapping["sdpa"]))
    return calls


def step(model, b):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss = model(**b).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def attn_impls(model) -> set:
    return {m.config._attn_implementation for m in model.modules() if hasattr(m, "config")}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "t5"])
def test_same_loss_and_grads_core_runs_twice(family, impl, core_calls):
    model, b = tiny(family, impl), batch()
    n = cores_per_step(family)

    loss0, grads0 = step(model, b)
    assert len(core_calls) == n  # once per layer without selective
    core_calls.clear()

    enable_selective(model)
    assert is_selective(model) and attn_impls(model) == {f"selective_{impl}"}
    loss1, grads1 = step(model, b)
    assert len(core_calls) == 2 * n  # forward + recompute in backward
    core_calls.clear()
    assert torch.allclose(loss0, loss1, rtol=0, atol=1e-6)
    assert grads0.keys() == grads1.keys() and len(grads0) == len(list(model.parameters()))
    for name in grads0:
        assert torch.allclose(grads0[name], grads1[name], rtol=0, atol=1e-6), name

    disable_selective(model)
    assert not is_selective(model) and attn_impls(model) == {impl}
    loss2, grads2 = step(model, b)
    assert len(core_calls) == n
    assert torch.equal(loss0, loss2)
    assert all(torch.equal(grads0[k], grads2[k]) for k in grads0)


def test_no_checkpoint_without_grad(core_calls, monkeypatch):
    model = tiny("llama", "sdpa")
    enable_selective(model)
    ckpts = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: ckpts.append(1) or real(*a, **k))
    with torch.no_grad():
        model(**batch())
    assert len(core_calls) == LAYERS and not ckpts


def saved_bytes(model, b, monkeypatch):
    """Bytes of the distinct storages saved for backward during forward (the checkpoint's inputs included:
    non-reentrant checkpoint saves them through the same hooks), and the storages of the checkpoint inputs
    that do not require grad (the attention mask, position ids: shared by all layers)."""
    saved, shared = {}, {}
    real = torch.utils.checkpoint.checkpoint

    def spy(fn, *args, **kwargs):
        assert all(isinstance(a, torch.Tensor) for a in args)  # only tensors go positionally
        for a in args:
            if not a.requires_grad:
                shared[a.untyped_storage().data_ptr()] = a.untyped_storage().nbytes()
        return real(fn, *args, **kwargs)

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t  # kept alive: no address reuse while measuring
        return t

    with monkeypatch.context() as m:
        m.setattr(torch.utils.checkpoint, "checkpoint", spy)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**b).loss
    total = sum(t.untyped_storage().nbytes() for t in saved.values())
    loss.backward()
    return total, sum(shared.values())


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_saved_activation_memory_drops(family, monkeypatch):
    s = 64
    model, b = tiny(family, "eager"), batch(s, padded=False)
    probs = B * HEADS * s * s * 4  # one layer's fp32 softmax output

    base, none_shared = saved_bytes(model, b, monkeypatch)
    assert none_shared == 0
    enable_selective(model)
    sel, shared = saved_bytes(model, b, monkeypatch)
    disable_selective(model)
    again, _ = saved_bytes(model, b, monkeypatch)

    assert again == base
    # The checkpoint must keep its inputs until backward. Query, key and value are saved without it too;
    # the causal mask (fp32, B x 1 x s x s) and position ids are new, but held once for all layers.
    assert shared <= B * s * s * 4 + B * s * 8
    assert base - sel >= LAYERS * probs - shared
    if family == "bert":  # no padding: no mask at all, so every layer's probabilities are saved outright
        assert shared == 0 and base - sel >= LAYERS * probs


class CastingCounter(TorchFunctionMode):
    """An autocast-like mode: matmuls, linears and sdpa run in bf16; softmax/sdpa calls are counted. It
    handles `Tensor.backward` too, so torch pops it for the whole backward: the recomputation must re-enter it
    (else the recomputed core runs in fp32 and checkpoint's metadata check fails)."""

    CAST = {"linear", "matmul", "scaled_dot_product_attention"}

    def __init__(self):
        super().__init__()
        self.cores = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("softmax", "scaled_dot_product_attention"):
            self.cores += 1
        if name in self.CAST:
            cast = lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_fake_tensors_and_function_mode(impl, fake):
    ctx = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t)
    with ctx:
        model = tiny("llama", impl)
        enable_selective(model)
        mode = CastingCounter()
        with mode:
            loss = model(**batch()).loss
            assert mode.cores == LAYERS
            loss.backward()
        assert mode.cores == 2 * LAYERS  # the recomputation ran under the mode as well
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and g.dtype == torch.float32 for g in grads)
        assert all(isinstance(g, FakeTensor) == fake for g in grads)
        if not fake:
            assert all(torch.isfinite(g).all() for g in grads)


def test_t5_configs_and_idempotence():
    model = tiny("t5", "eager")
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    assert len(configs) == 3  # the model's and the two stacks' deep copies
    enable_selective(model)
    enable_selective(model)  # no-op
    assert {c._attn_implementation for c in configs.values()} == {"selective_eager"}
    disable_selective(model)
    assert {c._attn_implementation for c in configs.values()} == {"eager"}
    disable_selective(model)  # no-op
    assert {c._attn_implementation for c in configs.values()} == {"eager"}


def test_unsupported():
    other = torch.nn.Module()
    other.config = transformers.BloomConfig()
    with pytest.raises(ValueError, match="supported: .*llama"):
        enable_selective(other)
    model = tiny("llama", "eager")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="flex_attention"):
        enable_selective(model)
    assert not is_selective(model) and model.config._attn_implementation == "flex_attention"


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_wrapper_returns_core_outputs(impl):
    from memplan.selective import SELECTIVE_FUNCTIONS, resolve_core

    model = tiny("llama", impl)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, HEADS, S, 16, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.zeros(B, 1, S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    core = resolve_core(impl, attn)
    ref = core(attn, q, k, v, mask, dropout=0.0, scaling=0.25)
    out = SELECTIVE_FUNCTIONS[f"selective_{impl}"](attn, q, k, v, mask, dropout=0.0, scaling=0.25)
    assert len(out) == len(ref) == 2
    assert torch.equal(out[0], ref[0])
    assert (out[1] is None) == (ref[1] is None) and (ref[1] is None or torch.equal(out[1], ref[1]))
    assert (ref[1] is None) == (impl == "sdpa")
