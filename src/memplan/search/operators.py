"""What one micro batch of training runs on one GPU, operator by operator (docs/cost-model.md): the GEMMs with
their shapes from the parameter table, the attention core, and the memory-bound kernels with the elements they
move. search/cost.py turns it into seconds with a roofline per operator.

Element moves count every read and every write of one element by a memory-bound kernel, forward plus backward,
as PyTorch eager runs a Hugging Face layer (one kernel per op, no fusion); a move is priced at the width of the
tensor it touches (the residual stream's or the matmul outputs'). The counts are read off the ops' definitions
(ATen's forward and derivatives.yaml backward) and are stated with each constant.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from memplan.estimator.activations import norms_per_layer
from memplan.estimator.families import family
from memplan.estimator.finetune import Tuning, quantised, recorded_layers, records_frozen_blocks, tuned_params
from memplan.estimator.parallel import tp_shape
from memplan.inputs.modelspec import LM_HEADS, ModelSpec, ParamGroup
from memplan.inputs.workload import Workload

# -- element moves per element, forward + backward ----------------------------------------------------------
NORM_MOVES = 5  # layer_norm / rms_norm: read x, write y; backward reads x and dy, writes dx
RESIDUAL_MOVES = 6  # x + f(x): read 2, write 1; backward adds the two branches' gradients (read 2, write 1)
DROPOUT_MOVES = 5  # read, write, the mask; backward reads dy and the mask, writes dx (mask bytes rounded up)
ACT_MOVES = 5  # gelu / silu: read, write; backward reads x and dy, writes dx
GATE_MOVES = 8  # act(gate) * up: read 2, write 1; backward reads dy and both factors, writes both gradients
# HF apply_rotary_pos_emb on q and k: q * cos, rotate_half(q) (two slices, a negation, a cat), * sin, the sum:
# 13 moves forward, as many in backward
ROTARY_MOVES = 26
# eager attention on the scores (b * heads * s * s_kv elements): the matmuls' own write of the scores and read of
# the probabilities, and in backward the four matmuls' reads and writes of them (6); scale, mask add, softmax and
# the cast back for the PV matmul, and in backward softmax's (read y, dy, write) and the scale's (15). Priced at
# the residual stream's width: transformers' float mask is in the model's dtype, so under autocast the masked
# scores, the softmax and its dropout are fp32
EAGER_SCORE_MOVES = 21
# the LM loss per logit: transformers' ForCausalLMLoss upcasts the logits to fp32 (read 2, write 4 bytes),
# cross_entropy's log_softmax (read 4, write 4) and nll; backward: nll's zeros and scatter (4), log_softmax's
# (read 8, write 4) and the cast back (read 4, write 2): about 40 bytes per logit
LOSS_BYTES_PER_LOGIT = 40
# the embedding's backward writes a dense vocab x hidden gradient (embedding_dense_backward: zeros, then
# index_put), which AccumulateGrad then adds into .grad when one exists: 3 moves of vocab x hidden
EMBED_GRAD_MOVES = 3
# autocast casts every fp32 weight to half once per forward (read 4, write 2 bytes; the cache lives for one
# forward: torch.autocast clears it on exit), again when a checkpointed forward is recomputed
AUTOCAST_CAST_BYTES = 6
# bitsandbytes dequantises a 4-bit weight to half in forward and again in backward (read 0.5, write 2 bytes)
DEQUANT_BYTES = 2.5
# kernels one layer's forward launches beyond its GEMMs (norms, adds, dropout, activation, views that copy):
# a HF layer is ~15-25 ops; backward launches about twice as many
LAYER_KERNELS = 20
EAGER_KERNELS = 6  # the eager core: two matmuls, scale, mask, softmax, cast (fused kernels: 1)
# under autocast, eager attention's half scores are cast to fp32 for softmax and its output back for the PV matmul
AUTOCAST_EAGER_CASTS = 2


# 2-D parameters of these categories are matmul weights even without a module type (megatron_gpt's table, routers)
MATRIX_CATEGORIES = ("attention", "mlp", "router", "head")


class Gemm(NamedTuple):
    rows: float  # M per token of the micro batch: 1 for a dense layer, K/E for a routed expert
    n: int  # output features (one tensor-parallel rank's share)
    k: int  # input features
    count: int  # matmuls of this shape in the model
    passes: int  # forward, the input's gradient, the weight's gradient (when it trains)
    quantisable: bool = False  # a weight transformers converts to bitsandbytes' layers (finetune.quantised)


class StepOps(NamedTuple):
    """One micro batch on one GPU of a model split `tp` ways, before pipeline splitting; per token unless named."""

    layer_gemms: tuple[Gemm, ...]  # every layer's linears (pipeline stages split them)
    head_gemms: tuple[Gemm, ...]  # the LM head (the last stage's)
    attn_flops: float  # the attention core's matmul FLOPs per token per key position, all layers, fwd + bwd
    fused_attn: bool  # the core is one kernel (SDPA, FlashAttention-2, memplan's) rather than eager ops
    score_moves: float  # eager: score elements moved per token per key position, all layers (residual width)
    stream_moves: float  # elements moved at the residual stream's width, all layers
    act_moves: float  # elements moved at the matmul outputs' width, all layers
    head_bytes: float  # the loss's bytes (the last stage's)
    cast_params: int  # weight elements autocast casts per micro batch (twice under full recompute)
    quant_params: int  # 4-bit weight elements dequantised per micro batch, each in forward and backward
    embed_grad: int  # elements of the embedding gradient written per micro batch (0: frozen)
    core_kernels: float  # the attention core's kernel launches, all layers, forward + backward (+ recompute)
    elementwise_kernels: float  # the layers' other non-GEMM kernel launches, likewise
    layers: int
    # autocast's cast kernels in one forward of all layers (autocast_casts): of the weights and biases stored in
    # the precision's parameter width (fp32 under autocast over an fp32 model), of those stored in fp32 whatever
    # the precision (LoRA's adapters), and of the fp32 activations entering half ops; forward_passes: forwards per
    # micro batch (2 under full recompute)
    weight_casts: float = 0.0
    input_casts: float = 0.0
    forward_passes: int = 1
    fp32_weight_casts: float = 0.0
    backward_share: float = 1.0  # of the layers, those with a backward (freeze: the trained blocks)


class OpsKey(NamedTuple):
    """Everything the operator inventory reads (a frozen, hashable cache key)."""

    spec: ModelSpec
    tuning: Tuning
    tp: int
    sp: bool
    attn: str
    recompute: str
    kernels: bool
    tiled_mlp: bool

    @classmethod
    def of(cls, spec: ModelSpec, w: Workload) -> "OpsKey":
        return cls(spec, Tuning.of(w), w.tp, w.sp, w.attn, w.grad_ckpt, w.kernels, w.tiled_mlp)


def _gemm(spec: ModelSpec, g: ParamGroup, tp: int, recorded: bool) -> Gemm | None:
    """The matmul a weight takes part in, or None (norms, biases, embeddings, a classifier on one token).
    recorded: autograd records the frozen weights' matmuls (finetune.records_frozen_blocks), so they compute their
    input's gradient; else a frozen weight runs forward only."""
    shape = tp_shape(g.shape, tp)
    passes = 3 if g.trainable else 1 + recorded
    if g.category == "experts" and len(shape) == 3:  # fused experts (E, out, in): each expert sees K/E of the tokens
        e = shape[0]
        share = 1.0 if family(spec.model_type).moe_all_experts else spec.experts_per_token / spec.num_experts
        return Gemm(share, shape[1], shape[2], g.count * e, passes)
    if g.category == "adapter" and len(shape) == 2:
        return Gemm(1.0, shape[0], shape[1], g.count, passes)
    if len(shape) == 2 and (g.weight_of or g.category in MATRIX_CATEGORIES):
        out, inp = (shape[1], shape[0]) if g.weight_of == "Conv1D" else shape
        return Gemm(1.0, out, inp, g.count, passes, quantised(spec, g))
    if len(shape) == 4 and g.category == "embeddings":  # a ViT patch convolution: one GEMM over the patches
        return Gemm(1.0, shape[0], shape[1] * shape[2] * shape[3], g.count, passes)
    return None


