"""Measure what a transformers model keeps for backward, block by block, for a model_type memplan has no
analytic activation model of (estimator/traced.py fits and uses the measurements; docs/estimator.md,
"Traced coefficients").

One measurement builds the real model from its config with its blocks cut to two per stack, or to the first
layer and one per distinct layer type (the layer types' shares of the full model weight them later; the first
layer's own extra is kept apart: T5's first block computes the position bias every block shares), and runs
verify's training step on it once as FakeTensors under CUDA semantics (verify/run.py train_steps,
verify/cudasim.py: autocast's op lists, native dropout, the SDPA kernel an sm80 GPU picks), every storage
tracked (verify/tracer.py). Hooks on the blocks (transformers' own `_no_split_modules` classes) mark where each
block's forward and backward begin and end. From the timeline it reads:
- saved: every storage born in the forward and still alive when backward starts, by where it was born (the
  embeddings, block k, the head); a block's input belongs to the block that reads it, the last block's output
  to the head (the analytic model's convention: a norm's saved input is its layer's);
- lsm: the head's saved storages freed before the last block's backward starts (the loss's log-softmax);
- the transient bytes above the saved ones at every allocation of three windows: the loss (after the last
  block, in the forward), the start of backward (until the last block's backward starts) and the last block's
  backward, each as a series over the window's events;
- for the estimator's replay of reserved memory (estimator/timeline.py), the storages of those windows and of
  every block's forward and backward in order: each birth, each death inside the window, and where the block's
  (or the head's) saved storages are born (`sequence`).
Weights, autocast's weight casts, gradients, the optimizer's tensors and the batch are left out: the step model
counts them itself.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

from memplan.errors import UserError

# the SDPA kernel choice of an sm80 GPU (FlashAttention for half inputs, memory-efficient for fp32)
TRACE_SM = (8, 0)
# a sequence's marker of a saved storage's birth: SAVED - its place in its block's list (below any ~n of a free)
SAVED = -(2**30)
# config names of the layer counts, every stack (transformers' attribute_map aliases most of them)
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                "num_decoder_layers")


def reduced_config(cfg: Any, types: tuple[str, ...]) -> Any:
    """The config with two blocks per stack, or with the blocks of `types` (then config.layer_types)."""
    small = copy.deepcopy(cfg)
    n = len(types) or 2
    for name in LAYER_COUNTS:
        if isinstance(getattr(small, name, None), int) and not isinstance(getattr(small, name), bool):
            setattr(small, name, n)
    if types:
        small.layer_types = list(types)
    return small


def find_blocks(model) -> list:
    """The model's blocks (every stack's), in module order: a ModuleList's children of the classes transformers
    names in `_no_split_modules` (the unit device_map never splits: a layer), else a ModuleList's uniform
    children."""
    from torch import nn

    names = set(getattr(model, "_no_split_modules", None) or ())
    listed = [c for m in model.modules() if isinstance(m, nn.ModuleList) for c in m]
    blocks = [c for c in listed if type(c).__name__ in names]  # not the embeddings some also name there
    if blocks:
        return blocks
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1 and \
                any(True for _ in m[0].parameters()):
            blocks += list(m)
    if not blocks:
        raise UserError(f"{type(model).__name__}: no transformer blocks found to trace")
    return blocks


class _Marks:
    """Positions in the tracker's event list where each block's forward and backward begin and end."""

    def __init__(self, tracker, blocks: list) -> None:
        self.tracker = tracker
        self.order: list[int] = []  # blocks in the order they ran
        self.start: dict[int, int] = {}
        self.end: dict[int, int] = {}
        self.inputs: dict[int, int | None] = {}  # block -> alloc index of its input hidden states
        self.outputs: dict[int, int | None] = {}
        self.bwd_start: dict[int, int] = {}  # block -> event position when its output's gradient is ready
        self.bwd_end: dict[int, int] = {}  # ... and its input's
        self.handles = []
        for k, blk in enumerate(blocks):
            self.handles.append(blk.register_forward_pre_hook(self._pre(k), with_kwargs=True))
            self.handles.append(blk.register_forward_hook(self._post(k), with_kwargs=True))

    def _pos(self) -> int:
        return len(self.tracker.events)

    def _mark(self, table: dict[int, int], k: int) -> None:  # a tensor hook: returns None, the gradient stays
        table.setdefault(k, self._pos())

    def _alloc(self, t) -> int | None:
        return self.tracker.live.get(id(t.untyped_storage()))

    def _pre(self, k: int):
        def hook(module, args, kwargs):
            if self.tracker.phase != "forward":  # a checkpointed block's recompute in backward
                return
            x = args[0] if args else kwargs.get("hidden_states")
            self.order.append(k)
            self.start[k] = self._pos()
            self.inputs[k] = self._alloc(x) if _is_tensor(x) else None
            if _is_tensor(x) and x.requires_grad:
                x.register_hook(lambda g: self._mark(self.bwd_end, k))
        return hook

    def _post(self, k: int):
        def hook(module, args, kwargs, out):
            if self.tracker.phase != "forward":
                return
            self.end[k] = self._pos()
            y = _first_tensor(out)
            self.outputs[k] = self._alloc(y) if y is not None else None
            if y is not None and y.requires_grad:
                y.register_hook(lambda g: self._mark(self.bwd_start, k))
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _first_tensor(out):
    from torch.utils._pytree import tree_flatten

    return next((t for t in tree_flatten(out)[0] if _is_tensor(t) and t.is_floating_point()), None)


def measure(cfg: Any, head: str, precision: str, attn: str, b: int, s: int, use_cache: bool = True,
            checkpointed: bool = False) -> dict[str, Any]:
    """One training step of the reduced model `cfg` at micro batch b and sequence s, as verify runs it, a decoder
    with or without its KV cache, with full gradient checkpointing or without (see the module's docstring):
    {"saved": {region: [bytes, ...]}, "lsm": [bool per head storage], "windows": {name: [(op, bytes), ...]},
    "sequences": {loss window: [(op, n, bytes), ...]}, "block_forward" / "block_backward": {block
    index: its sequence}, "order": [block index, in the order the blocks ran]}."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.inputs.workload import Workload
    from memplan.verify.cudasim import CudaSemantics
    from memplan.verify.run import autocast_dtype, make_batch, setup, train_steps
    from memplan.verify.tracer import LiveTracker

    # the optimizer's tensors are not measured (the step counts them): SGD without momentum is the cheapest step
    w = Workload(precision=precision, attn=attn, grad_ckpt="full" if checkpointed else "none", optim="sgd")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, head, optimizer, dtype = setup(cfg, head, w, "meta")
        model.config.use_cache = use_cache
        sem = CudaSemantics(autocast_dtype(w), TRACE_SM, fake=True)
        tracker = LiveTracker()
        marks = _Marks(tracker, find_blocks(model))
        phases: dict[str, int] = {}  # phase -> the event position where it began
        try:
            with tracker:
                tracker.register(list(model.parameters()) + list(model.buffers()), "weights")
                with sem:
                    train_steps(model, lambda: make_batch(model, head, b, s, dtype, "cpu"), optimizer, w, 1,
                                tracker=tracker, sem=sem,
                                on_phase=lambda step, name: phases.setdefault(name, len(tracker.events)))
        finally:
            marks.close()
        out = _read(tracker, marks, phases["backward"])
        model = optimizer = None
    return out


def _read(tracker, marks: _Marks, backward_at: int) -> dict[str, Any]:
    """The saved storages by region and the three transient windows' series (module docstring)."""
    allocs, events = tracker.allocs, tracker.events
    ours = [a.category in ("activations", "transient") for a in allocs]
    freed_at = {~e: pos for pos, e in enumerate(events) if e < 0}
    born_at = {e: pos for pos, e in enumerate(events) if e >= 0}
    saved = [i for i, a in enumerate(allocs) if ours[i] and a.phase == "forward" and born_at[i] < backward_at
             and freed_at.get(i, len(events)) >= backward_at]
    if not marks.order:
        raise UserError("the traced forward ran no transformer block")
    last = marks.order[-1]
    if last not in marks.bwd_start or last not in marks.bwd_end:
        raise UserError("the traced backward never reached the last block")
    region = _regions(saved, born_at, marks)
    by_region: dict[str, list[int]] = {}
    for i in saved:
        by_region.setdefault(region[i], []).append(i)
    lsm_set = {i for i in by_region.get("head", []) if freed_at.get(i, len(events)) < marks.bwd_start[last]}
    saved_set = set(saved)
    # requested bytes, not the allocator's 512-byte blocks: the fit needs sizes polynomial in (b, s), and the
    # step rounds the fitted tensors itself
    size = [a.nbytes for a in allocs]
    saved_total = sum(size[i] for i in saved)
    lsm_total = sum(size[i] for i in lsm_set)

    def series(lo: int, hi: int, unsaved_only: bool, base: int) -> list[tuple[str, int]]:
        """(the event's op, live bytes of ours minus `base` after it) for each event in [lo, hi); in the forward
        only its unsaved storages count."""
        cur, out = 0, []
        for pos, e in enumerate(events[:hi]):
            i = e if e >= 0 else ~e
            if ours[i] and not (unsaved_only and i in saved_set):
                cur += size[i] if e >= 0 else -size[i]
            if pos >= lo:
                out.append((("+" if e >= 0 else "-") + allocs[i].op, cur - base))
        return out or [("", 0)]

    windows = {
        "loss_forward": series(marks.end[last], backward_at, True, 0),
        "loss_backward": series(backward_at, marks.bwd_start[last], False, saved_total),
        "layer_backward": series(marks.bwd_start[last], marks.bwd_end[last], False, saved_total - lsm_total),
    }
    sequences = {
        "loss_forward": sequence(allocs, events, ours, saved_set, marks.end[last], backward_at,
                                 by_region.get("head", [])),
        "loss_backward": sequence(allocs, events, ours, saved_set, backward_at, marks.bwd_start[last]),
    }
    # every block's forward and backward (each traced block replays its own: estimator/traced.py Coefficients.blocks)
    forward = {k: sequence(allocs, events, ours, saved_set, marks.start[k], marks.end[k],
                           by_region.get(f"block{k}", [])) for k in marks.order if k in marks.end}
    backward = {k: sequence(allocs, events, ours, saved_set, marks.bwd_start[k], marks.bwd_end[k])
                for k in marks.order if k in marks.bwd_start and k in marks.bwd_end}
    return {"saved": {r: [allocs[i].nbytes for i in ids] for r, ids in by_region.items()},
            "lsm": [i in lsm_set for i in by_region.get("head", [])], "windows": windows,
            "sequences": sequences, "block_forward": forward, "block_backward": backward, "order": list(marks.order)}


def sequence(allocs, events, ours, saved: set[int], lo: int, hi: int,
             own: list[int] | tuple = ()) -> list[tuple[str, int, int]]:
    """The window's own storages in order, for the estimator's replay (estimator/timeline.py): (op, n, bytes) for the
    n-th storage born in it, (op, ~n, 0) when it dies in it, (op, SAVED - k, 0) where the k-th of `own` (the region's
    saved storages: the block's, the head's) is born. A saved storage born here is left to the step's lists, and
    storages born before the window are not the window's."""
    ids: dict[int, int] = {}
    place = {i: k for k, i in enumerate(own)}
    out = []
    for e in events[lo:hi]:
        i = e if e >= 0 else ~e
        if not ours[i]:
            continue
        op = ("+" if e >= 0 else "-") + allocs[i].op
        if i in saved:
            if e >= 0 and i in place:
                out.append((op, SAVED - place[i], 0))
            continue
        if e >= 0:
            ids[i] = len(ids)
            out.append((op, ids[i], allocs[i].nbytes))
        elif i in ids:
            out.append((op, ~ids[i], 0))
    return out


def _regions(saved: list[int], born_at: dict[int, int], marks: _Marks) -> dict[int, str]:
    """Where each saved storage belongs: "block<k>", "embed" or "head" (module docstring)."""
    inputs = {a: k for k, a in marks.inputs.items() if a is not None}
    last = marks.order[-1]
    out: dict[int, str] = {}
    for i in saved:
        if i in inputs:
            out[i] = f"block{inputs[i]}"
            continue
        if marks.outputs.get(last) == i:
            out[i] = "head"
            continue
        pos = born_at[i]
        inside = [k for k in marks.order if marks.start[k] <= pos < marks.end[k]]
        if inside:
            out[i] = f"block{inside[-1]}"
        elif pos >= marks.end[last]:
            out[i] = "head"
        else:
            out[i] = "embed"
    return out


class Layout(NamedTuple):
    """The traced model's blocks, the same in every trace of a key."""

    stacks: tuple[list[int], list[int]]  # the blocks of each stack (encoder-or-decoder-only, decoder) as they ran
    weights: dict[int, float]  # block -> its share of its stack's layers (its layer type's); block 0: the first
    layer_counts: tuple[int, int]  # the full model's layers per stack
    types: tuple[str, ...] = ()  # each traced block's layer type (_trace_types); (): the model has none


def trace_points(key) -> tuple[Layout, list[tuple[int, int, dict[str, Any]]]]:
    """The traced model's layout and (b, s, measurement) at every point estimator/traced.py fits, for one
    TraceKey; under full checkpointing a measurement holds the checkpointed one under "checkpointed"."""
    import json

    from memplan.estimator.traced import B_POINTS, seq_points
    from memplan.inputs.hf import prepare_config, quiet, spec_from_config

    with quiet():
        config = json.loads(key.config)
        spec = spec_from_config(config, "trace", head=key.head)
        cfg, head = prepare_config(config, key.head)
        types = _trace_types(spec.layer_types)
        small = reduced_config(cfg, types)
        runs = []
        for s in seq_points(spec, key.beyond_window):
            for b in B_POINTS:
                # the saved tensors and the loss's windows without checkpointing (the block's recompute saves
                # them), the last block's backward with it (its recompute in it)
                m = measure(small, head, key.precision, key.attn, b, s, use_cache=not key.checkpointed)
                if key.checkpointed:
                    m["checkpointed"] = measure(small, head, key.precision, key.attn, b, s, False, checkpointed=True)
                runs.append((b, s, m))
    order = list(dict.fromkeys(runs[0][2]["order"]))
    if spec.arch == "encoder-decoder":
        half = len(order) // 2
        counts = (spec.num_layers, spec.num_decoder_layers)
        return Layout((order[:half], order[half:]), {k: 1.0 for k in order}, counts), runs
    # block 0 is the first layer, which may keep more (T5's position bias): block 1 on are the layers' types
    shares = {k: spec.layer_types.count(t) / len(spec.layer_types) for k, t in enumerate(types) if k} or {1: 1.0}
    return Layout((order, []), shares, (spec.num_layers, 0), types), runs


def _trace_types(types: tuple[str, ...]) -> tuple[str, ...]:
    """The first layer's type, then one block per distinct layer type, the model's last layer's type last (its
    backward is the first); () without layer types."""
    if not types:
        return ()
    distinct = [t for t in dict.fromkeys(types) if t != types[-1]]
    return (types[0],) + tuple(distinct) + (types[-1],)
