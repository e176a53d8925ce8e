"""Evaluating a space: every candidate's memory and step time (one step table per layout: the estimator
and the cost model over arrays), and the Plan documents of the few that are shown, read from the cells
that evaluated them.

The only calls into the estimator the search makes are here: step.evaluate, step.cell_peak, step.peak
(inference) and step.report."""

from __future__ import annotations

from typing import NamedTuple

from memplan.estimator.breakdown import allocator_mode, usable_bytes, with_host_limit
from memplan.estimator.step import cell_peak, evaluate, peak, report
from memplan.estimator.serving_timeline import serving_replayable
from memplan.estimator.timeline import replayable
from memplan.inputs import constraints
from memplan.inputs.defaults import host_ram as default_host_ram
from memplan.inputs.workload import Workload
from memplan.search.cost import StepTime, flops_per_token, workload_rates
from memplan.search.plan import Plan
from memplan.search.rank import Candidate
from memplan.search.request import SearchRequest
from memplan.search.space import Space, bases, divisors, layouts


class Found(NamedTuple):
    candidates: list[Candidate]  # every candidate that fits
    evaluated: int  # how many were evaluated (all of them: one table per layout)
    # the least host RAM per node among candidates that fit the GPU but not the host RAM (0: none)
    host_short: int = 0
    near: tuple = ()  # candidates the segment arithmetic puts over the GPU by less than ARITHMETIC_SLACK


# The segment arithmetic the search filters with over-predicts what the replay and real runs reserve: on the lent
# H200's 38 runs a median 9.5 %, at most 21.9 % (docs/estimator.md). A candidate it puts over the usable memory by
# less than this share may fit by its replay, which suggest asks for the fastest few (suggestion.promote).
ARITHMETIC_SLACK = 0.25


def host_limit(req: SearchRequest, gpus: int) -> int | None:
    """Host RAM per node a plan on nodes of `gpus` GPUs may pin: --cpu-mem, else the default
    (memplan.inputs.defaults.host_ram); None: not checked."""
    return req.cpu_mem if req.cpu_mem is not None else default_host_ram(req.gpu, gpus)


def _least(a: int, b: int) -> int:
    return min(x for x in (a, b) if x) if a or b else 0


def search_pass(req: SearchRequest, sp: Space, notes: list[str] | None = None) -> Found:
    """Every fitting candidate of the space (notes: where to say which layouts the batch rules out)."""
    found: list[Candidate] = []
    near: list[Candidate] = []
    n = short = 0
    for tp, pp, dp in layouts(req, sp, [] if notes is None else notes):
        per_rank = sp.global_batch // dp
        ws = bases(req, sp, tp, pp, dp)
        if ws:
            f = (_train if req.train else _infer)(req, sp, ws, per_rank)
            found += f.candidates
            near += f.near
            n += f.evaluated
            short = _least(short, f.host_short)
    return Found(found, n, short, tuple(near))


def _usable(req: SearchRequest) -> int:
    return usable_bytes(req.gpu, req.headroom)


