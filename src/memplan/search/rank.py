"""Ranking plans: the order of `suggest`'s plans, the Pareto front of memory vs speed, and why the
first plan is first (docs/cost-model.md, "Ranking")."""

from __future__ import annotations

from typing import NamedTuple

from memplan.inputs.workload import Workload
from memplan.search.space import shardings
from memplan.search.cost import StepTime, Throughput


class Candidate(NamedTuple):
    """One evaluated plan, kept light: the Plan document is built only for what is shown."""

    base: Workload  # every knob but the micro batch and accumulation
    mb: int
    m: int
    device_used: int
    headroom: int
    speed: Throughput
    cell: tuple | None = None  # (table, row, column) of the step table that evaluated it (training)

    @property
    def w(self) -> Workload:
        return self.base.model_copy(update={"micro_batch": self.mb, "grad_accum": self.m})

    @property
    def samples_per_s(self) -> float:
        return self.speed.samples_per_s

    @property
    def tokens_per_s(self) -> float:
        return self.speed.tokens_per_s

    @property
    def mfu(self) -> float:
        return self.speed.mfu

    @property
    def step(self) -> StepTime | None:
        """Seconds by cost term (None for inference)."""
        return self.speed.terms


def speed_key(samples_per_s: float) -> float:
    """Speeds equal to 4 significant digits are a tie: the cost model is not that precise, and the
    tie goes to the plan with more headroom."""
    return float(f"{samples_per_s:.4g}")


def rank_key(c: Candidate, objective: str) -> tuple:
    w = c.base
    # deterministic: ties go to more headroom, fewer GPUs in TP/PP, then the knob values themselves
    tail = (-c.headroom, w.tp * w.pp, w.zero, w.fsdp, w.offload, c.m, w.grad_ckpt, w.attn, w.precision,
            w.optim, w.sp, w.vpp)
    if objective == "headroom":
        return (-c.headroom, -speed_key(c.samples_per_s)) + tail
    return (-speed_key(c.samples_per_s),) + tail


def distinct(cands: list[Candidate], most: int) -> list[Candidate]:
    """Ranked candidates without those that differ from an earlier one only in a knob that changes
    nothing (SDPA and FlashAttention-2 save the same tensors and cost the same here): the first stays,
    and `explain` still says what the other costs."""
    seen: set = set()
    out = []
    for c in cands:
        knobs = tuple(v for k, v in c.base.__dict__.items() if k != "attn")
        key = (knobs, c.base.attn == "eager", c.mb, c.device_used, c.samples_per_s)
        if key not in seen:
            seen.add(key)
            out.append(c)
            if len(out) == most:
                break
    return out


def pareto(cands: list[Candidate]) -> list[Candidate]:
    """Plans that no other plan beats on both device memory and samples/s, least memory first (of plans
    that tie on both, the first in ranking order)."""
    front: list[Candidate] = []
    best = -1.0
    for c in sorted(cands, key=lambda c: (c.device_used, -c.samples_per_s)):
        if c.samples_per_s > best:
            front.append(c)
            best = c.samples_per_s
    return front


def _gib(n: float) -> str:
    return f"{n / 2**30:+.1f} GiB"


def sharding_label(zero: int, fsdp: str) -> str:
    """How a plan shards its states, as every table and line names it."""
    return f"FSDP {fsdp}" if fsdp != "none" else (f"ZeRO-{zero}" if zero else "DDP")


def _value(w: Workload, knob: str):
    return (w.zero, w.fsdp) if knob == "sharding" else getattr(w, knob)


def _knob(knob: str, v) -> str:
    if knob == "sharding":
        return sharding_label(*v)
    return {"offload": f"offload {v}", "tp": f"TP {v}", "pp": f"PP {v}", "sp": f"SP {'on' if v else 'off'}",
            "grad_ckpt": f"checkpointing {v}", "attn": f"attention {v}", "vpp": f"interleave x{v}",
            "kernels": f"fused loss {'on' if v else 'off'}", "tiled_mlp": f"tiled MLP {'on' if v else 'off'}"}[knob]


WHY_KNOBS = ("sharding", "offload", "tp", "pp", "sp", "vpp", "grad_ckpt", "attn", "kernels", "tiled_mlp")
# the knobs a compared plan must share with the best one besides the knob it changes: the method too (a
# full fine-tuning plan says nothing about a LoRA plan's checkpointing)
FIXED = WHY_KNOBS + ("precision", "optim", "method")


def explain(best: Candidate, cands: list[Candidate], space) -> list[str]:
    """For each knob, the best plan that changes only that knob (micro batch and accumulation chosen
    again): what it would cost in memory and speed, or that it does not fit."""
    w = best.base
    searched = {"sharding": shardings(space, w.dp), "offload": space.offloads, "tp": space.tps, "pp": space.pps,
                "sp": space.sps, "vpp": space.vpps, "grad_ckpt": space.ckpts, "attn": space.attns,
                "kernels": space.kernels, "tiled_mlp": space.tiled}
    out = []
    mine_all = tuple(_value(w, k) for k in FIXED)
    # each candidate's knob values once; a candidate counts for a knob when it differs from the best
    # plan in that knob only
    by_base: dict[int, tuple] = {}  # candidates share their base across micro batches
    values = []
    for c in cands:
        vals = by_base.get(id(c.base))
        if vals is None:
            vals = by_base[id(c.base)] = tuple(_value(c.base, k) for k in FIXED)
        values.append((vals, c))
    diffs: dict[int, dict] = {i: {} for i in range(len(WHY_KNOBS))}
    for vals, c in values:
        off = [i for i, (a, b) in enumerate(zip(vals, mine_all)) if a != b]
        if len(off) == 1 and off[0] < len(WHY_KNOBS):
            seen = diffs[off[0]]
            v = vals[off[0]]
            if v not in seen or c.samples_per_s > seen[v].samples_per_s:
                seen[v] = c
    for i, knob in enumerate(WHY_KNOBS):
        mine = mine_all[i]
        seen = diffs[i]
        for v in searched[knob]:
            if v == mine:
                continue
            c = seen.get(v)
            change = f"{_knob(knob, v)} instead of {_knob(knob, mine)}"
            if c is None:
                if knob in ("sharding", "offload", "grad_ckpt", "attn"):
                    out.append(f"{change}: does not fit or is not possible with the rest of this plan")
                continue
            mem = c.device_used - best.device_used
            speed = c.samples_per_s / best.samples_per_s - 1
            out.append(f"{change}: {_gib(mem)}, {speed:+.0%} tokens/s (micro batch {c.mb})")
    return out
