"""Reserved memory from the estimator's own allocations, in order: the tensors the estimate counts (each parameter,
each layer's saved activations and autocast copies, the loss's and each layer's backward transients, gradients,
optimizer states and temporaries) allocated and freed in the order a training step makes them, replayed through
the caching-allocator simulation (estimator/allocator.py) in both allocator modes (docs/estimator.md).

For one GPU holding a whole replica (no TP / PP / ZeRO / FSDP, not QLoRA): the estimate of one configuration and
the plans suggest shows; the search ranks with the segment arithmetic of meters.py. Two optimizer steps (the
first creates the optimizer states) of at most two micro batches each: the allocator's state repeats after that.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from memplan.estimator.activation_arrays import ActsKey
from memplan.estimator.activations import ActivationModel, Tensors
from memplan.estimator.allocator import CachingAllocator
from memplan.estimator.finetune import Tuning, element_bytes, stored_tensors, tied_embedding, tuned_params
from memplan.estimator.parallel import tied_head
from memplan.estimator.rules import FP32, HALF, OPTIMIZERS, PRECISIONS, Precision, optimizer_state_bytes
from memplan.estimator.states import LINEAR_CATEGORIES, paged
from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.inputs.workload import Workload

STEPS = 2
MICRO_BATCHES = 2


class ReplayKey(NamedTuple):
    """Everything the replay reads (a frozen, hashable cache key)."""

    spec: ModelSpec
    acts: ActsKey
    tuning: Tuning
    precision: str
    optim: str
    momentum: bool
    grad_ckpt: str
    micro_batch: int
    micro_batches: int
    zero_grad: str

    @classmethod
    def of(cls, spec: ModelSpec, w: Workload) -> "ReplayKey":
        return cls(spec, ActsKey.of(spec, w), Tuning.of(w), w.precision, w.optim, w.momentum > 0, w.grad_ckpt,
                   w.micro_batch, min(w.grad_accum, MICRO_BATCHES), w.zero_grad)


def replayable(w: Workload) -> bool:
    """The configurations the replay covers: training one whole replica on one GPU, QLoRA aside (its
    dequantisation transients are not in the activation lists)."""
    return (w.task == "train" and w.world == 1 and w.zero == 0 and w.fsdp == "none" and w.offload == "none"
            and w.method != "qlora")


class Replayed(NamedTuple):
    peak_allocated: int  # tensor bytes, workspace aside
    reserved: int  # default allocator, workspace aside
    reserved_expandable: int


@lru_cache(maxsize=64)
def replay(k: ReplayKey) -> Replayed:
    """Peak allocated and reserved of the replayed step in both allocator modes."""
    default, expandable = _Sim(False), _Sim(True)
    for sim in (default, expandable):
        _Step(k, sim).run()
    return Replayed(default.a.peak_allocated, default.a.peak_reserved, expandable.a.peak_reserved)


class _Sim:
    """One allocator simulation with integer keys handed out in order."""

    def __init__(self, expandable: bool) -> None:
        self.a = CachingAllocator(expandable)
        self.n = 0

    def alloc(self, nbytes: float) -> int:
        self.n += 1
        self.a.malloc(self.n, int(nbytes))
        return self.n

    def free(self, keys: list[int]) -> None:
        for key in keys:
            self.a.free(key)


class _Step:
    """The order of one training step's allocations (the estimator's lists; activations.py names each)."""

    def __init__(self, k: ReplayKey, sim: _Sim) -> None:
        self.k, self.sim = k, sim
        self.spec = k.spec
        self.prec: Precision = PRECISIONS[k.precision]  # one replica: no half model (replayable)
        self.rule = OPTIMIZERS[k.optim]
        self.groups = tuned_params(k.spec, k.tuning)
        self.am: ActivationModel = k.acts.model(k.micro_batch)
        L = max(k.spec.total_layers, 1)
        # a group whose count is a multiple of the layers belongs to them, count // L per layer
        self.per_layer = [(i, g, g.count // L) for i, g in enumerate(self.groups)
                          if g.count % L == 0 and g.category not in ("embeddings", "head")]
        # each layer's saved list: an encoder-decoder's decoder layers save their own (cross-attention)
        self.saved = [self.am.layer] * k.spec.num_layers + [self.am.decoder_layer or self.am.layer] * (
            k.spec.num_decoder_layers)
        self.layers = len(self.saved)
        self.grads: dict[int, list[int]] = {}  # a group's index -> its gradients' keys

    def tensors(self, ts: list[Tensors]) -> list[int]:
        return [self.sim.alloc(t.nbytes) for t in ts for _ in range(t.count)]

    def casts(self, groups: list[tuple[ParamGroup, int]] | None = None) -> list[int]:
        """Autocast's half copies of fp32 weights: one layer's linears, or `groups` (group, copies)."""
        if groups is None:
            groups = [(g, n) for _, g, n in self.per_layer if g.category in LINEAR_CATEGORIES]
        if not self.prec.autocast:
            return []
        return [self.sim.alloc(g.numel * HALF) for g, n in groups if element_bytes(g, self.prec.param) == FP32
                for _ in range(n)]

    def grad(self, i: int, n: int) -> None:
        """`n` more of group i's gradients, up to its count (AccumulateGrad makes each on first use)."""
        g = self.groups[i]
        have = self.grads.setdefault(i, [])
        while len(have) < g.count and n > 0:
            have.append(self.sim.alloc(g.numel * element_bytes(g, self.prec.grad)))
            n -= 1

    def run(self) -> None:
        for g in self.groups:
            for nbytes, count in stored_tensors(g, self.prec.param):
                for _ in range(count):
                    self.sim.alloc(nbytes)
        if self.spec.buffer_bytes:
            self.sim.alloc(self.spec.buffer_bytes)
        for step in range(STEPS):
            for _ in range(self.k.micro_batches):
                self.micro_batch()
            self.optimizer_step(first=step == 0)

    def micro_batch(self) -> None:
        full = self.k.grad_ckpt == "full"
        embed = self.tensors(self.am.embed)
        held, cached = [], []
        for saved in self.saved:
            casts = self.casts()
            if full:  # autocast caches the no-grad forward's casts too, until its region ends with the loss; the
                # no-grad forward makes the layer's tensors and drops them, keeping its input
                cached += casts
                casts = []
                self.sim.free(self.tensors(saved))
            held.append(casts + self.tensors(self.am.layer_input if full else saved))
        head = self.casts([(g, g.count) for g in self.groups if g.category == "head"])
        head += self.tensors(self.am.head_saved)
        self.sim.free(self.tensors(self.am.loss_forward))
        self.sim.free(cached)  # autocast's exit clears its cache; backward recomputes the casts it needs
        loss = self.tensors(self.am.loss_backward)
        for i, g in enumerate(self.groups):  # the head's gradient first (the tied embedding matrix's, when tied)
            if g.trainable and (g.category == "head" or tied_head(self.spec) and tied_embedding(self.spec, g)):
                self.grad(i, g.count)
        self.sim.free(loss + head)
        again = {"full": None, "selective": self.am.layer_core, "none": []}[self.k.grad_ckpt]
        for i in reversed(range(self.layers)):  # full: the layer's forward again; selective: its attention core
            self.layer_backward(held[i], self.saved[i] if again is None else again)
        if tied_head(self.spec):  # the embedding's dense gradient and its sum with the head's
            v = self.spec.vocab_size * self.spec.hidden_size * self.prec.grad
            self.sim.free([self.sim.alloc(v), self.sim.alloc(v)])
        for i, g in enumerate(self.groups):
            if g.trainable:
                self.grad(i, g.count)
        self.sim.free(embed)

    def layer_backward(self, held: list[int], recomputed: list[Tensors]) -> None:
        """One layer's backward after recomputing `recomputed` (full checkpointing: its saved list and casts)."""
        full = self.k.grad_ckpt == "full"
        again = (self.casts() if full else []) + self.tensors(recomputed)
        work = self.tensors(self.am.layer_backward)
        for i, g, n in self.per_layer:
            if g.trainable:
                self.grad(i, n)
        self.sim.free(work + again + held)

    def optimizer_step(self, first: bool) -> None:
        trained = [g for g in self.groups if g.trainable]
        rule = self.rule
        if first:  # the states, made lazily by the first step, one tensor per state
            for g in trained:
                if paged(rule, g):  # CUDA managed memory, outside the caching allocator
                    continue
                n = optimizer_state_bytes(rule, g.shape, element_bytes(g, self.prec.param), self.k.momentum)
                per = max(rule.state_count(self.k.momentum), 1)  # one tensor per state, as states.py packs them
                for _ in range(g.count * per if n else 0):
                    self.sim.alloc(n / per)
        if rule.per_tensor_temp:  # a Python loop: one tensor's temporaries at a time
            for g in trained:
                for _ in range(g.count):
                    self.sim.free([self.sim.alloc(g.numel * FP32) for _ in range(int(rule.per_tensor_temp))])
        if rule.foreach_temp:  # foreach: the whole group's at once
            self.sim.free([self.sim.alloc(g.numel * element_bytes(g, self.prec.param) * rule.foreach_temp)
                           for g in trained for _ in range(g.count)])
        if self.k.zero_grad == "set-to-none":
            for keys in self.grads.values():
                self.sim.free(keys)
            self.grads = {}
