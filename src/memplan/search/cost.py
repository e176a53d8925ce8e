"""Throughput model for ranking plans (docs/cost-model.md): one micro batch priced operator by operator
(search/operators.py's inventory: every GEMM's roofline, the attention core, the memory-bound element moves at
the achievable bandwidth, each class of kernels no faster than the host launches it), times the micro batches,
plus the pipeline bubble, the communication not hidden behind compute, and the optimizer step; each GPU
generation's efficiencies fitted on published runs (benchmarks/throughput/compare.py --fit).

flops_per_token gives the FLOPs MFU and published TFLOP/s are counted in: 6 * N per token for forward +
backward of the active parameters (Kaplan et al. 2020, C = 6N), 2 * N more under full recompute and the
attention core's forward again under selective recompute (Korthikanti et al. 2022), plus the attention core
(operators.attention_forward_flops, x3 with backward). MoE counts only the K routed experts per token (model
FLOPs, and hardware FLOPs but for Llama 4, whose experts run on every token: idle_expert_params).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from memplan.estimator.families import family
from memplan.estimator.finetune import Tuning, tuned_params
from memplan.estimator.parallel import ds_buckets, fetch_unit
from memplan.estimator.states import activation_precision, layout_params
from memplan.estimator.rules import FP32, HALF, PRECISIONS
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import Workload
from memplan.search import operators as ops


class Generation(NamedTuple):
    """What kernels reach on one GPU generation, as fractions of the profile's datasheet figures (docs/cost-model.md
    lists the fit and the runs it was fitted on)."""

    matmul: float  # a large tensor-core GEMM in the half dtype, of the dense half peak
    matmul_fp32: float  # a large fp32 GEMM (no TF32: PyTorch's default), of the fp32 peak
    attention: float  # the fused attention kernel (flash / memory-efficient SDPA), forward + backward, of the peak
    bandwidth: float  # memory-bound kernels, of the memory bandwidth
    launch_s: float  # host time to dispatch one eager op with autograd: the floor of a kernel's time


# The host floor is taken per class of kernels and the classes add up: the GEMMs (each no faster than its launch),
# the attention core, the element-wise kernels. Taking it over a whole micro batch instead (the larger of the GPU's
# total and the host's total) assumes the host's lead during the long GEMMs carries over to the short kernels
# around them; in an eager step with its host syncs (GradScaler's inf check, the Trainer's loss reads) it does so
# only in part, and the published runs side with the per-class floor: fitted either way on them by
# `python benchmarks/throughput/compare.py --fit`, its loss is 0.0335 against 0.0423 (the old floor: ece8d96's
# search/cost.py and operators.py under de50d55's compare.py; docs/cost-model.md).
# Fitted by `python benchmarks/throughput/compare.py --fit` on benchmarks/throughput/published_runs.json
# (docs/cost-model.md); keyed by compute capability major (7: Volta / Turing, 8: Ampere / Ada, 9: Hopper and later).
# Two constants the runs hardly constrain stay where they were, as moving them would reorder plans on no evidence:
# Ampere's launch_s at 6 us (2d2b460's refit wandered to 21 us for a loss of 0.0281 against 0.0284) and Hopper's
# bandwidth at 0.655 (the last refit took it to 0.471 for 0.0265 against 0.0266; serving's decode steps, which
# the training runs do not measure, are priced by it).
GENERATIONS: dict[int, Generation] = {
    7: Generation(matmul=0.858, matmul_fp32=0.706, attention=0.3, bandwidth=0.748, launch_s=1.52e-05),
    8: Generation(matmul=0.72, matmul_fp32=0.85, attention=0.23, bandwidth=0.869, launch_s=6e-06),
    9: Generation(matmul=0.579, matmul_fp32=0.85, attention=0.16, bandwidth=0.655, launch_s=5e-06),
}


def generation(gpu: GPUProfile) -> Generation:
    major = gpu.compute_capability[0]
    return GENERATIONS[max((k for k in GENERATIONS if k <= major), default=min(GENERATIONS))]


def achievable_bandwidth(gpu: GPUProfile) -> float:
    """Bytes/s a memory-bound kernel reaches: the datasheet bandwidth times the generation's efficiency."""
    return gpu.memory_bandwidth_gbs * 1e9 * generation(gpu).bandwidth


