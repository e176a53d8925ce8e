"""Throughput model for ranking plans: step time = matmul FLOPs at an achievable rate, the memory traffic
of the saved activations and of the optimizer step, the pipeline bubble, and the communication that is
not hidden behind compute (docs/cost-model.md).

FLOPs: 6 * N per token for forward + backward of the dense parameters (Kaplan et al. 2020, "Scaling
Laws", C = 6N), 2 * N more under full recompute and the attention core's forward again under selective
recompute (Korthikanti et al. 2022), plus attention's score and
context matmuls, 4 * s * a * d per layer per token forward (12 with backward), halved for causal
masks in fused kernels that skip masked tiles. MoE counts only the K routed experts per token.
"""

from __future__ import annotations

from typing import NamedTuple

from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import Workload

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


class Throughput(NamedTuple):
    step_seconds: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs (no recompute) / (time * peak of the compute dtype)
    terms: "StepTime | None" = None  # type: ignore[assignment]


def active_params(spec: ModelSpec) -> int:
    hit = _ACTIVE.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    n = _active_params(spec)
    _ACTIVE[id(spec)] = (spec, n)
    return n


_ACTIVE: dict = {}


def _active_params(spec: ModelSpec) -> int:
    by = spec.params_by_category()
    dense = sum(n for c, n in by.items() if c not in ("experts", "embeddings"))
    if spec.tie_embeddings and spec.head in ("causal-lm", "seq2seq-lm"):
        dense += spec.vocab_size * spec.hidden_size  # the tied matrix is also the LM head matmul
    experts = by.get("experts", 0)
    if spec.is_moe:
        experts = experts * spec.experts_per_token // spec.num_experts
    return dense + experts


