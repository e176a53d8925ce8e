"""A serving step's allocations in order, for the caching-allocator replay (timeline.replay; docs/estimator.md,
"Inference"): what `memplan verify --task infer` runs (verify/infer.py serve: generate written out).

- the weights in module order (the embeddings, each block's, the final norm, the head), as they are loaded
  (model.parameters(): module registration order), at the bytes bitsandbytes stores where it converts them;
- the prompts' token ids;
- the prefill: the embedding output and what every layer reads (RoPE's tables, masks) before the blocks; in each
  block its live tensors moment by moment (activations.inference_working_set's, in timeline.MOMENTS' order: the step
  from one moment's set to the next frees what the next does not hold and makes what it adds; a decoder's eager core
  op by op, activations.inference_eager_core), its KV cache made where RoPE has run (without RoPE after the fused
  projection under SDPA, else after the attention moment), autocast's cached weight copies made as the block's
  projections first read them, GPT2Block's MLP ending as traced (block_end); then the head's final norm, logits
  and generate's fp32 copy of them;
- each decode step the same at one token a sequence, each layer's cache grown by torch.cat (transformers 5.24
  DynamicLayer.update: the grown keys made and the old freed, then the values; a sliding layer makes both before
  it frees either). Past DECODE_BLOCK_PASSES the decode steps are replayed in even strides that end at the last
  step (the cache grows by the stride at each replayed step).

Limitations, stated: a moment's tensors are matched to the previous moment's by size (the traced order interleaves
births and deaths inside a moment: the q, k and v projections' input casts, the masks' intermediate booleans);
outside GPT2Block (block_end) the block's output is made beside the MLP's intermediates (the real sum follows the
down projection, which runs beside their product only: the replay's peak allocated is up to 9 % over the
estimate's, DeepSeek-V3-small bf16); beam search's cache reordering is not run (verify does not run it either).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.estimator.activations import (Tensors, held_intermediates, inference_eager_core, inference_working_set,
                                           kv_widths, layer_kinds)
from memplan.estimator.families import family
from memplan.estimator.inference import (dequantised_copy, layer_windows, serving_autocast, served_tensors,
                                         serving_widths)
from memplan.estimator.parallel import tied_head
from memplan.estimator.rules import FP32, HALF, WEIGHT_FORMATS
from memplan.estimator.states import LINEAR_CATEGORIES
from memplan.estimator.timeline import Events, block_groups, module_order, per_mlp_kind, walk_no_grad_block
from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.inputs.workload import Workload

# decode steps replayed one by one while steps x blocks stays within DECODE_BLOCK_PASSES (0.30-0.34 s a replay for
# 1B-70B models: benchmarks/results/replay_speed.json), else in even strides, at least MIN_DECODE_STEPS of them.
# Strides under-state the fragmentation a long generation's growing caches leave in the default allocator: GPT-2
# fp32, 32 sequences, 512 + 512 tokens replayed 6.8 GiB reserved in 16 strides, 8.6 in 32, 9.0 in 64, 9.1 in 128,
# 10.1 GiB step by step at 1336c10 (docs/estimator.md)
DECODE_BLOCK_PASSES = 1024
MIN_DECODE_STEPS = 16
INT64 = 8  # token ids
# the moments whose projections read weights: autocast casts a block's as the first of them starts
CAST_BEFORE = ("projection", "rotary", "scores", "attention", "mlp")
# the weights autocast casts as the attention reads them; the rest of a block's (MLP, experts, router) before its MLP
ATTENTION_CASTS = ("attention",)


@dataclass(frozen=True)
class ServingKey:
    """Everything the serving replay reads (a frozen, hashable cache key; a dataclass, so never equal to a training
    step's ReplayKey in timeline.replay's cache)."""

    spec: ModelSpec
    precision: str
    attn: str
    sequences: int  # micro batch x beams
    prompt: int
    new_tokens: int
    static: bool  # StaticCache

    @classmethod
    def of(cls, spec: ModelSpec, w: Workload) -> "ServingKey":
        return cls(spec, w.precision, w.attn, w.micro_batch * w.beams, w.seq_len, w.max_new_tokens,
                   w.kv_cache == "static")

    def events(self) -> list[tuple[int, int]]:
        events = Events()
        _Serve(self, events).run()
        return events.events


def serving_replayable(spec: ModelSpec, w: Workload) -> bool:
    """Serving on one GPU (tensor-parallel serving is refused: inputs/constraints.py), an encoder-decoder aside (its
    encoder runs once and its decoder's cross-attention cache is not modelled: the segment arithmetic)."""
    return w.task == "infer" and w.world == 1 and spec.arch != "encoder-decoder"


def decode_lengths(prompt: int, new_tokens: int, blocks: int) -> list[int]:
    """The cache length after each replayed decode step: every step within the budget (DECODE_BLOCK_PASSES), else
    as many as it allows in even strides ending at the last (the prefill gives the first new token: new_tokens - 1
    decode steps)."""
    steps = max(new_tokens - 1, 0)
    most = max(MIN_DECODE_STEPS, DECODE_BLOCK_PASSES // max(blocks, 1))
    if steps <= most:
        return [prompt + t for t in range(1, steps + 1)]
    return [prompt + round(i * steps / most) for i in range(1, most + 1)]


class _Serve:
    """The order of one serving step's allocations."""

    def __init__(self, k: ServingKey, sim: Events) -> None:
        self.k, self.sim, self.spec = k, sim, k.spec
        self.fmt = WEIGHT_FORMATS[k.precision]
        self.autocast = serving_autocast(k.precision)
        self.p, self.r, self.kv_b = serving_widths(k.spec, k.precision)
        self.generate = k.new_tokens > 0
        self.per_block = block_groups(k.spec, k.spec.params)  # each block's (group index, tensors)
        self.blocks = [[(k.spec.params[i], n) for i, n in blk] for blk in self.per_block]
        self.windows = layer_windows(k.spec) if self.generate else ()
        self.cache: list[tuple[int, int]] = []  # each cached layer's (key, value) storages
        self.casts_made = False

    def run(self) -> None:
        for g, n in module_order(self.spec.params, self.per_block):
            pieces = served_tensors(self.fmt, self.spec, g)  # a quantised weight, then its scales (load order)
            for _ in range(n):
                for nbytes, _ in pieces:
                    self.sim.alloc(nbytes)
        if self.spec.buffer_bytes:
            self.sim.alloc(self.spec.buffer_bytes)
        if self.spec.arch != "vision":  # the prompts' token ids (an image model's pixels: ws["around"])
            self.sim.alloc(self.k.sequences * self.k.prompt * INT64)
        self.forward(self.k.prompt, 0)
        self.casts_made = True
        for length in decode_lengths(self.k.prompt, self.k.new_tokens, len(self.blocks)):
            self.forward(1, length)

    def forward(self, tokens: int, context: int) -> None:
        """One forward of `tokens` a sequence (context: the cache length a decode step attends to; 0: prefill)."""
        k = self.k
        seqs = k.sequences
        # each layer kind's moments where the layers' MLPs differ (a MoE model's dense layers: activations.layer_kinds)
        sets = per_mlp_kind(self.spec, layer_kinds(self.spec) or (None,) * len(self.blocks),
                            lambda kind: inference_working_set(
                                self.spec, seqs, tokens, self.p, self.r, k.attn, full_logits=not self.generate,
                                context=context, dequant=dequantised_copy(self.spec, self.fmt, seqs * tokens),
                                kind=kind))
        ws = sets[0]
        stream = self.r * self.spec.hidden_size * seqs * tokens
        embed = self.sim.alloc(stream)
        around = self.tensors(ws["around"])
        held = embed
        core = inference_eager_core(self.spec, seqs, tokens, self.p, self.r, k.attn, context)
        for b, groups in enumerate(self.blocks):
            out = self.block(b, groups, sets[b], core, stream, context)
            if held != embed:
                self.sim.free([held])
            held = out
        # the head: the final norm reads the last block's output, then the base model's locals are gone
        head = self.tensors(ws["head"][:1])
        self.sim.free(([] if held == embed else [held]) + [embed] + around)
        if not self.casts_made:
            self.casts(self.head_groups())
            self.tied_cast()
        self.sim.free(head + self.tensors(ws["head"][1:]))

    def block(self, b: int, groups: list[tuple[ParamGroup, int]], ws: dict[str, list[Tensors]],
              core: list[tuple[int, int]], stream: int, context: int) -> int:
        """One block's forward (timeline.walk_no_grad_block); returns its output's key. Autocast casts a block's
        weights as its projections first read them (CAST_BEFORE), its cache updates where kv_moment says."""
        cast: set[bool] = set()  # whose casts are made: the attention's (True), the rest's (False)

        def before(moment: str) -> None:
            attention = moment != "mlp"
            if moment in CAST_BEFORE and attention not in cast:
                self.layer_casts(groups, attention)
                cast.add(attention)

        local = walk_no_grad_block(self.sim, ws, core, stream, before, self.kv_moment(ws, context),
                                   lambda: self.kv(b, context))
        local = self.block_end(local, stream)
        out = self.sim.alloc(stream)
        self.sim.free([key for _, key in local])
        return out

    def block_end(self, local: list[tuple[int, int]], stream: int) -> list[tuple[int, int]]:
        """GPT2Block's MLP end (families.Family.block_keeps_attn_output; a dense MLP): the activation chain's pieces
        die but its output, which c_proj reads (LLM.int8 first quantises it: bitsandbytes int8_vectorwise_quant's
        int8 copy and fp32 scale per row, freed after the matmul); c_proj's output is made, then the activation's
        output dies, before the block's sum (traced: GPT-2 int8 and GPT-BigCode-small bf16-pure serving). Returns
        the block's tensors still alive. The other families' blocks end as the moment's list leaves them: the same
        end for every family moved Qwen3-small bf16 SDPA serving 0.00 -> +4.2 % and SmolLM3-small bf16-pure
        0.00 -> -5.3 % (the walk reuses a block's tensors by size, not identity: docs/estimator.md)."""
        spec = self.spec
        if spec.is_moe or not family(spec.model_type).block_keeps_attn_output:
            return local
        tokens = stream // (self.r * spec.hidden_size)
        inter = self.p * spec.intermediate_size * tokens
        pieces = [x for x in local if x[0] == inter]
        if not pieces:
            return local
        # the intermediates the MLP moment made are the last of that size (eager's kept probabilities can match it)
        *early, last = pieces = pieces[-held_intermediates(spec, family(spec.model_type).gated_up_linears == 1):]
        self.sim.free([key for _, key in early])
        quant = [self.sim.alloc(n) for n in (tokens * spec.intermediate_size, FP32 * tokens)] \
            if self.fmt.store == "int8" else []
        down = self.sim.alloc(self.p * spec.hidden_size * tokens)
        self.sim.free(quant + [last[1]])
        return [x for x in local if x not in pieces] + [(self.p * spec.hidden_size * tokens, down)]

    def kv_moment(self, ws: dict[str, list[Tensors]], context: int) -> tuple[str, bool]:
        """Where a block's cache update runs: (the moment, True: between its frees and its makes; False: after it).
        The cache takes RoPE's k; without RoPE under SDPA it follows the attention's projections (the "projection"
        moment: GPT2Attention's fused c_attn output, then the cache's copies of k and v, then the core; traced, GPT-2
        int8 serving); under eager (whose list splits the projections' output at the query heads) and for MLA's
        latent cache, after the attention moment. A StaticCache's prefill zeros its whole length in update
        (lazy_initialization), after RoPE's transients are freed and before the attention's first tensor (eager's
        scores, else its outputs)."""
        if "projection" in ws:
            return "projection", False
        if "rotary" not in ws:
            return "attention", False
        if self.k.static and not context:
            return ("scores" if "scores" in ws else "attention"), True
        return "rotary", False

    def kv(self, b: int, context: int) -> None:
        """Block b's cache update (transformers 5.24 cache_utils.py): the prefill makes its key and value
        (StaticCache its whole length); a decode step's torch.cat grows them (StaticCache writes in place, but a
        full sliding layer rolls its window: torch.roll's copies of both, copied back)."""
        if b >= len(self.windows) or not self.generate:
            return
        window = self.windows[b]
        if self.k.static:
            total = self.k.prompt + self.k.new_tokens
            size = total if window is None else min(total, window)
            if not context:
                self.cache.append(self.kv_pair(size))
            elif window is not None and context > window:
                self.sim.free(list(self.kv_pair(window)))
            return
        tokens = self.k.prompt if not context else (context if window is None else min(context, window))
        if not context:
            self.cache.append(self.kv_pair(tokens))
        elif window is None:  # DynamicLayer.update: self.keys = torch.cat(...) frees the old keys, then the values
            (old_k, old_v), (key, value) = self.cache[b], self.kv_bytes(tokens)
            new_k = self.sim.alloc(key)
            self.sim.free([old_k])
            self.cache[b] = (new_k, self.sim.alloc(value))
            self.sim.free([old_v])
        else:  # DynamicSlidingWindowLayer: both cats, then both views assigned
            old, self.cache[b] = self.cache[b], self.kv_pair(tokens)
            self.sim.free(list(old))

    def kv_bytes(self, tokens: int) -> tuple[int, int]:
        """A layer's key and value bytes for `tokens` a sequence (activations.kv_widths)."""
        key, value = kv_widths(self.spec, self.kv_b, self.p)
        return key * self.k.sequences * tokens, value * self.k.sequences * tokens

    def kv_pair(self, tokens: int) -> tuple[int, int]:
        """A layer's key and value storages for `tokens` a sequence."""
        key, value = self.kv_bytes(tokens)
        return self.sim.alloc(key), self.sim.alloc(value)

    def tensors(self, ts: list[Tensors]) -> list[int]:
        return [self.sim.alloc(t.nbytes) for t in ts for _ in range(t.count)]

    def casts(self, groups: list[tuple[ParamGroup, int]], attention: bool | None = None) -> list[int]:
        """Autocast's half copies of the fp32 linear weights among `groups` (attention: the attention's only, or with
        False the others; None: all), cached for the whole no_grad region (verify/infer.py: cache_enabled)."""
        if not self.autocast:
            return []
        return [self.sim.alloc(g.numel * HALF) for g, n in groups if g.category in LINEAR_CATEGORIES
                and (attention is None or (g.category in ATTENTION_CASTS) == attention) for _ in range(n)]

    def layer_casts(self, groups: list[tuple[ParamGroup, int]], attention: bool) -> None:
        """A block's casts: made by the first forward and cached; where the family's layers bypass the cache
        (Falcon: families.Family.autocast_caches_layer_weights), made and freed again by every forward."""
        if family(self.spec.model_type).autocast_caches_layer_weights:
            if not self.casts_made:
                self.casts(groups, attention)
            return
        self.sim.free(self.casts(groups, attention))

    def head_groups(self) -> list[tuple[ParamGroup, int]]:
        return [(g, g.count) for g in self.spec.params if g.category == "head"]

    def tied_cast(self) -> list[int]:
        """A tied LM head's matmul casts the fp32 embedding matrix (inference._serving_casts)."""
        if not (self.autocast and tied_head(self.spec)):
            return []
        return [self.sim.alloc(self.spec.vocab_size * self.spec.hidden_size * HALF)]
