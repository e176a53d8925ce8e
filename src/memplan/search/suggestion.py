"""`suggest`: search every knob over the GPUs, keep the plans that fit, rank them (docs/parallel.md).

A pipeline: the validated request (search/request.py) -> its space (search/space.py: tensor x pipeline x
data parallel layouts over `gpus * nodes` GPUs, sequence parallelism, the interleaved schedule, ZeRO 0-3
with offload, FSDP, memplan's kernels, micro batch, checkpointing, precision, optimizer, attention;
every combination the constraints table allows) -> evaluated (search/evaluate.py) -> ranked
(search/rank.py) -> explained, with alternatives and notes (here).

Nothing is pruned: every candidate of a layout (every setting of the other knobs x every micro
batch) is evaluated at once by `memplan.estimator.step.evaluate`, the estimator and the cost model in
numpy; a shown plan's report is read from the table cell that evaluated it (`step.cell_peak`).

Knobs that change the training mathematics (optimizer, pure bf16, fp32 vs mixed precision) are
searched only when the user allows them; otherwise the best alternative that would change them is
reported with what it would gain.
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any, NamedTuple

from memplan.estimator.finetune import ALL_LINEAR, assumed, default_targets
from memplan.estimator.timeline import replayable
from memplan.estimator.states import half_model
from memplan.inputs.defaults import OPTIM
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import Workload
from memplan.search.evaluate import confirm, host_limit, host_ram, plan, search_pass
from memplan.search.plan import Alternative, Suggestion
from memplan.search.rank import Candidate, distinct, explain, pareto, rank_key
from memplan.search.request import SearchRequest
from memplan.search.space import (
    Space, best_mixed_precision, defaults, divisors, kernel_options, space, supported_precisions,
)

# how many candidates the segment arithmetic rejects the search replays to see whether they fit (promote)
PROMOTED = 3
# how many ranked candidates the replay may reject before the search stops replaying (confirm_ranked): each costs
# a replay (0.03-0.14 s: benchmarks/results/replay_speed.json), and the arithmetic is over the replay in all but 19
# of the accuracy suite's 152 training cases (benchmarks/accuracy/results/accuracy.json at 382cb54)
CONFIRM_DROPS = 8
# what the user keeps closed, and the option that would open it (said when nothing fits)
CLOSED_KNOBS = (("--grad-ckpt full", lambda sp, train: "full" in sp.ckpts),
                ("--optim any", lambda sp, train: len(sp.optims) > 1 or not train),
                ("--precision any", lambda sp, train: len(sp.precisions) > 1),
                ("--zero 3 --offload all", lambda sp, train: 3 in sp.zeros and "all" in sp.offloads or not train))


def _without_gc(fn):
    """Run `fn` with the cyclic garbage collector paused. The search allocates about a million small,
    short-lived objects (workloads, tuples, arrays; freed by reference counting, no cycles), and each
    collection those allocations trigger walks the whole heap of the process, torch's and transformers'
    objects included (docs/cost-model.md, search speed)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return run


class Searched(NamedTuple):
    """The result of the search passes: the ranked fitting candidates and the space they came from."""

    found: list[Candidate]  # ranked
    evaluated: int
    space: Space  # the space of the plans shown (its gpus / nodes: the world they run on)
    host_short: int = 0  # the least host RAM per node that would have let a GPU-fitting plan fit (0: none)
    near: tuple = ()  # candidates the segment arithmetic puts just over the GPU (evaluate.ARITHMETIC_SLACK)


