"""Multi-GPU model states: what one GPU holds under tensor, pipeline and data parallelism, ZeRO and
offload. Pure arithmetic on the parameter table, no torch (docs/parallel.md derives every term).

Layout. Ranks are ordered tensor-parallel fastest, then data-parallel, then pipeline (Megatron's
default order "tp-cp-ep-dp-pp"), so TP groups stay inside a node, and DP groups leave it only when
tp * dp exceeds the GPUs of a node.

Tensor parallelism (Shoeybi et al. 2019, Megatron-LM): attention and MLP matrices are split by columns
or rows, the embedding and the LM head by vocabulary (VocabParallelEmbedding); norms and MoE routers
are replicated. Pipeline parallelism: the layers are split evenly; the first stage also holds the
embeddings, the last the final norm and the head (a tied head keeps a copy of the embedding matrix on
the last stage, as Megatron does). ZeRO (Rajbhandari et al. 2020) then partitions the remaining states
over the dp ranks, the way DeepSpeed does it (see `zero_states`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memplan.estimator.families import family
from memplan.estimator.finetune import element_bytes, stored_tensors
from memplan.estimator.rules import FP32, HALF, OptimRule, Precision
from memplan.inputs.modelspec import LM_HEADS, ModelSpec, ParamGroup

TP_SPLIT = ("attention", "mlp", "experts", "embeddings", "head")  # column/row/vocab parallel
LAYER_CATEGORIES = ("attention", "mlp", "experts", "router", "norms")

# -- DeepSpeed knobs memplan writes into the config, hence counts (docs/parallel.md). -------------
# DeepSpeed's defaults are 5e8 elements for both buckets (runtime/zero/config.py); transformers' HF
# integration replaces "auto" by hidden*hidden (reduce bucket), 0.9*hidden*hidden (stage-3 prefetch)
# and 10*hidden (param persistence threshold): integrations/deepspeed.py, trainer_config_finalize.
# memplan emits the same hidden-based numbers, so the estimate and the config agree.
STAGE3_MAX_LIVE_PARAMETERS = 10**9  # DeepSpeed default (elements)


def ds_buckets(spec: ModelSpec) -> dict[str, int]:
    """The DeepSpeed bucket sizes (elements) memplan puts in ds_config.json for this model."""
    h = spec.hidden_size
    return {"reduce_bucket_size": h * h, "allgather_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h), "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": STAGE3_MAX_LIVE_PARAMETERS}


def _group(category: str, shape: tuple[int, ...], count: int, trainable: bool, module: str = "") -> ParamGroup:
    return ParamGroup.model_construct(category=category, shape=shape, count=count, trainable=trainable, module=module)


def tp_shape(shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Megatron splits each matrix along one dimension; the larger one is split here (ceil), which
    keeps the element count exact to within one row."""
    if tp == 1 or not shape:
        return shape
    i = max(range(len(shape)), key=lambda k: shape[k])
    return shape[:i] + (-(-shape[i] // tp),) + shape[i + 1:]


def stage_params(spec: ModelSpec, tp: int, pp: int, stage: int) -> list[ParamGroup]:
    """The parameter tensors one GPU of pipeline stage `stage` (0-based) holds, after TP sharding.
    A group whose count is a multiple of the layer count belongs to the layers (count // L per layer);
    what is left over (embedding / final norms, poolers) to the first or last stage."""
    L = max(spec.total_layers, 1)
    per_stage = -(-L // pp)
    lo = stage * per_stage
    n_layers = max(0, min(L, lo + per_stage) - lo)
    first, last = stage == 0, stage == pp - 1
    out: list[ParamGroup] = []
    if tp == 1 and pp == 1:
        return list(spec.params)
    for g in spec.params:
        shape = tp_shape(g.shape, tp) if g.category in TP_SPLIT else g.shape
        per_layer = g.count // L if g.category in LAYER_CATEGORIES else 0
        if per_layer and n_layers:
            out.append(_group(g.category, shape, per_layer * n_layers, g.trainable, g.module))
        rest = g.count - per_layer * L
        if rest and ((first and g.category == "embeddings") or (last and g.category != "embeddings")):
            out.append(_group(g.category, shape, rest, g.trainable, g.module))
    if last and pp > 1 and tied_head(spec):
        # the last stage keeps its own copy of the tied matrix; the two copies' gradients are all-reduced
        out.append(_group("head", tp_shape((spec.vocab_size, spec.hidden_size), tp), 1, True))
    return out


def tied_head(spec: ModelSpec) -> bool:
    """The LM head's weight is the input embedding matrix (tie_word_embeddings)."""
    return spec.tie_embeddings and spec.head in LM_HEADS


def numel(ts: list[ParamGroup], trainable_only: bool = False) -> int:
    return sum(t.total for t in ts if t.trainable or not trainable_only)


@dataclass(frozen=True)
class ZeroStates:
    """Per-GPU bytes of the model states under DeepSpeed ZeRO (or torch DDP for stage 0)."""

    weights: int  # parameters in their training dtype (half under DeepSpeed mixed precision)
    gradients: int  # gradients alive through backward (and through forward under accumulation)
    grads_persistent: bool  # the gradient buffer outlives the step (stage 3's grad_partitions_flat_buffer)
    step_transient: int  # extra bytes created for the optimizer step (flattened + fp32 gradient partition)
    optimizer_states: int  # fp32 master copy + optimizer moments (the GPU part)
    comm_buffers: int  # reduce buckets, DDP bucket copies
    gathered: int  # ZeRO-3: parameters gathered for the modules being computed
    cpu: int  # host RAM this GPU's process holds for offload
    trained_weights: int = 0  # the trained parameters' share of `weights` (LoRA adapters: states.py)
    constants: int = 0  # quantisation constants, replicated: part of `weights`


# -- a fine-tuning method's table (estimator/finetune.py) as the sharding libraries see it ---------------
def flat_view(ts: list[ParamGroup], width: float) -> tuple[list[ParamGroup], int]:
    """(the parameters as DeepSpeed and FSDP hold them, the bytes of the quantisation constants).
    A bitsandbytes weight is one tensor of bnb_4bit_quant_storage's dtype (`width` bytes, the model's
    float dtype: constraints.py requires it under ZeRO-3 and FSDP), holding the packed 4-bit values:
    ceil(packed bytes / width) elements (bitsandbytes 0.50.2 functional.py quantize_4bit: a
    ((n + 1) // (2 * itemsize), 1) tensor of quant_storage). An LLM.int8 weight is its int8 data.
    Its quant_state (absmax, code, the nested state; Int8Params' SCB) is a Python attribute of the
    parameter, not a parameter: no library partitions it, so every rank holds all of it. Float groups
    are returned as they are."""
    out, constants = [], 0
    for g in ts:
        if element_bytes(g, width):
            out.append(g)
            continue
        (packed, count), *rest = stored_tensors(g, width)
        out.append(g.model_copy(update={"shape": (-(-int(packed) // int(width)),), "count": count,
                                        "store": "half" if width == HALF else "fp32"}))
        constants += int(sum(b * c for b, c in rest))
    return out, constants


def zero_states(ts: list[ParamGroup], spec: ModelSpec, *, zero: int, dp: int, offload: str, prec: Precision,
                optim: OptimRule, accumulating: bool) -> ZeroStates:
    """The states of one DeepSpeed rank holding tensors `ts`, partitioned over `dp` ranks (DeepSpeed
    0.19 read for each term; P = parameters of this GPU, N = dp; docs/parallel.md).

    Mixed precision (fp16 / bf16 section): half params and grads, fp32 master 4P/N and Adam moments 8P/N
    (K = 12 of the ZeRO paper); fp32: 4-byte params and grads, no master copy.
    Stages 1 and 2 (stage_1_and_2.py): full half params; stage 1 keeps the full half .grad until the
    accumulation boundary, stage 2 copies each gradient into its partition (contiguous_gradients) and
    frees it. Two reduce buckets (overlap_comm, which memplan turns on). At the step, the partition is
    flattened (2P/N) and cast to fp32 (4P/N) for the optimizer; that is the "18" of DeepSpeed's own
    estimator (2 + 4 + 4 + 8), and memplan adds the 2-byte flatten alive during the cast.
    Stage 3 (stage3.py): params partitioned (2P/N) except those under the persistence threshold, a
    persistent gradient partition (2P/N), one reduce bucket, the step's fp32 copy per sub-group
    (<= sub_group_size), and the gathered parameters (see `gathered_numel`).
    Offload of the optimizer: master, moments, the fp32 gradient and a half staging copy move to pinned
    host RAM (stage 1/2: 18P/N, plus a half accumulation buffer under gradient accumulation; stage 3:
    4 + 8 + 2 + 4 = 18P/N); offload of parameters (stage 3) moves the half partitions too (2P/N).
    DeepSpeed without ZeRO (only used here under pipeline parallelism) is stage 1 with N = 1.
    prec: the model's precision as DeepSpeed runs it (a half one, or fp32); optim: its state rule (the
    moments are fp32 on the master copy whatever the model's dtype).
    Fine-tuning methods: the engine casts every float parameter, frozen or not, to the half dtype
    (engine.py _cast_module_mixed_precision: CASTABLE_DTYPES; bitsandbytes' uint8 / int8 weights are not
    castable and stay); only trained parameters enter the optimizer's groups and its flat buffers
    (utils.py is_optimized_parameter), so gradients, the master copy and the moments count the trained
    parameters Pt. Stages 1 and 2 keep every parameter on every rank, frozen ones included; stage 3
    partitions every parameter of the module, frozen or not (parameter_offload.py
    _convert_to_zero_parameters: all module.parameters()). A 4-bit weight is its packed tensor
    (`flat_view`), its quantisation constants replicated.
    """
    ts, constants = flat_view(ts, prec.param)
    P = numel(ts)
    Pt = numel(ts, trainable_only=True)
    pb, half = prec.param, prec.half is not None
    master = FP32 if half else 0
    moments = optim.states * FP32
    b = ds_buckets(spec)
    n = dp if zero else 1
    part = lambda x: -(-x // n)  # noqa: E731  (flat buffers are padded to a multiple of the ranks)
    opt = int((master + moments) * part(Pt))
    largest = max((t.numel for t in ts if t.trainable), default=0)
    if zero <= 2:
        if offload == "none":
            grads = Pt * pb if zero <= 1 else part(Pt) * pb
            step = (pb + FP32) * part(Pt) if half else 0
            cpu = 0
        else:
            grads = largest * pb  # temp_grad_buffer_for_gpu_offload; partitions go to the host
            step = 0
            cpu = opt + FP32 * part(Pt) + pb * part(Pt) + (pb * part(Pt) if accumulating else 0)
            opt = 0
        comm = 2 * b["reduce_bucket_size"] * pb
        # the stage-2 partition (grads_in_partition) is freed at each step (_release_ipg_buffers)
        return ZeroStates(P * pb + constants, grads, False, step, opt, comm, 0, cpu, int(Pt * pb), constants)
    return _zero3_states(ts, spec, n, offload, prec, opt, constants)


def _zero3_states(ts: list[ParamGroup], spec: ModelSpec, n: int, offload: str, prec: Precision, opt: int,
                  constants: int) -> ZeroStates:
    """zero_states' stage 3 (its docstring) over n ranks, for the flat view `ts`; opt: the bytes of the
    optimizer states."""
    b, pb = ds_buckets(spec), prec.param
    P, Pt = numel(ts), numel(ts, trainable_only=True)
    thr = b["stage3_param_persistence_threshold"]
    part = lambda x: -(-x // n)  # noqa: E731
    persistent = sum(t.total for t in ts if t.numel <= thr)
    sharded = P - persistent
    weights = (part(sharded) + persistent) * pb
    cpu = 0
    if offload == "all":
        cpu += part(sharded) * pb
        weights = persistent * pb
    grads = part(Pt) * pb
    step = (pb + FP32) * min(part(Pt), SUB_GROUP_SIZE) if prec.half is not None else 0
    if offload != "none":
        cpu += opt + grads + FP32 * part(Pt)
        opt, grads, step = 0, 0, 0
    # the gathered parameters and, in backward, the fetch unit's full gradients before their reduce-scatter (a z3
    # leaf's wait in .grad for the module's backward hook; a larger-than-bucket one until the next hook: stage3.py
    # reduce_partition_and_remove_grads), DeepSpeed's own "4 x largest layer" (2 bytes of each)
    gathered = (gathered_numel(spec, ts) + fetch_unit(spec, ts)) * pb
    # the trained parameters' share: each whole below the persistence threshold, else its part
    trained = sum(t.total if t.numel <= thr else (0 if offload == "all" else part(t.total)) for t in ts if t.trainable)
    return ZeroStates(weights + constants, grads, True, step, opt, b["reduce_bucket_size"] * pb, gathered, cpu,
                      int(trained * pb), constants)


SUB_GROUP_SIZE = 10**9  # DeepSpeed default sub_group_size (elements)
STAGE3_MAX_REUSE_DISTANCE = 10**9  # DeepSpeed default (elements)


def fetch_unit(spec: ModelSpec, ts: list[ParamGroup]) -> int:
    """Elements of the largest set of parameters ZeRO-3 gathers at once: a module's own parameters
    (partitioned_param_coordinator.py fetch_sub_module: iter_params(module, recurse=False)), or a z3 leaf
    module's with all its descendants' (families.Family.z3_leaf: Mixtral's sparse MoE block, router and fused
    experts, 1.41 B in Mixtral-8x7B). A path's instances are the gcd of its groups' counts (a LayerNorm's
    weight and bias of one shape share a group, so such a module counts half: small modules only); a group
    without a module path (megatron_gpt) is one tensor."""
    leaf = family(spec.model_type).z3_leaf
    units: dict[str, list[ParamGroup]] = {}
    for i, g in enumerate(ts):
        path = g.module or f"#{i}"
        if leaf:
            head, sep, _ = path.partition(f".*.{leaf}.")
            path = head + f".*.{leaf}" if sep else path
        units.setdefault(path, []).append(g)
    largest = 0
    for groups in units.values():
        instances = math.gcd(*(g.count for g in groups)) if groups[0].module else groups[0].count
        largest = max(largest, sum(g.total for g in groups) // max(instances, 1))
    return largest


def gathered_numel(spec: ModelSpec, ts: list[ParamGroup]) -> int:
    """ZeRO-3 parameters gathered at the worst moment, in elements (DeepSpeed 0.19.8; docs/parallel.md):
    - a fetch: the unit's parameters all-gathered in one coalesced flat buffer, which lives until the last of
      them is consumed while each parameter is copied out of it (twice the unit), plus one prefetch bucket;
    - the turn from forward to backward: the parameters reused within stage3_max_reuse_distance are not released
      (__params_to_release); the trace runs forward then backward, so the last layers holding up to half the
      distance stay gathered (stage3_max_live_parameters gates only the prefetch, never the kept or the current).
    The persistent parameters (<= stage3_param_persistence_threshold) are in the weights."""
    b = ds_buckets(spec)
    thr = b["stage3_param_persistence_threshold"]
    sharded = sum(t.total for t in ts if t.numel > thr)
    if not sharded:
        return 0
    unit = fetch_unit(spec, ts)
    kept = min(STAGE3_MAX_REUSE_DISTANCE // 2, sharded)
    return max(2 * unit + b["stage3_prefetch_bucket_size"], kept + unit)


def fsdp_states(ts: list[ParamGroup], spec: ModelSpec, *, strategy: str, dp: int, gpus: int, prec: Precision,
                optim: OptimRule) -> ZeroStates:
    """PyTorch FSDP2 (`fully_shard`, as accelerate applies it with an auto-wrap policy on the decoder /
    encoder layer class). accelerate's mixed precision sets MixedPrecisionPolicy(param_dtype=half,
    reduce_dtype=half) (accelerate/utils/dataclasses.py, FullyShardedDataParallelPlugin.set_mixed_precision):
    the sharded parameters, their gradients and the optimizer states stay fp32 (4 + 4 + 8 bytes / N);
    a unit's parameters are all-gathered in half precision for its forward and backward.
    - full-shard (reshard_after_forward=True): the layer being computed and the next one (FSDP2
      prefetches one unit in forward and backward), the layer's unsharded half gradient before its
      reduce-scatter, and the root unit (embeddings, head, final norm), which FSDP2 does not reshard
      after forward because backward starts with it;
    - shard-grad-op (reshard_after_forward=False): parameters stay gathered from forward to backward:
      every parameter in half at the backward peak;
    - hybrid-shard: full-shard over the GPUs of one node (N = gpus), replicated across nodes.
    prec: the precision units are gathered in (param_dtype); optim: its state rule.
    Fine-tuning methods (FSDP2; accelerate 1.15 utils/fsdp_utils.py fsdp2_prepare_model): accelerate
    up-casts the trained parameters to fp32 and leaves frozen ones in their loaded dtype (`fsdp_width`);
    fully_shard shards each parameter, frozen or not, as its own DTensor, and only trained ones get a
    gradient. A 4-bit weight is its packed tensor of quant_storage's dtype (`flat_view`; constraints.py
    requires quant_storage to be the float dtype: accelerate leaves a uint8 one out of sharding), its
    quantisation constants replicated. Units are gathered in param_dtype (the packed weights in their
    storage dtype, the same width)."""
    n = gpus if strategy == "hybrid-shard" else dp
    ts, constants = flat_view(ts, prec.param)
    P = numel(ts)
    Pt = numel(ts, trainable_only=True)
    part = lambda x: -(-x // n)  # noqa: E731
    pb = prec.param
    widths: dict[float, int] = {}
    for g in ts:
        widths[fsdp_width(g)] = widths.get(fsdp_width(g), 0) + g.total
    weights = sum(part(count) * width for width, count in widths.items())
    layer, root = fsdp_units(spec, ts)
    gathered = P * pb if strategy == "shard-grad-op" else (3 * layer + root) * pb
    moments = optim.states * FP32
    return ZeroStates(int(weights) + constants, part(Pt) * FP32, False, 0, int(moments * part(Pt)), 0, gathered, 0,
                      part(Pt) * FP32, constants)


def fsdp_width(g: ParamGroup) -> float:
    """Bytes per element of a sharded FSDP2 parameter: fp32 for a trained one (accelerate up-casts it under
    mixed precision: fsdp2_prepare_model "Upcast to fp32 master weights"), its load dtype for a frozen one
    (full fine-tuning and freeze load fp32, LoRA's base the half type, QLoRA's packed weights their storage)."""
    return FP32 if g.trainable else element_bytes(g, FP32)


UNIT_CATEGORIES = LAYER_CATEGORIES + ("adapter",)  # LoRA's adapters belong to their layer's unit


def fsdp_units(spec: ModelSpec, ts: list[ParamGroup]) -> tuple[int, int]:
    """(elements of one transformer layer, of the root unit: embeddings, head, norms outside layers);
    ts: the table as sharded (`flat_view`: the model's, or a method's)."""
    L = max(spec.total_layers, 1)
    # a module's tensors counted together: freeze splits a layer group into trained and frozen blocks
    counts: dict[tuple, int] = {}
    for g in ts:
        key = (g.category, g.module, g.shape)
        counts[key] = counts.get(key, 0) + g.count
    layer = sum((c // L) * math.prod(shape) for (cat, _, shape), c in counts.items() if cat in UNIT_CATEGORIES and c >= L)
    return layer, numel(ts) - layer * L