# Bytes per parameter one optimizer step moves (each read or write of a parameter-sized fp32 tensor is 4 bytes;
# the states' own widths for 8-bit ones), from the step's kernels in torch 2.13 / bitsandbytes 0.50:
# - fused AdamW (torch/optim/adamw.py -> _fused_adamw_, one kernel): p r/w, g r, m r/w, v r/w = 7 x 4;
# - foreach AdamW (_multi_tensor_adamw): mul_(p), lerp_(m, g), mul_(v), addcmul_(v, g, g), sqrt(v), div_, add_,
#   addcdiv_(p, m, denom): 20 x 4;
# - bitsandbytes 8-bit AdamW (one blockwise kernel): p r/w, g r at 4 bytes, m and v r/w at 1 byte = 16;
# - Adafactor (transformers, a Python loop): grad**2, its row and column means, the rsqrt outer product,
#   update * grad, the RMS, clamp, lr, p.add_: about 15 x 4;
# - SGD (foreach add_): p r/w, g r = 3 x 4 (a momentum buffer adds r/w); Adagrad / RMSprop: addcmul_, sqrt,
#   add_, addcdiv_: 11 x 4; Lion: p r/w, g r, m r/w = 5 x 4 (8-bit: 14).
STEP_BYTES = {"adamw_torch": 80, "adamw_torch_fused": 28, "adamw_bnb_8bit": 16, "adamw_8bit": 16,
              "paged_adamw_8bit": 16, "paged_adamw_32bit": 28, "adafactor": 60, "sgd": 12, "adagrad": 44,
              "rmsprop": 44, "lion_32bit": 20, "lion_8bit": 14, "paged_lion_32bit": 20, "paged_lion_8bit": 14}
# Ops a step launches per parameter tensor when it loops over them in Python (torch's fused and foreach steps
# launch a few kernels per group): transformers' Adafactor (about 15 ops: the squares, the row and column means,
# the rsqrt product, RMS, clamp, the update), bitsandbytes' 8-bit and paged optimizers (one kernel per tensor,
# with its Python around it: 2)
STEP_OPS_PER_TENSOR = {"adafactor": 15, "adamw_bnb_8bit": 2, "adamw_8bit": 2, "paged_adamw_8bit": 2,
                       "paged_adamw_32bit": 2, "lion_32bit": 2, "lion_8bit": 2, "paged_lion_32bit": 2,
                       "paged_lion_8bit": 2}
# The Trainer clips gradients every step (max_grad_norm = 1.0: clip_grad_norm_ reads the gradients for the norm,
# then scales them: 3 moves) and under fp16 GradScaler unscales them first (read, write: 2 moves).
CLIP_MOVES = 3
UNSCALE_MOVES = 2
# AccumulateGrad adds each later micro batch's weight gradients into .grad: read 2, write 1
ACCUMULATE_MOVES = 3


class QuantKernels(NamedTuple):
    """How bitsandbytes 0.50.2 runs one quantised linear without autograd (serving): bytes per weight element and
    per element of the input (M x K) and output (M x N) rows."""

    weight_bytes: float  # what the fused kernel reads per weight element
    fused_rows: float  # rows (M) up to which the fused kernel runs; above, a half copy and F.linear
    dequant_bytes: float  # per weight element above fused_rows: read the packed weight, write the half copy
    gemm_in: float  # per input element the GEMM reads
    gemm_out: float  # per output element the GEMM writes
    extra_in: float  # per input element, the memory-bound kernels around the GEMM (added to it)
    extra_out: float  # per output element, likewise
    kernels: int  # launches per linear


# Serving weight formats' linears (`--task infer --precision int4 / int8`):
# - NF4 (autograd/_functions.py matmul_4bit -> backends/cuda/ops.py gemm_4bit): under no_grad the fused kernel
#   reads the packed 4-bit weight and its fp32 absmax (0.5 + 4/64 B). It always runs for up to 4 rows
#   (_GEMM_4BIT_CUSTOM_FLOOR_M); from 5 to 512 rows _gemm_4bit_use_custom_cuda picks it or the fallback by
#   arch and shape (an A100 dequantises a 4096 x 4096 weight from 6 rows, Llama-2-7B's down projection from 16;
#   an H100 a 4096 x 4096 one from 8), and above 512 always the fallback: dequantize_4bit writes a half copy
#   that F.linear reads. memplan takes the fallback above 4 rows: the copy is then never missed, and the time
#   errs slow. bitsandbytes 0.40.0's release notes give 3.4x over 16-bit for a batch-1 matmul of inner
#   dimension >= 4096 on Ampere (2.2x Turing, 4.0x Ada / Hopper); the weight reads alone give 2 / 0.5625 = 3.6x.
# - LLM.int8 (MatMul8bitLt; backends/cuda/ops.py int8_vectorwise_quant, backends/default/ops.py
#   int8_mixed_scaled_mm -> int8_scaled_mm): the outlier search at llm_int8_threshold 6.0 (A.abs() >= threshold,
#   any(): read 2, write 2, read 2, write 1, read 1 B an input element, and a host sync on `if outliers.any()`)
#   and the quantisation (read 2, write 1) before the GEMM, which reads the int8 input (1 B) and the int8 weight
#   and writes int32 (4 B); int8_mm_dequant reads that and writes half (4 + 2 B) after it: six launches, the
#   memory-bound ones added to the GEMM. The GEMM is priced at the half rate, not the int8 tensor cores':
#   published LLM.int8 inference ran 2 to 6x slower than fp16 (bitsandbytes issues 347, 490, 605, 2023) and no
#   measurement of 0.50's kernel says otherwise. The outlier columns' half matmul (argwhere, another sync) is
#   left out.
SERVING_KERNELS = {
    "int4": QuantKernels(0.5 + 4 / 64, 4, 0.5 + 4 / 64 + 2, 2, 2, 0, 0, 1),
    "int8": QuantKernels(1.0, math.inf, 0.0, 1, 4, 2 + 2 + 2 + 1 + 1 + 2 + 1, 4 + 2, 6),
}


