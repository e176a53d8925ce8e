"""`suggest`: search every knob over the GPUs, keep the plans that fit, rank them (docs/parallel.md).

The space: tensor x pipeline x data parallel degrees over `gpus * nodes` GPUs (TP inside a node, and
dividing the attention and KV heads), sequence parallelism with TP, the interleaved pipeline schedule,
ZeRO stage 0-3 with optimizer / parameter offload, FSDP, memplan's fused loss (on one GPU, or when
asked), and every single-GPU knob: micro batch (the global batch is micro x accumulation x dp
exactly), checkpointing, precision, optimizer, attention.

Nothing is pruned: every candidate of a layout (every setting of the other knobs x every micro
batch) is evaluated at once by `memplan.estimator.table`, the estimator and the cost model in numpy; the plans
shown are estimated again by the scalar path.

Knobs that change the training mathematics (optimizer, pure bf16, fp32 vs mixed precision) are
searched only when the user allows them; otherwise the best alternative that would change them is
reported with what it would gain.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Iterable
from itertools import product
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from memplan.search.cost import COMPUTE_DTYPE, StepTime, flops_per_token, inference_throughput, rates
from memplan.search.rank import Candidate, distinct, explain, pareto, rank_key
from memplan.errors import UserError
from memplan.estimator.step import (
    MemoryBreakdown, check_hardware, check_support, fused_loss_supported, peak, report, supported_attn, tiled_mlp_supported,
    tp_problem,
)
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.estimator.rules import INFER_PRECISIONS, OPTIMIZERS, TRAIN_PRECISIONS
from memplan.inputs.workload import ADAM_OPTIMS, Workload, canonical_optim

DEFAULT_GLOBAL_BATCH = 32
ATTNS = ("flash", "sdpa", "eager", "memplan")
CKPTS = ("none", "selective", "full")
OFFLOADS = ("none", "optimizer", "all")
OBJECTIVES = ("throughput", "min-gpus", "headroom")
FSDPS = ("none", "full-shard", "shard-grad-op", "hybrid-shard")
# FSDP's sharding strategy with the same partitioning, for accelerate users (PyTorch FSDP docs:
# FULL_SHARD ~ ZeRO-3, SHARD_GRAD_OP ~ ZeRO-2, HYBRID_SHARD = FULL_SHARD inside a node, replicas across)
FSDP_EQUIVALENT = {0: "NO_SHARD", 1: "SHARD_GRAD_OP", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True)

    micro_batch: int
    grad_accum: int
    global_batch: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    precision: str
    optim: str
    grad_ckpt: str
    attn: str
    seq_len: int
    samples_per_s: float
    tokens_per_s: float
    mfu: float
    estimate: MemoryBreakdown
    sp: bool = False
    vpp: int = 1
    offload: str = "none"
    gpus: int = 1
    nodes: int = 1
    fsdp: str = "none"  # an FSDP plan (accelerate) instead of DeepSpeed / DDP
    kernels: bool = False  # trains with memplan.kernels' fused loss (memplan.kernels.apply(model))
    tiled_mlp: bool = False  # and with its tiled MLP (memplan.kernels.apply(model, mlp=True))
    fsdp_equivalent: str | None = None  # for a ZeRO plan: the FSDP sharding strategy that partitions alike
    step_seconds: float = 0.0
    step_terms: dict[str, float] = {}  # seconds per step by cost term (docs/cost-model.md)

    # -- the files to launch (memplan.emit) ------------------------------------------------------------
    def _spec(self, spec: ModelSpec | None) -> ModelSpec:
        from memplan.inputs.catalog import resolve_model

        return spec or resolve_model(self.estimate.model.hf_id or self.estimate.model.name)

    def training_arguments(self, spec: ModelSpec | None = None) -> dict:
        """Keyword arguments for transformers.TrainingArguments."""
        from memplan import emit

        return emit.training_arguments(self, self._spec(spec))

    def deepspeed_config(self, spec: ModelSpec | None = None) -> dict:
        """The ds_config.json contents (DeepSpeed plans)."""
        from memplan import emit

        return emit.deepspeed_config(self, self._spec(spec))

    def accelerate_config(self, spec: ModelSpec | None = None) -> dict:
        """The accelerate config YAML contents, as a dict."""
        from memplan import emit

        return emit.accelerate_config(self, self._spec(spec))

    def write(self, directory: str, what: tuple[str, ...] = ("trainer", "deepspeed", "accelerate"),
              force: bool = False, spec: ModelSpec | None = None) -> list[str]:
        """Write the files (atomically; an existing file only with force); return their paths."""
        from memplan import emit

        return emit.write(emit.render(self, self._spec(spec), what), directory, force)


class Alternative(BaseModel):
    change: str
    gain: str
    plan: Plan


class Suggestion(BaseModel):
    model: str
    gpu: str
    task: str
    seq_len: int
    global_batch: int
    gpus: int = 1
    nodes: int = 1
    objective: str = "throughput"
    defaults: list[str]  # the defaults memplan chose, said out loud
    searched: dict[str, list[str]]
    candidates: int  # evaluated: every setting of every knob, its memory estimated and its step time modelled
    search_seconds: float = 0.0
    plans: list[Plan]
    # fitting plans no other plan beats on both memory and speed, least memory first: the 12 with the least
    # memory of the front (pareto_size says how many it has)
    pareto: list[Plan] = []
    pareto_size: int = 0
    why: list[str] = []  # for the first plan: what each alternative would cost
    alternatives: list[Alternative]
    notes: list[str]


def default_seq_len(spec: ModelSpec, task: str) -> int:
    if spec.arch == "vision":
        return spec.seq_positions
    cap = 2048 if spec.arch == "decoder" else 512
    return min(spec.max_position or cap, cap)


def best_mixed_precision(gpu: GPUProfile, task: str) -> str:
    if task == "infer":
        return "bf16-pure" if gpu.bf16 else "fp16-pure"
    return "bf16" if gpu.bf16 else "fp16"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _parse_choice(value: str | None, every: Iterable[str], default: list[str], what: str, canon=lambda x: x) -> list[str]:
    if value is None:
        return default
    if value.strip().lower() == "any":
        return list(every)
    out = []
    for item in str(value).split(","):
        item = canon(item.strip().lower())
        if item not in every:
            raise UserError(f"unknown {what} {item!r} (choose from {', '.join(every)}, or 'any')")
        out.append(item)
    return out


def _parse_ints(value, every: list[int], what: str) -> list[int]:
    if value is None or str(value).strip().lower() == "any":
        return every
    out = []
    for item in str(value).split(","):
        try:
            out.append(int(item))
        except ValueError:
            raise UserError(f"--{what}: expected a number, a comma list or 'any', got {item!r}") from None
    return out


def _layouts(spec: ModelSpec, world: int, gpus: int, tps, pps, gb: int, notes: list[str]):
    """(tp, pp, dp) over the GPUs: TP inside a node dividing the heads, PP over the layers, and a DP
    degree that divides the global batch."""
    skipped = []
    for tp in tps:
        if world % tp or tp > gpus or tp_problem(spec, tp):
            continue
        for pp in pps:
            if (world // tp) % pp or pp > spec.total_layers:
                continue
            dp = world // (tp * pp)
            if gb % dp:
                skipped.append(f"tp {tp} x pp {pp} (dp {dp})")
                continue
            yield tp, pp, dp
    if skipped:
        notes.append(f"global batch {gb} is not divisible by the data-parallel degree of: {', '.join(skipped[:4])}"
                     + (" ..." if len(skipped) > 4 else ""))


def _evaluate_infer(spec: ModelSpec, gpu: GPUProfile, w: Workload, mb: int, m: int, usable: int) -> Candidate | None:
    w = w.model_copy(update={"micro_batch": mb, "grad_accum": m})
    p = peak(spec, gpu, w)
    if p.device_used > usable:
        return None
    thr = inference_throughput(spec, gpu, w, p.saved_activations, p.state_bytes)
    return Candidate(w, mb, m, p.device_used, usable - p.device_used, thr.samples_per_s, thr.tokens_per_s, thr.mfu,
                     thr.terms)


class Space(NamedTuple):
    precisions: list[str]
    optims: list[str]
    ckpts: list[str]
    attns: list[str]
    tps: list[int]
    pps: list[int]
    zeros: list[int]
    offloads: list[str]
    sps: list[bool]
    vpps: list[int]
    fsdps: list[str]
    kernels: list[bool]
    tiled: list[bool]


def _bases(spec: ModelSpec, gpu: GPUProfile, task: str, seq: int, gpus: int, nodes: int, tp: int, pp: int,
           dp: int, per_rank: int, sp_: Space, common: dict):
    """Every valid setting of the knobs other than the micro batch, for one layout."""
    shardings = [(z, "none") for z in sp_.zeros]
    if tp == pp == 1 and dp > 1:
        shardings += [(0, f) for f in sp_.fsdps if f != "none" and (f != "hybrid-shard" or nodes > 1)]
    sps = sp_.sps if tp > 1 else [False]
    vpps = [v for v in sp_.vpps if v == 1 or spec.total_layers % (pp * v) == 0] if pp > 1 else [1]
    kernel_opts = sp_.kernels if tp == 1 else [False]  # the fused loss and the tiled MLP are not tensor-parallel
    tiled_opts = sp_.tiled if tp == 1 else [False]
    for (zero, fsdp), offload, sp, vpp, prec, optim, ckpt, attn, fused, tiled in product(
            shardings, sp_.offloads, sps, vpps, sp_.precisions, sp_.optims, sp_.ckpts, sp_.attns, kernel_opts,
            tiled_opts):
        if (offload != "none" and zero == 0) or (offload == "all" and zero != 3) or (pp > 1 and zero > 1):
            continue  # offload is DeepSpeed's; DeepSpeed's pipeline engine refuses ZeRO-2/3
        if (zero or fsdp != "none") and optim not in ADAM_OPTIMS:
            continue
        try:
            base = Workload(task=task, micro_batch=1, seq_len=seq, grad_accum=per_rank, precision=prec, optim=optim,
                            grad_ckpt=ckpt, attn=attn, gpus=gpus, nodes=nodes, tp=tp, pp=pp, vpp=vpp, sp=sp,
                            zero=zero, offload=offload, fsdp=fsdp, kernels=fused, tiled_mlp=tiled, **common)
            check_hardware(gpu, base)
            check_support(spec, base)  # what estimate refuses is not a plan (e.g. --kernels on a model without it)
        except (ValidationError, UserError):
            continue
        yield base


def _search(spec: ModelSpec, gpu: GPUProfile, task: str, seq: int, gb: int, gpus: int, nodes: int, sp_: Space,
            common: dict, cpu_mem: int | None, notes: list[str]) -> tuple[list[Candidate], int]:
    """Every fitting candidate, and how many were evaluated (all of them: one table per layout)."""
    import numpy as np  # here, not at the top: `memplan estimate` and the API's estimate do without it

    from memplan.estimator.step import evaluate
    found: list[Candidate] = []
    n = 0
    usable = int(gpu.memory_bytes * (1 - common["headroom"]))
    for tp, pp, dp in _layouts(spec, gpus * nodes, gpus, sp_.tps, sp_.pps, gb, notes):
        per_rank = gb // dp
        mbs = _divisors(per_rank)
        bases = list(_bases(spec, gpu, task, seq, gpus, nodes, tp, pp, dp, per_rank, sp_, common))
        if not bases:
            continue
        if task != "train":
            for base in bases:
                for mb in mbs:
                    n += 1
                    c = _evaluate_infer(spec, gpu, base, mb, per_rank // mb, usable)
                    if c is not None:
                        found.append(c)
            continue
        t = evaluate(spec, gpu, bases, mbs, per_rank)
        ms = np.asarray([per_rank // mb for mb in mbs])
        # the interleaved schedule needs the micro batches to be a multiple of the stages
        valid = np.asarray([w.vpp == 1 for w in bases])[:, None] | (ms % pp == 0)[None, :]
        n += int(valid.sum())
        fits = valid & (t.device_used <= usable)
        if cpu_mem is not None:
            fits &= t.cpu_per_gpu * gpus <= cpu_mem
        seq_eff = spec.seq_positions if spec.arch == "vision" else seq
        flops = {(a, g): flops_per_token(spec, seq_eff, a, g)[0] for a in sp_.attns for g in sp_.ckpts}
        model_f = [flops[(w.attn, w.grad_ckpt)] for w in bases]  # model FLOPs: no recompute
        peak_tf = [gpu.tflops.get(COMPUTE_DTYPE[w.precision]) or gpu.tflops.get("fp32", 1.0) for w in bases]
        used, steps, terms = t.device_used.tolist(), t.step.tolist(), t.terms.transpose(1, 2, 0).tolist()
        rows, cols = np.nonzero(fits)
        for b, k in zip(rows.tolist(), cols.tolist()):
            w, mb, m, dev = bases[b], mbs[k], per_rank // mbs[k], used[b][k]
            r = rates(w, mb, m, seq_eff, steps[b][k], model_f[b], peak_tf[b], StepTime(*terms[b][k]))
            found.append(Candidate(w, mb, m, dev, usable - dev, r.samples_per_s, r.tokens_per_s, r.mfu, r.terms))
    return found, n


def _plan(spec: ModelSpec, gpu: GPUProfile, c: Candidate) -> Plan:
    w = c.w
    est = report(spec, gpu, w, peak(spec, gpu, w))
    st = c.step
    terms = {k: getattr(st, k) for k in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "optimizer")} if st else {}
    return Plan(micro_batch=w.micro_batch, grad_accum=w.grad_accum, global_batch=w.global_batch, dp=w.dp, tp=w.tp,
                pp=w.pp, zero_stage=w.zero, precision=w.precision, optim=w.optim, grad_ckpt=w.grad_ckpt, attn=w.attn,
                seq_len=w.seq_len, samples_per_s=c.samples_per_s, tokens_per_s=c.tokens_per_s, mfu=c.mfu,
                estimate=est, sp=w.sp, vpp=w.vpp, offload=w.offload, gpus=w.gpus, nodes=w.nodes, fsdp=w.fsdp,
                kernels=w.kernels, tiled_mlp=w.tiled_mlp,
                fsdp_equivalent=(FSDP_EQUIVALENT[w.zero] if w.task == "train" and w.world > 1 and w.tp == w.pp == 1
                                 and w.fsdp == "none" else None),
                step_seconds=st.total if st else 0.0, step_terms=terms)


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


@_without_gc
def suggest(spec: ModelSpec, gpu: GPUProfile, *, task: str = "train", seq_len: int | None = None,
            global_batch: int | None = None, precision: str | None = None, optim: str | None = None,
            grad_ckpt: str | None = None, attn: str | None = None, momentum: float = 0.0,
            headroom: float = 0.05, zero_grad: str = "set-to-none", top: int = 5, gpus: int = 1, nodes: int = 1,
            zero=None, offload: str | None = None, tp=None, pp=None, sp: str | None = None, vpp=None,
            fsdp: str | None = None, kernels: bool | None = None, tiled_mlp: bool | None = None,
            cpu_mem: int | None = None, net_gbs: float | None = None, objective: str = "throughput") -> Suggestion:
    t0 = time.perf_counter()
    if top < 1:
        raise UserError("--top must be at least 1")
    if gpus < 1 or nodes < 1:
        raise UserError("--gpus and --nodes must be at least 1")
    if objective not in OBJECTIVES:
        raise UserError(f"unknown objective {objective!r} (choose from {', '.join(OBJECTIVES)})")
    defaults: list[str] = []
    if task == "train" and (kernels or tiled_mlp):  # asked for by name: refused as estimate refuses it
        check_support(spec, Workload(task=task, kernels=bool(kernels), tiled_mlp=bool(tiled_mlp)))
    seq = seq_len or default_seq_len(spec, task)
    if seq_len is None:
        defaults.append(f"seq-len {seq} ({'image patches + CLS' if spec.arch == 'vision' else 'model maximum, capped'})")
    gb = global_batch or DEFAULT_GLOBAL_BATCH
    if global_batch is None:
        defaults.append(f"global batch {gb} sequences")
    if gb < 1 or seq < 1:
        raise UserError("--batch-size and --seq-len must be positive")
    if spec.arch != "vision" and spec.max_position and seq > spec.max_position and spec.position == "learned":
        raise UserError(f"--seq-len {seq} exceeds {spec.name}'s {spec.max_position} learned positions")

    mixed = best_mixed_precision(gpu, task)
    all_prec = TRAIN_PRECISIONS if task == "train" else INFER_PRECISIONS
    supported = [p for p in all_prec if gpu.bf16 or "bf16" not in p]
    precisions = _parse_choice(precision, supported, [mixed], "precision")
    if precision is None:
        defaults.append(f"precision {mixed} (best mixed precision {gpu.name} supports)")
    if task == "train":
        optims = _parse_choice(optim, list(OPTIMIZERS), ["adamw_torch_fused"], "optimizer", canonical_optim)
        if optim is None:
            defaults.append("optimizer adamw_torch_fused (HF Trainer's default)")
    else:
        optims = ["adamw_torch_fused"]
    ckpts = _parse_choice(grad_ckpt, CKPTS, list(CKPTS) if task == "train" else ["none"], "checkpointing")
    # memplan's tiled attention saves what SDPA and FlashAttention-2 save: searched when asked (--attn)
    attns = _parse_choice(attn, ATTNS, [a for a in supported_attn(spec) if (a != "flash" or gpu.flash_attention)
                                        and a != "memplan"],
                          "attention", lambda a: {"flash_attention_2": "flash"}.get(a, a))
    world = gpus * nodes
    train = task == "train"
    space = Space(
        precisions, optims, ckpts, attns,
        tps=_parse_ints(tp, _divisors(gpus) if train else [1], "tp"),
        pps=_parse_ints(pp, _divisors(world) if train else [1], "pp"),
        zeros=_parse_ints(zero, [0, 1, 2, 3] if train and fsdp is None else [0], "zero"),
        offloads=_parse_choice(offload, OFFLOADS, list(OFFLOADS) if train else ["none"], "offload"),
        sps=[s == "on" for s in _parse_choice(sp, ("off", "on"), ["off", "on"], "sp")],
        vpps=_parse_ints(vpp, [1, 2], "vpp"),
        # naming one framework's sharding (--zero or --fsdp) leaves the other out unless it is named too
        fsdps=_parse_choice(fsdp, FSDPS, list(FSDPS) if train and zero is None and world > 1 else ["none"], "fsdp"),
        # the fused loss is searched on one GPU where memplan.kernels.apply can patch the model (the
        # logits weigh most there); over several GPUs when asked (--kernels), to keep the search fast
        kernels=[bool(kernels)] if kernels is not None else
        ([False, True] if train and world == 1 and fused_loss_supported(spec) else [False]),
        # the tiled MLP likewise (it costs an MLP forward, so only where memory is short does it pay)
        tiled=[bool(tiled_mlp)] if tiled_mlp is not None else
        ([False, True] if train and world == 1 and tiled_mlp_supported(spec) else [False]),
    )
    common = dict(momentum=momentum, headroom=headroom, zero_grad=zero_grad, net_gbs=net_gbs)
    notes: list[str] = []
    # One GPU: the plain Trainer unless it cannot fit. DeepSpeed there partitions nothing; it only changes
    # the numerics (a half model with an fp32 master copy instead of autocast) or offloads to the host.
    deepspeed_later = world == 1 and train and zero is None and offload is None and fsdp is None
    first = space._replace(zeros=[0], offloads=["none"]) if deepspeed_later else space
    found, n = _search(spec, gpu, task, seq, gb, gpus, nodes, first, common, cpu_mem, notes)
    if deepspeed_later:
        if found:
            space = first
        else:
            more, m = _search(spec, gpu, task, seq, gb, gpus, nodes, space._replace(zeros=[1, 2, 3]), common,
                              cpu_mem, notes)
            found, n = more, n + m
            if found:
                notes.append("the plain Trainer does not fit one GPU: DeepSpeed ZeRO with offload does")
    shown_world = (gpus, nodes)
    if objective == "min-gpus" and found:
        # the fewest GPUs of this kind (whole nodes past one node) on which some plan fits
        for g, nn in _smaller_worlds(gpus, nodes):
            f2, m = _search(spec, gpu, task, seq, gb, g, nn, space, common, cpu_mem, [])
            n += m
            if f2:
                found, shown_world = f2, (g, nn)
                break
    found.sort(key=lambda c: rank_key(c, objective))
    plans = [_plan(spec, gpu, c) for c in distinct(found, top)]
    whole_front = pareto(found)
    front = [_plan(spec, gpu, c) for c in whole_front[:12]]
    why = explain(found[0], found, space) if found else []
    if found and (found[0].base.kernels or found[0].base.tiled_mlp):
        # what the kernels buy: the best plan without them (found is ranked)
        plain = next((c for c in found if not (c.base.kernels or c.base.tiled_mlp)), None)
        best = found[0]
        notes.append(kernels_note(best.base) + ("; without them nothing fits" if plain is None else
                     f"; without them the best plan runs micro batch {plain.mb} at "
                     f"{plain.tokens_per_s / best.tokens_per_s - 1:+.0%} tokens/s"))
    elif found and found[0].base.attn == "memplan":
        notes.append(kernels_note(found[0].base))
    if objective == "min-gpus" and found:
        notes.append(f"fewest GPUs that fit: {shown_world[0] * shown_world[1]} ({shown_world[1]} node(s) of "
                     f"{shown_world[0]})")
    if found and any(c.base.offload != "none" for c in found[:top]):
        need = max(_plan_cpu(spec, gpu, c) for c in found[:top])
        notes.append(f"offload pins up to {need / 2**30:,.0f} GiB of host RAM per node"
                     + ("" if cpu_mem else " (not checked: give --cpu-mem)"))

    alternatives: list[Alternative] = []
    if train and (precision is None or optim is None):
        alt_prec = precisions if precision is not None else supported
        alt_opt = optims if optim is not None else ["adamw_torch_fused", "adamw_bnb_8bit", "adafactor"]
        # on the best plan's layout (or the whole space when nothing fits): what precision / optimizer buy
        b0 = found[0].base if found else None
        layout = space if b0 is None else space._replace(
            tps=[b0.tp], pps=[b0.pp], zeros=[b0.zero], offloads=[b0.offload], sps=[b0.sp], vpps=[b0.vpp],
            fsdps=[b0.fsdp])
        wider, m = _search(spec, gpu, task, seq, gb, shown_world[0], shown_world[1],
                           layout._replace(precisions=alt_prec, optims=alt_opt), common, cpu_mem, [])
        n += m
        wider.sort(key=lambda c: rank_key(c, objective))
        best = found[0] if found else None
        seen: set[tuple[str, str]] = set()
        for c in wider:
            key = (c.base.precision, c.base.optim)
            if key in seen or (best and key == (best.base.precision, best.base.optim)):
                continue
            seen.add(key)
            if best is None or c.samples_per_s > best.samples_per_s * 1.01:
                change = ", ".join(x for x in (
                    f"--precision {c.base.precision}" if c.base.precision != (best.base.precision if best else mixed) else "",
                    f"--optim {c.base.optim}" if c.base.optim != (best.base.optim if best else "adamw_torch_fused") else "")
                    if x)
                gain = (f"{c.samples_per_s / best.samples_per_s - 1:+.0%} samples/s, micro batch {c.mb}"
                        if best else f"fits with micro batch {c.mb}")
                alternatives.append(Alternative(change=change, gain=gain, plan=_plan(spec, gpu, c)))
            if len(alternatives) == 3:
                break
    if not found:
        notes.append(_nothing_fits(spec, gpu, task, seq, gb, gpus, nodes, space, common, cpu_mem, train))
    searched = {"precision": precisions, "optim": optims, "grad_ckpt": ckpts, "attn": attns,
                "micro_batch": ["divisors of the per-rank batch"]}
    if world > 1:
        searched |= {"tp": [str(x) for x in space.tps], "pp": [str(x) for x in space.pps],
                     "sp": ["on" if s else "off" for s in space.sps], "vpp": [str(x) for x in space.vpps],
                     "fsdp": space.fsdps}
    if world > 1 or space.zeros != [0]:
        searched |= {"zero": [str(x) for x in space.zeros], "offload": space.offloads}
    if len(space.kernels) > 1:
        searched["kernels"] = ["off", "on"]
    if len(space.tiled) > 1:
        searched["tiled_mlp"] = ["off", "on"]
    return Suggestion(model=spec.name, gpu=gpu.name, task=task, seq_len=seq, global_batch=gb, gpus=shown_world[0],
                      nodes=shown_world[1], objective=objective, defaults=defaults, searched=searched, candidates=n,
                      search_seconds=time.perf_counter() - t0, plans=plans, pareto=front, pareto_size=len(whole_front), why=why,
                      alternatives=alternatives, notes=notes)


def kernels_note(w: Workload) -> str:
    """What the user's training script must call for a plan with memplan's kernels."""
    parts = (["fused loss (no batch x sequence x vocabulary logits)"] if w.kernels else []) + (
        ["tiled MLP (each layer keeps only its MLP input)"] if w.tiled_mlp else []) + (
        ["tiled attention"] if w.attn == "memplan" else [])
    return (f"the first plan trains with memplan's {' and '.join(parts)}: call "
            f"memplan.kernels.apply(model, loss={w.kernels}, mlp={w.tiled_mlp}, attention={w.attn == 'memplan'}) "
            "before training")


def _plan_cpu(spec: ModelSpec, gpu: GPUProfile, c: Candidate) -> int:
    return peak(spec, gpu, c.w).cpu_per_gpu * c.w.gpus


def _smaller_worlds(gpus: int, nodes: int):
    """GPU counts below gpus x nodes, fewest first: 1..gpus on one node, then whole nodes."""
    for g in _divisors(gpus):
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


def _nothing_fits(spec, gpu, task, seq, gb, gpus, nodes, space: Space, common, cpu_mem, train: bool) -> str:
    """Say what would fit: the fewest GPUs of this kind (doubling the nodes, up to 4096 GPUs), or the
    knob the user kept closed."""
    tries = [t for t, searched in (("--grad-ckpt full", "full" in space.ckpts),
                                    ("--optim any", len(space.optims) > 1 or not train),
                                    ("--precision any", len(space.precisions) > 1),
                                    ("--zero 3 --offload all", 3 in space.zeros and "all" in space.offloads or not train),
                                    ) if not searched]
    world = gpus * nodes
    msg = f"nothing fits on {world} x {gpu.name} with micro batch 1"
    if train:
        for g, nn in _larger_worlds(gpus, nodes):
            batch = gb if gb % (g * nn) == 0 else g * nn * -(-gb // (g * nn))
            if _search(spec, gpu, task, seq, batch, g, nn, space._replace(tps=_divisors(g)), common, cpu_mem, [])[0]:
                msg += f"; it fits on {g * nn} GPUs ({nn} node(s) of {g})"
                if batch != gb:
                    msg += f" with a global batch of {batch}"
                break
        else:
            msg += "; not even on 4096 of them"
    if tries:
        msg += f"; also try {', '.join(tries)}"
    return msg + (", or a shorter --seq-len" if train else "; try a shorter --seq-len or int4 weights")
