"""The search space of a request: the values of every knob (memplan's defaults said out loud), the
layouts over the GPUs, and every candidate of a layout that the constraints table allows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from memplan.errors import UserError
from memplan.estimator.rules import OPTIMIZERS
from memplan.estimator.families import fused_loss_supported, supported_attn, tiled_mlp_supported
from memplan.inputs import constraints, defaults as chosen
from memplan.inputs.defaults import precision as best_mixed_precision, seq_len as default_seq_len
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import ATTN_ALIASES, METHOD_KNOBS, Workload, canonical_optim
from memplan.search.request import SearchRequest, parse_choice

ATTNS = ("flash", "sdpa", "eager", "memplan")
CKPTS = ("none", "selective", "full")
OFFLOADS = ("none", "optimizer", "all")
ZEROS = ("0", "1", "2", "3")
FSDPS = ("none", "full-shard", "shard-grad-op", "hybrid-shard")


# suggest's knob options (Workload fields) -> the Space list of their values
KNOBS = {"precision": "precisions", "optim": "optims", "grad_ckpt": "ckpts", "attn": "attns", "tp": "tps", "pp": "pps",
         "zero": "zeros", "offload": "offloads", "sp": "sps", "vpp": "vpps", "fsdp": "fsdps", "kernels": "kernels",
         "tiled_mlp": "tiled", "method": "methods"}


class Space(NamedTuple):
    seq: int
    global_batch: int
    gpus: int
    nodes: int
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
    methods: list[str]

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


def supported_precisions(spec: ModelSpec, gpu: GPUProfile, task: str) -> list[str]:
    """The task's precisions the constraints table lets this GPU run (bf16 needs sm80)."""
    return constraints.allowed({"task": task}, "precision", constraints.precisions_of(task), spec, gpu)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _parse_ints(value, every: list[int], what: str) -> list[int]:
    if value is None or str(value).strip().lower() == "any":
        return every
    out = []
    for item in str(value).split(","):
        try:
            out.append(int(item))
        except ValueError:
            raise UserError(f"--{what}: expected a number, a comma list or 'any', got {item!r}") from None
        if out[-1] < 1:
            raise UserError(f"--{what}: a degree is at least 1, got {item!r}")
    return out


def defaults(req: SearchRequest) -> list[str]:
    """The defaults memplan chooses for what the request leaves open, said out loud: the line estimate
    and verify print for the same question (memplan.inputs.defaults)."""
    given = {k: getattr(req, k) for k in ("task", "seq_len", "max_new_tokens", "precision", "optim", "kernels",
                                          "tiled_mlp", "cpu_mem")}
    return chosen.choose(req.spec, req.gpu, given, gpus=req.gpus).said


def space(req: SearchRequest) -> Space:
    """Every value of every knob the search tries. A UserError for a value that does not parse, or for
    values the user named that the constraints table refuses (as estimate would), rather than a search
    where nothing fits."""
    sp = _values(req)
    fixed = dict(req.common(), gpus=req.gpus, nodes=req.nodes, seq_len=sp.seq)
    choices = {k: getattr(sp, v) for k, v in KNOBS.items()}
    # every value the user named must run with some setting of the rest (`--precision fp16,bf16` on a V100
    # refuses bf16 with the table's reason rather than dropping it)
    named = [{k: [v]} for k in KNOBS if str(getattr(req, k) or "any").strip().lower() != "any" for v in choices[k]]
    for one in [{}] + named:
        problem = constraints.refusal(fixed, choices | one, req.spec, req.gpu)
        if problem:
            raise UserError(problem)
    return sp


def _values(req: SearchRequest) -> Space:
    spec, gpu, train, world = req.spec, req.gpu, req.train, req.gpus * req.nodes
    # memplan's tiled attention saves what SDPA and FlashAttention-2 save: searched when asked (--attn)
    attns = [a for a in constraints.allowed({"task": req.task}, "attn", supported_attn(spec), spec, gpu)
             if a != "memplan"]
    return Space(
        seq=req.seq_len or default_seq_len(spec, req.task, req.max_new_tokens),
        global_batch=req.global_batch or chosen.GLOBAL_BATCH,
        gpus=req.gpus, nodes=req.nodes,
        precisions=parse_choice(req.precision, supported_precisions(spec, gpu, req.task),
                                [best_mixed_precision(gpu, req.task)], "precision",
                                known=constraints.precisions_of(req.task)),
        optims=parse_choice(req.optim, list(OPTIMIZERS), [chosen.OPTIM], "optimizer", canonical_optim)
        if train else [chosen.OPTIM],
        ckpts=parse_choice(req.grad_ckpt, CKPTS, list(CKPTS) if train else ["none"], "checkpointing"),
        attns=parse_choice(req.attn, ATTNS, attns, "attention", lambda a: ATTN_ALIASES.get(a, a)),
        tps=_parse_ints(req.tp, divisors(req.gpus) if train else [1], "tp"),
        pps=_parse_ints(req.pp, divisors(world) if train else [1], "pp"),
        zeros=[int(z) for z in parse_choice(req.zero, ZEROS, list(ZEROS) if train and req.fsdp is None else ["0"],
                                            "zero")],
        offloads=parse_choice(req.offload, OFFLOADS, list(OFFLOADS) if train else ["none"], "offload"),
        sps=[s == "on" for s in parse_choice(req.sp, ("off", "on"), ["off", "on"], "sp")],
        vpps=_parse_ints(req.vpp, [1, 2], "vpp"),
        # naming one framework's sharding (--zero or --fsdp) leaves the other out unless it is named too
        fsdps=parse_choice(req.fsdp, FSDPS, list(FSDPS) if train and req.zero is None and world > 1 else ["none"],
                           "fsdp"),
        kernels=[chosen.KERNELS] if req.kernels is None else [req.kernels],
        tiled=[chosen.TILED_MLP] if req.tiled_mlp is None else [req.tiled_mlp],
        methods=req.methods,
    )


