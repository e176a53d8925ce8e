"""Reserved memory from the estimator's own allocations, in order: the tensors the estimate counts (each parameter,
each layer's saved activations and autocast copies, the loss's and each layer's backward transients, gradients,
optimizer states and temporaries) allocated and freed in the order a training step makes them, replayed through
the caching-allocator simulation (estimator/allocator.py) in both allocator modes (docs/estimator.md). Where the
activation model has a sequence (ActivationModel.sequences: a traced model's windows and block forward, an analytic
model's eager attention core) its storages are made and freed in that order, the saved tensors born at their markers.

For one GPU holding a whole replica (no TP / PP / ZeRO / FSDP, not QLoRA): the estimate of one configuration and
the plans suggest shows; the search ranks with the segment arithmetic of meters.py. Two optimizer steps (the
first creates the optimizer states) of at most two micro batches each: the allocator's state repeats after that.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple, Protocol, Sequence

from memplan.estimator.activation_arrays import ActsKey
from memplan.estimator.activations import (ActivationModel, LayerKind, Tensors, TensorKind, expert_loop,
                                           inference_eager_core, inference_working_set, is_core, layer_kinds,
                                           mlp_kinds)
from memplan.estimator.allocator import simulate
from memplan.estimator.finetune import (Tuning, cast_kept, element_bytes, head_stack, in_decoder,
                                       records_frozen_blocks, stack_blocks, stored_tensors, tied_embedding,
                                       trained_blocks, tuned_params, under)
from memplan.estimator.parallel import tied_head
from memplan.estimator.rules import FP32, HALF, OPTIMIZERS, PRECISIONS, Precision, optimizer_state_bytes
from memplan.estimator.states import LINEAR_CATEGORIES, paged, per_tensor_temps
from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.inputs.trace import SAVED
from memplan.inputs.workload import Workload

STEPS = 2
MICRO_BATCHES = 2
# the parameter categories of a block's MLP: their weights' autocast casts are made as the MLP starts, their
# gradients in the MLP's backward (_Step.mlp_side)
MLP_SIDE = ("mlp", "experts", "router")


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

    def events(self) -> list[tuple[int, int]]:
        """The step's allocations in order (a serving step's key, serving_timeline.ServingKey, has its own)."""
        events = Events()
        _Step(self, events).run()
        return events.events


def replayable(w: Workload) -> bool:
    """The configurations the replay covers: training one whole replica on one GPU, QLoRA aside (its
    dequantisation transients are not in the activation lists)."""
    return (w.task == "train" and w.world == 1 and w.zero == 0 and w.fsdp == "none" and w.offload == "none"
            and w.method != "qlora")


class StepKey(Protocol):
    """A replay's frozen key: a training step's (ReplayKey) or a serving step's (serving_timeline.ServingKey)."""

    def events(self) -> list[tuple[int, int]]: ...


class Replayed(NamedTuple):
    peak_allocated: int  # tensor bytes, workspace aside
    reserved: int  # default allocator, workspace aside
    reserved_expandable: int


@lru_cache(maxsize=64)
def replay(k: StepKey) -> Replayed:
    """Peak allocated and reserved of the replayed step in both allocator modes (the step's allocations made
    once, then simulated under each mode)."""
    events = k.events()
    default, expandable = simulate(events, False), simulate(events, True)
    return Replayed(default.peak_allocated, default.peak_reserved, expandable.peak_reserved)


class Capped(NamedTuple):
    """A replay held to a device's capacity: the reserved bytes the allocator may hold (a frozen cache key)."""

    key: StepKey
    capacity: int


@lru_cache(maxsize=64)
def replay_within(c: Capped) -> int | None:
    """Peak reserved of the replayed step under the default allocator held to `c.capacity` bytes, which releases
    its cached segments when a cudaMalloc would pass it (allocator.CachingAllocator); None: it runs out even so."""
    s = simulate(c.key.events(), False, c.capacity)
    return None if s.oom else s.peak_reserved


