"""Terminal rendering (rich): the breakdown with proportional bars, the meters, the plan table."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from memplan.estimator.breakdown import MemoryBreakdown, allocator_mode
from memplan.inputs.defaults import line
from memplan.search.rank import sharding_label
from memplan.search.plan import Suggestion

GIB = 1 << 30
MIB = 1 << 20
BAR = 30


# the width of output that is not a terminal (a pipe, a file): wide enough that no table column or line is
# cut or wrapped; rich sizes a table to its content, so nothing is padded to it
PIPE_WIDTH = 10_000


def console() -> Console:
    """A console that does not squeeze tables to 80 columns when the output is a pipe or a file."""
    return Console() if sys.stdout.isatty() else Console(width=PIPE_WIDTH)


def gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if abs(n) >= GIB else f"{n / MIB:,.0f} MiB"


def _bar(n: int, of: int) -> str:
    filled = 0 if of <= 0 else min(BAR, round(BAR * max(n, 0) / of))  # past capacity: a full bar
    return "█" * filled + "·" * (BAR - filled)


def _workload_line(e: MemoryBreakdown) -> str:
    w = e.workload
    if w.task == "infer":
        gen = f", {w.max_new_tokens} new tokens x {w.beams} beams" if w.max_new_tokens else ""
        return f"infer {w.precision}, batch {w.micro_batch} x seq {w.seq_len}{gen}, attn {w.attn}"
    tuned = "" if w.method == "full" else f"{method_label(w)}, "
    line = (f"train {w.precision}, {tuned}micro batch {w.micro_batch} x seq {w.seq_len}, grad accum {w.grad_accum}, "
            f"{w.optim}, checkpointing {w.grad_ckpt}, attn {w.attn}"
            + (", memplan's fused loss" if w.kernels else "") + (", memplan's tiled MLP" if w.tiled_mlp else ""))
    if w.world > 1 or w.zero:
        line += (f"\n{w.world} GPUs ({w.nodes} x {w.gpus}): dp {w.dp} x tp {w.tp}{' + SP' if w.sp else ''} x pp {w.pp}"
                 f"{f' (interleaved x{w.vpp})' if w.vpp > 1 else ''}, "
                 + (f"DeepSpeed ZeRO-{w.zero}" if w.zero else f"FSDP {w.fsdp}" if w.fsdp != "none" else
                    ("DeepSpeed pipeline" if w.pp > 1 else "torch DDP"))
                 + (f", offload {w.offload}" if w.offload != "none" else "") + "; every number is per GPU")
    return line


def print_estimate(e: MemoryBreakdown, console: Console | None = None) -> None:
    c = console or globals()['console']()
    c.print(f"[bold]{e.model.name}[/] ({e.model.params_total:,} params, {e.model.params_trainable:,} trainable) "
            f"on [bold]{e.gpu}[/]")
    _defaults(c, e.defaults)
    c.print(_workload_line(e))
    t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    t.add_column("category")
    t.add_column("bytes", justify="right")
    t.add_column(f"share of {gib(e.capacity_bytes)}")
    for k, v in e.breakdown.items():
        if v:
            t.add_row(k, gib(v), _bar(v, e.capacity_bytes))
    c.print(t)
    m = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    m.add_column("meter")
    m.add_column("predicted", justify="right")
    m.add_column("what reads it")
    m.add_row("peak allocated", gib(e.peak_allocated_bytes), "torch.cuda.max_memory_allocated()")
    m.add_row("peak reserved", gib(e.peak_reserved_bytes), f"torch.cuda.max_memory_reserved() ({e.reserved_from})")
    arithmetic = (e.by_allocator.get(allocator_mode(e.workload.expandable_segments)) or {}).get("arithmetic_reserved_bytes")
    if arithmetic:  # the replay is the meter; the search ranked with this (docs/estimator.md)
        m.add_row("  segment arithmetic", gib(arithmetic), "the same, the search's fast figure")
    m.add_row("device used", gib(e.device_used_bytes), "NVML / nvidia-smi")
    c.print(m)
    verdict = "[green]fits[/]" if e.headroom_bytes >= 0 else "[red]does not fit[/]"  # the GPU; host RAM below
    c.print(f"peak at {e.peak_phase}; {verdict}: {gib(e.device_used_bytes)} of {gib(e.usable_bytes)} usable "
            f"({e.workload.headroom:.0%} headroom kept), {gib(e.headroom_bytes)} to spare")
    if e.cpu_ram_per_node_bytes or not e.host_ram_fits:  # host RAM said where offload pins some
        c.print(_host_line(e))
    if e.step_time_s:
        w = e.workload
        step = "step" if w.task == "train" else (
            f"generate call (prefill + {w.max_new_tokens - 1} decode steps)" if w.max_new_tokens
            else "forward of the micro batch")
        tokens = "new tokens/s" if w.task == "infer" and w.max_new_tokens else "tokens/s"
        c.print(f"speed (predicted, docs/cost-model.md): {e.step_time_s:.3g} s per {step}, "
                f"{e.samples_per_s:,.1f} samples/s, {e.tokens_per_s:,.0f} {tokens}, MFU {e.mfu:.0%}")
    for n in e.notes:
        c.print(f"note: {n}")


def print_suggestion(s: Suggestion, console: Console | None = None) -> None:
    c = console or globals()['console']()
    world = s.gpus * s.nodes
    on = f"{world} x [bold]{s.gpu}[/] ({s.nodes} node(s) of {s.gpus})" if world > 1 else f"[bold]{s.gpu}[/]"
    c.print(f"[bold]{s.model}[/] on {on}, {s.task}: seq {s.seq_len}, global batch {s.global_batch}"
            + (" (default; --batch-size)" if s.global_batch_default else ""))
    _defaults(c, s.defaults)
    c.print(f"searched {s.candidates:,} candidates in {s.search_seconds:.2f} s: "
            + "; ".join(f"{k} {'/'.join(v)}" for k, v in s.searched.items()))
    if not s.plans:
        for n in s.notes:
            c.print(f"[red]{n}[/]")
    else:
        train = s.task == "train"
        multi = train and (world > 1 or any(p.zero_stage for p in s.plans))
        _plan_table(c, s.plans, train, multi)
        best = s.plans[0]
        if not train:
            c.print(f"best: batch {best.micro_batch}, {best.precision}, attn {best.attn}; predicted peak "
                    f"{gib(best.estimate.device_used_bytes)} of {gib(best.estimate.capacity_bytes)}")
        else:
            kern = "".join(f", {k}" for k, on in (("fused loss", best.kernels), ("tiled MLP", best.tiled_mlp)) if on)
            tuned = "" if best.method == "full" else f"{method_label(best.workload)}, "
            c.print(f"best: {tuned}micro batch {best.micro_batch} x accumulation {best.grad_accum} = {best.global_batch}, "
                    f"{best.precision}, {best.optim}, checkpointing {best.grad_ckpt}, attn {best.attn}{kern}; predicted "
                    f"peak {gib(best.estimate.device_used_bytes)} of {gib(best.estimate.capacity_bytes)} "
                    f"(at {best.estimate.peak_phase})")
        if multi:
            c.print(f"layout: dp {best.dp} x tp {best.tp}{' + SP' if best.sp else ''} x pp {best.pp}"
                    f"{f' (interleaved x{best.vpp})' if best.vpp > 1 else ''}, "
                    f"{sharding_label(best.zero_stage, best.fsdp)}, offload "
                    f"{best.offload}; MFU {best.mfu:.0%}; step {best.step_seconds:.2f} s = "
                    + ", ".join(f"{k} {v:.2f}" for k, v in best.step_terms.items() if v))
        if s.why:
            c.print("[bold]why this plan[/] (the best plan that changes one knob):")
            for line in s.why:
                c.print(f"  {line}")
        if len(s.pareto) > 1:
            c.print(f"[bold]Pareto front[/] (memory vs speed: the {len(s.pareto)} with the least memory of its "
                    f"{s.pareto_size} plans):")
            _plan_table(c, s.pareto, train, multi)
    for a in s.alternatives:
        c.print(f"also fits: {a.change}: {a.gain}")
    for n in s.notes if s.plans else ():
        c.print(f"note: {n}")


def _defaults(c: Console, said: list[str]) -> None:
    """The one defaults line (memplan.inputs.defaults), the same in estimate, suggest and verify."""
    if said:
        c.print(line(said), markup=False, highlight=False)


def _host_line(e: MemoryBreakdown) -> str:
    pinned = f"offload pins {gib(e.cpu_ram_per_node_bytes)} of host RAM per node ({e.workload.gpus} GPUs)"
    if e.host_ram_limit_bytes is None:
        return pinned + "; host RAM not checked"
    verdict = "[green]fits[/]" if e.host_ram_fits else "[red]does not fit[/]"
    return f"{pinned}: {verdict} in {gib(e.host_ram_limit_bytes)}"


def print_verify(r) -> None:
    """`memplan verify`: each meter predicted vs measured, then the breakdown at the traced peak."""
    c = console()
    c.print(f"[bold]{r.model}[/] on {r.gpu}: {_workload_line(r.estimate)}")
    _defaults(c, r.defaults)
    c.print(f"ran: [bold]{r.device}[/] ({r.device_note}), {r.steps} steps in {r.run_seconds:.1f} s")
    colour = {"ok": "green", "close": "yellow", "off": "red"}
    t = Table("meter", "predicted", "measured", "error", "verdict", "how measured")
    for m in r.meters:
        t.add_row(m.meter, gib(m.predicted_bytes), gib(m.measured_bytes), f"{m.error_pct:+.2f} %",
                  f"[{colour[m.verdict]}]{m.verdict}[/]", m.how)
    c.print(t)
    if r.breakdown:
        b = Table("category", "predicted", "measured", "difference", title=f"at the peak: {r.peak_phase} ({r.peak_op})")
        for k, v in r.breakdown.items():
            if v["predicted"] or v["measured"]:
                b.add_row(k, gib(v["predicted"]), gib(v["measured"]), gib(v["predicted"] - v["measured"]))
        c.print(b)
    if r.tokens_per_s:
        c.print(f"step time {r.step_time_s * 1000:.1f} ms, {r.tokens_per_s:,.0f} tokens/s ({r.device})")
    if r.sdpa_kernels:
        c.print("attention kernels (as CUDA would pick): " + ", ".join(f"{k} x{n}" for k, n in r.sdpa_kernels.items()))
    for n in r.notes:
        c.print(f"note: {n}")


def _plan_table(c: Console, plans, train: bool, multi: bool) -> None:
    cols = ("#", "micro", "accum", "precision", "optim", "ckpt", "attn") if train else ("#", "batch", "precision", "attn")
    methods = train and any(p.method != "full" for p in plans)
    if methods:
        cols = cols[:1] + ("method",) + cols[1:]
    if multi:
        cols += ("dp", "tp", "pp", "sharding", "offload")
    kernels = train and any(p.kernels or p.tiled_mlp for p in plans)
    if kernels:
        cols += ("kernels",)
    if train:  # host RAM is a limit like the GPU's: each plan's, per node
        cols += ("host RAM",)
    t = Table(show_header=True, header_style="bold")
    for col in cols + ("device used", "headroom", "samples/s", "tokens/s"):
        t.add_column(col, justify="left" if col in ("method", "precision", "optim", "ckpt", "attn", "offload", "kernels")
                     else "right")
    for i, p in enumerate(plans, 1):
        e = p.estimate
        knobs = ((str(p.micro_batch), str(p.grad_accum), p.precision, p.optim, p.grad_ckpt, p.attn) if train
                 else (str(p.micro_batch), p.precision, p.attn))
        if methods:
            knobs = (method_label(p.workload),) + knobs
        if multi:
            knobs += (str(p.dp), f"{p.tp}{'+sp' if p.sp else ''}", f"{p.pp}{f'x{p.vpp}' if p.vpp > 1 else ''}",
                      sharding_label(p.zero_stage, p.fsdp),
                      p.offload)
        if kernels:
            knobs += ("+".join(k for k, on in (("loss", p.kernels), ("mlp", p.tiled_mlp)) if on) or "-",)
        if train:
            knobs += (gib(p.host_ram_per_node_bytes) if p.host_ram_per_node_bytes else "-",)
        t.add_row(str(i), *knobs, gib(e.device_used_bytes), gib(e.headroom_bytes), f"{p.samples_per_s:,.1f}",
                  f"{p.tokens_per_s:,.0f}")
    c.print(t)


def method_label(w) -> str:
    """The fine-tuning method of a plan in a few characters: lora r8, qlora nf4 r8, freeze K=2."""
    if w.method in ("lora", "qlora"):
        return f"{w.method}{f' {w.quant}' if w.method == 'qlora' else ''} r{w.lora_r}"
    return f"freeze K={w.trainable_layers}" if w.method == "freeze" else w.method
