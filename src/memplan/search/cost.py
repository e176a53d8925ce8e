"""Throughput model for ranking plans: step time = matmul FLOPs at an achievable rate, the memory traffic
of the saved activations and of the optimizer step, the pipeline bubble, and the communication that is
not hidden behind compute (docs/cost-model.md).

FLOPs: 6 * N per token for forward + backward of the dense parameters (Kaplan et al. 2020, "Scaling
Laws", C = 6N), 2 * N more under full recompute and the attention core's forward again under selective
recompute (Korthikanti et al. 2022), plus attention's score and
context matmuls, 4 * s * a * d per layer per token forward (12 with backward), halved for causal
masks in fused kernels that skip masked tiles. MoE counts only the K routed experts per token
(model FLOPs, and hardware FLOPs but for Llama 4, whose experts run on every token: idle_expert_params).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from memplan.estimator.families import family
from memplan.estimator.rules import FP32, HALF
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import Workload

# Fraction of peak a large, well-shaped matmul-bound transformer step reaches (public MFU reports for
# single-GPU HF training sit at 35-60%); smaller shapes reach less: half-efficiency at 512 tokens per
# micro batch and at hidden 384 (an assumption fitted to nothing, documented as such in
# docs/cost-model.md; measurements on a GPU should calibrate it).
PEAK_EFFICIENCY = 0.6
TOKENS_HALF = 512
HIDDEN_HALF = 384
# Saved activations are written in forward and read in backward, and their gradients written and read.
ACTIVATION_TRAFFIC = 3.0
# AdamW step reads params, grads, two states and writes params and two states.
OPTIMIZER_TRAFFIC = 2.0

COMPUTE_DTYPE = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16", "fp16-pure": "fp16",
                 "int8": "fp16", "int4": "fp16"}


class Throughput(NamedTuple):
    step_seconds: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs (no recompute) / (time * peak of the compute dtype)
    terms: "StepTime | None" = None  # type: ignore[assignment]


@lru_cache(maxsize=64)
def active_params(spec: ModelSpec) -> int:
    """Parameters one token's forward multiplies by: the dense ones, the tied matrix as the LM head,
    and K of the E experts (cached per model: the search reads it for every row)."""
    by = spec.params_by_category()
    dense = sum(n for c, n in by.items() if c not in ("experts", "embeddings"))
    if spec.tie_embeddings and spec.head in ("causal-lm", "seq2seq-lm"):
        dense += spec.vocab_size * spec.hidden_size  # the tied matrix is also the LM head matmul
    experts = by.get("experts", 0)
    if spec.is_moe:
        experts = experts * spec.experts_per_token // spec.num_experts
    return dense + experts


def idle_expert_params(spec: ModelSpec) -> int:
    """Expert parameters the hardware multiplies by although the router zeroed them: Llama 4 runs every token
    through every expert (families.Family.moe_all_experts), so E - K of its E experts; 0 for a routed MoE."""
    if not (spec.is_moe and family(spec.model_type).moe_all_experts):
        return 0
    return spec.params_by_category().get("experts", 0) * (spec.num_experts - spec.experts_per_token) // spec.num_experts


def flops_per_token(spec: ModelSpec, seq: int, attn: str, recompute: str,
                    fused_loss: bool = False, tiled_mlp: bool = False) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs incl. recompute) per token of one training step. recompute: none,
    selective (the attention core's forward again) or full (the whole forward again)."""
    n = active_params(spec)
    causal = spec.arch == "decoder" and attn != "eager"
    # QK^T at the query / key head width and PV at the value head width, 2 FLOPs per multiply-add (MLA: 192 and
    # 128 in DeepSeek-V3; else both head_dim, 4 * seq * heads * head_dim)
    attn_fwd = 2 * seq * spec.num_heads * (spec.head_dim + spec.value_head_dim) * spec.total_layers * (
        0.5 if causal else 1.0)
    model = 6 * n + 3 * attn_fwd
    idle = idle_expert_params(spec)
    hw = model + 6 * idle + {"none": 0, "selective": attn_fwd, "full": 2 * (n + idle) + attn_fwd}[recompute]
    if fused_loss:  # the fused loss recomputes the logits in backward: the LM head's forward again
        hw += 2 * spec.hidden_size * spec.vocab_size
    if tiled_mlp and not spec.is_moe:  # the tiled MLP recomputes each layer's MLP forward in backward
        hw += 2 * (3 if spec.mlp == "gated" else 2) * spec.hidden_size * spec.intermediate_size * spec.total_layers
    return model, hw