class Events:
    """A step's allocations in order as allocator.simulate reads them: (key, bytes) a malloc, (key, -1) a free;
    integer keys handed out in order."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.n = 0

    def alloc(self, nbytes: float) -> int:
        self.n += 1
        self.events.append((self.n, int(nbytes)))
        return self.n

    def free(self, keys: list[int]) -> None:
        self.events.extend((key, -1) for key in keys)

    def play(self, seq, on_marker=None) -> dict[int, int]:
        """A sequence of storages in order: (n >= 0, bytes) makes storage n, (~n, 0) frees it, (SAVED - k, 0) is a
        marker handed to `on_marker(k)` (traced sequences: where a saved tensor is born). Returns the storages left
        alive, n -> key."""
        live: dict[int, int] = {}
        for n, nbytes in seq:
            if n >= 0:
                live[n] = self.alloc(nbytes)
            elif n <= SAVED:
                if on_marker is not None:
                    on_marker(SAVED - n)
            elif ~n in live:
                self.free([live.pop(~n)])
        return live


# A block's forward without autograd, moment by moment: the serving replay's prefill and decode steps
# (serving_timeline.py) and full checkpointing's first forward (_Step.forward) walk it. The moments of a block, in
# the order its forward reaches them (its first norm, the attention's first projection, RoPE, eager's scores before
# their mask, the attention core, the second norm, then the MLP); their live tensors are
# activations.inference_working_set's.
MOMENTS = ("norm", "projection", "rotary", "scores", "attention", "mlp norm", "mlp", "shared experts",
           "shared down")


def own_sizes(moment: list[Tensors], around: list[Tensors], stream: int) -> list[int]:
    """A block's own tensors at a moment, as sizes: the moment's set less what every layer reads (its first
    entries) and two residual-stream tensors (the embedding output and the block's input, held across blocks)."""
    sizes = [int(t.nbytes) for t in moment[len(around):] for _ in range(t.count)]
    for _ in range(2):
        if stream in sizes:
            sizes.remove(stream)
    return sizes


def reach(sim: Events, live: list[tuple[int, int]], target: list[int], between=None) -> list[tuple[int, int]]:
    """From the live (bytes, key) tensors to a moment's sizes: those of a size it holds stay, the others are freed,
    then (after `between`, when given) the missing ones are made, in the moment's list order."""
    want = list(target)
    kept, gone = [], []
    for nbytes, key in live:
        if nbytes in want:
            want.remove(nbytes)
            kept.append((nbytes, key))
        else:
            gone.append(key)
    sim.free(gone)
    if between is not None:
        between()
    return kept + [(n, sim.alloc(n)) for n in want]


def walk_no_grad_block(sim: Events, ws: dict[str, list[Tensors]], core: list[tuple[int, int]], stream: int,
                       before=None, kv_at: tuple[str, bool] | None = None, kv=None) -> list[tuple[int, int]]:
    """One block's forward without autograd through MOMENTS; returns its (bytes, key) tensors alive at its end (the
    caller makes the block's output, then frees them). Where eager's core has an order (core:
    activations.inference_eager_core), the attention moment's other tensors are reached first and the core runs in
    that order, leaving the probabilities the layer keeps. before(moment): called as a moment starts (the serving
    replay's autocast casts); kv: the cache update, at kv_at (the moment, True: between its frees and its makes;
    False: after it)."""
    local: list[tuple[int, int]] = []
    for moment in MOMENTS:
        if moment not in ws:
            continue
        if before is not None:
            before(moment)
        ordered = bool(core) and moment == "attention"
        target = [t for t in ws[moment] if not (ordered and is_core(t))]
        local = reach(sim, local, own_sizes(target, ws["around"], stream), kv if kv_at == (moment, True) else None)
        if ordered:
            ((slot, key),) = sim.play(core).items()
            local.append((dict(op for op in core if op[0] >= 0)[slot], key))
        if kv_at == (moment, False):
            kv()
    return local


class _Block(NamedTuple):
    """One block of the stack as the replay runs it."""

    saved: list[Tensors]  # what autograd keeps (a frozen block's list under freeze; empty when not recorded)
    groups: list[tuple[int, int]]  # (group index, tensors of it in this block)
    recorded: bool  # autograd records it: it has a backward
    am: ActivationModel  # its layer's own lists (ActsKey.layer_models), else the mean layer's


def per_mlp_kind(spec: ModelSpec, kinds: Sequence[LayerKind | None], make: Callable) -> list:
    """make(kind) for each of `kinds`, made once per MLP kind: a layer's no-grad moments read nothing else of its
    kind (activations.inference_working_set: mlp_kinds), so Llama 4's local and global MoE layers share theirs."""
    made: dict[tuple[bool, ...], object] = {}
    for kind in kinds:
        if (mlps := mlp_kinds(spec, kind)) not in made:
            made[mlps] = make(kind)
    return [made[mlp_kinds(spec, kind)] for kind in kinds]


def block_groups(spec: ModelSpec, groups: Sequence[ParamGroup],
                 narrowed: Callable[[ParamGroup, range], range] | None = None) -> list[list[tuple[int, int]]]:
    """Each block's parameter groups, as (index in `groups`, tensors of it in the block), encoder (or decoder-only)
    blocks first; groups outside the blocks (embeddings, head, final norms) are in none. narrowed(g, stack): the
    blocks of g's stack that may hold it (freeze's trained or frozen ones), else the whole stack; of those, the
    ones that do (holders)."""
    enc, dec = spec.num_layers, spec.num_decoder_layers
    per: list[list[tuple[int, int]]] = [[] for _ in range(enc + dec)]
    for i, g in enumerate(groups):
        if "*" not in g.module:
            continue
        stack = range(enc, enc + dec) if in_decoder(spec, g.module) else range(enc)
        for b, n in spread(g.count, holders(g, stack, narrowed(g, stack) if narrowed else stack)).items():
            per[b].append((i, n))
    return per


def holders(g: ParamGroup, stack: range, blocks: range | list[int]) -> list[int]:
    """The blocks among `blocks` (of `stack`) that hold group g (ParamGroup.layers: a MoE model's experts, its dense
    layers' MLP, T5's relative_attention_bias; (): all of them)."""
    held = [b for b in blocks if b - stack.start in g.holding(len(stack))]
    assert held or not blocks, f"{g.module}: none of blocks {list(blocks)} holds it"  # tuned_params splits by layers
    return held


def module_order(groups: Sequence[ParamGroup], blocks: list[list[tuple[int, int]]]) -> list[tuple[ParamGroup, int]]:
    """The parameter tensors in model.parameters() order, as (group, tensors): the embeddings, each block's (`blocks`:
    block_groups' index into `groups` and tensors of each), then the rest (final norms, poolers) and the head last.
    The serving replay's weights are loaded in it, the optimizer makes its states in it."""
    outside = [g for g in groups if "*" not in g.module]
    first = [(g, g.count) for g in outside if g.category == "embeddings"]
    last = sorted(((g, g.count) for g in outside if g.category != "embeddings"), key=lambda x: x[0].category == "head")
    return first + [(groups[i], n) for b in blocks for i, n in b] + last


def spread(count: int, blocks: range | list[int]) -> dict[int, int]:
    """`count` tensors of a group over `blocks`, as evenly as they go."""
    share = [count // len(blocks) + (j < count % len(blocks)) for j in range(len(blocks))]
    return {b: n for b, n in zip(blocks, share) if n}


def block_table(spec: ModelSpec, t: Tuning, groups: tuple[ParamGroup, ...], mean: ActivationModel,
                layers: tuple[ActivationModel, ...] = ()) -> list[_Block]:
    """Each block's saved list and parameter tensors, encoder (or decoder-only) blocks first. freeze trains the
    last K blocks of the stack next to the head (finetune.tuned_params splits its groups so); the frozen blocks
    before them are recorded only when a trained embedding makes their input require a gradient. layers: each
    block's own model where the blocks differ (ActsKey.layer_models), else every block takes the mean one."""
    enc, dec = spec.num_layers, spec.num_decoder_layers
    trained = trained_blocks(spec, t) if t.method == "freeze" else stack_blocks(spec)
    head = range(enc, enc + dec) if dec else range(enc)
    trained_range = range(head.stop - trained, head.stop)

    def frozen_split(g: ParamGroup, stack: range) -> range:
        if t.method == "freeze" and head_stack(spec, g.module) and not under(g.module, t.modules_to_save):
            return trained_range if g.trainable else range(head.start, trained_range.start)
        return stack

    per = block_groups(spec, groups, frozen_split)
    frozen_recorded = records_frozen_blocks(spec, t)
    out = []
    for b in range(enc + dec):
        decoder = b >= enc
        am = layers[b] if b < len(layers) else mean
        # freeze: a block of the stack next to the head before the trained ones, or an encoder-decoder's encoder
        frozen = t.method == "freeze" and (b not in trained_range if b in head else True)
        if not frozen:
            saved = am.decoder_layer if decoder and am.decoder_layer else am.layer
        elif frozen_recorded:
            saved = am.frozen_decoder_layer if decoder and am.frozen_decoder_layer else am.frozen_layer
        else:
            saved = []
        out.append(_Block(saved, per[b], not frozen or frozen_recorded, am))
    return out


class _Step:
    """The order of one training step's allocations (the estimator's lists; activations.py names each)."""

    def __init__(self, k: ReplayKey, sim: Events) -> None:
        self.k, self.sim = k, sim
        self.spec = k.spec
        self.prec: Precision = PRECISIONS[k.precision]  # one replica: no half model (replayable)
        self.rule = OPTIMIZERS[k.optim]
        self.groups = tuned_params(k.spec, k.tuning)
        self.am: ActivationModel = k.acts.model(k.micro_batch)
        # MoE models with dense layers, Gemma 3's and Llama 4's local and global layers, every traced block: each its
        # own tensors (the mean layer's averaged sizes packed into fewer segments: Llama 4 small bf16-pure SDPA -9.4 %
        # under the allocator simulation of its trace, benchmarks/accuracy/results/accuracy.md)
        layers = k.acts.layer_models(k.micro_batch)
        self.blocks = block_table(k.spec, k.tuning, self.groups, self.am, layers)
        # a traced model's first blocks make their own storages (every traced block has its model: layer_models), not
        # the step's stand-in for them
        self.embed = [t for t in self.am.embed if t.kind is not TensorKind.FIRST_BLOCK]
        # the embedding matrix a tied LM head uses (None: no tied head)
        self.tied = next((i for i, g in enumerate(self.groups) if tied_embedding(k.spec, g)), None) \
            if tied_head(k.spec) else None
        self.grads: dict[int, list[int]] = {}  # a group's index -> its gradients' keys
        # the vocabulary matrix's gradient comes in parts when more than one module reads it: a tied head, and both
        # stacks of an encoder-decoder (T5's and BART's shared embedding): matrix_part
        self.reads = (self.tied is not None) + (2 if k.spec.arch == "encoder-decoder" else 1)
        vocab = [i for i, g in enumerate(self.groups)
                 if g.category == "embeddings" and g.shape[:1] == (k.spec.vocab_size,)]
        self.shared = self.tied if self.tied is not None else next(iter(vocab), None)
        if self.reads < 2 or self.shared is None or not self.groups[self.shared].trainable:
            self.shared = None
        self.part: int | None = None  # the matrix's gradient summed so far, waiting in autograd's input buffer
        self.kv: list[int] = []  # the forward's KV cache (forward_cache, unrecorded_cache), freed after the loss
        self.parts = 0
        # full checkpointing's first forward of each block, by its layer kind (activations.layer_kinds)
        kinds = layer_kinds(k.spec) or (None,) * len(self.blocks)
        self.walks = per_mlp_kind(k.spec, kinds, self.no_grad_walk) if k.grad_ckpt == "full" else [None] * len(kinds)

    def no_grad_walk(self, kind: LayerKind | None) -> tuple | None:
        """Full checkpointing's first forward of a decoder block saves nothing, so its tensors live and die as a
        prefill's do: walk_no_grad_block's arguments (inference_working_set's moments at the step's widths, eager's
        ordered core, the residual stream's bytes) for a layer of `kind` (None: a model whose layers are alike).
        None where the block's list in order stands in: a traced
        model's sequence (traced under checkpointing), encoders, adapters and frozen blocks, memplan's kernels.
        The list kept every tensor of the block to its end: off the suite (accuracy-offsuite.json), GPT-2 fp32
        eager b3 s1024 was -9.95 % and OPT-350M -8.6 %, and Qwen3-small bf16-pure eager +7.4 % in it."""
        a = self.k.acts
        if self.traced or self.spec.arch != "decoder" or self.k.tuning.method != "full" or a.kernels or a.tiled_mlp:
            return None
        prec = PRECISIONS[a.precision]
        p, r, attn = (HALF if prec.autocast else prec.act), prec.residual, "eager" if a.eager else "sdpa"
        b, s = self.k.micro_batch, a.seq
        ws = inference_working_set(self.spec, b, s, p, r, attn, full_logits=True, kind=kind)
        return ws, inference_eager_core(self.spec, b, s, p, r, attn, 0), r * self.spec.hidden_size * b * s

    def tensors(self, ts: list[Tensors]) -> list[int]:
        return [self.sim.alloc(t.nbytes) for t in ts for _ in range(t.count)]

    def casts(self, groups: list[tuple[int, int]], kept: bool = True) -> list[int]:
        """Autocast's half copies of the fp32 linear weights among `groups` (group index, tensors): those it
        keeps (a weight that requires a gradient, or a recorded block's, finetune.cast_kept), or with
        kept=False the others, each freed as its matmul ends."""
        keys = []
        for i, n in groups:
            g = self.groups[i]
            if self.autocast_cast(g) and cast_kept(self.spec, self.k.tuning, g) == kept:
                # the expert loop casts each expert's slice of a fused weight (W[e], a view autocast does not
                # cache): E copies, saved by their matmuls (activations.expert_loop)
                pieces = g.shape[0] if self.looped(g) else 1
                keys += [self.sim.alloc(g.numel * HALF / pieces) for _ in range(n * pieces)]
        if not kept:
            self.sim.free(keys)
            return []
        return keys

    def autocast_cast(self, g: ParamGroup) -> bool:
        """Autocast runs g's matmuls on a half copy of it: an fp32 linear's weight (or bias) under autocast."""
        return self.prec.autocast and g.category in LINEAR_CATEGORIES and element_bytes(g, self.prec.param) == FP32

    def tied_cast(self) -> list[int]:
        """The tied head's matmul casts the fp32 embedding matrix (states.autocast_copies counts it too)."""
        g = None if self.tied is None else self.groups[self.tied]
        if not (self.prec.autocast and g is not None and element_bytes(g, self.prec.param) == FP32):
            return []
        return [self.sim.alloc(g.numel * HALF)]

    def grad(self, i: int, n: int) -> None:
        """`n` of group i's gradients, each its op's own (in the gradients' width), accumulated (`accumulate`)."""
        g = self.groups[i]
        for _ in range(n if g.trainable else 0):
            self.accumulate(i, self.sim.alloc(g.numel * element_bytes(g, self.prec.grad)))

    def weight_grads(self, groups: list[tuple[int, int]], between: Callable[[], None] | None = None) -> None:
        """The gradients of `groups` (group index, tensors) as a layer's backward makes them, each accumulated
        (`accumulate`). A weight autocast casts gets its matmul's half gradient, then AccumulateGrad's fp32 copy,
        the half one freed; with `between` (the frees of the phase's transients) every half one is made, then
        `between` runs, then the copies (traced, roberta-base fp16 eager: intermediate.dense's 4.5 MiB mm beside the
        MLP's 12 MiB gelu_backward, its 9 MiB _to_copy once that dies; output.dense's, made earlier beside the
        12 MiB gradient of its input, are made here with it). The fused expert weights the expert loop slices are
        summed over the experts together (`looped_grads`); any other gradient is the matmul's own, made where it
        runs."""
        halves: list[tuple[int, int]] = []
        looped = [(i, n) for i, n in groups if self.groups[i].trainable and self.looped(self.groups[i])]
        for i, total in self.looped_grads(looped):
            self.accumulate(i, total)
        for i, n in groups:
            g = self.groups[i]
            for _ in range(n if g.trainable and not self.looped(g) else 0):
                if not self.autocast_cast(g):
                    self.grad(i, 1)
                    continue
                halves.append((i, self.sim.alloc(g.numel * HALF)))
                if between is None:
                    self.copy_grad(*halves.pop())
        if between is not None:
            between()
        for i, half in halves:
            self.copy_grad(i, half)

    def copy_grad(self, i: int, half: int) -> None:
        """AccumulateGrad's fp32 copy of a half gradient of group i (accumulated); the half one dies."""
        g = self.groups[i]
        copy = self.sim.alloc(g.numel * element_bytes(g, self.prec.grad))
        self.sim.free([half])
        self.accumulate(i, copy)

    def accumulate(self, i: int, key: int) -> None:
        """A new gradient of one of group i's tensors: it becomes that tensor's .grad where none exists yet
        (AccumulateGrad keeps it), else it is added into .grad in place and freed (a later micro batch; a later
        step under zero_grad 'zeros')."""
        have = self.grads.setdefault(i, [])
        if len(have) < self.groups[i].count:
            have.append(key)
        else:
            self.sim.free([key])

    def looped(self, g: ParamGroup) -> bool:
        """A fused expert weight the expert loop runs slice by slice (activations.expert_loop)."""
        return g.category == "experts" and len(g.shape) == 3 and expert_loop(self.spec, self.prec)

    def looped_grads(self, looped: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The gradients of fused expert weights the expert loop slices (group index, tensors: one MoE layer's),
        summed over the experts; returns (group index, the sum's key) of each. The loop runs expert by expert, each
        expert's weights in backward's order (down_proj's, then the fused gate_up_proj's): each
        slice W[e] gets its matmul's gradient (under autocast the half one, then its fp32 copy), select_backward
        places it in a zero tensor of the whole weight, and autograd's input buffer adds that to the weight's
        running sum out of place; the last sums are the gradients (traced, gpt-oss-small bf16: per expert mm
        0.25 MiB, _to_copy 0.5 MiB, select_backward 4 MiB, add 4 MiB for down_proj, then the same at 8 MiB for
        gate_up_proj). Every expert is taken to have rows (at the step's batches they do)."""
        # down_proj first: the smaller where gate and up are fused (its layout, in x out or out x in, differs by family)
        weights = sorted((i for i, n in looped for _ in range(n)), key=lambda i: self.groups[i].numel)
        totals: dict[int, int] = {}  # position in `weights` -> its running sum
        for _ in range(max((self.groups[i].shape[0] for i in weights), default=0)):
            for k, i in enumerate(weights):
                g = self.groups[i]
                experts, width = g.shape[0], element_bytes(g, self.prec.grad)
                half = [self.sim.alloc(g.numel / experts * HALF)] if self.autocast_cast(g) else []
                part = self.sim.alloc(g.numel / experts * width)
                self.sim.free(half)
                placed = self.sim.alloc(g.numel * width)
                self.sim.free([part])
                if k in totals:
                    summed = self.sim.alloc(g.numel * width)
                    self.sim.free([totals[k], placed])
                    placed = summed
                totals[k] = placed
        return [(i, totals[k]) for k, i in enumerate(weights)]

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

    def ordered(self, name: str, saved: list[Tensors], marked: bool = True, am: ActivationModel | None = None,
                before: dict | None = None) -> dict[int, list[int]]:
        """`saved` made in the order of sequence `name` (ActivationModel.sequences; marked: its markers name these
        tensors): the unmarked ones before the first marked first, the sequence's own storages made and freed as it
        goes, the unmarked rest after it; without a sequence, `saved` in list order; am: the block's model, else the
        step's; before: k -> a call made just before entry k (at the end if none is). Each entry's keys by index."""
        seq = (am or self.am).sequences.get(name, [])
        marks = {SAVED - n for n, _ in seq if n <= SAVED}
        if not marked or not marks <= set(range(len(saved))):
            seq, marks = [(n, b) for n, b in seq if n > SAVED], set()
        first_marked = min(marks, default=len(saved))
        calls = dict(before or {})
        keys: dict[int, list[int]] = {}

        def born(k: int) -> None:
            if k in calls:
                calls.pop(k)()
            keys[k] = self.tensors([saved[k]])

        for k in range(min(first_marked, len(saved))):
            born(k)
        self.sim.free(list(self.sim.play(seq, born).values()))
        for k in range(first_marked + 1, len(saved)):
            if k not in marks:
                born(k)
        for call in calls.values():
            call()
        return keys

    def forward(self, block: _Block, full: bool, cached: list[int], walk: tuple | None) -> list[int]:
        """One block's forward; returns what it holds into backward. full: the no-grad forward makes the
        block's tensors and drops them, keeping its input, and autocast caches its casts until the loss. The MLP's
        weights are cast as the MLP starts (ActivationModel.mlp_start) where the block's list is the layer's,
        the others' at the block's start."""
        self.casts(block.groups, kept=False)
        layer_list = block.saved is block.am.layer  # the sequence's markers name the layer list's tensors
        if not block.recorded:
            casts = self.casts(block.groups)
            self.kv += self.tensors(block.am.unrecorded_cache)
            self.sim.free(self.tensors(block.am.layer) + casts)  # nothing requires a gradient yet
            return []
        if full:  # a traced model's sequence is the no-grad forward itself (traced under checkpointing)
            casts = self.casts(block.groups)
            if walk is not None:  # a decoder block's no-grad forward, as a prefill runs it (no_grad_walk)
                local = walk_no_grad_block(self.sim, *walk)
                cached += casts
                out = self.tensors(self.am.layer_input)
                self.sim.free([key for _, key in local])
                return out
            cached += casts
            self.sim.free(_flat(self.ordered("layer_forward", [] if self.traced else block.saved, layer_list,
                                             block.am)))
            return self.tensors(self.am.layer_input)
        # a grouped matmul's experts are cast as it runs; the expert loop's slices (experts_start 0) with the MLP;
        # where the block's list is not the layer's (a frozen block's), all at the block's start
        at = {c: block.am.mlp_start for c in MLP_SIDE} | {"experts": block.am.experts_start or block.am.mlp_start}
        later: dict[int, list[tuple[int, int]]] = {}  # entry -> the groups cast just before it
        for i, n in block.groups:
            if k := (at.get(self.groups[i].category, 0) if layer_list else 0):
                later.setdefault(k, []).append((i, n))
        delayed = {g for gs in later.values() for g in gs}
        casts = self.casts([g for g in block.groups if g not in delayed])
        before = {k: (lambda gs=gs: casts.extend(self.casts(gs))) for k, gs in later.items()}
        if block.am.forward_cache:  # the cache update, after RoPE and before repeat_kv's copies (the core's first)
            core = next((k for k, t in enumerate(block.saved) if is_core(t)), len(block.saved))
            made = before.get(core, lambda: None)
            before[core] = lambda: (made(), self.kv.extend(self.tensors(block.am.forward_cache)))
        # a traced block's forward is its own traced block's, whose markers name its list, a decoder's too
        marked = layer_list or (self.traced and block.saved is block.am.decoder_layer)
        return casts + _flat(self.ordered("layer_forward", block.saved, marked, block.am, before))

    @property
    def traced(self) -> bool:
        """A traced model: its windows are sequences too (an analytic one has at most its block's forward)."""
        return "layer_backward" in self.am.sequences

    def micro_batch(self) -> None:
        full = self.k.grad_ckpt == "full"
        embed = self.tensors(self.embed)
        masks = self.tensors(self.am.forward_masks)
        cached: list[int] = []
        held = [self.forward(b, full, cached, walk) for b, walk in zip(self.blocks, self.walks)]
        self.sim.free(masks)
        self.loss(cached)
        first_decoder = self.spec.num_layers if self.spec.arch == "encoder-decoder" else None
        # full: each block's forward again; selective: its core
        for n, (b, keys) in reversed(list(enumerate(zip(self.blocks, held)))):
            again = {"full": b.saved, "selective": b.am.layer_core, "none": []}[self.k.grad_ckpt]
            if b.recorded:
                self.layer_backward(b, keys, again)
            if n == first_decoder and self.shared is not None:  # the decoder's embedding, before the encoder
                self.matrix_part()
        if self.shared is not None:
            self.matrix_part()
        for i, g in enumerate(self.groups):  # the embeddings' and the other groups outside the blocks and the loss
            if "*" not in g.module and not (g.category == "head" or i in (self.tied, self.shared)):
                self.grad(i, g.count)
        self.sim.free(embed)

    def loss(self, cached: list[int]) -> None:
        """The head and the loss, forward and backward, up to the head's gradient."""
        head = self.casts([(i, g.count) for i, g in enumerate(self.groups) if g.category == "head"])
        head += self.tied_cast()
        autocast = bool(head)  # the head's weights are cast: its matmul's weight gradients are half
        saved = self.am.head_saved
        lsm_at = [k for k, t in enumerate(saved) if t.kind == TensorKind.LOG_SOFTMAX]
        if self.traced:  # the window's own order, the head's saved storages born where their markers are
            keys = self.ordered("loss_forward", saved)
        else:  # the logits (and their fp32 copy) before the log-softmax output the loss saves, then freed
            keys = {k: self.tensors([t]) for k, t in enumerate(saved) if k not in lsm_at}
            logits = self.tensors(self.am.loss_forward)
            keys |= {k: self.tensors([saved[k]]) for k in lsm_at}
            self.sim.free(logits)
        lsm = [key for k in lsm_at for key in keys.pop(k)]
        head += _flat(keys)
        self.sim.free(cached)  # autocast's exit clears its cache; backward recomputes the casts it needs
        self.sim.free(self.kv)  # the model's output, which holds the KV cache, dies once the loss is taken
        self.kv = []
        # the loss's backward transients peak beside the log-softmax output its backward reads, before the head's
        # gradient exists (the estimate's backward-start moment; traced: Llama-3.2-1B under freeze peaks there, the
        # tied matrix's fp32 gradient not yet made)
        cast: list[int] = []
        if self.traced:
            self.ordered("loss_backward", [])
            self.sim.free(lsm)
        else:
            grads = self.tensors(self.am.loss_backward)
            self.sim.free(lsm + grads[:1])
            # then dL/dlogits is cast back to the logits' width where the loss up-cast them (activations.py's loss
            # lists: the logits, then their fp32 copy) for the head's matmul backward
            cast = self.tensors(self.am.loss_forward[:1]) if len(self.am.loss_forward) > 1 else []
            self.sim.free(grads[1:])
        # the head's weight gradients: under autocast the matmul's half gradient first, then dL/dlogits and the
        # weights' casts die, then AccumulateGrad's fp32 copy is made and the half one dies (traced: qwen3-small
        # bf16: mm, the cast dL/dlogits and the head's cast freed, _to_copy, the mm's freed); a half model's
        # matmul makes the gradient itself, before those die
        trained = [(i, g) for i, g in enumerate(self.groups)
                   if (g.category == "head" or i == self.tied) and g.trainable]
        halves = [self.sim.alloc(g.numel * HALF) for _, g in trained for _ in range(g.count)] if autocast else []
        if halves:
            self.sim.free(cast + head)
        for i, g in trained:
            if i == self.shared:  # the tied matrix's part from the head
                self.matrix_part()
                continue
            self.grad(i, g.count)
        self.sim.free(halves if halves else cast + head)

    def matrix_part(self) -> None:
        """One more part of the shared vocabulary matrix's gradient (the head's, the decoder's embedding's, the
        encoder's or only embedding's, in the order backward makes them). The first waits in autograd's input buffer;
        each later one is summed with it out of place, both addends freed; the last sum becomes .grad, or is added
        into an existing one in place and freed. Traced: cohere2-small and qwen3-small (the head's part,
        embedding_dense_backward, add, the part and the dense gradient freed), bart-small (a second sum after the
        decoder's embedding, before the encoder's blocks). The replay had kept the head's part as .grad and the
        optimizer states went behind it: qwen3-small bf16-pure -12.5 % under expandable segments (with the traced
        window fix, cohere2-small b3 s96 +15.4 % under the default allocator)."""
        g = self.groups[self.shared]
        v = g.numel * element_bytes(g, self.prec.grad)  # the matrix's own width (OPT's 512-wide embedding)
        new = self.sim.alloc(v)
        if self.part is not None:
            total = self.sim.alloc(v)
            self.sim.free([self.part, new])
            new = total
        self.part, self.parts = new, self.parts + 1
        if self.parts < self.reads:
            return
        if self.grads.get(self.shared):
            self.sim.free([new])
        else:
            self.grads[self.shared] = [new]
        self.part, self.parts = None, 0

    def layer_backward(self, block: _Block, held: list[int], recomputed: list[Tensors]) -> None:
        """One block's backward after recomputing `recomputed` (full checkpointing: its saved list and casts; a
        traced model's sequence holds its recompute, traced under checkpointing)."""
        full = self.k.grad_ckpt == "full" and not self.traced
        # the recomputed tensors (selective: the core's, in eager order, activations._selective_core_sequence), then
        # full recompute's casts: the order 3ec7f04 made, which the traced steps' simulation agrees with better than
        # the casts first (GPT-OSS-small full recompute -22.5 -> -13.5 %, benchmarks/accuracy/results/accuracy.md)
        rebuilt = _flat(self.ordered("layer_core", [] if self.traced else recomputed, am=block.am))
        again = (self.casts(block.groups) if full else []) + rebuilt
        am = block.am
        if self.traced:  # its sequence holds the matmuls' half gradients of cast weights (transients to the trace)
            self.ordered("layer_backward", [], am=am)
            for i, n in block.groups:
                self.grad(i, n)
        elif block.saved is am.layer or block.saved is am.decoder_layer:
            # autograd runs the MLP's backward before the attention's: the MLP's weight gradients among its
            # transients, then eager attention's transients, then the attention's and the norms' gradients (QLoRA's
            # dequantised weight is in layer_backward alone: the replay does not cover QLoRA, `replayable`)
            mlp, rest = self.mlp_side(block.groups)
            transients = self.tensors(am.mlp_backward)
            self.weight_grads(mlp, lambda: self.sim.free(transients))
            self.sim.free(self.tensors(am.attention_backward))
            self.weight_grads(rest)
        else:  # a frozen block autograd records: its backward's transients peak before any gradient
            self.sim.free(self.tensors(am.layer_backward))
            self.weight_grads(block.groups)
        self.sim.free(again + held)

    def mlp_side(self, groups: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """A block's groups as the MLP's (MLP_SIDE categories, and the LoRA adapters that follow them:
        finetune._with_adapters puts a linear's adapters right after it) and the rest."""
        mlp: list[tuple[int, int]] = []
        rest: list[tuple[int, int]] = []
        side = rest
        for i, n in groups:
            if self.groups[i].category != "adapter":
                side = mlp if self.groups[i].category in MLP_SIDE else rest
            side.append((i, n))
        return mlp, rest

    def trained_in_order(self) -> list[tuple[ParamGroup, int]]:
        """The trained parameter tensors as (group, tensors) in the optimizer's order (module_order)."""
        return [(g, n) for g, n in module_order(self.groups, [b.groups for b in self.blocks]) if g.trainable]

    def optimizer_step(self, first: bool) -> None:
        rule = self.rule
        trained = [g for g in self.groups if g.trainable]

        def states(g: ParamGroup, n: int) -> None:  # one tensor per state, as states.py packs them
            if paged(rule, g):  # CUDA managed memory, outside the caching allocator
                return
            size = optimizer_state_bytes(rule, g.shape, element_bytes(g, self.prec.param), self.k.momentum)
            per = max(rule.state_count(self.k.momentum), 1)
            for _ in range(n * per if size else 0):
                self.sim.alloc(size / per)

        def temps(g: ParamGroup, n: int) -> None:  # a Python loop: one tensor's temporaries at a time
            for _ in range(n if rule.per_tensor_temp else 0):
                made = [self.sim.alloc(g.numel * FP32) for _ in range(int(per_tensor_temps(rule, g, self.prec)))]
                self.sim.free(made)

        # the states made lazily as the loop reaches each parameter (bitsandbytes 0.50 Optimizer8bit.step's
        # init_state, Adafactor), each beside its update's temporaries (Adafactor's alone has them); torch's AdamW
        # makes a group's states first (_init_group), which without per-tensor temporaries is the same order
        for g, n in self.trained_in_order():
            if first:
                states(g, n)
            temps(g, n)
        if rule.foreach_temp:  # foreach: the whole group's at once
            self.sim.free([self.sim.alloc(g.numel * element_bytes(g, self.prec.param) * rule.foreach_temp)
                           for g in trained for _ in range(g.count)])
        if self.k.zero_grad == "set-to-none":
            for keys in self.grads.values():
                self.sim.free(keys)
            self.grads = {}


def _flat(keys: dict[int, list[int]]) -> list[int]:
    """The keys of `ordered`'s entries, in list order."""
    return [key for k in sorted(keys) for key in keys[k]]