def flops_per_token(spec: ModelSpec, seq: int, attn: str, recompute: str,
                    fused_loss: bool = False, tiled_mlp: bool = False) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs incl. recompute) per token of one training step. recompute: none,
    selective (the attention core's forward again) or full (the whole forward again)."""
    n = active_params(spec)
    causal = spec.arch == "decoder" and attn != "eager"
    attn_fwd = 4 * seq * spec.num_heads * spec.head_dim * spec.total_layers * (0.5 if causal else 1.0)
    model = 6 * n + 3 * attn_fwd
    hw = model + {"none": 0, "selective": attn_fwd, "full": 2 * n + attn_fwd}[recompute]
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


def _group_bw(gpu: GPUProfile, w: Workload, stride: int, size: int) -> float:
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


def step_time(spec: ModelSpec, gpu: GPUProfile, w: Workload, saved_activation_bytes: float, state_bytes: float,
              params_per_gpu: int, half: bool, mb: int, m: int, hw_f: float | None = None) -> StepTime:
    """One optimizer step of one data-parallel replica (mb sequences x m micro batches); every rank
    takes the same time."""
    seq = spec.seq_positions if spec.arch == "vision" else w.seq_len
    tokens = mb * seq
    dtype = COMPUTE_DTYPE[w.precision]
    peak = gpu.tflops.get(dtype) or gpu.tflops.get("fp32", 1.0)
    # the matmuls of one TP rank are 1/tp as wide: the shape efficiency sees hidden / tp
    width = spec.hidden_size / w.tp
    eff = PEAK_EFFICIENCY * tokens / (tokens + TOKENS_HALF) * width / (width + HIDDEN_HALF)
    bw = gpu.memory_bandwidth_gbs * 1e9
    if hw_f is None:
        hw_f = flops_per_token(spec, seq, w.attn, w.grad_ckpt, w.kernels, w.tiled_mlp)[1]
    dp = w.dp
    compute_micro = hw_f * tokens / (w.tp * w.pp) / (peak * 1e12 * eff)
    micro = compute_micro + ACTIVATION_TRAFFIC * saved_activation_bytes / bw
    compute = micro * m
    # 1F1B: (pp - 1) micro-batch slots of fill and drain, divided by the virtual stages when interleaved
    bubble = micro * (w.pp - 1) / w.vpp

    act_bytes = 2 if half else 4
    layers = spec.total_layers / w.pp
    intra = intra_node_gbs(gpu) * 1e9
    tp_comm = 0.0
    if w.tp > 1:
        # Megatron: 2 all-reduces in forward and 2 in backward per layer over b*s*h (with SP: an
        # all-gather + reduce-scatter pair each, the same volume); full recompute repeats the forward's
        n_ar = 4 + (2 if w.grad_ckpt == "full" else 0)
        tp_comm = m * layers * n_ar * ring(w.tp, tokens * spec.hidden_size * act_bytes, intra, "all-reduce")
    pp_comm = 0.0
    if w.pp > 1:
        # each micro batch crosses every stage boundary forward and backward (vpp times when
        # interleaved); with SP the message is split over the TP ranks
        msg = tokens * spec.hidden_size * act_bytes / (w.tp if w.sp else 1)
        p2p_bw = _group_bw(gpu, w, w.tp * dp, w.pp)
        pp_comm = 2 * m * w.vpp * msg / p2p_bw
    dp_comm = 0.0
    sharded = w.zero or w.fsdp != "none"
    g_bytes = params_per_gpu * (2 if (half and sharded) else 4)  # FSDP: reduce_dtype = the half dtype
    p_bytes = params_per_gpu * (2 if half else 4)
    dpbw = _group_bw(gpu, w, w.tp, dp)
    backward = 2 / 3 * compute_micro  # backward is 2 of the 3 matmul passes
    if dp > 1 and w.fsdp != "none":
        # FSDP2: every micro batch all-gathers each unit in forward (and again in backward unless
        # shard-grad-op kept it) and reduce-scatters its gradients, prefetched behind compute; hybrid
        # shards inside a node and all-reduces its gradient shard across nodes once per step
        n = w.gpus if w.fsdp == "hybrid-shard" else dp
        bw_n = _group_bw(gpu, w, 1, n)
        gathers = 1 if w.fsdp == "shard-grad-op" else 2
        per_micro = gathers * ring(n, p_bytes, bw_n, "all-gather") + ring(n, g_bytes, bw_n, "reduce-scatter")
        dp_comm = m * max(per_micro - compute_micro, 0.0)
        if w.fsdp == "hybrid-shard":
            dp_comm += ring(dp // n, g_bytes / n, inter_node_gbs(gpu, w) * 1e9, "all-reduce")
    elif dp > 1:
        if w.zero in (0, 1):
            # one all-reduce (ZeRO-1: reduce-scatter + all-gather, the same volume) at the accumulation
            # boundary, overlapped with the last micro batch's backward
            dp_comm = max(ring(dp, g_bytes, dpbw, "all-reduce") - backward, 0.0)
        elif w.zero == 2:
            # ZeRO-2 reduce-scatters every micro batch behind its backward, then all-gathers the
            # updated parameters after the step
            rs = ring(dp, g_bytes, dpbw, "reduce-scatter")
            dp_comm = m * max(rs - backward, 0.0) + ring(dp, p_bytes, dpbw, "all-gather")
        else:
            # ZeRO-3 (paper section 7.2.2: 1.5x the all-reduce volume): all-gather in forward and again
            # in backward, reduce-scatter of the gradients, every micro batch, prefetched behind compute
            per_micro = 2 * ring(dp, p_bytes, dpbw, "all-gather") + ring(dp, g_bytes, dpbw, "reduce-scatter")
            dp_comm = m * max(per_micro - compute_micro, 0.0)
    n_opt = params_per_gpu / (dp if sharded else 1)
    if w.offload == "none":
        optimizer = OPTIMIZER_TRAFFIC * state_bytes / bw
    else:
        # CPU Adam over the GPUs of a node sharing the host's memory bandwidth, plus the PCIe copies:
        # half gradients down every micro batch (ZeRO-2/3 partitions), updated half params up
        cpu = CPU_ADAM_BYTES_PER_PARAM * n_opt * w.gpus / (HOST_MEMORY_GBS * 1e9)
        pcie = gpu.pcie_gbs * LINK_EFFICIENCY * 1e9
        optimizer = cpu + (m * 2 * n_opt + 2 * n_opt) / pcie
        if w.offload == "all":  # parameters come up over PCIe for forward and backward of each micro batch
            optimizer += m * 2 * (params_per_gpu / dp) * 2 / pcie
    return StepTime(compute, bubble, tp_comm, pp_comm, dp_comm, optimizer)


def throughput(spec: ModelSpec, gpu: GPUProfile, w: Workload, saved_activation_bytes: float,
               state_bytes: float, params_per_gpu: int | None = None, half: bool = True, mb: int | None = None,
               m: int | None = None) -> Throughput:
    mb = w.micro_batch if mb is None else mb
    m = w.grad_accum if m is None else m
    seq = spec.seq_positions if spec.arch == "vision" else w.seq_len
    tokens = mb * seq
    dtype = COMPUTE_DTYPE[w.precision]
    peak = gpu.tflops.get(dtype) or gpu.tflops.get("fp32", 1.0)
    if w.task == "infer":
        eff = PEAK_EFFICIENCY * tokens / (tokens + TOKENS_HALF) * spec.hidden_size / (spec.hidden_size + HIDDEN_HALF)
        fwd = 2 * active_params(spec) * tokens
        t = fwd / (peak * 1e12 * eff) + (state_bytes + saved_activation_bytes) / (gpu.memory_bandwidth_gbs * 1e9)
        # every data-parallel replica serves its own batches
        return Throughput(t, mb * w.dp / t, tokens * w.dp / t, fwd / (t * peak * 1e12))
    model_f, hw_f = flops_per_token(spec, seq, w.attn, w.grad_ckpt, w.kernels, w.tiled_mlp)
    st = step_time(spec, gpu, w, saved_activation_bytes, state_bytes,
                   params_per_gpu if params_per_gpu is not None else spec.params_total, half, mb, m, hw_f)
    return rates(w, mb, m, seq, st.total, model_f, peak, st)


def rates(w: Workload, mb: int, m: int, seq: int, step: float, model_flops_per_token: float, peak_tflops: float,
          terms: StepTime | None = None) -> Throughput:
    """Samples/s, tokens/s and MFU of a step of `step` seconds. MFU over all GPUs: model FLOPs of the
    global batch / (step time x world x peak)."""
    samples = mb * m * w.dp
    return Throughput(step, samples / step, samples * seq / step,
                      model_flops_per_token * samples * seq / (step * peak_tflops * 1e12 * w.world), terms)