def kernel_options(req: SearchRequest, sp: Space) -> tuple[list[bool], list[bool]]:
    """The kernels' settings an alternative may try where the user left them to memplan: on one GPU,
    where memplan.kernels.apply can patch the model (the logits weigh most there; the tiled MLP costs an
    MLP forward, so it pays only where memory is short)."""
    alone = req.train and sp.world == 1
    fused = req.kernels is None and alone and fused_loss_supported(req.spec)
    tiled = req.tiled_mlp is None and alone and tiled_mlp_supported(req.spec)
    return (sp.kernels + [True] if fused else sp.kernels), (sp.tiled + [True] if tiled else sp.tiled)


def layouts(req: SearchRequest, sp: Space, notes: list[str]) -> Iterator[tuple[int, int, int]]:
    """(tp, pp, dp) over the GPUs that the constraints allow (TP inside a node dividing the heads, PP
    over the layers, ...), with a data-parallel degree that divides the global batch."""
    fixed = dict(req.common(), gpus=sp.gpus, nodes=sp.nodes, seq_len=sp.seq)
    skipped = []
    for a in constraints.assignments(fixed, [("tp", sp.tps), ("pp", sp.pps)], req.spec, req.gpu):
        dp = sp.world // (a["tp"] * a["pp"])
        if sp.global_batch % dp:
            skipped.append(f"tp {a['tp']} x pp {a['pp']} (dp {dp})")
            continue
        yield a["tp"], a["pp"], dp
    if skipped:
        notes.append(f"global batch {sp.global_batch} is not divisible by the data-parallel degree of: "
                     f"{', '.join(skipped[:4])}" + (" ..." if len(skipped) > 4 else ""))


def shardings(sp: Space, dp: int) -> list[tuple[int, str]]:
    """The (ZeRO stage, FSDP strategy) pairs a layout of `dp` data-parallel ranks searches: FSDP over one
    rank shards nothing, and hybrid-shard inside one node is full-shard."""
    out = [(z, "none") for z in sp.zeros]
    if dp > 1:
        out += [(0, f) for f in sp.fsdps if f != "none" and (f != "hybrid-shard" or sp.nodes > 1)]
    return out


def bases(req: SearchRequest, sp: Space, tp: int, pp: int, dp: int) -> list[Workload]:
    """Every setting of the knobs other than the micro batch that the constraints allow, on one layout
    (micro batch 1, the whole per-rank batch accumulated)."""
    spec, gpu = req.spec, req.gpu
    fixed = dict(req.common(), micro_batch=1, seq_len=sp.seq, grad_accum=sp.global_batch // dp, gpus=sp.gpus,
                 nodes=sp.nodes, tp=tp, pp=pp)
    # a knob asked for applies where it can: where the layout refuses every asked value, it is off
    # (SP without TP, an interleaved schedule without a pipeline, the fused loss under TP)
    def where_possible(name: str, values: list, off) -> list:
        return constraints.allowed(fixed, name, values, spec, gpu) or [off]

    axes = [(("zero", "fsdp"), shardings(sp, dp)), ("offload", sp.offloads), ("sp", where_possible("sp", sp.sps, False)),
            ("vpp", where_possible("vpp", sp.vpps, 1)), ("precision", sp.precisions), ("optim", sp.optims),
            ("grad_ckpt", sp.ckpts), ("attn", sp.attns), ("kernels", where_possible("kernels", sp.kernels, False)),
            ("tiled_mlp", where_possible("tiled_mlp", sp.tiled, False)),
            (("method",) + METHOD_KNOBS, [tuple(req.tuning(m).values()) for m in sp.methods])]
    # every entry of the constraints table has passed on each assignment, and the values come from the
    # space's canonical lists: validating each again would repeat the same table (a third of a search)
    template = Workload.model_construct(**fixed)
    return [template.model_copy(update=a) for a in constraints.assignments(fixed, axes, spec, gpu)]