# -- communication (docs/cost-model.md) ------------------------------------------------------------
# NCCL reaches about 80 % of a link's unidirectional bandwidth in large all-reduce / all-gather /
# reduce-scatter (busbw in nccl-tests reports: ~360-370 GB/s on 8x H100 NVLink4, 450 GB/s per
# direction); an assumption, documented as such.
LINK_EFFICIENCY = 0.8
# Inter-node bandwidth per GPU when the user gives no --net-gbs: one 400 Gb/s NIC per GPU on Hopper
# systems (DGX H100 / AWS p5 / GCP a3-mega: 8x 400 Gb/s ConnectX-7), 200 Gb/s per GPU on A100 systems
# (DGX A100: 8x 200 Gb/s HDR), 100 Gb/s otherwise. GB/s, one direction.
NET_GBS_BY_ARCH = {9: 50.0, 8: 25.0}
NET_GBS_DEFAULT = 12.5
# DeepSpeedCPUAdam is memory-bound on the host: per parameter it reads and writes the fp32 master
# and both moments and reads the fp32 gradient (4 * 7 = 28 bytes) and writes the half copy (2).
CPU_ADAM_BYTES_PER_PARAM = 30
HOST_MEMORY_GBS = 200.0  # achievable DRAM bandwidth of a 2-socket server node (assumption)


def intra_node_gbs(gpu: GPUProfile) -> float:
    """One direction of the GPU-to-GPU link inside a node: NVLink (quoted bidirectional) or PCIe."""
    return (gpu.nvlink_gbs / 2 if gpu.nvlink_gbs else gpu.pcie_gbs) * LINK_EFFICIENCY


def inter_node_gbs(gpu: GPUProfile, w: Workload) -> float:
    return (w.net_gbs or NET_GBS_BY_ARCH.get(gpu.compute_capability[0], NET_GBS_DEFAULT)) * LINK_EFFICIENCY


def group_bw(gpu: GPUProfile, w: Workload, stride: int, size: int) -> float:
    """Bytes/s of a collective over `size` ranks spaced `stride` apart in the rank order: inside a
    node when the whole group fits in one, else limited by the network."""
    return (intra_node_gbs(gpu) if stride * size <= w.gpus else inter_node_gbs(gpu, w)) * 1e9


def ring(n: int, nbytes: float, bw: float, kind: str) -> float:
    """Ring algorithm time: all-reduce moves 2(n-1)/n of the buffer, all-gather and reduce-scatter
    (n-1)/n (Patarasuk & Yuan 2009; NCCL's busbw definitions)."""
    if n <= 1:
        return 0.0
    f = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return f * nbytes / bw


class StepTime(NamedTuple):
    """Seconds per optimizer step, by term (the sum is the step time)."""

    compute: float  # matmuls + activation traffic of all micro batches, one stage
    bubble: float  # pipeline fill and drain
    tp_comm: float  # tensor-parallel all-reduces (or SP all-gather + reduce-scatter), not overlapped
    pp_comm: float  # point-to-point activations between stages
    dp_comm: float  # the part of the DP / ZeRO collectives not hidden behind backward
    optimizer: float  # the optimizer step (GPU memory traffic, or CPU Adam + PCIe under offload)

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm + self.optimizer


def efficiency(tokens, width: float):
    """Fraction of peak a matmul reaches: PEAK_EFFICIENCY, halved at TOKENS_HALF tokens per micro batch
    and at HIDDEN_HALF width (numbers or arrays)."""
    return PEAK_EFFICIENCY * tokens / (tokens + TOKENS_HALF) * width / (width + HIDDEN_HALF)


def step_time(spec: ModelSpec, gpu: GPUProfile, bases: list[Workload], mb: np.ndarray, m: np.ndarray,
              saved: np.ndarray, state: np.ndarray, params: np.ndarray) -> np.ndarray:
    """(6, B, K) seconds per optimizer step of one data-parallel replica, in StepTime's order, for the
    rows `bases` (one layout) x the micro batches `mb` (m micro batches each); every rank takes the
    same time. saved, state, params: (B, K) saved activation bytes, weights + gradients + states, and
    the parameters one GPU holds."""
    w0 = bases[0]
    seq = spec.seq_positions if spec.arch == "vision" else w0.seq_len
    tokens = (mb * seq).astype(np.float64)[None, :]
    m = m.astype(np.float64)[None, :]
    peak = _col([peak_tflops(gpu, w.precision) for w in bases])
    # the matmuls of one TP rank are 1/tp as wide: the shape efficiency sees hidden / tp
    eff = efficiency(tokens, spec.hidden_size / w0.tp)
    bw = gpu.memory_bandwidth_gbs * 1e9
    flops: dict[tuple, float] = {}  # one row per workload, few distinct settings
    for w in bases:
        key = (w.attn, w.grad_ckpt, w.kernels, w.tiled_mlp)
        if key not in flops:
            flops[key] = flops_per_token(spec, seq, *key)[1]
    hw_f = _col([flops[(w.attn, w.grad_ckpt, w.kernels, w.tiled_mlp)] for w in bases])
    compute_micro = hw_f * tokens / (w0.tp * w0.pp) / (peak * 1e12 * eff)
    micro = compute_micro + ACTIVATION_TRAFFIC * saved / bw
    vpp = _col([w.vpp for w in bases])
    # 1F1B: (pp - 1) micro-batch slots of fill and drain, divided by the virtual stages when interleaved
    bubble = micro * (w0.pp - 1) / vpp
    half = _col([w.precision != "fp32" for w in bases]).astype(bool)
    act_bytes = np.where(half, HALF, FP32)
    terms = (micro * m, bubble, _tp_comm(spec, gpu, bases, tokens, m, act_bytes),
             _pp_comm(spec, gpu, bases, tokens, m, act_bytes, vpp),
             _dp_comm(gpu, bases, m, half, params, compute_micro), _optimizer(gpu, bases, m, params, state, bw))
    return np.stack([np.broadcast_to(x, saved.shape) for x in terms])


