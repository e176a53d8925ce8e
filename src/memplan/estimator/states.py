"""What one GPU of a pipeline stage holds whatever the micro batch: weights, gradients, optimizer states
and temporaries, communication buffers, autocast's half copies, and the segments they reserve
(docs/estimator.md, docs/parallel.md).

`stage_states` is cached, and its only argument is a frozen `StatesKey` that holds every input it
reads: a field it does not hold cannot change its answer, so the cache cannot return another
configuration's numbers, whatever order the calls come in.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from memplan.estimator.allocation import allocated_of, round_block, segments_of
from memplan.estimator.families import embedding_layernorm
from memplan.estimator.finetune import (
    Tuning, cast_kept, element_bytes, records_frozen_blocks, stored_tensors, tied_embedding, trained_blocks,
    tuned_params,
)
from memplan.estimator.parallel import fsdp_states, numel, stage_params, tied_head, zero_states
from memplan.estimator.rules import (
    FP32, HALF, OPTIMIZERS, PAGED_MIN_NUMEL, PRECISIONS, Precision, optimizer_state_bytes,
)
from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.inputs.workload import Workload

# the parameters autocast casts to half for a matmul (an fp32 one: a half or quantised weight is used as is)
LINEAR_CATEGORIES = ("attention", "mlp", "experts", "router", "head", "adapter")
CACHE_SIZE = 4096  # distinct stage settings kept: a 405B search on 1,024 GPUs visits about 1,500


def half_model(w: "Workload | StatesKey") -> bool:
    """The model itself runs in half precision and the fp32 states live elsewhere: DeepSpeed (any ZeRO
    stage, or its PipelineEngine) or FSDP with accelerate's mixed-precision policy. (A workload or a
    stage's key: both carry zero, pp and fsdp.)"""
    return w.zero > 0 or w.pp > 1 or w.fsdp != "none"


def train_precision(w: "Workload | StatesKey") -> Precision:
    """The precision the parameters and activations see: a half model has no autocast (its activations are
    pure half)."""
    prec = PRECISIONS[w.precision]
    if half_model(w) and prec.autocast:
        prec = PRECISIONS[f"{prec.half}-pure"]
    return prec


def activation_precision(spec: ModelSpec, w: Workload) -> Precision:
    """The widths the activations have under FSDP and the fine-tuning method (docs/finetune.md):
    - FSDP, as the HF Trainer runs it through accelerate: the MixedPrecisionPolicy gathers the parameters in the
      half type (accelerate 1.15 FullyShardedDataParallelPlugin.set_mixed_precision: param_dtype), and accelerate
      still wraps the forward in autocast (Accelerator.native_amp leaves out only DeepSpeed and Megatron-LM):
      half parameters under autocast, as LoRA's half base below, its adapters half too (lora_terms); QLoRA under
      FSDP keeps the half model's rows;
    - lora: the base is loaded in the half type, so the residual stream is half; under autocast the
      half inputs of the linears pass as they are (the "halfbase" rows of rules.PRECISIONS). Where the
      embeddings end with a LayerNorm (BERT), autocast runs it in fp32 (torch 2.13 ATen/autocast_mode.h
      AT_FORALL_FP32) and every residual add of a half output to that fp32 stream promotes: the stream is
      fp32 as over an fp32 base, and the precision's own row applies (traced: BertSelfOutput's add is fp32);
    - qlora: prepare_model_for_kbit_training leaves norms and embeddings in fp32, so the residual stream is
      fp32; with autocast the matmuls run in half (as bf16 / fp16 over an fp32 model); without, the 4-bit
      layers cast their output back to the fp32 input's dtype, so everything is fp32. Under DeepSpeed the
      engine casts those fp32 parameters back to half: a half model, pure half."""
    if w.fsdp != "none" and w.method != "qlora" and PRECISIONS[w.precision].autocast:
        own = PRECISIONS[w.precision]
        return own if embedding_layernorm(spec) else PRECISIONS[f"{own.half}-halfbase"]
    prec = train_precision(w)
    if w.method == "lora" and prec.half:
        return PRECISIONS[f"{prec.half}-halfbase"] if prec.autocast and not embedding_layernorm(spec) else prec
    if w.method == "qlora" and not half_model(w):
        return PRECISIONS[f"{prec.half}-qlora"] if prec.autocast else PRECISIONS["fp32"]
    return prec


