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

from memplan.estimator.allocation import round_block, segments_of
from memplan.estimator.parallel import fsdp_states, numel, stage_params, tied_head, zero_states
from memplan.estimator.rules import FP32, HALF, OPTIMIZERS, PRECISIONS, Precision, optimizer_state_bytes
from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.inputs.workload import Workload

LINEAR_CATEGORIES = ("attention", "mlp", "experts", "router", "head")
CACHE_SIZE = 4096  # distinct stage settings kept: a 405B search on 1,024 GPUs visits about 1,500


def half_model(w: "Workload | StatesKey") -> bool:
    """The model itself runs in half precision and the fp32 states live elsewhere: DeepSpeed (any ZeRO
    stage, or its PipelineEngine) or FSDP with accelerate's mixed-precision policy. (A workload or a
    stage's key: both carry zero, pp and fsdp.)"""
    return w.zero > 0 or w.pp > 1 or w.fsdp != "none"


def train_precision(w: "Workload | StatesKey") -> Precision:
    """The precision the activations see: a half model has no autocast (its activations are pure half)."""
    prec = PRECISIONS[w.precision]
    if half_model(w) and prec.autocast:
        prec = PRECISIONS[f"{prec.half}-pure"]
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

    @classmethod
    def of(cls, spec: ModelSpec, w: Workload, stage: int) -> "StatesKey":
        return cls(spec, stage, w.tp, w.pp, w.dp, w.gpus, w.zero, w.offload, w.fsdp, w.precision, w.optim,
                   w.momentum > 0, False)

    def accumulated(self) -> "StatesKey":
        """The key of the same stage under gradient accumulation: it changes the states only through
        offload's host accumulation buffer (ZeRO-1/2)."""
        return self._replace(accumulating=True) if self.offload != "none" and self.zero in (1, 2) else self


class StageStates(NamedTuple):
    """One stage's GPU, independent of the micro batch; all numbers, so the step stacks them as one array."""

    weights: int
    grads: int
    states: int
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


@lru_cache(maxsize=CACHE_SIZE)
def layout_params(spec: ModelSpec, tp: int, pp: int, stage: int) -> tuple[ParamGroup, ...]:
    """One stage's parameter groups, shared by every ZeRO / precision / optimizer setting of a layout."""
    return tuple(stage_params(spec, tp, pp, stage))


@lru_cache(maxsize=CACHE_SIZE)
def stage_states(k: StatesKey) -> StageStates:
    spec, prec, rule = k.spec, train_precision(k), OPTIMIZERS[k.optim]
    groups = layout_params(spec, k.tp, k.pp, k.stage)
    last = k.stage == k.pp - 1
    tied = -(-spec.vocab_size // k.tp) * spec.hidden_size if (tied_head(spec) and last and k.pp == 1) else 0
    if half_model(k):
        z = _sharded(k, groups)
        weights, grads, states, comm, gathered, cpu = (z.weights, z.gradients, z.optimizer_states, z.comm_buffers,
                                                       z.gathered, z.cpu)
        temp, grads_persistent = z.step_transient, z.grads_persistent
        persistent = [(weights, 1), (grads, 1), (states, 1), (comm, 1), (gathered, 1), (temp, 1)]
    else:
        trainable = tuple(g for g in groups if g.trainable)
        weights = rounded(groups, lambda g: g.numel * prec.param)
        grads = rounded(trainable, lambda g: g.numel * prec.grad)
        states = sum(round_block(optimizer_state_bytes(rule, g.shape, prec.param, k.momentum)) * g.count
                     for g in trainable)
        temp = _step_temporaries(groups, trainable, prec, rule)
        comm = grads if k.dp > 1 else 0  # DDP buckets: a second copy of every gradient (gradient_as_bucket_view=False)
        gathered = cpu = 0
        grads_persistent = False
        persistent = _persistent_tensors(k, groups)
    c_all, c_head, c_mlp = autocast_copies(groups, tied) if prec.autocast else (0, 0, 0)
    return StageStates(weights, grads, states, temp, comm, gathered, cpu, grads_persistent, tied,
                       c_all, c_head, c_mlp, _head_grads(groups, tied, prec.grad), segments_of(persistent),
                       numel(list(groups)), *stage_layers(spec, k.pp, k.stage))


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


def _step_temporaries(groups, trainable, prec: Precision, rule) -> int:
    """The optimizer's temporaries during step(): foreach's whole-group temporaries, or the largest
    single tensor's for per-parameter loops (rules.OptimRule)."""
    if rule.per_tensor_temp:
        return int(rule.per_tensor_temp * round_block(max((g.numel for g in groups), default=0) * FP32))
    if rule.foreach_temp:
        return rounded(trainable, lambda g: g.numel * prec.param * rule.foreach_temp)
    return 0


def rounded(groups, bytes_of) -> int:
    """Allocated bytes of one tensor per parameter, each rounded as the allocator rounds it."""
    return sum(round_block(bytes_of(g)) * g.count for g in groups)


def _persistent_tensors(k: StatesKey, groups) -> list[tuple[float, int]]:
    """Weights, gradients and optimizer states as (bytes, count) tensors, for segment packing."""
    prec, rule = train_precision(k), OPTIMIZERS[k.optim]
    n_states = max(rule.states + (1 if rule.momentum_arg and k.momentum else 0), 1)
    out: list[tuple[float, int]] = []
    for g in by_shape(groups):
        out.append((g.numel * prec.param, g.count))
        if prec.autocast and g.category in LINEAR_CATEGORIES:
            out.append((g.numel * HALF, g.count))  # the half copies autocast re-creates every step
        if g.trainable:
            out.append((g.numel * prec.grad, g.count * (2 if k.dp > 1 else 1)))  # + DDP's bucket copy
            st = optimizer_state_bytes(rule, g.shape, prec.param, k.momentum)
            if st:
                out.append((st / n_states, g.count * n_states))
    return out


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


def autocast_copies(groups, tied: int, half: int = HALF) -> tuple[int, int, int]:
    """(all copies, head copies, MLP copies): half copies of the parameters that autocast casts for
    matmuls. A tied LM head casts the embedding matrix (`tied` elements), so that copy exists too."""
    lin = tuple(g for g in groups if g.category in LINEAR_CATEGORIES)
    all_c = rounded(lin, lambda g: g.numel * half)
    head_c = rounded(tuple(g for g in lin if g.category == "head"), lambda g: g.numel * half)
    mlp_c = rounded(tuple(g for g in lin if g.category == "mlp"), lambda g: g.numel * half)
    all_c += round_block(tied * half)
    head_c += round_block(tied * half)
    return all_c, head_c, mlp_c


def _head_grads(groups, tied: int, grad_bytes: float) -> int:
    """Gradients allocated first in backward: the head (or the tied embedding matrix)."""
    g = rounded(tuple(x for x in groups if x.category == "head" and x.trainable), lambda x: x.numel * grad_bytes)
    return g + round_block(tied * grad_bytes)