def _tp_comm(spec: ModelSpec, gpu: GPUProfile, bases: list[Workload], tokens, m, act_bytes):
    """Megatron: 2 all-reduces in forward and 2 in backward per layer over b*s*h (with SP: an
    all-gather + reduce-scatter pair each, the same volume); full recompute repeats the forward's."""
    w0 = bases[0]
    if w0.tp == 1:
        return 0.0
    n_ar = _col([4 + (2 if w.grad_ckpt == "full" else 0) for w in bases])
    per_layer = ring(w0.tp, 1.0, intra_node_gbs(gpu) * 1e9, "all-reduce") * tokens * spec.hidden_size * act_bytes
    return m * spec.total_layers / w0.pp * n_ar * per_layer


def _pp_comm(spec: ModelSpec, gpu: GPUProfile, bases: list[Workload], tokens, m, act_bytes, vpp):
    """Each micro batch crosses every stage boundary forward and backward (vpp times when interleaved);
    with SP the message is split over the TP ranks."""
    w0 = bases[0]
    if w0.pp == 1:
        return 0.0
    msg = tokens * spec.hidden_size * act_bytes / _col([w0.tp if w.sp else 1 for w in bases])
    return 2 * m * vpp * msg / group_bw(gpu, w0, w0.tp * w0.dp, w0.pp)


def _dp_comm(gpu: GPUProfile, bases: list[Workload], m, half, params, compute_micro):
    """The part of the data-parallel collectives not hidden behind backward (FSDP: `_fsdp_comm`)."""
    w0, dp = bases[0], bases[0].dp
    zero = _col([w.zero for w in bases])
    sharded = (zero > 0) | _col([w.fsdp != "none" for w in bases]).astype(bool)
    g_bytes = params * np.where(half & sharded, HALF, FP32)  # FSDP: reduce_dtype = the half dtype
    p_bytes = params * np.where(half, HALF, FP32)
    if dp == 1:
        return np.zeros(params.shape)
    dpbw = group_bw(gpu, w0, w0.tp, dp)
    ar, ag = ring(dp, 1.0, dpbw, "all-reduce"), ring(dp, 1.0, dpbw, "all-gather")
    backward = 2 / 3 * compute_micro  # backward is 2 of the 3 matmul passes
    # ZeRO-0/1: one all-reduce (ZeRO-1: reduce-scatter + all-gather, the same volume) at the accumulation
    # boundary, overlapped with the last micro batch's backward
    z01 = np.maximum(ar * g_bytes - backward, 0.0)
    # ZeRO-2 reduce-scatters every micro batch behind its backward, then all-gathers the updated parameters
    z2 = m * np.maximum(ag * g_bytes - backward, 0.0) + ag * p_bytes
    # ZeRO-3 (paper section 7.2.2: 1.5x the all-reduce volume): all-gather in forward and again in
    # backward, reduce-scatter of the gradients, every micro batch, prefetched behind compute
    z3 = m * np.maximum(2 * ag * p_bytes + ag * g_bytes - compute_micro, 0.0)
    dp_comm = np.where(zero <= 1, z01, np.where(zero == 2, z2, z3))
    for i, w in enumerate(bases):
        if w.fsdp != "none":
            dp_comm[i] = _fsdp_comm(gpu, w, m[0], p_bytes[i], g_bytes[i], compute_micro[i])
    return dp_comm