@_without_gc
def suggest(spec: ModelSpec, gpu: GPUProfile, **options: Any) -> Suggestion:
    """Ranked plans that fit; options: the fields of SearchRequest (bad values raise UserError)."""
    t0 = time.perf_counter()
    req = SearchRequest.of(spec, gpu, **options)
    notes: list[str] = []
    full = space(req)
    s = run_passes(req, full, notes)
    found, sp = promote(req, confirm_ranked(req, s.found, req.top), s.near), s.space
    notes += plan_notes(req, found, sp, full)
    alternatives, n = alternatives_of(req, sp, found)
    kernel_alt, k = kernels_alternative(req, sp, found)
    method_alt, k2 = method_alternatives(req, sp, found)
    alternatives += kernel_alt + method_alt
    k += k2
    if not found:
        # the note names the methods that fit; what they fit with is their alternative (printed once)
        notes.append(nothing_fits(req, sp, s.host_short)
                     + (f"; LoRA fits: {' or '.join(a.change for a in method_alt)}" if method_alt else ""))
    whole_front = pareto(found)
    shown = distinct(found, req.top)
    front = list(_confirmed(req, whole_front[:12]))
    if any(c.w.expandable_segments for c in shown) and not req.expandable_segments:
        notes.append("plans with expandable_segments fit only with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                     "(one growing segment per pool instead of a segment per cache miss); their launch.sh exports it")
    return Suggestion(
        model=spec.name, gpu=gpu.name, task=req.task, seq_len=sp.seq, global_batch=sp.global_batch,
        global_batch_default=req.global_batch is None, gpus=sp.gpus,
        nodes=sp.nodes, objective=req.objective, defaults=defaults(req) + method_defaults(req, sp, found),
        searched=searched(sp, req.gpus * req.nodes, req.task),
        host_ram_limit_bytes=host_limit(req, sp.gpus) if req.train else None,
        candidates=s.evaluated + n + k, search_seconds=time.perf_counter() - t0,
        plans=[plan(req, c) for c in shown],
        pareto=[plan(req, c) for c in front], pareto_size=len(whole_front),
        why=explain(found[0], found, sp) if found else [], alternatives=alternatives, notes=notes)


def confirm_ranked(req: SearchRequest, found: list[Candidate], top: int) -> list[Candidate]:
    """The ranked candidates with the first `top` distinct ones confirmed by their replayed meters (evaluate.confirm):
    those the replay says do not fit are dropped, the rest keep their rank. The ones after are as the search's
    segment arithmetic has them."""
    out: list[Candidate] = []
    dropped = 0
    for i, c in enumerate(found):
        if len(distinct(out, top)) == top:
            return _ranked(req, out) + found[i:]  # the replay's headroom may reorder (--objective headroom)
        kept = confirm(req, c)
        out += [kept] if kept is not None else []
        dropped += kept is None
        if dropped == CONFIRM_DROPS:  # the arithmetic is this far under: the rest, unconfirmed, are not plans
            break
    return _ranked(req, out)


def promote(req: SearchRequest, found: list[Candidate], near: tuple) -> list[Candidate]:
    """The ranked plans with those the segment arithmetic rejected that fit by their replay: of the candidates it
    puts just over the GPU (evaluate.ARITHMETIC_SLACK), the PROMOTED fastest that would rank above the best plan
    are replayed (evaluate.confirm). `memplan suggest --model bert-large --gpu v100-16g`: micro batch 16, 15.95 GiB
    device used by the arithmetic, replays to 14.95 of 14.99 usable, and trains 11 % faster than micro batch 8."""
    key = functools.partial(rank_key, objective=req.objective)
    # only the replay can say a candidate fits that the arithmetic puts over (not under ZeRO, several GPUs, ...)
    ahead = _ranked(req, [c for c in near if replayable(c.w) and (not found or key(c) < key(found[0]))])
    kept = list(_confirmed(req, ahead[:PROMOTED]))
    return _ranked(req, kept + found) if kept else found


def _confirmed(req: SearchRequest, cands: list[Candidate]):
    """The candidates that fit by their replay, as evaluate.confirm has them, in order (lazily: each is a replay)."""
    return (c for c in map(functools.partial(confirm, req), cands) if c is not None)


def _plain_trainer_first(req: SearchRequest) -> bool:
    """Training with no sharding named: on one GPU the plain Trainer is searched first, DeepSpeed only
    where it does not fit."""
    return req.train and req.zero is None and req.offload is None and req.fsdp is None


def run_passes(req: SearchRequest, full: Space, notes: list[str]) -> Searched:
    """The search passes: the space (on one GPU the plain Trainer first, DeepSpeed only if it does not
    fit), then for --objective min-gpus the fewest GPUs on which some plan fits."""
    # On one GPU DeepSpeed partitions nothing; it only changes the numerics (a half model with an fp32
    # master copy instead of autocast) or offloads to the host.
    deepspeed_later = full.world == 1 and _plain_trainer_first(req)
    sp = full._replace(zeros=[0], offloads=["none"]) if deepspeed_later else full
    found, n, short, near = search_pass(req, sp, notes)
    if deepspeed_later:  # DeepSpeed only where no plain Trainer plan fits by its replay, near misses promoted too
        found = promote(req, confirm_ranked(req, _ranked(req, found), 1), near)
    if deepspeed_later and not found:
        found, m, short, near = search_pass(req, full._replace(zeros=[1, 2, 3]), notes)
        n, sp = n + m, full
        if found:
            notes.append("the plain Trainer does not fit one GPU: DeepSpeed ZeRO with offload does")
    if req.objective == "min-gpus" and found:
        for g, nn in _smaller_worlds(sp.gpus, sp.nodes):
            smaller = sp._replace(gpus=g, nodes=nn)
            f2, m, _, near2 = search_pass(req, smaller)
            n += m
            f2 = confirm_ranked(req, _ranked(req, f2), 1)  # a smaller world only where a plan fits by its replay
            if f2:
                found, sp, near = f2, smaller, near2
                break
    return Searched(_ranked(req, found), n, sp, short, near)


def _ranked(req: SearchRequest, cands: list[Candidate]) -> list[Candidate]:
    return sorted(cands, key=lambda c: rank_key(c, req.objective))


def plan_notes(req: SearchRequest, found: list[Candidate], sp: Space, full: Space) -> list[str]:
    """What the first plans need from the user (memplan's kernels called, host RAM for offload), and
    the GPUs that --objective min-gpus found."""
    out = []
    best = found[0] if found else None
    if best and (best.base.kernels or best.base.tiled_mlp):
        # what the kernels buy: the best plan without them, searched as the request's passes search (the
        # plain Trainer first, DeepSpeed where it does not fit). The space holds one kernels setting and one
        # tiled-MLP setting (the user's, or off), so the best plan's space has no plan without them.
        without = run_passes(req, full._replace(kernels=[False], tiled=[False]), []).found
        plain = without[0] if without else None
        out.append(kernels_note(best.base) + ("; without them nothing fits" if plain is None else
                   f"; without them the best plan runs micro batch {plain.mb} at "
                   f"{plain.tokens_per_s / best.tokens_per_s - 1:+.0%} tokens/s"))
    elif best and best.base.attn == "memplan":
        out.append(kernels_note(best.base))
    if req.objective == "min-gpus" and found:
        out.append(f"fewest GPUs that fit: {sp.world} ({sp.nodes} node(s) of {sp.gpus})")
    shown = found[:req.top]
    if any(c.base.offload != "none" for c in shown):
        need, limit = max(host_ram(req, c) for c in shown), host_limit(req, sp.gpus)
        out.append(f"offload pins up to {need / 2**30:,.0f} GiB of host RAM per node"
                   + (" (not checked: give --cpu-mem)" if limit is None else f", of {limit / 2**30:,.0f} GiB"))
    return out


def kernels_note(w: Workload) -> str:
    """What the user's training script must call for a plan with memplan's kernels."""
    parts = (["fused loss (no batch x sequence x vocabulary logits)"] if w.kernels else []) + (
        ["tiled MLP (each layer keeps only its MLP input)"] if w.tiled_mlp else []) + (
        ["tiled attention"] if w.attn == "memplan" else [])
    return (f"the first plan trains with memplan's {' and '.join(parts)}: call "
            f"memplan.kernels.apply(model, loss={w.kernels}, mlp={w.tiled_mlp}, attention={w.attn == 'memplan'}) "
            "before training")


def alternatives_of(req: SearchRequest, sp: Space, found: list[Candidate]) -> tuple[list[Alternative], int]:
    """Up to three plans that change the precision or the optimizer (when the user left them to memplan),
    on the best plan's layout (or the whole space when nothing fits), and how many candidates that took."""
    if not req.train or (req.precision is not None and req.optim is not None):
        return [], 0
    best = found[0] if found else None
    layout = sp if best is None else sp._replace(
        tps=[best.base.tp], pps=[best.base.pp], zeros=[best.base.zero], offloads=[best.base.offload],
        sps=[best.base.sp], vpps=[best.base.vpp], fsdps=[best.base.fsdp])
    wider, n, *_ = search_pass(req, layout._replace(
        precisions=sp.precisions if req.precision is not None else supported_precisions(req.spec, req.gpu, req.task),
        optims=sp.optims if req.optim is not None else [OPTIM, "adamw_bnb_8bit", "adafactor"]))
    wider = _ranked(req, wider)
    mine = (best.base.precision, best.base.optim) if best else (best_mixed_precision(req.gpu, req.task), OPTIM)
    out: list[Alternative] = []
    seen = {mine}
    for c in wider:
        key = (c.base.precision, c.base.optim)
        if key in seen:
            continue
        seen.add(key)
        if (best is None or c.samples_per_s > best.samples_per_s * 1.01) and (c := confirm(req, c)) is not None:
            change = ", ".join(f"--{opt} {v}" for opt, v, was in zip(("precision", "optim"), key, mine) if v != was)
            out.append(Alternative(change=change, gain=_gain(c, best), plan=plan(req, c)))
        if len(out) == 3:
            break
    return out, n


def kernels_alternative(req: SearchRequest, sp: Space, found: list[Candidate]) -> tuple[list[Alternative], int]:
    """memplan's kernels are off unless asked (they need memplan.kernels.apply in the training script):
    where they would fit a plan when nothing else does, or beat the best plan by more than 1 %, say so."""
    fused, tiled = kernel_options(req, sp)
    if not req.train or (fused, tiled) == (sp.kernels, sp.tiled):
        return [], 0
    best = found[0] if found else None
    # one GPU (kernel_options): as run_passes, the plain Trainer first (the kernels may spare DeepSpeed),
    # DeepSpeed only where it does not fit
    plain = _plain_trainer_first(req)
    n, with_kernels = 0, []
    for space_ in ([sp._replace(zeros=[0], offloads=["none"])] if plain else []) + [sp]:
        wider, m, *_ = search_pass(req, space_._replace(kernels=fused, tiled=tiled))
        n += m
        with_kernels = _ranked(req, [c for c in wider if c.base.kernels or c.base.tiled_mlp])
        if with_kernels:
            break
    c = next(_confirmed(req, with_kernels[:PROMOTED]), None)
    if c is None or (best is not None and c.samples_per_s <= best.samples_per_s * 1.01):
        return [], n
    change = " ".join(opt for opt, on in (("--kernels", c.base.kernels), ("--tiled-mlp", c.base.tiled_mlp)) if on)
    call = f"memplan.kernels.apply(model, loss={c.base.kernels}, mlp={c.base.tiled_mlp}) in the training script"
    return [Alternative(change=change, gain=f"{_gain(c, best)}; needs {call}", plan=plan(req, c))], n


def method_alternatives(req: SearchRequest, sp: Space, found: list[Candidate]) -> tuple[list[Alternative], int]:
    """Full fine-tuning is kept unless the user names a method (LoRA changes what is trained); say what
    LoRA and QLoRA, at the user's rank and targets, would allow: a plan where nothing fits, or a larger
    micro batch than the best plan's (docs/finetune.md)."""
    if not req.train or req.method is not None or sp.world > 1:
        return [], 0
    best, out, n = (found[0] if found else None), [], 0
    req, targets = _lora_request(req)
    for method in ("lora", "qlora"):
        cands, m, *_ = search_pass(req, sp._replace(methods=[method], zeros=[0], offloads=["none"]))
        n += m
        if not cands or (best is not None and max(c.mb for c in cands) <= best.mb):
            continue
        c = confirm(req, max(cands, key=lambda c: (c.mb, c.samples_per_s)))  # the replay keeps its micro batch
        if c is None:
            continue
        what = f"LoRA r{req.lora_r}" + (" on every linear layer" if targets else "") + (
            " on 4-bit weights (QLoRA)" if method == "qlora" else "")
        gain = f"{what} fits with micro batch {c.mb}" + (f" (full fine-tuning: {best.mb})" if best else
                                                          f"; full fine-tuning does not fit one {req.gpu.name}")
        out.append(Alternative(change=f"--method {method}{targets}", gain=gain, plan=plan(req, c)))
    return out, n


def method_defaults(req: SearchRequest, sp: Space, found: list[Candidate]) -> list[str]:
    """The defaults line's items for the knobs of the fine-tuning methods searched (finetune.assumed), once
    each, for the precision of the best plan (or the first searched): the compute dtype follows it. The
    adapters' dtype where every fitting plan of the method runs the model alike (states.half_model)."""
    said: list[str] = []
    precision = found[0].base.precision if found else sp.precisions[0]
    for m in sp.methods:
        if m != "full":
            w = Workload(**req.common(), precision=precision, **req.tuning(m))
            half = {half_model(c.base) for c in found if c.base.method == m}
            said += [x for x in assumed(req.spec, w, req.model_fields_set, half.pop() if len(half) == 1 else None)
                     if x not in said]
    return said


def _lora_request(req: SearchRequest) -> tuple[SearchRequest, str]:
    """The request the LoRA alternatives are searched with, and the option they add: the user's targets,
    or PEFT's default for the model type; a model without one (phi3, mixtral) is offered all-linear, named
    in the option so that nothing is chosen silently."""
    if req.lora_targets or default_targets(req.spec):
        return req, ""
    return req.model_copy(update={"lora_targets": (ALL_LINEAR,)}), f" --lora-targets {ALL_LINEAR}"


def _gain(c: Candidate, best: Candidate | None) -> str:
    """What an alternative buys over the best plan (or that it fits when nothing else does)."""
    return (f"{c.samples_per_s / best.samples_per_s - 1:+.0%} samples/s, micro batch {c.mb}" if best
            else f"fits with micro batch {c.mb}")


def searched(sp: Space, world: int, task: str) -> dict[str, list[str]]:
    """The values the search tried, by knob (the parallel ones when the request has several GPUs); serving has
    no optimizer and no recompute to try."""
    out = {"precision": sp.precisions} | ({"optim": sp.optims, "grad_ckpt": sp.ckpts} if task == "train" else {}) | {
        "attn": sp.attns, "micro_batch": ["divisors of the per-rank batch"]}
    if sp.methods != ["full"]:
        out["method"] = sp.methods
    if world > 1:
        out |= {"tp": [str(x) for x in sp.tps], "pp": [str(x) for x in sp.pps],
                "sp": ["on" if s else "off" for s in sp.sps], "vpp": [str(x) for x in sp.vpps], "fsdp": sp.fsdps}
    if world > 1 or sp.zeros != [0]:
        out |= {"zero": [str(x) for x in sp.zeros], "offload": sp.offloads}
    if len(sp.kernels) > 1:
        out["kernels"] = ["off", "on"]
    if len(sp.tiled) > 1:
        out["tiled_mlp"] = ["off", "on"]
    return out


def _smaller_worlds(gpus: int, nodes: int):
    """GPU counts below gpus x nodes, fewest first: 1..gpus on one node, then whole nodes."""
    for g in divisors(gpus):
        yield g, 1
    for nn in range(2, nodes + 1):
        yield gpus, nn


def _larger_worlds(gpus: int, nodes: int):
    """More GPUs, fewest first: a fuller node (up to 8), then doubling the nodes, up to 4096 GPUs."""
    g = gpus
    while nodes == 1 and g < 8:
        g *= 2
        yield g, 1
    nn = nodes
    while g * nn * 2 <= 4096:
        nn *= 2
        yield g, nn


def nothing_fits(req: SearchRequest, sp: Space, host_short: int = 0) -> str:
    """Say what would fit: more host RAM, the fewest GPUs of this kind (doubling the nodes, up to 4096
    GPUs), or the knob the user kept closed."""
    msg = f"nothing fits on {sp.world} x {req.gpu.name} with micro batch 1"
    limit = host_limit(req, sp.gpus)
    if host_short and limit is not None:
        msg += (f"; offload would fit with {host_short / 2**30:,.0f} GiB of host RAM per node "
                f"(the node has {limit / 2**30:,.0f} GiB: --cpu-mem)")
    if req.train:
        gb = sp.global_batch
        for g, nn in _larger_worlds(sp.gpus, sp.nodes):
            batch = gb if gb % (g * nn) == 0 else g * nn * -(-gb // (g * nn))
            if search_pass(req, sp._replace(gpus=g, nodes=nn, global_batch=batch, tps=divisors(g))).candidates:
                msg += f"; it fits on {g * nn} GPUs ({nn} node(s) of {g})"
                if batch != gb:
                    msg += f" with a global batch of {batch}"
                break
        else:
            msg += "; not even on 4096 of them"
    tries = [option for option, searched_ in CLOSED_KNOBS if not searched_(sp, req.train)]
    if tries:
        msg += f"; also try {', '.join(tries)}"
    return msg + (", or a shorter --seq-len" if req.train else "; try a shorter --seq-len or int4 weights")


__all__ = ["suggest"]
