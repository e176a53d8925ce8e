"""The estimator against its calibration point and its invariants."""

import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

import memplan
from memplan.estimator import step as estimator
from memplan.errors import UserError

MiB = 1 << 20
# DESIGN.md calibration point: V100-SXM2 16 GB, HF Trainer, bert-large-uncased sequence classification,
# batch 4, seq 512, fp32, AdamW: NVML showed 14949 MB (MiB) used.
V100_BERT_LARGE_MIB = 14949


@pytest.mark.parametrize("zero_grad", ["set-to-none", "zeros"])
def test_v100_bert_large_calibration(zero_grad):
    e = memplan.estimate("bert-large", "v100-16g", micro_batch=4, seq_len=512, precision="fp32",
                         optim="adamw_torch_fused", attn="eager", zero_grad=zero_grad)
    assert e.model.params_total == 335_143_938
    assert abs(e.device_used_bytes / MiB / V100_BERT_LARGE_MIB - 1) < 0.05
    assert e.fits
    assert e.peak_allocated_bytes <= e.peak_reserved_bytes <= e.device_used_bytes


def test_meters_and_breakdown_add_up():
    e = memplan.estimate("gpt2", "a100-80g", micro_batch=8, seq_len=1024, precision="bf16")
    b = e.breakdown
    assert b["allocator_overhead"] + e.peak_allocated_bytes == e.peak_reserved_bytes
    assert e.peak_reserved_bytes + b["cuda_context"] == e.device_used_bytes
    assert sum(v for k, v in b.items() if k not in ("allocator_overhead", "cuda_context")) == e.peak_allocated_bytes
    assert e.phases[e.peak_phase] + b["workspace"] == e.peak_allocated_bytes


def test_autocast_keeps_half_copies_until_backward():
    fp32 = memplan.estimate("gpt2-medium", "a100-80g", micro_batch=8, seq_len=1024, precision="fp32")
    amp = memplan.estimate("gpt2-medium", "a100-80g", micro_batch=8, seq_len=1024, precision="bf16")
    assert fp32.breakdown["autocast_cache"] == 0
    # linear weights + the tied LM head, 2 bytes each
    assert amp.breakdown["autocast_cache"] > 1.9 * (amp.model.params_total - 1024 * 1024)


def test_large_vocab_logits_dominate_llama3():
    e = memplan.estimate("llama-3.2-1b", "h100-80g", micro_batch=4, seq_len=4096, precision="bf16", attn="flash",
                         grad_ckpt="full")
    # 4*4096 tokens x 128,256 vocab: the fp32 loss buffers are GBs
    assert e.peak_phase in ("backward-start", "forward-loss")
    assert e.breakdown["transient"] + e.breakdown["activations"] > 8 * 4 * 4096 * 128256


def test_inference_kv_cache_and_formats():
    e = memplan.estimate("llama-2-7b", "a100-80g", task="infer", micro_batch=4, seq_len=1024, precision="bf16-pure",
                         max_new_tokens=1024, beams=2)
    # 2 * 32 layers * 8 seqs * 2048 tokens * 32 kv heads * 128 * 2 bytes
    assert e.breakdown["kv_cache"] == 2 * 32 * 8 * 2048 * 32 * 128 * 2
    w16 = e.breakdown["weights"]
    w4 = memplan.estimate("llama-2-7b", "a100-80g", task="infer", precision="int4").breakdown["weights"]
    amp = memplan.estimate("llama-2-7b", "a100-80g", task="infer", precision="fp16")
    assert w4 < 0.4 * w16
    assert amp.breakdown["weights"] + amp.breakdown["autocast_cache"] == pytest.approx(3 * w16, rel=0.02)  # 6 B/param


def test_hardware_refusals():
    with pytest.raises(UserError, match="bf16"):
        memplan.estimate("gpt2", "v100-16g", precision="bf16")
    with pytest.raises(UserError, match="FlashAttention"):
        memplan.estimate("gpt2", "t4-16g", precision="fp16", attn="flash")
    with pytest.raises(UserError, match="fp32"):
        memplan.estimate("gpt2", "a100-80g", precision="fp32", attn="flash_attention_2")


def test_estimate_path_imports_no_torch():
    code = ("import sys, memplan; memplan.estimate('llama-3.1-8b', 'h100', micro_batch=2, seq_len=2048, "
            "precision='bf16'); memplan.suggest('bert-large', 'v100-16g'); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


MODELS = ["bert-base", "gpt2", "llama-3.2-1b", "t5-small", "mixtral-8x7b", "vit-base", "qwen2.5-0.5b", "gemma-2-2b"]
train_cfg = dict(
    model=st.sampled_from(MODELS),
    precision=st.sampled_from(["fp32", "fp16", "bf16", "bf16-pure"]),
    optim=st.sampled_from(["adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "adafactor", "sgd"]),
    attn=st.sampled_from(["eager", "sdpa", "flash"]),
    ckpt=st.sampled_from(["none", "full"]),
    b=st.integers(1, 16),
    s=st.integers(1, 2048),
)


def _est(model, precision, optim, attn, ckpt, b, s):
    if attn == "flash" and precision == "fp32":
        attn = "sdpa"
    if attn not in estimator.supported_attn(memplan.resolve_model(model)):
        attn = "eager"
    return memplan.estimate(model, "h100-80g", micro_batch=b, seq_len=s, precision=precision, optim=optim,
                            attn=attn, grad_ckpt=ckpt)


@settings(max_examples=60, deadline=None)
@given(**train_cfg, db=st.integers(1, 8))
def test_more_batch_never_needs_less(model, precision, optim, attn, ckpt, b, s, db):
    small = _est(model, precision, optim, attn, ckpt, b, s)
    big = _est(model, precision, optim, attn, ckpt, b + db, s)
    for meter in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes"):
        assert getattr(big, meter) >= getattr(small, meter)


@settings(max_examples=60, deadline=None)
@given(**train_cfg, ds=st.integers(1, 512))
def test_longer_sequence_never_needs_less(model, precision, optim, attn, ckpt, b, s, ds):
    short = _est(model, precision, optim, attn, ckpt, b, s)
    long = _est(model, precision, optim, attn, ckpt, b, s + ds)
    assert long.peak_allocated_bytes >= short.peak_allocated_bytes
    assert long.device_used_bytes >= short.device_used_bytes


@settings(max_examples=60, deadline=None)
@given(**train_cfg)
def test_checkpointing_never_increases_memory(model, precision, optim, attn, ckpt, b, s):
    none = _est(model, precision, optim, attn, "none", b, s)
    full = _est(model, precision, optim, attn, "full", b, s)
    assert full.peak_allocated_bytes <= none.peak_allocated_bytes
    assert full.device_used_bytes <= none.device_used_bytes