def _fsdp_comm(gpu: GPUProfile, w: Workload, m, p_bytes, g_bytes, compute_micro):
    """FSDP2: every micro batch all-gathers each unit in forward (and again in backward unless
    shard-grad-op kept it) and reduce-scatters its gradients, prefetched behind compute; hybrid shards
    inside a node and all-reduces its gradient shard across nodes once per step."""
    n = w.gpus if w.fsdp == "hybrid-shard" else w.dp
    bw_n = group_bw(gpu, w, 1, n)
    gathers = 1 if w.fsdp == "shard-grad-op" else 2
    per = gathers * ring(n, 1.0, bw_n, "all-gather") * p_bytes + ring(n, 1.0, bw_n, "reduce-scatter") * g_bytes
    out = m * np.maximum(per - compute_micro, 0.0)
    if w.fsdp == "hybrid-shard":
        out = out + ring(w.dp // n, 1.0, inter_node_gbs(gpu, w) * 1e9, "all-reduce") * g_bytes / n
    return out


def _optimizer(gpu: GPUProfile, bases: list[Workload], m, params, state, bw: float):
    """The optimizer step: GPU memory traffic, or under offload CPU Adam over the GPUs of a node sharing
    the host's memory bandwidth plus the PCIe copies (half gradients down every micro batch, updated half
    parameters up; with parameter offload the parameters come up for forward and backward too)."""
    w0, dp = bases[0], bases[0].dp
    sharded = _col([w.zero > 0 or w.fsdp != "none" for w in bases]).astype(bool)
    n_opt = params / np.where(sharded, dp, 1)
    pcie = gpu.pcie_gbs * LINK_EFFICIENCY * 1e9
    cpu_opt = (CPU_ADAM_BYTES_PER_PARAM * n_opt * w0.gpus / (HOST_MEMORY_GBS * 1e9) + (m * HALF * n_opt + HALF * n_opt) / pcie)
    all_extra = m * 2 * (params / dp) * HALF / pcie  # up for forward and again for backward
    off = _col([w.offload != "none" for w in bases]).astype(bool)
    off_all = _col([w.offload == "all" for w in bases]).astype(bool)
    return np.where(off, cpu_opt + np.where(off_all, all_extra, 0.0), OPTIMIZER_TRAFFIC * state / bw)


def peak_tflops(gpu: GPUProfile, precision: str) -> float:
    """The GPU's dense peak in the compute dtype of a precision."""
    return gpu.tflops.get(COMPUTE_DTYPE[precision]) or gpu.tflops.get("fp32", 1.0)


def inference_throughput(spec: ModelSpec, gpu: GPUProfile, w: Workload, saved_activation_bytes: float,
                         state_bytes: float) -> Throughput:
    """One forward of the micro batch: the matmuls at the shape's efficiency, plus reading the weights
    (and KV cache) and the working set once; every data-parallel replica serves its own batches."""
    seq = spec.seq_positions if spec.arch == "vision" else w.seq_len
    tokens = w.micro_batch * seq
    peak = peak_tflops(gpu, w.precision)
    fwd = 2 * active_params(spec) * tokens
    hw = fwd + 2 * idle_expert_params(spec) * tokens
    t = hw / (peak * 1e12 * efficiency(tokens, spec.hidden_size)) + (state_bytes + saved_activation_bytes) / (
        gpu.memory_bandwidth_gbs * 1e9)
    return Throughput(t, w.micro_batch * w.dp / t, tokens * w.dp / t, fwd / (t * peak * 1e12))


def _col(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)[:, None]


def workload_rates(spec: ModelSpec, gpu: GPUProfile, w: Workload, mb: int, m: int, step: float,
                   terms: StepTime | None = None, model_flops: float | None = None) -> Throughput:
    """The rates of a training step of `step` seconds for the workload w run at micro batch mb x m micro batches
    (the search's cells and estimate's one configuration); model_flops: flops_per_token's model FLOPs, when the
    caller has them."""
    seq = spec.seq_positions if spec.arch == "vision" else w.seq_len
    f = flops_per_token(spec, seq, w.attn, w.grad_ckpt)[0] if model_flops is None else model_flops
    return rates(w, mb, m, seq, step, f, peak_tflops(gpu, w.precision), terms)


def rates(w: Workload, mb: int, m: int, seq: int, step: float, model_flops_per_token: float, peak: float,
          terms: StepTime | None = None) -> Throughput:
    """Samples/s, tokens/s and MFU of a step of `step` seconds. MFU over all GPUs: model FLOPs of the
    global batch / (step time x world x peak), `peak` in TFLOP/s (peak_tflops)."""
    samples = mb * m * w.dp
    return Throughput(step, samples / step, samples * seq / step,
                      model_flops_per_token * samples * seq / (step * peak * 1e12 * w.world), terms)
