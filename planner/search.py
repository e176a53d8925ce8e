"""`suggest`: search the single-GPU knobs, keep the plans that fit, rank them by predicted speed.

Knobs that change the training mathematics (optimizer, pure bf16, fp32 vs mixed precision) are
searched only when the user allows them; otherwise the best alternative that would change them is
reported with what it would gain. Multi-GPU degrees (dp/tp/pp/zero) are fixed at 1/1/1/0 here.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from .cost import throughput
from .errors import UserError
from .estimator import MemoryBreakdown, check_hardware, estimate, supported_attn
from .modelspec import ModelSpec
from .profiles import GPUProfile
from .rules import INFER_PRECISIONS, OPTIMIZERS, TRAIN_PRECISIONS
from .workload import Workload, canonical_optim

DEFAULT_GLOBAL_BATCH = 32
ATTNS = ("flash", "sdpa", "eager")
CKPTS = ("none", "selective", "full")


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
    defaults: list[str]  # the defaults memplan chose, said out loud
    searched: dict[str, list[str]]
    candidates: int
    plans: list[Plan]
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
    for item in value.split(","):
        item = canon(item.strip().lower())
        if item not in every:
            raise UserError(f"unknown {what} {item!r} (choose from {', '.join(every)}, or 'any')")
        out.append(item)
    return out


def _evaluate(spec: ModelSpec, gpu: GPUProfile, w: Workload, global_batch: int) -> Plan | None:
    try:
        check_hardware(gpu, w)
    except UserError:
        return None
    est = estimate(spec, gpu, w)
    if not est.fits:
        return None
    b = est.breakdown
    acts = b["activations"] if w.task == "train" else b["transient"]
    state = b["weights"] + b["gradients"] + b["optimizer_states"] if w.task == "train" else b["weights"] + b["kv_cache"]
    thr = throughput(spec, gpu, w, acts, state)
    return Plan(micro_batch=w.micro_batch, grad_accum=w.grad_accum, global_batch=global_batch,
                precision=w.precision, optim=w.optim, grad_ckpt=w.grad_ckpt, attn=w.attn, seq_len=w.seq_len,
                samples_per_s=thr.samples_per_s, tokens_per_s=thr.tokens_per_s, mfu=thr.mfu, estimate=est)


def _rank_key(p: Plan) -> tuple:
    # fastest first; ties: more headroom, then fewer accumulation steps
    return (-round(p.samples_per_s, 6), -p.estimate.headroom_bytes, p.grad_accum)


def _search(spec, gpu, task, seq, global_batch, precisions, optims, ckpts, attns, momentum, headroom, zero_grad):
    plans: list[Plan] = []
    n = 0
    micro_batches = _divisors(global_batch)
    for prec in precisions:
        for optim in optims:
            for ckpt in ckpts:
                for attn in attns:
                    for mb in micro_batches:
                        try:
                            w = Workload(task=task, micro_batch=mb, seq_len=seq, grad_accum=global_batch // mb,
                                         precision=prec, optim=optim, grad_ckpt=ckpt, attn=attn, momentum=momentum,
                                         headroom=headroom, zero_grad=zero_grad)
                        except ValueError:
                            break  # e.g. flash with fp32: no micro batch makes it valid
                        n += 1
                        plan = _evaluate(spec, gpu, w, global_batch)
                        if plan is None:
                            break  # memory only grows with the micro batch (property-tested)
                        plans.append(plan)
    plans.sort(key=_rank_key)
    return plans, n


def suggest(spec: ModelSpec, gpu: GPUProfile, *, task: str = "train", seq_len: int | None = None,
            global_batch: int | None = None, precision: str | None = None, optim: str | None = None,
            grad_ckpt: str | None = None, attn: str | None = None, momentum: float = 0.0,
            headroom: float = 0.05, zero_grad: str = "set-to-none", top: int = 5) -> Suggestion:
    if top < 1:
        raise UserError("--top must be at least 1")
    defaults: list[str] = []
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
    attns = _parse_choice(attn, ATTNS, [a for a in supported_attn(spec) if a != "flash" or gpu.flash_attention],
                          "attention", lambda a: {"flash_attention_2": "flash"}.get(a, a))

    plans, n = _search(spec, gpu, task, seq, gb, precisions, optims, ckpts, attns, momentum, headroom, zero_grad)
    notes: list[str] = []
    alternatives: list[Alternative] = []
    # what the knobs the user did not open would buy
    if task == "train" and (precision is None or optim is None):
        alt_prec = precisions if precision is not None else supported
        alt_opt = optims if optim is not None else ["adamw_torch_fused", "adamw_bnb_8bit", "adafactor"]
        wider, m = _search(spec, gpu, task, seq, gb, alt_prec, alt_opt, ckpts, attns, momentum, headroom, zero_grad)
        n += m
        best = plans[0] if plans else None
        seen: set[tuple[str, str]] = set()
        for p in wider:
            key = (p.precision, p.optim)
            if key in seen or (best and key == (best.precision, best.optim)):
                continue
            seen.add(key)
            if best is None or p.samples_per_s > best.samples_per_s * 1.01:
                change = ", ".join(x for x in (
                    f"--precision {p.precision}" if p.precision != (best.precision if best else mixed) else "",
                    f"--optim {p.optim}" if p.optim != (best.optim if best else "adamw_torch_fused") else "") if x)
                gain = (f"{p.samples_per_s / best.samples_per_s - 1:+.0%} samples/s, micro batch {p.micro_batch}"
                        if best else f"fits with micro batch {p.micro_batch}")
                alternatives.append(Alternative(change=change, gain=gain, plan=p))
        alternatives = alternatives[:3]
    if not plans:
        tries = [t for t, searched in (("--grad-ckpt full", "full" in ckpts),
                                        ("--optim any", len(optims) > 1 or task != "train"),
                                        ("--precision any", len(precisions) > 1)) if not searched]
        tries += ["a shorter --seq-len", "more GPUs"]
        notes.append(f"nothing fits on one {gpu.name} with micro batch 1; try {', '.join(tries)}")
    return Suggestion(model=spec.name, gpu=gpu.name, task=task, seq_len=seq, global_batch=gb, defaults=defaults,
                      searched={"precision": precisions, "optim": optims, "grad_ckpt": ckpts, "attn": attns,
                                "micro_batch": [str(d) for d in _divisors(gb)]},
                      candidates=n, plans=plans[:top], alternatives=alternatives, notes=notes)
