"""The activation models of a set of workloads at every micro batch, as arrays: one tensor's bytes on one
tensor-parallel rank, its count and the lists it belongs to, for the step to sum and to pack into
segments (activations.py builds the tensors, traced.py a traced model's; docs/estimator.md).

Every activation term is affine in the micro batch b: activations.py builds each from T = b*s,
b*a*s*s, b*s*E, ..., and a few are shared by the batch (T5's position bias: the constant part). So the
models at b = 1 and b = 2 give every micro batch's tensors as c + b * x. memplan's kernels (the fused
loss, the tiled MLP) size their blocks by the token count, so their models are built at each micro
batch instead (`ActsKey.mb`). tests/test_estimator.py checks the affine form over the catalog.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from memplan.estimator import traced
from memplan.estimator.activations import (ActivationModel, LayerKind, Tensors, is_log_softmax, layer_kinds,
                                           training_activations)
from memplan.estimator.rules import FP32, HALF, PRECISIONS
from memplan.estimator.finetune import (
    LoraActs, Tuning, compute_bytes, lora_acts, records_frozen_blocks, trains_embeddings,
)
from memplan.estimator.states import CACHE_SIZE, activation_precision, half_model
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.workload import Workload

# The lists of an activation model the step sums (ActivationModel's fields; lsm: the loss's saved
# log-softmax output within head_saved, freed during the last layer's backward).
LISTS = ("layer", "decoder_layer", "embed", "head_saved", "lsm", "layer_input", "layer_core", "loss_forward",
         "loss_backward", "layer_backward", "frozen_layer", "frozen_decoder_layer", "forward_cache",
         "unrecorded_cache")
LIST = {name: i for i, name in enumerate(LISTS)}


class ActsKey(NamedTuple):
    """Everything one activation model reads, before tensor-parallel sharding. mb = 0: the affine form
    (models at b = 1 and 2); mb > 0: the model at that micro batch (memplan's kernels)."""

    spec: ModelSpec
    seq: int
    precision: str  # the precision the activations see (states.activation_precision)
    eager: bool  # eager attention saves its scores and probabilities; SDPA, FlashAttention-2 and memplan's do not
    grad_ckpt: str
    kernels: bool
    tiled_mlp: bool
    lora: LoraActs | None = None  # the frozen base's adapters (estimator/finetune.py)
    embed_grad: bool = True  # the embeddings' output requires a gradient
    frozen_blocks: bool = False  # freeze: autograd records frozen blocks (finetune.records_frozen_blocks)
    mb: int = 0

    @classmethod
    def of(cls, spec: ModelSpec, w: Workload) -> "ActsKey":
        t = Tuning.of(w)
        return cls(spec, w.seq_len, activation_precision(spec, w).name, w.attn == "eager", w.grad_ckpt, w.kernels,
                   w.tiled_mlp, lora_acts(spec, t, w.lora_dropout, compute_bytes(w), HALF if half_model(w) else FP32),
                   trains_embeddings(spec, t),
                   t.method == "freeze" and records_frozen_blocks(spec, t))

    @property
    def trace_key(self) -> traced.TraceKey:
        """The traced coefficients this model reads (a model_type without an analytic model)."""
        return traced.key_of(self.spec, self.seq, PRECISIONS[self.precision], "eager" if self.eager else "sdpa",
                             self.grad_ckpt == "full")

    @property
    def affine(self) -> bool:
        # a traced model's transients are the largest of several fitted moments, which is not affine in b
        return not (self.kernels or self.tiled_mlp or self.spec.traced_config)

    def model(self, b: int, kind: LayerKind | None = None) -> ActivationModel:
        """The model at micro batch b: its lists of the mean layer, or with `kind` of that kind's layers."""
        if self.spec.traced_config:  # a model_type without an analytic model: fitted to traces of it
            return traced.activations(self.trace_key, b, self.seq)
        return training_activations(self.spec, b, self.seq, PRECISIONS[self.precision],
                                    "eager" if self.eager else "sdpa", selective=self.grad_ckpt == "selective",
                                    kv_cache=self.grad_ckpt != "full", fused_loss=self.kernels,
                                    tiled_mlp=self.tiled_mlp, lora=self.lora, embed_grad=self.embed_grad,
                                    frozen_blocks=self.frozen_blocks, kind=kind)

    def layer_models(self, b: int) -> tuple[ActivationModel, ...]:
        """Each block's own model (one per kind, shared by its layers) where the layers differ
        (activations.layer_kinds), else (); a traced model's blocks always (_traced_layers)."""
        if self.spec.traced_config:
            return self._traced_layers(b)
        kinds = layer_kinds(self.spec)
        # a kind's model from its first layer (its LoRA adapters: LoraActs.at_layer)
        models = {k: (self if self.lora is None else self._replace(lora=self.lora.at_layer(kinds.index(k)))).model(b, k)
                  for k in dict.fromkeys(kinds)}
        return tuple(models[k] for k in kinds)

    def _traced_layers(self, b: int) -> tuple[ActivationModel, ...]:
        """A traced model's blocks, each the traced block that stands for it (traced.block_of: its stack's first,
        its layer type's, or its stack's second)."""
        key, enc, dec = self.trace_key, self.spec.num_layers, self.spec.num_decoder_layers
        types = self.spec.layer_types if len(self.spec.layer_types) == enc and not dec else ()
        picks = [traced.block_of(key, False, i, types[i] if types else "") for i in range(enc)]
        picks += [traced.block_of(key, True, j, "") for j in range(dec)]
        models = {k: traced.activations(key, b, self.seq, k) for k in dict.fromkeys(picks)}
        return tuple(models[k] for k in picks)


class Units(NamedTuple):
    """The tensors of one activation model, every list in one: bytes(b) = c + b * x (x = 0 at a fixed mb)."""

    c: np.ndarray  # (T,) float64
    x: np.ndarray  # (T,) float64
    count: np.ndarray  # (T,) int64
    rep: np.ndarray  # (T,) bool: replicated under TP unless SP (activations.shard)
    member: np.ndarray  # (T, F) int64: 1 where the tensor belongs to list f


def tensor_lists(am: ActivationModel) -> tuple[list[Tensors], np.ndarray]:
    """Every tensor of the model's lists (lsm is part of head_saved) and its list membership."""
    every, rows = [], []
    for name in LISTS:
        if name == "lsm":
            continue
        for t in getattr(am, name):
            row = [0] * len(LISTS)
            row[LIST[name]] = 1
            if name == "head_saved" and is_log_softmax(t):
                row[LIST["lsm"]] = 1
            every.append(t)
            rows.append(row)
    return every, np.array(rows, np.int64).reshape(-1, len(LISTS))


@lru_cache(maxsize=CACHE_SIZE)
def units(k: ActsKey) -> Units:
    if k.mb:
        ts, member = tensor_lists(k.model(k.mb))
        c, x = np.array([float(t.nbytes) for t in ts]), np.zeros(len(ts))
    else:
        ts, member = tensor_lists(k.model(1))
        two, _ = tensor_lists(k.model(2))
        n1, n2 = np.array([float(t.nbytes) for t in ts]), np.array([float(t.nbytes) for t in two])
        c, x = 2 * n1 - n2, n2 - n1
    return Units(c, x, np.array([t.count for t in ts], np.int64), np.array([t.rep for t in ts], bool), member)


class Stack(NamedTuple):
    """The distinct activation models of a set of workloads at every micro batch, padded to one width T
    (a padding tensor has 0 bytes and belongs to no list)."""

    nbytes: np.ndarray  # (R, K, T) float64: one tensor's bytes on one tensor-parallel rank
    count: np.ndarray  # (R, K, T) int64
    member: np.ndarray  # (R, K, T, F) int64
    rows: np.ndarray  # (B,) the model of each workload
    full: np.ndarray  # (R,) bool: full checkpointing (a layer keeps its input)


def stack(spec: ModelSpec, bases: list[Workload], mbs: np.ndarray) -> Stack:
    keys: dict[tuple[ActsKey, int, bool], int] = {}
    rows = []
    for w in bases:  # the sharding is applied per model: tp and sp join the key here
        rows.append(keys.setdefault((ActsKey.of(spec, w), w.tp, w.sp), len(keys)))
    per_model = [_at_micro_batches(k, mbs) for k, _, _ in keys]
    divs = [_tp_divisor(k, tp, sp) for k, tp, sp in keys]
    R, K = len(per_model), len(mbs)
    T = max(max((u.count.shape[-1] for u in m), default=0) for m in per_model)
    nbytes, count = np.zeros((R, K, T)), np.zeros((R, K, T), np.int64)
    member = np.zeros((R, K, T, len(LISTS)), np.int64)
    for r, m in enumerate(per_model):
        if len(m) == 1:  # the affine form: every micro batch at once
            u = m[0]
            n = u.count.shape[-1]
            nbytes[r, :, :n] = (u.c[None, :] + mbs[:, None] * u.x[None, :]) / divs[r]
            count[r, :, :n], member[r, :, :n] = u.count, u.member
            continue
        for k, u in enumerate(m):
            n = u.count.shape[-1]
            nbytes[r, k, :n] = (u.c + mbs[k] * u.x) / divs[r]
            count[r, k, :n], member[r, k, :n] = u.count, u.member
    return Stack(nbytes, count, member, np.asarray(rows), np.array([k.grad_ckpt == "full" for k, _, _ in keys]))


def _at_micro_batches(k: ActsKey, mbs: np.ndarray) -> list[Units]:
    """One model's units: the affine form (one entry for every micro batch), or the model built at each
    micro batch (memplan's kernels)."""
    return [units(k)] if k.affine else [units(k._replace(mb=int(mb))) for mb in mbs]


def _tp_divisor(k: ActsKey, tp: int, sp: bool) -> np.ndarray | int:
    """One tensor-parallel rank's share (activations.shard): heads, the MLP intermediate and the
    vocabulary are split tp ways; the residual side too under sequence parallelism. Kernel rows run
    without TP (a constraint), so their tensors' order never matters here."""
    return 1 if tp == 1 else np.where(units(k).rep & (not sp), 1, tp)