# the GEMMs' dtype of each precision row (bitsandbytes' serving weights run half GEMMs)
COMPUTE_DTYPE = {name: p.half or "fp32" for name, p in PRECISIONS.items()} | {"int8": "fp16", "int4": "fp16"}


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
    attn_fwd = seq * ops.attention_forward_flops(spec, attn)
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
    """Bytes/s per rank of a ring collective over `size` ranks spaced `stride` apart in the rank order: inside a
    node when the whole group fits in one; else the network, whose NICs the group's ranks in a node drive at once
    (NCCL runs one ring channel per NIC, so a node's k ranks of the group cross nodes over k NICs: the per-rank
    ring volume (n - 1)/n moves at k x the NIC's bandwidth, never faster than the node's own links)."""
    if stride * size <= w.gpus:
        return intra_node_gbs(gpu) * 1e9
    per_node = max(1, min(size, w.gpus // stride))
    return min(intra_node_gbs(gpu), per_node * inter_node_gbs(gpu, w)) * 1e9


def ring(n: int, nbytes: float, bw: float, kind: str) -> float:
    """Ring algorithm time: all-reduce moves 2(n-1)/n of the buffer, all-gather and reduce-scatter
    (n-1)/n (Patarasuk & Yuan 2009; NCCL's busbw definitions)."""
    if n <= 1:
        return 0.0
    f = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return f * nbytes / bw


class StepTime(NamedTuple):
    """Seconds per optimizer step, by term (the sum is the step time)."""

    compute: float  # every operator of all micro batches on the last stage, and the gradient accumulation
    bubble: float  # pipeline fill and drain
    tp_comm: float  # tensor-parallel all-reduces (or SP all-gather + reduce-scatter), not overlapped
    pp_comm: float  # point-to-point activations between stages
    dp_comm: float  # the part of the DP / ZeRO collectives not hidden behind backward
    optimizer: float  # the optimizer step (GPU memory traffic, or CPU Adam + PCIe under offload)

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm + self.optimizer


def _gemm_seconds(g: ops.Gemm, tokens: np.ndarray, flops_s: float, bytes_s: float, width: int,
                  launch_s: float) -> np.ndarray:
    """A roofline per GEMM: its FLOPs at the achievable matmul rate or its operands' bytes at the achievable
    bandwidth, whichever is slower, and no less than its launch, for every pass (forward, the input's and the
    weight's gradients)."""
    m = g.rows * tokens
    flops = 2.0 * m * g.n * g.k
    moved = (m * g.k + g.k * g.n + m * g.n) * width
    return g.count * g.passes * np.maximum(np.maximum(flops / flops_s, moved / bytes_s), launch_s)


def _quant_gemm_seconds(g: ops.Gemm, tokens: np.ndarray, q: QuantKernels, flops_s: float, bytes_s: float,
                        launch_s: float) -> np.ndarray:
    """One serving forward of a quantised linear (SERVING_KERNELS): up to q.fused_rows rows the fused kernel's
    roofline, above them the dequantisation and a half GEMM; the memory-bound kernels around the GEMM added;
    no faster than its launches."""
    m = g.rows * tokens
    fused = m <= q.fused_rows
    flops = 2.0 * m * g.n * g.k
    moved = m * g.k * np.where(fused, q.gemm_in, HALF) + g.k * g.n * np.where(fused, q.weight_bytes, HALF) + (
        m * g.n * np.where(fused, q.gemm_out, HALF))
    extra = (m * g.k * q.extra_in + m * g.n * q.extra_out + np.where(fused, 0.0, q.dequant_bytes * g.k * g.n)) / bytes_s
    return g.count * np.maximum(np.maximum(flops / flops_s, moved / bytes_s) + extra,
                                (q.kernels + np.where(fused, 0, 1)) * launch_s)


def _layer_gemm_seconds(o: ops.StepOps, launch_s: float, tokens: np.ndarray, flops_s: float, bytes_s: float,
                        width: int, fwd: float, weights: str | None) -> np.ndarray:
    """Every layer GEMM's roofline; a serving forward of bitsandbytes weights (weights: int4 / int8) prices the
    linears transformers converts by their kernels (SERVING_KERNELS)."""
    q = SERVING_KERNELS.get(weights or "")
    return sum(_quant_gemm_seconds(g, tokens, q, flops_s, bytes_s, launch_s) if q and g.quantisable
               else _gemm_seconds(g, tokens, flops_s, bytes_s, width, launch_s) * fwd for g in o.layer_gemms)


def _cast_launches(o: ops.StepOps, prec, forward_only: bool, casts: bool) -> float:
    """autocast's cast kernels per micro batch: each forward's (the weights' not in a decode step, whose cache
    holds them), and in the layers with a backward as many again (each cast's gradient cast back) and the
    recomputed forward's."""
    if not prec.autocast:
        return 0.0
    per_forward = o.weight_casts * _casts_weights(prec, casts) + o.fp32_weight_casts * casts + o.input_casts
    return per_forward if forward_only else per_forward * (1 + o.backward_share * o.forward_passes)


def _casts_weights(prec, casts: bool) -> bool:
    """autocast casts the weights only when they are fp32 (torch.autocast passes a half tensor as it is)."""
    return prec.autocast and prec.param == FP32 and casts


def micro_seconds(o: ops.StepOps, gpu: GPUProfile, precision: str, tokens: np.ndarray, seq: float,
                  pp: int = 1, forward_only: bool = False, casts: bool = True,
                  head_tokens: np.ndarray | None = None, weights: str | None = None,
                  launch_s: float | None = None) -> np.ndarray:
    """Seconds of one micro batch of `tokens` (an array) on the last pipeline stage (its 1/pp of the layers and
    the head): every GEMM's roofline, the attention core, the memory-bound kernels' bytes at the achievable
    bandwidth, per-micro-batch weight traffic. Each class of kernels (every GEMM, the attention core, the
    element-wise kernels) takes no less than the host takes to launch it (Generation.launch_s).
    forward_only: one forward (serving), the inventory's forward share. casts: autocast casts the weights (not
    in a decode step: its cache, alive for the whole generate call, already holds them). head_tokens: the tokens
    the head runs on, when not every one (generate's prefill keeps the last position's logits only). weights: the
    serving weight format (int4 / int8: bitsandbytes' kernels price the converted linears). launch_s: the host
    time per kernel, when not the generation's (a decode step's: SERVING_LAUNCH_S)."""
    gen, prec = generation(gpu), PRECISIONS[precision]
    if launch_s is not None:
        gen = gen._replace(launch_s=launch_s)
    peak = peak_tflops(gpu, precision) * 1e12
    flops_s = peak * (gen.matmul if prec.half is not None else gen.matmul_fp32)
    bytes_s = achievable_bandwidth(gpu)
    fwd = (1 / 3) if forward_only else 1.0  # the forward is 1 of a GEMM's 3 passes
    share = ops.FORWARD_SHARE if forward_only else 1.0
    gemms = _layer_gemm_seconds(o, gen.launch_s, tokens, flops_s, bytes_s, prec.act, fwd, weights)
    core_flops = o.attn_flops * tokens * seq * fwd
    core = core_flops / (peak * gen.attention) if o.fused_attn else core_flops / flops_s
    core = core + o.score_moves * seq * prec.residual * tokens * share / bytes_s
    elementwise = (o.stream_moves * prec.residual + o.act_moves * prec.act) * tokens * share / bytes_s
    layers = (gemms + np.maximum(core, o.core_kernels * fwd * gen.launch_s)
              + np.maximum(elementwise, (o.elementwise_kernels * fwd + _cast_launches(o, prec, forward_only, casts))
                           * gen.launch_s))
    # per micro batch: the casts and the dequantisation run in forward (and dequantisation again in backward)
    per_batch = (o.cast_params * ops.AUTOCAST_CAST_BYTES * _casts_weights(prec, casts)
                 + o.quant_params * (1 if forward_only else 2) * ops.DEQUANT_BYTES
                 + o.embed_grad * ops.EMBED_GRAD_MOVES * prec.grad * (not forward_only)) / bytes_s
    at_head = tokens if head_tokens is None else head_tokens
    head = sum(_gemm_seconds(g, at_head, flops_s, bytes_s, prec.act, gen.launch_s) for g in o.head_gemms) * fwd
    head = head + o.head_bytes * at_head * share / bytes_s
    return (layers + per_batch) / pp + head


def step_time(spec: ModelSpec, gpu: GPUProfile, bases: list[Workload], mb: np.ndarray, m: np.ndarray,
              state: np.ndarray, params: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """(6, B, K) seconds per optimizer step of one data-parallel replica, in StepTime's order, for the
    rows `bases` (one layout) x the micro batches `mb` (m micro batches each); every rank takes the
    same time. state, params, trained: (B, K) weights + gradients + states, the parameters one GPU holds, and
    those of them that train (LoRA's adapters, freeze's trained blocks: the optimizer step, clipping, gradient
    accumulation and the gradient collectives touch only these; ZeRO-3 / FSDP gather all of them)."""
    w0 = bases[0]
    seq = spec.seq_positions if spec.arch == "vision" else w0.seq_len
    tokens_k = (mb * seq).astype(np.float64)
    tokens = tokens_k[None, :]
    m = m.astype(np.float64)[None, :]
    priced: dict[tuple, np.ndarray] = {}  # one row per workload, few distinct settings
    rows = []
    for w in bases:
        # the widths and casts the activations really have, as the memory side sees them: DeepSpeed trains a half
        # model without autocast, FSDP and LoRA autocast over half weights (states.activation_precision)
        key = (ops.OpsKey.of(spec, w), activation_precision(spec, w).name)
        if key not in priced:
            priced[key] = micro_seconds(ops.step_ops(key[0]), gpu, key[1], tokens_k, seq, w.pp)
        rows.append(priced[key])
    micro = np.stack(rows)
    vpp = _col([w.vpp for w in bases])
    # 1F1B: (pp - 1) micro-batch slots of fill and drain, divided by the virtual stages when interleaved
    bubble = micro * (w0.pp - 1) / vpp
    half = _col([w.precision != "fp32" for w in bases]).astype(bool)
    act_bytes = np.where(half, HALF, FP32)
    grad_b = _col([PRECISIONS[w.precision].grad for w in bases])
    bw = achievable_bandwidth(gpu)
    accumulate = (m - 1) * ACCUMULATE_MOVES * trained * grad_b / bw
    terms = (micro * m + accumulate, bubble, _tp_comm(spec, gpu, bases, tokens, m, act_bytes),
             _pp_comm(spec, gpu, bases, tokens, m, act_bytes, vpp),
             _dp_comm(spec, gpu, bases, m, half, params, trained, micro),
             _optimizer(spec, gpu, bases, m, params, trained, bw))
    return np.stack([np.broadcast_to(x, state.shape) for x in terms])


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
    """Each micro batch crosses every stage boundary forward and backward (vpp times when interleaved); the
    message is split over the TP ranks (Megatron's scatter / gather across the stage's NVLink: Narayanan et al.
    2021, section 4.1; with SP the activations are already split)."""
    w0 = bases[0]
    if w0.pp == 1:
        return 0.0
    msg = tokens * spec.hidden_size * act_bytes / w0.tp
    return 2 * m * vpp * msg / group_bw(gpu, w0, w0.tp * w0.dp, w0.pp)


def zero3_overlap(spec: ModelSpec, w: Workload) -> float:
    """The share of a ZeRO-3 fetch that can be in flight before its module runs: the prefetch bucket over the
    largest fetch unit (estimator/parallel.py), at most all of it."""
    if w.zero != 3:
        return 1.0
    unit = fetch_unit(spec, list(layout_params(spec, w.tp, w.pp, w.pp - 1)))
    return min(1.0, ds_buckets(spec)["stage3_prefetch_bucket_size"] / max(unit, 1))


# The latency of a ring all-gather / reduce-scatter, NCCL's own tuning model (src/graph/tuning.cc, the Simple
# protocol; the numbers as NCCL's example tuner plugin mirrors them): 17 us per collective, 3.6 us per step over
# NVLink and 19.8 us per step across the network; a ring over n ranks on k nodes takes n - 1 steps, k - 1 of them
# between nodes.
RING_BASE_S, RING_NVLINK_STEP_S, RING_NET_STEP_S = 17e-6, 3.6e-6, 19.8e-6


def ring_latency(n: int, nodes: int) -> float:
    """Seconds of latency of one ring all-gather or reduce-scatter over n ranks spread over `nodes` nodes."""
    if n <= 1:
        return 0.0
    inter = max(nodes, 1) - 1
    return RING_BASE_S + (n - 1 - inter) * RING_NVLINK_STEP_S + inter * RING_NET_STEP_S


def zero3_latency(spec: ModelSpec, gpu: GPUProfile, w: Workload) -> float:
    """Seconds of ring steps per micro batch under ZeRO-3: every sharded tensor's module is all-gathered in forward
    and in backward and its gradient reduce-scattered, each a ring over the dp ranks (ring_latency)."""
    if w.zero != 3 or w.dp == 1:
        return 0.0
    thr = ds_buckets(spec)["stage3_param_persistence_threshold"]
    units = sum(g.count for g in layout_params(spec, w.tp, w.pp, w.pp - 1) if g.numel > thr)
    nodes = -(-w.tp * w.dp // w.gpus)
    return 3 * units * ring_latency(w.dp, nodes)


# What a data-parallel step loses beyond its collectives' exposed bytes, as a share of one micro batch's compute, at
# the step's gradient synchronisation (DDP, every ZeRO stage, and FSDP, whose last reduce-scatter the optimizer step
# waits for): DDP's bucket copies, NCCL's kernels taking SMs and memory bandwidth from the backward they overlap, the
# slowest rank setting the step. The published runs show it where the collectives alone cannot: DeepLearningExamples'
# BERT SQuAD fine-tuning (no accumulation) keeps 0.70-0.96 of its one-GPU throughput per GPU on 8 V100s, in FP32 as in
# FP16, though the all-reduce at NVLink's bandwidth is 3-5 % of the step and overlaps the backward; its pre-training,
# which synchronises once per many micro batches, keeps 0.95-0.99; llm-foundry's FSDP runs without accumulation read
# 10-11 % below memplan's step without it, those with accumulation 1-6 %. Fitted alone by `python
# benchmarks/throughput/compare.py` over a grid (docs/cost-model.md): loss 0.0172 at 0.05, 0.0162 at 0.07, 0.0156 at
# 0.09, 0.0157 at 0.10, 0.0168 at 0.12.
DP_STEP_SYNC = 0.09


def _dp_comm(spec: ModelSpec, gpu: GPUProfile, bases: list[Workload], m, half, params, trained, compute_micro):
    """The part of the data-parallel collectives not hidden behind backward (FSDP: `_fsdp_comm`): the gradients
    of the trained parameters, and under ZeRO-3 / FSDP the gathers of all of them; and, whatever the sharding, the
    step's synchronisation (DP_STEP_SYNC of one micro batch's compute)."""
    w0, dp = bases[0], bases[0].dp
    zero = _col([w.zero for w in bases])
    sharded = (zero > 0) | _col([w.fsdp != "none" for w in bases]).astype(bool)
    g_bytes = trained * np.where(half & sharded, HALF, FP32)  # FSDP: reduce_dtype = the half dtype
    width = np.where(half, HALF, FP32)
    p_bytes = params * width
    if dp == 1:
        return np.zeros(params.shape)
    dpbw = group_bw(gpu, w0, w0.tp, dp)
    ar, ag = ring(dp, 1.0, dpbw, "all-reduce"), ring(dp, 1.0, dpbw, "all-gather")
    backward = 2 / 3 * compute_micro  # backward is 2 of the 3 matmul passes
    # ZeRO-0/1: one all-reduce (ZeRO-1: reduce-scatter + all-gather, the same volume) at the accumulation
    # boundary, overlapped with the last micro batch's backward
    z01 = np.maximum(ar * g_bytes - backward, 0.0)
    # ZeRO-2 reduce-scatters every micro batch behind its backward, then all-gathers the updated parameters
    z2 = m * np.maximum(ag * g_bytes - backward, 0.0) + ag * trained * width
    # ZeRO-3 (paper section 7.2.2: 1.5x the all-reduce volume): all-gather in forward and again in
    # backward, reduce-scatter of the gradients, every micro batch, prefetched behind compute
    # DeepSpeed fetches a module's parameters when it runs and prefetches at most stage3_prefetch_bucket_size
    # elements ahead (partitioned_param_coordinator.py), so only that share of each fetch can hide behind the
    # module before it: the rest waits (zero3_overlap)
    f = _col([zero3_overlap(spec, w) for w in bases])
    z3_comm = 2 * ag * p_bytes + ag * g_bytes + _col([zero3_latency(spec, gpu, w) for w in bases])
    z3 = m * ((1 - f) * z3_comm + np.maximum(f * z3_comm - compute_micro, 0.0))
    dp_comm = np.where(zero <= 1, z01, np.where(zero == 2, z2, z3))
    for i, w in enumerate(bases):
        if w.fsdp != "none":
            dp_comm[i] = _fsdp_comm(gpu, w, m[0], p_bytes[i], g_bytes[i], compute_micro[i])
    return dp_comm + DP_STEP_SYNC * compute_micro


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


def _optimizer(spec: ModelSpec, gpu: GPUProfile, bases: list[Workload], m, params, trained, bw: float):
    """The optimizer step: its kernels' bytes (STEP_BYTES, scaled to the master copy's width) with the
    Trainer's gradient clipping (and fp16's unscaling) at the achievable bandwidth; or under offload CPU Adam
    over the GPUs of a node sharing the host's memory bandwidth plus the PCIe copies (half gradients down every
    micro batch, updated half parameters up; with parameter offload the parameters come up for forward and
    backward too). A step that loops over the tensors in Python is no faster than its ops' dispatch
    (STEP_OPS_PER_TENSOR)."""
    w0, dp = bases[0], bases[0].dp
    sharded = _col([w.zero > 0 or w.fsdp != "none" for w in bases]).astype(bool)
    host = _col([STEP_OPS_PER_TENSOR.get(w.optim, 0) * _trained_tensors(spec, w) / (w.tp * w.pp) for w in bases])
    n_opt = trained / np.where(sharded, dp, 1)
    pcie = gpu.pcie_gbs * LINK_EFFICIENCY * 1e9
    cpu_opt = (CPU_ADAM_BYTES_PER_PARAM * n_opt * w0.gpus / (HOST_MEMORY_GBS * 1e9) + (m * HALF * n_opt + HALF * n_opt) / pcie)
    all_extra = m * 2 * (params / dp) * HALF / pcie  # up for forward and again for backward
    off = _col([w.offload != "none" for w in bases]).astype(bool)
    off_all = _col([w.offload == "all" for w in bases]).astype(bool)
    per_param = _col([_step_bytes(w) for w in bases])
    gpu_step = np.maximum(per_param * n_opt / bw, host * generation(gpu).launch_s)
    return np.where(off, cpu_opt + np.where(off_all, all_extra, 0.0), gpu_step)


def _trained_tensors(spec: ModelSpec, w: Workload) -> int:
    """The tensors a Python-loop optimizer steps: the trained ones (every one in full fine-tuning, LoRA's adapters,
    freeze's trained blocks)."""
    return sum(g.count for g in tuned_params(spec, Tuning.of(w)) if g.trainable)


def _step_bytes(w: Workload) -> float:
    """Bytes one parameter's optimizer step moves: the optimizer's kernels at the master copy's width (fp32 but
    for pure half training: DeepSpeed's and FSDP's masters are fp32), clipping, fp16's unscaling."""
    master = PRECISIONS[w.precision].param if w.zero == 0 and w.fsdp == "none" else FP32
    g = PRECISIONS[w.precision].grad
    moves = CLIP_MOVES + (UNSCALE_MOVES if w.precision == "fp16" else 0)
    return STEP_BYTES[w.optim] * master / FP32 + moves * g


def peak_tflops(gpu: GPUProfile, precision: str) -> float:
    """The GPU's dense peak in the compute dtype of a precision."""
    return gpu.tflops.get(COMPUTE_DTYPE[precision]) or gpu.tflops.get("fp32", 1.0)


# A decode forward's host time per kernel it launches (no autograd, transformers' Python modules and torch's
# dispatch around each kernel; the prefill and scoring forwards keep the training floor, Generation.launch_s, as
# they are long on the GPU). A decode step of a small model is nothing but this: measured on the H200 lease of
# 2026-11-27 (benchmarks/results/gpu_lease2/, torch 2.11, transformers 5.24), decode steps without cuDNN attention
# took 9.5-33 ms where this model's kernels at the training launch floor (Generation.launch_s, fitted on large
# published training runs) gave 2-3 ms. The value is the median over those steps of the measured step / the
# forward's modelled kernels; `python benchmarks/serving_speed.py --fit` recomputes it.
SERVING_LAUNCH_S = 3.3e-05
# PyTorch picks cuDNN's attention first for SDPA on compute capability 9.x / 10.x with cuDNN newer than 9.15
# (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp check_prefer_cudnn_attention; TORCH_CUDNN_SDPA_DEPRIORITIZED=1
# turns it off), and cuDNN builds an execution graph for each new key length (pytorch/pytorch PR 155958, which adds
# an opt-in to avoid it). A DynamicCache grows the keys by one every decode step, so every full-attention layer
# pays that host time every step: the profiler put 2.9 ms (Llama-3.2-1B) and 5.5 ms (GPT-2) of host time in each
# _cudnn_attention_forward on the H200, and the step grew by (94.3 - 15.2) / 16 = 4.9 and (81.4 - 14.2) / 12 = 5.6 ms
# a layer (benchmarks/results/gpu_lease2/decode.json, cuDNN on and off). The value is the median over all the
# lease's SDPA decode steps (`python benchmarks/serving_speed.py --fit`); whether the builds go per layer or per
# distinct shape is open (docs/cost-model.md, "Not settled").
CUDNN_GRAPH_S = 2.5e-03
CUDNN_FIRST_MAJORS = (9, 10)


def cudnn_rebuilds(spec: ModelSpec, gpu: GPUProfile, w: Workload) -> int:
    """cuDNN graph builds in one generate call's decode steps: each step, each layer whose key length grew. A
    windowed layer's keys (sliding, or Llama 4's chunks, cached as a sliding window: inference.layer_windows)
    stop growing once the window is full, after one build for the first decode step's shape; a static cache's
    never change length. cuDNN's SDPA takes half inputs only: fp32 serving runs another kernel. The prefill's
    own build is not counted."""
    from memplan.estimator.inference import layer_windows  # inference imports this module

    steps = max(w.max_new_tokens - 1, 0)
    if (w.attn != "sdpa" or w.kv_cache != "dynamic" or gpu.compute_capability[0] not in CUDNN_FIRST_MAJORS
            or PRECISIONS[_serving_compute(w)].half is None):
        return 0
    return sum(steps if win is None else min(steps, max(win - w.seq_len, 1)) for win in layer_windows(spec))


def serving_tokens(w: Workload) -> int:
    """The tokens a serving step's rate counts: a generate call's new ones (one per prompt and step: beams are
    generate's search, not output), or the scoring forward's prompt tokens (an image model's seq_len is its
    patches + CLS: the constraints refuse any other)."""
    return w.micro_batch * (w.max_new_tokens or w.seq_len)


def _serving_compute(w: Workload) -> str:
    return w.precision if w.precision in PRECISIONS else "fp16-pure"  # int8 / int4 weights run half GEMMs


def decode_step_seconds(spec: ModelSpec, gpu: GPUProfile, w: Workload, launch_s: float | None = None) -> float:
    """One decode forward of a generate call (one token per sequence) at the call's mean context, its host time
    per kernel at least SERVING_LAUNCH_S (launch_s: another, for the fit); without the cache's traffic and cuDNN's
    graph builds, which inference_throughput adds per call."""
    seq, steps = w.seq_len, max(w.max_new_tokens - 1, 1)
    compute = _serving_compute(w)
    o = ops.step_ops(ops.OpsKey.of(spec, w.model_copy(update={"precision": compute})))
    context = seq + (steps + 1) / 2  # decode step k attends to seq + k keys
    host = max(generation(gpu).launch_s, SERVING_LAUNCH_S) if launch_s is None else launch_s
    return float(micro_seconds(o, gpu, compute, np.array([float(w.micro_batch * w.beams)]), context,
                               forward_only=True, casts=False, weights=w.precision, launch_s=host)[0])


def inference_throughput(spec: ModelSpec, gpu: GPUProfile, w: Workload, working_bytes: float,
                         decode_kv_bytes: float = 0.0) -> Throughput:
    """One scoring forward of the micro batch, or one greedy generate call as verify/infer.py runs it: the prompt's
    forward (the head on the last position only), which gives the first new token, then max_new_tokens - 1 decode
    forwards of one token per sequence (beams included: generate expands the batch before the prefill). Each
    forward is priced per operator as training's forward share (micro_seconds; the GEMMs' rooflines read the
    weights, so a decode step is bandwidth- or launch-bound), the prefill reads the no-grad working set once, a
    decode step's attention runs over the steps' mean context, and the KV cache the steps move (`decode_kv_bytes`:
    estimator/inference.py decode_kv_traffic) at the achievable bandwidth. A decode step's kernels are no faster
    than their host launch at SERVING_LAUNCH_S each (decode_step_seconds), and cuDNN's graph builds add
    CUDNN_GRAPH_S each (cudnn_rebuilds). Every data-parallel replica serves its
    own batches. Rates: sequences per second; tokens per second of the prompts (scoring) or of the new tokens
    (generate)."""
    seq = spec.seq_positions if spec.arch == "vision" else w.seq_len
    seqs, new = w.micro_batch * w.beams, w.max_new_tokens
    compute = _serving_compute(w)
    o = ops.step_ops(ops.OpsKey.of(spec, w.model_copy(update={"precision": compute})))
    bw = achievable_bandwidth(gpu)
    head = np.array([float(seqs)]) if new else None
    t = float(micro_seconds(o, gpu, compute, np.array([float(seqs * seq)]), seq, forward_only=True,
                            head_tokens=head, weights=w.precision)[0]) + working_bytes / bw
    steps = max(new - 1, 0)
    if steps:
        t += steps * decode_step_seconds(spec, gpu, w) + decode_kv_bytes / bw \
            + cudnn_rebuilds(spec, gpu, w) * CUDNN_GRAPH_S
    fwd = 2 * active_params(spec) * seqs * (seq + steps)
    peak = peak_tflops(gpu, w.precision)
    tokens = serving_tokens(w)
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
