"""Tensor-byte accounting of a running step: every storage that comes to life, when it dies, and what it is.

`LiveTracker` is a `TorchDispatchMode`. Each op's output storages are recorded once (views and in-place
results share a storage and are not counted again), with their size rounded as the CUDA caching
allocator rounds a block (512 B, `kMinBlockSize` in c10/cuda/CUDACachingAllocator.cpp), and a weakref
finaliser records the free. It works the same on FakeTensors (no memory at all: the full-size model
traced anywhere) and on real tensors (a real CPU run).

Each allocation carries a category, fixed when it is known: parameters and buffers are `weights`;
casts of a weight during the forward are `autocast_cache`; what becomes a parameter's `.grad` is
`gradients` and what the optimizer keeps in its state is `optimizer_states` (from the moment they were
allocated, so the peak's breakdown is right even when it falls inside backward or the first step);
anything else is named after the phase it was born in: `activations` (forward: saved tensors and
temporaries), `transient` (backward), `optimizer_temporaries` (optimizer step), `inputs` (the batch).
The run is replayed afterwards (`summarize`) to find the peak, its phase and op, the breakdown there,
the peak of each phase, and the reserved memory from the allocator simulation.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memplan.estimator.allocator import CachingAllocator
from memplan.estimator.allocation import round_block


@dataclass
class Alloc:
    nbytes: int  # requested bytes (storage nbytes)
    category: str
    phase: str
    op: str


@dataclass
class TraceSummary:
    peak_allocated: int
    peak_phase: str
    peak_op: str
    breakdown: dict[str, int]  # rounded bytes per category at the peak
    phases: dict[str, int]  # peak allocated within each phase
    peak_reserved: int  # allocator simulation of the same alloc / free sequence
    allocations: int
    ops: int
    peak_reserved_expandable: int = 0  # the same simulation under expandable_segments:True


class LiveTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.allocs: list[Alloc] = []
        self.events: list[int] = []  # i: alloc i; ~i: free of alloc i
        self.marks: list[tuple[int, str]] = []  # (event position, phase) at each phase change
        self.live: dict[int, int] = {}  # id(storage) -> alloc index
        self.weight_storages: set[int] = set()
        self.phase = "setup"
        self.ops = 0

    # -- phases and categories ---------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.marks.append((len(self.events), phase))

    def register(self, tensors, category: str) -> None:
        """Tensors that existed before tracking started (parameters, buffers) or must be named."""
        for t in tensors:
            idx = self._track(t, "register", category)
            if idx is not None:
                self.allocs[idx].category = category
                if category == "weights":
                    self.weight_storages.add(id(t.untyped_storage()))

    def classify(self, tensors, category: str) -> None:
        """Name tensors that already live (a parameter's .grad, an optimizer's state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                idx = self.live.get(id(t.untyped_storage()))
                if idx is not None:
                    self.allocs[idx].category = category

    # -- tracking ----------------------------------------------------------------------------------
    def _track(self, t: torch.Tensor, op: str, category: str | None = None) -> int | None:
        st = t.untyped_storage()
        key = id(st)
        idx = self.live.get(key)
        if idx is not None:
            return idx
        n = st.nbytes()
        if n == 0:
            return None
        idx = len(self.allocs)
        self.allocs.append(Alloc(n, category or _PHASE_CATEGORY.get(self.phase, self.phase), self.phase, op))
        self.live[key] = idx
        self.events.append(idx)
        weakref.finalize(st, self._free, key, idx)
        return idx

    def _free(self, key: int, idx: int) -> None:
        if self.live.get(key) == idx:
            del self.live[key]
            self.events.append(~idx)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        name = func.__name__
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        cat = None
        if self.phase == "forward" and name.startswith("_to_copy") and self.weight_storages:
            src = args[0] if args else None
            if isinstance(src, torch.Tensor) and id(src.untyped_storage()) in self.weight_storages:
                cat = "autocast_cache"
        for t in outs:
            self._track(t, name, cat)
        return out

    # -- replay --------------------------------------------------------------------------------------
    def summarize(self) -> TraceSummary:
        allocs, events = self.allocs, self.events
        size = [round_block(a.nbytes) for a in allocs]
        marks = dict(self.marks)
        cur = peak = peak_at = 0
        phase = "setup"
        phase_peak: dict[str, int] = {}
        for pos, e in enumerate(events):
            phase = marks.get(pos, phase)
            cur += size[e] if e >= 0 else -size[~e]
            if cur > peak:
                peak, peak_at = cur, pos
            if cur > phase_peak.get(phase, -1):
                phase_peak[phase] = cur
        live: dict[int, None] = {}
        for e in events[: peak_at + 1]:
            if e >= 0:
                live[e] = None
            else:
                live.pop(~e, None)
        breakdown: dict[str, int] = {}
        for i in live:
            breakdown[allocs[i].category] = breakdown.get(allocs[i].category, 0) + size[i]
        peak_alloc = allocs[events[peak_at]] if events and events[peak_at] >= 0 else None
        sim, expandable = CachingAllocator(), CachingAllocator(expandable=True)
        for e in events:
            for a in (sim, expandable):
                if e >= 0:
                    a.malloc(e, allocs[e].nbytes)
                else:
                    a.free(~e)
        return TraceSummary(
            peak_allocated=peak, peak_phase=peak_alloc.phase if peak_alloc else "setup",
            peak_op=peak_alloc.op if peak_alloc else "", breakdown=dict(sorted(breakdown.items())),
            phases=phase_peak, peak_reserved=sim.peak_reserved, allocations=len(allocs), ops=self.ops,
            peak_reserved_expandable=expandable.peak_reserved)


_PHASE_CATEGORY = {"forward": "activations", "backward": "transient", "optimizer": "optimizer_temporaries",
                   "data": "inputs", "setup": "weights"}

