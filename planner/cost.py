"""Throughput model for ranking single-GPU plans: step time = matmul FLOPs at an achievable rate plus
the memory traffic of the saved activations and of the optimizer step (docs/cost-model.md).

FLOPs: 6 * N per token for forward + backward of the dense parameters (Kaplan et al. 2020, "Scaling
Laws", C = 6N), 2 * N more under full recompute and the attention core's forward again under selective
recompute (Korthikanti et al. 2022), plus attention's score and
context matmuls, 4 * s * a * d per layer per token forward (12 with backward), halved for causal
masks in fused kernels that skip masked tiles. MoE counts only the K routed experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from .modelspec import ModelSpec
from .profiles import GPUProfile
from .workload import Workload

# Fraction of peak a large, well-shaped matmul-bound transformer step reaches (public MFU reports for
# single-GPU HF training sit at 35-60%); smaller shapes reach less: half-efficiency at 512 tokens per
# micro batch and at hidden 384 (an assumption fitted to nothing, documented as such; issue 4 refines it).
PEAK_EFFICIENCY = 0.6
TOKENS_HALF = 512
HIDDEN_HALF = 384
# Saved activations are written in forward and read in backward, and their gradients written and read.
ACTIVATION_TRAFFIC = 3.0
# AdamW step reads params, grads, two states and writes params and two states.
OPTIMIZER_TRAFFIC = 2.0

COMPUTE_DTYPE = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16", "fp16-pure": "fp16",
                 "int8": "fp16", "int4": "fp16"}


@dataclass(frozen=True)
class Throughput:
    step_seconds: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs (no recompute) / (time * peak of the compute dtype)


def active_params(spec: ModelSpec) -> int:
    by = spec.params_by_category()
    dense = sum(n for c, n in by.items() if c not in ("experts", "embeddings"))
    if spec.tie_embeddings and spec.head in ("causal-lm", "seq2seq-lm"):
        dense += spec.vocab_size * spec.hidden_size  # the tied matrix is also the LM head matmul
    experts = by.get("experts", 0)
    if spec.is_moe:
        experts = experts * spec.experts_per_token // spec.num_experts
    return dense + experts


def flops_per_token(spec: ModelSpec, seq: int, attn: str, recompute: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs incl. recompute) per token of one training step. recompute: none,
    selective (the attention core's forward again) or full (the whole forward again)."""
    n = active_params(spec)
    causal = spec.arch == "decoder" and attn != "eager"
    attn_fwd = 4 * seq * spec.num_heads * spec.head_dim * spec.total_layers * (0.5 if causal else 1.0)
    model = 6 * n + 3 * attn_fwd
    hw = model + {"none": 0, "selective": attn_fwd, "full": 2 * n + attn_fwd}[recompute]
    return model, hw


def throughput(spec: ModelSpec, gpu: GPUProfile, w: Workload, saved_activation_bytes: float,
               state_bytes: float) -> Throughput:
    seq = spec.seq_positions if spec.arch == "vision" else w.seq_len
    tokens = w.micro_batch * seq
    dtype = COMPUTE_DTYPE[w.precision]
    peak = gpu.tflops.get(dtype) or gpu.tflops.get("fp32", 1.0)
    eff = PEAK_EFFICIENCY * tokens / (tokens + TOKENS_HALF) * spec.hidden_size / (spec.hidden_size + HIDDEN_HALF)
    bw = gpu.memory_bandwidth_gbs * 1e9
    if w.task == "infer":
        fwd = 2 * active_params(spec) * tokens
        t = fwd / (peak * 1e12 * eff) + (state_bytes + saved_activation_bytes) / bw
        return Throughput(t, w.micro_batch / t, tokens / t, fwd / (t * peak * 1e12))
    model_f, hw_f = flops_per_token(spec, seq, w.attn, w.grad_ckpt)
    micro = hw_f * tokens / (peak * 1e12 * eff) + ACTIVATION_TRAFFIC * saved_activation_bytes / bw
    step = micro * w.grad_accum + OPTIMIZER_TRAFFIC * state_bytes / bw
    samples = w.micro_batch * w.grad_accum
    return Throughput(step, samples / step, samples * seq / step, model_f * samples * seq / (step * peak * 1e12))