def stage_layers(spec: ModelSpec, pp: int, stage: int) -> tuple[int, int]:
    """(encoder-or-decoder-only layers, decoder layers of an encoder-decoder) on one pipeline stage."""
    L = spec.total_layers
    per = -(-L // pp)
    lo, hi = stage * per, min(L, (stage + 1) * per)
    enc = max(0, min(hi, spec.num_layers) - lo)
    return enc, max(0, hi - lo - enc)


class StatesKey(NamedTuple):
    """Everything `stage_states` reads: the model, the stage and the workload fields that shape it
    (a NamedTuple: frozen, and cheap to build and hash for every row of a search)."""

    spec: ModelSpec
    stage: int
    tp: int
    pp: int
    dp: int
    gpus: int  # GPUs per node: hybrid-shard shards inside a node
    zero: int
    offload: str
    fsdp: str
    precision: str
    optim: str
    momentum: bool
    accumulating: bool  # offload's host accumulation buffer (ZeRO-1/2 with gradient accumulation)
    tuning: Tuning  # the fine-tuning method and its knobs

    @classmethod
    def of(cls, spec: ModelSpec, w: Workload, stage: int) -> "StatesKey":
        return cls(spec, stage, w.tp, w.pp, w.dp, w.gpus, w.zero, w.offload, w.fsdp, w.precision, w.optim,
                   w.momentum > 0, False, Tuning.of(w))

    def accumulated(self) -> "StatesKey":
        """The key of the same stage under gradient accumulation: it changes the states only through
        offload's host accumulation buffer (ZeRO-1/2)."""
        return self._replace(accumulating=True) if self.offload != "none" and self.zero in (1, 2) else self


class StageStates(NamedTuple):
    """One stage's GPU, independent of the micro batch; all numbers, so the step stacks them as one array."""

    weights: int  # every parameter: base weights, quantisation constants, adapters
    adapters: int  # LoRA adapters (and modules_to_save copies): part of weights
    quant_constants: int  # bitsandbytes' absmax, code, scales: part of weights
    grads: int
    states: int  # optimizer states the caching allocator holds
    managed: int  # paged optimizers' states: CUDA managed memory, outside the allocator (device used only)
    temp: int
    comm: int
    gathered: int
    cpu: int
    grads_persistent: bool
    tied: int
    c_all: int
    c_head: int
    c_mlp: int  # the MLPs' share of c_all
    head_grads: int
    persistent_segments: int
    n_params: int
    n_enc: int  # layers on this stage
    n_dec: int
    grad_enc: int  # ... of which autograd keeps activations for (freeze: the trained blocks)
    grad_dec: int
    frozen_enc: int = 0  # freeze: frozen blocks autograd records (a frozen block's activations)
    frozen_dec: int = 0
    layer_grads: int = 0  # one replica's gradients of its layers' weights (neither the embeddings' nor the head's)
    n_trained: int = 0  # of n_params, those that train: what the optimizer, clipping and gradient collectives touch


@lru_cache(maxsize=CACHE_SIZE)
def layout_params(spec: ModelSpec, tp: int, pp: int, stage: int) -> tuple[ParamGroup, ...]:
    """One stage's parameter groups, shared by every ZeRO / precision / optimizer setting of a layout."""
    return tuple(stage_params(spec, tp, pp, stage))


@lru_cache(maxsize=CACHE_SIZE)
def stage_states(k: StatesKey) -> StageStates:
    return _with_buffers(_stage_states(k), k.spec, k.stage)


def _with_buffers(st: StageStates, spec: ModelSpec, stage: int) -> StageStates:
    """The model's buffers (ModelSpec.buffer_bytes) beside the first stage's weights, in a segment of their own:
    transformers registers them on the base model, and neither ZeRO nor FSDP shards buffers."""
    if not spec.buffer_bytes or stage:
        return st
    return st._replace(weights=st.weights + round_block(spec.buffer_bytes),
                       persistent_segments=st.persistent_segments + segments_of([(spec.buffer_bytes, 1)]))


def _stage_states(k: StatesKey) -> StageStates:
    spec, prec = k.spec, train_precision(k)
    # a fine-tuning method runs without TP or PP, on the whole model (constraints.py): its own table
    groups = layout_params(spec, k.tp, k.pp, k.stage) if k.tuning.method == "full" else tuned_params(spec, k.tuning)
    enc, dec = stage_layers(spec, k.pp, k.stage)
    if half_model(k):
        z = _sharded(k, groups)
        tied, _ = _tied(spec, k, groups, prec)
        weights, grads, states, comm, gathered, cpu = (z.weights, z.gradients, z.optimizer_states, z.comm_buffers,
                                                       z.gathered, z.cpu)
        temp, grads_persistent, managed = z.step_transient, z.grads_persistent, 0
        adapters, constants = z.trained_weights if k.tuning.adapters else 0, z.constants
        persistent = [(weights, 1), (grads, 1), (states, 1), (comm, 1), (gathered, 1), (temp, 1)]
        # DeepSpeed and FSDP run the model in pure half (train_precision has no autocast): no half copies
        return StageStates(weights, adapters, constants, grads, states, managed, temp, comm, gathered, cpu,
                           grads_persistent, tied, 0, 0, 0, _head_grads(groups, tied, prec.grad),
                           segments_of(persistent), numel(list(groups)), enc, dec,
                           *_grad_layers(spec, k.tuning, enc, dec), n_trained=numel(list(groups), True))
    return _replica_states(k, groups, enc, dec)


def _replica_states(k: StatesKey, groups: tuple[ParamGroup, ...], enc: int, dec: int) -> StageStates:
    """One replica's states (a single GPU or DDP): every tensor in its storage, gradients and optimizer
    states for the trained ones only."""
    prec, rule = train_precision(k), OPTIMIZERS[k.optim]
    trainable = tuple(g for g in groups if g.trainable)
    spec = k.spec
    tied, tied_cast = _tied(spec, k, groups, prec)
    # per group: its data tensor's bytes and the rest's (quantisation constants), as the allocator rounds them
    stored = [[allocated_of([t]) for t in stored_tensors(g, prec.param)] for g in groups]
    weights = sum(map(sum, stored))
    adapters = sum(sum(b) for g, b in zip(groups, stored) if g.trainable and k.tuning.adapters)
    constants = sum(sum(b[1:]) for b in stored)
    grads = rounded(trainable, lambda g: g.numel * element_bytes(g, prec.grad))
    state = [round_block(optimizer_state_bytes(rule, g.shape, element_bytes(g, prec.param), k.momentum)) * g.count
             for g in trainable]
    states = sum(state)
    managed = sum(v for g, v in zip(trainable, state) if paged(rule, g))
    comm = grads if k.dp > 1 else 0  # DDP buckets: a second copy of every gradient (gradient_as_bucket_view=False)
    kept = [g for g in groups if cast_kept(k.spec, k.tuning, g)]
    copies = autocast_copies(kept, tied_cast, prec) if prec.autocast else (0, 0, 0)
    layer_grads = rounded(tuple(g for g in trainable if g.category not in ("embeddings", "head")),
                          lambda g: g.numel * element_bytes(g, prec.grad))
    return StageStates(weights, adapters, constants, grads, states - managed, managed,
                       _step_temporaries(trainable, prec, rule), comm, 0, 0, False, tied, *copies,
                       _head_grads(groups, tied, prec.grad), segments_of(_persistent_tensors(k, groups)),
                       numel(list(groups)), enc, dec, *_grad_layers(spec, k.tuning, enc, dec), layer_grads,
                       numel(list(groups), True))


def _grad_layers(spec: ModelSpec, t: Tuning, enc: int, dec: int) -> tuple[int, int, int, int]:
    """(trained encoder-or-decoder-only, trained decoder, recorded frozen encoder, recorded frozen decoder)
    layers: freeze trains the last K blocks of the stack next to the head, and the frozen blocks before them
    record nothing unless a trained embedding makes their input require a gradient
    (finetune.records_frozen_blocks); recorded, they keep a frozen block's activations
    (activations.frozen_block). Under LoRA every block is a frozen one with adapters (its own activations)."""
    if t.method != "freeze":
        return enc, dec, 0, 0
    # a method runs on the whole model (no PP): the stage's layers are the model's
    trained_dec = trained_blocks(spec, t) if spec.num_decoder_layers else dec
    trained_enc = 0 if spec.num_decoder_layers else trained_blocks(spec, t)
    if not records_frozen_blocks(spec, t):
        return trained_enc, trained_dec, 0, 0
    return trained_enc, trained_dec, enc - trained_enc, dec - trained_dec


def _tied(spec: ModelSpec, k: StatesKey, groups, prec: Precision) -> tuple[int, int]:
    """(trained, autocast-cast) elements of the tied LM head matrix on this stage: trained, its gradients
    are summed at the end of backward; stored fp32 under autocast, the head's matmul casts it. Full
    fine-tuning trains it in the model's width; a method's table says how it is stored and whether trained
    (a method runs without TP or PP: constraints.py)."""
    if not (tied_head(spec) and k.stage == k.pp - 1 and k.pp == 1):
        return 0, 0
    n = -(-spec.vocab_size // k.tp) * spec.hidden_size
    if k.tuning.method == "full":
        return n, n * (prec.param == FP32)
    g = next((g for g in groups if tied_embedding(spec, g)), None)
    if g is None:
        return 0, 0
    return n * g.trainable, n * (element_bytes(g, prec.param) == FP32)


@lru_cache(maxsize=CACHE_SIZE)
def states_row(k: StatesKey) -> np.ndarray:
    """`stage_states` as an int64 row (StageStates' field order), for the step's tables."""
    return np.array(stage_states(k), dtype=np.int64)


def _sharded(k: StatesKey, groups: tuple[ParamGroup, ...]):
    """DeepSpeed ZeRO (any stage, or its pipeline engine) or FSDP: parallel.py's partitioned states."""
    prec, rule = train_precision(k), OPTIMIZERS[k.optim]
    if k.fsdp != "none":
        return fsdp_states(list(groups), k.spec, strategy=k.fsdp, dp=k.dp, gpus=k.gpus, prec=prec, optim=rule)
    return zero_states(list(groups), k.spec, zero=k.zero, dp=k.dp, offload=k.offload, prec=prec, optim=rule,
                       accumulating=k.accumulating)


def per_tensor_temps(rule, g, prec: Precision) -> float:
    """fp32 copies of group g's tensor a per-parameter loop holds at once during its step (rules.OptimRule)."""
    half = element_bytes(g, prec.param) < FP32
    return rule.per_tensor_temp + (rule.half_param_temp if half else 0.0)


def _step_temporaries(trainable, prec: Precision, rule) -> int:
    """The optimizer's temporaries during step(): foreach's whole-group temporaries, or the largest
    single tensor's for per-parameter loops (rules.OptimRule)."""
    if rule.per_tensor_temp:
        return int(max((per_tensor_temps(rule, g, prec) * round_block(g.numel * FP32) for g in trainable), default=0))
    if rule.foreach_temp:
        return rounded(trainable, lambda g: g.numel * element_bytes(g, prec.param) * rule.foreach_temp)
    return 0


def rounded(groups, bytes_of) -> int:
    """Allocated bytes of one tensor per parameter, each rounded as the allocator rounds it."""
    return allocated_of([(bytes_of(g), g.count) for g in groups])


def _persistent_tensors(k: StatesKey, groups) -> list[tuple[float, int]]:
    """Weights, gradients and optimizer states as (bytes, count) tensors, for segment packing."""
    prec, rule = train_precision(k), OPTIMIZERS[k.optim]
    n_states = max(rule.state_count(k.momentum), 1)
    out: list[tuple[float, int]] = []
    for g in by_shape(groups):
        out += stored_tensors(g, prec.param)
        if prec.autocast and g.category in LINEAR_CATEGORIES and element_bytes(g, prec.param) == FP32 \
                and cast_kept(k.spec, k.tuning, g):
            out.append((g.numel * HALF, g.count))  # the half copies autocast re-creates every step
        if g.trainable:
            width = element_bytes(g, prec.param)
            out.append((g.numel * element_bytes(g, prec.grad), g.count * (2 if k.dp > 1 else 1)))  # + DDP's copy
            st = optimizer_state_bytes(rule, g.shape, width, k.momentum)
            if st and not paged(rule, g):
                out.append((st / n_states, g.count * n_states))
    return out


def paged(rule, g: ParamGroup) -> bool:
    """Whether a paged optimizer keeps this parameter's states in CUDA managed memory (rules.PAGED_MIN_NUMEL)."""
    return rule.paged and g.numel >= PAGED_MIN_NUMEL


def by_shape(groups) -> list[ParamGroup]:
    """Groups of one category, shape, storage and trainability merged across modules (segment packing
    fills mid-size segments group by group, as it did before groups carried their module)."""
    merged: dict[tuple, ParamGroup] = {}
    for g in groups:
        key = (g.category, g.shape, g.trainable, g.store)
        merged[key] = g.model_copy(update={"count": merged[key].count + g.count}) if key in merged else g
    return list(merged.values())


def tied_grad_sum(spec: ModelSpec, grad_bytes: float, grads_live: bool, tp: int) -> int:
    """The end of backward for a tied head: autograd holds the head's weight gradient in the input
    buffer of the shared parameter until the embedding's backward produces its own, then adds them
    (torch/csrc/autograd/input_buffer.cpp): two vocab x hidden inputs and the sum coexist with every
    other gradient. With set-to-none the sum becomes .grad (counted as a gradient); with gradients
    already allocated it is a third temporary that AccumulateGrad adds in place."""
    if not tied_head(spec):
        return 0
    return (3 if grads_live else 2) * round_block(-(-spec.vocab_size // tp) * spec.hidden_size * grad_bytes)


def autocast_copies(groups, tied: int, prec: Precision | None = None, half: int = HALF) -> tuple[int, int, int]:
    """(all copies, head copies, MLP copies): half copies of the fp32 parameters that autocast casts for
    matmuls (a half or quantised weight is used as it is). A tied LM head casts the embedding matrix
    (`tied` elements), so that copy exists too. prec: the training precision (its parameter width for the
    groups stored as the model is); None: every linear weight is fp32."""
    width = prec.param if prec else FP32
    lin = tuple(g for g in groups if g.category in LINEAR_CATEGORIES and element_bytes(g, width) == FP32)
    all_c = rounded(lin, lambda g: g.numel * half)
    head_c = rounded(tuple(g for g in lin if g.category == "head"), lambda g: g.numel * half)
    mlp_c = rounded(tuple(g for g in lin if g.category == "mlp"), lambda g: g.numel * half)
    all_c += round_block(tied * half)
    head_c += round_block(tied * half)
    return all_c, head_c, mlp_c


def _head_grads(groups, tied: int, grad_bytes: float) -> int:
    """Gradients allocated first in backward: the head (or the tied embedding matrix)."""
    g = rounded(tuple(x for x in groups if x.category == "head" and x.trainable),
                lambda x: x.numel * element_bytes(x, grad_bytes))  # as `grads` counts it (a half-stored copy)
    return g + round_block(tied * grad_bytes)