# the share of a layer's element moves that is forward (2 of NORM_MOVES' 5, 3 of RESIDUAL_MOVES' 6, ...): what a
# recomputed forward moves again
FORWARD_SHARE = 0.4


@lru_cache(maxsize=256)
def step_ops(key: OpsKey) -> StepOps:
    """The operator inventory of one micro batch for `key` (per token; cost.py prices it). Full recompute
    runs the layers' forward twice (Korthikanti et al. 2022), selective the attention core's; memplan's fused
    loss computes the head's forward again in backward, its tiled MLP each MLP's."""
    spec, tp, full = key.spec, key.tp, key.recompute == "full"
    params = tuned_params(spec, key.tuning)
    recorded = records_frozen_blocks(spec, key.tuning)
    layer, head = [], []
    for g in params:
        gm = _gemm(spec, g, tp, recorded)
        if gm is None or (g.category == "head" and spec.head not in LM_HEADS):
            continue
        again = full and g.category != "head" and gm.passes > 1 or key.tiled_mlp and g.category == "mlp" or (
            key.kernels and g.category == "head")
        (head if g.category == "head" else layer).append(gm._replace(passes=gm.passes + again))
    if spec.tie_embeddings and spec.head in LM_HEADS:
        emb_trains = any(g.trainable for g in params if g.category == "embeddings")
        head.append(Gemm(1.0, -(-spec.vocab_size // tp), spec.hidden_size, 1, 2 + emb_trains + key.kernels))
    L = spec.total_layers
    # freeze: the frozen blocks below the trained ones run forward only (no backward, nothing to recompute)
    back = recorded_layers(spec, key.tuning) / max(L, 1)
    heads = -(-spec.num_heads // tp)
    attn_fwd = attention_forward_flops(spec, key.attn, tp)
    core_again = key.recompute in ("full", "selective")
    # a layer's element moves: FORWARD_SHARE of them forward, the rest backward, the forward again under full
    again = FORWARD_SHARE + back * (1 - FORWARD_SHARE + FORWARD_SHARE * full)
    fused = key.attn != "eager"
    scores = 0 if fused else heads * L * (EAGER_SCORE_MOVES + (DROPOUT_MOVES if spec.attention_dropout else 0))
    weight_casts, fp32_casts, input_casts = autocast_casts(params, L, fused)
    launches = L * (1 + back * (2 + full))  # per layer kernel: forward, twice that in backward, the recompute
    return StepOps(tuple(layer), tuple(head), (1 + back * (2 + core_again)) * attn_fwd, fused,
                   scores * (FORWARD_SHARE + back * (1 - FORWARD_SHARE + FORWARD_SHARE * core_again)),
                   (_stream_moves(spec, key) + _qk_norm_moves(spec, tp)) * L * again,
                   _act_moves(spec, tp) * L * again,
                   LOSS_BYTES_PER_LOGIT * spec.vocab_size / tp if spec.head in LM_HEADS else 0.0,
                   sum(g.total for g in params if g.weight_of and g.store == "model") * (1 + full * back),
                   sum(g.total for g in params if g.store in ("4bit", "4bit-dq")) * (1 + full * back),
                   _embed_grad(spec, params),
                   launches * (1 if fused else EAGER_KERNELS), launches * LAYER_KERNELS, L,
                   weight_casts, input_casts, 1 + full, fp32_casts, back)


def autocast_casts(params, L: int, fused: bool) -> tuple[float, float, float]:
    """Cast kernels autocast launches in one forward of the layers: one per fp32 weight and bias of a linear
    (torch.autocast casts a leaf once per forward, its cache cleared on exit), and one per fp32 activation entering
    a half op: the input of each linear that reads a norm's fp32 output (all but the attention's output and the
    MLP's down projection), and under eager attention the scores up to softmax's fp32 and its output back (ATen's
    autocast lists: layer_norm and softmax run in fp32, linear and matmul in half). The weights as (stored in the
    precision's parameter width, stored in fp32: LoRA's adapters); bitsandbytes' and half-loaded bases are none."""
    linear = ("attention", "mlp", "experts", "router", "adapter")

    def weights(store: str) -> float:
        return float(sum(g.count for g in params if g.category in linear and g.store == store
                         and (g.weight_of or len(g.shape) == 1)))

    per_layer = sum(g.count for g in params if g.category in linear[:-1] and g.weight_of) / max(L, 1)
    return weights("model"), weights("fp32"), L * (max(per_layer - 2, 0) + (0 if fused else AUTOCAST_EAGER_CASTS))


def attention_forward_flops(spec: ModelSpec, attn: str, tp: int = 1) -> float:
    """The attention core's forward FLOPs per token per key position, all layers, one TP rank: QK^T at the query /
    key head width and PV at the value head width, 2 FLOPs per multiply-add (MLA: 192 and 128 in DeepSeek-V3;
    else both head_dim), halved for the causal mask fused kernels skip the tiles of (eager computes them all)."""
    causal = spec.arch == "decoder" and attn != "eager"
    heads = -(-spec.num_heads // tp)
    return 2 * heads * (spec.head_dim + spec.value_head_dim) * spec.total_layers * (0.5 if causal else 1.0)


def _stream_moves(spec: ModelSpec, key: OpsKey) -> float:
    """Residual-width element moves of one layer on average: its norms, two residual adds, the hidden dropouts;
    split over the TP ranks only under sequence parallelism (else every rank repeats them)."""
    norms = (spec.num_layers * norms_per_layer(spec)
             + spec.num_decoder_layers * norms_per_layer(spec, True)) / max(spec.total_layers, 1)
    dropouts = 2 if spec.hidden_dropout else 0
    per = spec.hidden_size * (norms * NORM_MOVES + 2 * RESIDUAL_MOVES + dropouts * DROPOUT_MOVES)
    return per / (key.tp if key.sp else 1)


def _qk_norm_moves(spec: ModelSpec, tp: int) -> float:
    """Element moves of one layer's q / k norms (families.Family.qk_norm; activations._qk_norms saves their
    tensors): an RMSNorm over q's a*d and k's k*d values per token, NORM_MOVES each like the layer's own norms and
    priced like them at the residual width (they upcast to fp32 under autocast). Per-head norms split with the
    heads over TP; a norm over the whole projection runs on the gathered q and k. Llama 4 runs its L2 norm on
    the RoPE layers only (ModelSpec.qk_norm_layers)."""
    fam = family(spec.model_type)
    if fam.qk_norm is None or spec.qk_norm_layers == 0:
        return 0.0
    elements = (spec.num_heads + spec.num_kv_heads) * spec.head_dim / (tp if fam.qk_norm != "full" else 1)
    return NORM_MOVES * elements * spec.qk_norm_share


def _act_moves(spec: ModelSpec, tp: int) -> float:
    """Matmul-output-width element moves of one layer: the MLP's activation (and gate product), rotary on
    q and k; one TP rank's share."""
    width = spec.intermediate_size
    if spec.is_moe:
        width = spec.expert_width * (spec.num_experts if family(spec.model_type).moe_all_experts
                                     else spec.experts_per_token) + spec.shared_expert_intermediate_size
    moves = width * (ACT_MOVES + (GATE_MOVES if spec.mlp == "gated" else 0))
    if spec.position == "rotary":
        moves += ROTARY_MOVES * (spec.num_heads + spec.num_kv_heads) * spec.head_dim
    return moves / tp


def _embed_grad(spec: ModelSpec, params: tuple[ParamGroup, ...]) -> int:
    """Elements of the token embedding's dense gradient (0 when it is frozen)."""
    return sum(g.total for g in params if g.category == "embeddings" and g.trainable and len(g.shape) == 2
               and g.shape[0] == spec.vocab_size)