def _infer(req: SearchRequest, sp: Space, ws: list[Workload], per_rank: int) -> Found:
    spec, gpu, usable = req.spec, req.gpu, _usable(req)
    found, mbs = [], divisors(per_rank)
    for base in ws:
        for mb in mbs:
            w = base.model_copy(update={"micro_batch": mb, "grad_accum": per_rank // mb})
            p = peak(spec, gpu, w)
            used, cand = p.device_used, base
            if used > usable and req.expandable_segments is None:  # may fit only with expandable segments
                used = p.by_allocator["expandable_segments"]["device_used_bytes"]
                cand = base.model_copy(update={"expandable_segments": True})
            if used <= usable:
                found.append(Candidate(cand, mb, per_rank // mb, used, usable - used, p.rates))
    return Found(found, len(ws) * len(mbs))


def _train(req: SearchRequest, sp: Space, ws: list[Workload], per_rank: int) -> Found:
    """One table (candidates x micro batches) for the layout: memory and step time in numpy."""
    import numpy as np

    spec, gpu, usable = req.spec, req.gpu, _usable(req)
    mbs = divisors(per_rank)
    t = evaluate(spec, gpu, ws, mbs, per_rank)
    valid = np.asarray(constraints.batch_allowed(ws, mbs, per_rank, spec, gpu), dtype=bool)
    fits = valid & (t.device_used <= usable)
    # where the user left the allocator to memplan, a cell that fits only with expandable segments is a plan
    # that runs with them (PYTORCH_CUDA_ALLOC_CONF in launch.sh)
    expand = valid & ~fits & (t.modes.device_used_expandable <= usable)
    if req.expandable_segments is not None:  # the user decided: True runs every base with them, False none
        expand[:] = False
    fits = fits | expand
    least = t.device_used if req.expandable_segments is not None else np.minimum(
        t.device_used, t.modes.device_used_expandable)
    near = valid & ~fits & (least <= usable * (1 + ARITHMETIC_SLACK))
    limit, short = host_limit(req, sp.gpus), 0
    if limit is not None:  # host RAM is a limit like the GPU's: what offload pins must fit it
        host = t.cpu_per_gpu * sp.gpus
        over = fits & (host > limit)
        short = int(host[over].min()) if over.any() else 0
        fits &= ~over
        near &= host <= limit
    found = _candidates(req, sp, ws, mbs, per_rank, t, fits, expand)
    return Found(found, int(valid.sum()), short, tuple(_candidates(req, sp, ws, mbs, per_rank, t, near, expand)))


def _candidates(req: SearchRequest, sp: Space, ws: list[Workload], mbs: list[int], per_rank: int, t, cells,
                expand) -> list[Candidate]:
    """The Candidates of a layout's table at its `cells` (a boolean table), with their step time; a cell in
    `expand` runs with expandable segments."""
    import numpy as np

    spec, gpu, usable = req.spec, req.gpu, _usable(req)
    seq_eff = spec.seq_positions if spec.arch == "vision" else sp.seq
    flops = {(a, g): flops_per_token(spec, seq_eff, a, g)[0] for a in sp.attns for g in sp.ckpts}
    model_f = [flops[(w.attn, w.grad_ckpt)] for w in ws]  # model FLOPs: no recompute
    used, steps, terms = t.device_used.tolist(), t.step.tolist(), t.terms.transpose(1, 2, 0).tolist()
    out = []
    rows, cols = np.nonzero(cells)
    used_exp = t.modes.device_used_expandable.tolist()
    for b, k in zip(rows.tolist(), cols.tolist()):
        w, mb, m, dev = ws[b], mbs[k], per_rank // mbs[k], used[b][k]
        if expand[b, k]:
            w, dev = w.model_copy(update={"expandable_segments": True}), used_exp[b][k]
        r = workload_rates(spec, gpu, w, mb, m, steps[b][k], StepTime(*terms[b][k]), model_f[b])
        out.append(Candidate(w, mb, m, dev, usable - dev, r, (t, b, k)))
    return out


def confirm(req: SearchRequest, c: Candidate) -> Candidate | None:
    """A fitting candidate as its report has it: where the replay covers it (one GPU training a whole replica, or
    serving), its meters from the replay of its allocations, which the search's segment arithmetic only bounds
    (docs/estimator.md), and None when they do not fit. With the allocator left to memplan it runs the default
    allocator where that fits, else expandable segments."""
    if not (serving_replayable(req.spec, c.w) if c.cell is None else replayable(c.w)):
        return c
    usable = _usable(req)
    by_mode = _peak(req, c).by_allocator
    modes = (False, True) if req.expandable_segments is None else (c.base.expandable_segments,)
    for expandable in modes:
        used = by_mode[allocator_mode(expandable)]["device_used_bytes"]
        if used <= usable:
            return c._replace(base=c.base.model_copy(update={"expandable_segments": expandable}),
                              device_used=used, headroom=usable - used)
    return None


def plan(req: SearchRequest, c: Candidate) -> Plan:
    """The Plan document of a candidate: its estimate (read from its table cell, reserved replayed where the
    replay covers it, with the host RAM it was held to), and its step time."""
    w = c.w
    st = c.step
    est = report(req.spec, req.gpu, w, _peak(req, c))
    return Plan(workload=w, samples_per_s=c.samples_per_s, tokens_per_s=c.tokens_per_s, mfu=c.mfu,
                estimate=with_host_limit(est, host_limit(req, w.gpus)),
                step_seconds=st.total if st else 0.0, step_terms=st._asdict() if st else {})


def host_ram(req: SearchRequest, c: Candidate) -> int:
    """Host RAM that offload pins per node for the candidate."""
    return _peak(req, c).cpu_per_gpu * c.w.gpus


def _peak(req: SearchRequest, c: Candidate):
    if c.cell is None:  # inference: one configuration
        return peak(req.spec, req.gpu, c.w, simulate=True)
    t, b, k = c.cell
    return cell_peak(req.spec, req.gpu, t, c.w, b, k, simulate=True)
