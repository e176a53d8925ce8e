"""memplan's speed model against published training runs (benchmarks/throughput/published_runs.json, sources in
SOURCES.md): each run's setup becomes an `estimate`, whose step time, samples/s or tokens/s is compared with the
published figure in the source's own metric.

    python benchmarks/throughput/compare.py [--out benchmarks/throughput/results]
    python benchmarks/throughput/compare.py --fit   # refit cost.GENERATIONS (prints the constants; commit them)

A run memplan cannot represent is listed with the reason and left out (fp8 / tf32 training, torch.compile,
float8 linears, flex attention, context parallelism, an unstated micro batch). Each framework's run is mapped to
the nearest memplan configuration (FRAMEWORKS); what that leaves out is in docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import statistics
import sys
from collections import defaultdict

import memplan
from memplan.errors import UserError
from memplan.inputs.modelspec import megatron_gpt
from memplan.search import cost

HERE = pathlib.Path(__file__).parent

# framework (a substring of the run's "framework") -> how memplan runs it: the half precision (Megatron keeps the
# residual stream in half: bf16-pure; the HF Trainer, llm-foundry and torchtitan autocast an fp32 or fp32-master
# model: bf16 / fp16), and the recompute a run that does not state it used
FRAMEWORKS = {
    "DeepSpeed": {"half": "autocast", "recompute": "full"},
    "Megatron": {"half": "pure", "recompute": "full"},
    "HF Trainer": {"half": "autocast", "recompute": "none"},
    "DeepLearningExamples": {"half": "autocast", "recompute": "none"},
    "llm-foundry": {"half": "autocast", "recompute": "none"},
    "torchtitan": {"half": "autocast", "recompute": "none"},
    "torchtune": {"half": "autocast", "recompute": "none"},
    "NeMo": {"half": "pure", "recompute": "none"},
}
# the optimizer memplan prices for each published one (first matching substring): apex's FusedLAMB / FusedAdam
# and Megatron's Adam are one multi-tensor kernel (fused AdamW's traffic; LAMB's trust-ratio norms are left out);
# Composer's DecoupledAdamW, torchtitan's AdamW and BertAdam run foreach-like kernels per op (BertAdam, a Python
# loop over the tensors, is no foreach step: foreach AdamW's traffic is memplan's nearest). A key matches a substring
# not preceded by "un" ("unfused" is not "fused")
OPTIMIZERS = (("8bit", "adamw_bnb_8bit"), ("adafactor", "adafactor"), ("lamb", "adamw_torch_fused"),
              ("fused", "adamw_torch_fused"), ("megatron", "adamw_torch_fused"), ("deepspeed", "adamw_torch_fused"),
              ("adam", "adamw_torch"))
SHARDING = {"fsdp": {"fsdp": "full-shard"}, "fsdp2": {"fsdp": "full-shard"},
            "fsdp-shard-grad-op": {"fsdp": "shard-grad-op"}, "zero1": {"zero": 1}}
EXCLUDED = (("compile", "torch.compile (fused kernels memplan does not model)"), ("float8", "float8 linears"),
            ("flex", "flex attention"))


def _framework(run) -> dict:
    return next(v for k, v in FRAMEWORKS.items() if k in run["framework"])


def _excluded(run) -> str | None:
    if run.get("data_error"):
        return f"the source's value is in error: {run['data_error']}"
    text = " ".join(str(run.get(k) or "") for k in ("other", "attention", "framework")).lower()
    for word, why in EXCLUDED:
        if word in text:
            return why
    if run["precision"] not in ("fp32", "fp16", "bf16"):
        return f"precision {run['precision']} (memplan trains in fp32, fp16 or bf16)"
    if "closest memplan profile" in run["gpu"] or run["gpu"].startswith("a100 ("):
        return f"GPU {run['gpu']} is no memplan profile"
    if (run.get("cp") or 1) > 1:
        return "context parallelism"
    if "binned pretraining for phase2" in run.get("notes", "") and run["seq_len"] == 512:
        return "sequences binned by length (fewer tokens than seq_len)"
    if not run.get("micro_batch"):
        return "micro batch not stated"
    return None


def _spec(run):
    m = run["model"]
    if "catalog" in m:
        return memplan.resolve_model(m["catalog"], head=m.get("head"))
    g = m["gpt"]
    return megatron_gpt(g["layers"], g["hidden"], g["heads"], g.get("vocab") or 51200, max(run["seq_len"], 2048))


def _precision(run, fw) -> str:
    """Megatron's half training keeps the model and the residual stream in half with an fp32 master copy:
    bf16-pure under its ZeRO-1-like distributed optimizer is memplan's nearest; its fp16 runs are priced as
    bf16-pure too where the GPU has bf16 (the same tensor-core peak and widths), and on V100 as fp16 on a half
    model (workload: `_half_model`)."""
    p = run["precision"]
    if p == "fp32":
        return "fp32"
    if fw["half"] == "pure" and memplan.load_gpu(run["gpu"]).bf16:
        return "bf16-pure"
    return p


def _attn(run, gpu) -> str:
    a = (run.get("attention") or "").lower()
    if a.startswith("eager") or "softmax" in a or "core attention" in a:
        return "eager"
    return "flash" if gpu.flash_attention and "sdpa" not in a else "sdpa"


def _recompute(run, fw) -> str:
    r = (run.get("recompute") or fw["recompute"]).split()[0]
    return r if r in ("none", "selective", "full") else fw["recompute"]


def _half_model(fw, kw, dp: int) -> bool:
    """Megatron's fp16 training wraps the model in half (megatron/fp16/fp16.py FP16_Module, `module.half()`, in 2020;
    megatron/model/module.py Float16Module later: parameters, activations and the residual stream in fp16, the
    softmax fused) and keeps fp32 main parameters in its optimizer (FP16_Optimizer). memplan's fp16 half model is
    DeepSpeed's engine: any ZeRO stage (states.half_model); ZeRO-1 at one data-parallel rank shards nothing, so
    only such runs take it (at several ranks it would shard the step, as Megatron's later distributed optimizer
    does, not its 2020 FP16_Optimizer; the V100 rows are all at one rank). Without it, fp16 is the HF Trainer's
    autocast over an fp32 model: fp32 scores and residual stream, which priced the 2020 V100 rows 22 to 47 % slow."""
    return (fw["half"] == "pure" and kw["precision"] == "fp16" and kw["pp"] == 1 and dp == 1
            and "zero" not in kw and "fsdp" not in kw)


def workload(run) -> dict:
    """The estimate keywords of one published run."""
    fw = _framework(run)
    gpu = memplan.load_gpu(run["gpu"])
    tp, pp = run.get("tp") or 1, run.get("pp") or 1
    gpus = run["gpus"]
    per_node = min(run.get("gpus_per_node") or 8, gpus)
    dp = gpus // (tp * pp)
    mb = run["micro_batch"]
    accum = (run["global_batch"] // (mb * dp)) if run.get("global_batch") else (run.get("grad_accum") or 1)
    named = f"{run.get('optimizer')} {run['framework']}".lower()
    opt = next(o for k, o in OPTIMIZERS if re.search(f"(?<!un){k}", named))
    kw = dict(precision=_precision(run, fw), seq_len=run["seq_len"], micro_batch=mb, grad_accum=max(accum, 1),
              gpus=per_node, nodes=max(gpus // per_node, 1), tp=tp, pp=pp, vpp=run.get("vpp") or 1,
              sp=bool(run.get("sequence_parallel")), attn=_attn(run, gpu), grad_ckpt=_recompute(run, fw), optim=opt)
    kw |= SHARDING.get(str(run.get("sharding")), {})
    if _half_model(fw, kw, dp):
        kw["zero"] = 1
    if pp > 1:  # memplan plans pipelines on DeepSpeed's engine: its mixed precision, ZeRO-1's gradient volume
        kw["precision"] = kw["precision"].replace("-pure", "")
        kw["zero"] = 1 if dp > 1 else 0
    return kw


def predict(run) -> float:
    """memplan's figure in the run's own metric."""
    spec, kw = _spec(run), workload(run)
    e = memplan.estimate(spec, run["gpu"], simulate=False, **kw)  # the step time only: no replay of reserved
    metric = run["metric"]
    if metric == "step_time_s":
        return e.step_time_s
    if metric == "samples_per_s":
        return e.samples_per_s if run.get("metric_scope") != "per_gpu" else e.samples_per_s / run["gpus"]
    if metric == "tokens_per_s_per_gpu":
        return e.tokens_per_s / run["gpus"]
    if metric == "tflops_per_gpu":
        model, hw = cost.flops_per_token(spec, kw["seq_len"], kw["attn"], kw["grad_ckpt"])
        per_token = hw if str(run.get("flops_convention", "")).startswith("hardware") else model
        return per_token * e.tokens_per_s / run["gpus"] / 1e12
    raise ValueError(metric)


def source_of(run) -> str:
    return run["source"]["title"].split(":")[0].split("(")[0].strip()


def evaluate(runs) -> tuple[list[dict], list[dict]]:
    rows, skipped = [], []
    for run in runs:
        why = _excluded(run)
        if why is None:
            try:
                pred = predict(run)
            except UserError as e:
                why = f"memplan refuses: {e}"
        if why:
            skipped.append({"id": run["id"], "why": why})
            continue
        rows.append({"id": run["id"], "source": source_of(run), "gpu": run["gpu"], "metric": run["metric"],
                     "published": run["value"], "predicted": pred, "error": pred / run["value"] - 1})
    return rows, skipped


def summary(rows) -> dict:
    errs = [abs(r["error"]) for r in rows]
    by_source = defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(abs(r["error"]))
    return {"runs": len(rows), "sources": len(by_source), "gpus": sorted({r["gpu"] for r in rows}),
            "median_abs_error": statistics.median(errs), "max_abs_error": max(errs),
            "by_source": {k: {"runs": len(v), "median": statistics.median(v), "max": max(v)}
                          for k, v in sorted(by_source.items())}}


def loss(rows) -> float:
    """Sources weigh equally (llm-foundry's 200 rows would otherwise decide the fit): the mean over sources of
    their mean squared log error, plus a tenth of the worst run's."""
    by = defaultdict(list)
    for r in rows:
        by[r["source"]].append(math.log1p(r["error"]) ** 2)
    return statistics.mean(statistics.mean(v) for v in by.values()) + 0.1 * max(max(v) for v in by.values())


def _major(run) -> int:
    """The GENERATIONS key whose constants price this run."""
    major = memplan.load_gpu(run["gpu"]).compute_capability[0]
    return max((k for k in cost.GENERATIONS if k <= major), default=min(cost.GENERATIONS))


# Constants the fit leaves where they are (cost.GENERATIONS' comment says why: the runs hardly constrain them, and
# serving's decode steps, which no training run measures, are priced by Hopper's bandwidth)
PINNED = {(8, "launch_s"), (9, "bandwidth")}


def fit(runs, rounds: int = 6) -> None:
    """Coordinate descent over each generation's constants (but PINNED) on a multiplicative grid, until a round
    improves nothing; prints GENERATIONS. A generation's constants price only its own GPUs' runs, so a trial
    re-evaluates those and keeps the other generations' rows."""
    fields = ("matmul", "matmul_fp32", "attention", "bandwidth", "launch_s")
    runs = [r for r in runs if _excluded(r) is None]
    by_major = {k: [r for r in runs if _major(r) == k] for k in cost.GENERATIONS}
    rows = {k: evaluate(v)[0] for k, v in by_major.items()}
    best = loss([r for v in rows.values() for r in v])
    for _ in range(rounds):
        start = best
        for major in sorted(cost.GENERATIONS):
            others = [r for k, v in rows.items() if k != major for r in v]
            for f in (f for f in fields if (major, f) not in PINNED):
                for step in (0.5, 0.7, 0.85, 0.95, 1.05, 1.15, 1.4, 2.0) if f == "launch_s" else (
                        0.7, 0.85, 0.95, 1.05, 1.15, 1.3):
                    g = cost.GENERATIONS[major]
                    value = getattr(g, f) * step
                    cost.GENERATIONS[major] = g._replace(**{f: value if f == "launch_s" else min(value, 0.98)})
                    trial = evaluate(by_major[major])[0]
                    trial_loss = loss(others + trial)
                    if trial_loss < best:
                        best, rows[major] = trial_loss, trial
                    else:
                        cost.GENERATIONS[major] = g
            print(major, cost.GENERATIONS[major], f"loss {best:.4f}", file=sys.stderr)
        if best >= start:
            break
    for major, g in sorted(cost.GENERATIONS.items()):
        print(f"    {major}: Generation(" + ", ".join(f"{f}={getattr(g, f):.3g}" for f in fields) + "),")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=str(HERE / "published_runs.json"))
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--fit", action="store_true")
    args = ap.parse_args()
    runs = json.loads(pathlib.Path(args.runs).read_text())
    if args.fit:
        fit(runs)
        return
    rows, skipped = evaluate(runs)
    s = summary(rows)
    pathlib.Path(args.out + ".json").write_text(json.dumps({"summary": s, "rows": rows, "skipped": skipped},
                                                           indent=1) + "\n")
    lines = ["# memplan's speed model vs published runs", "",
             "`python benchmarks/throughput/compare.py` (runs: published_runs.json; sources: SOURCES.md)", "",
             f"{s['runs']} runs from {s['sources']} sources on {', '.join(s['gpus'])}: median |error| "
             f"{100 * s['median_abs_error']:.1f} %, max {100 * s['max_abs_error']:.1f} %; {len(skipped)} left out "
             "(listed at the end).", "", "| source | runs | median abs error % | max % |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['runs']} | {100 * v['median']:.1f} | {100 * v['max']:.1f} |" for k, v in s["by_source"].items()]
    lines += ["", "| run | gpu | metric | published | predicted | error % |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['id']} | {r['gpu']} | {r['metric']} | {r['published']:g} | {r['predicted']:.4g} | "
              f"{100 * r['error']:+.1f} |" for r in rows]
    lines += ["", "Left out:", ""] + [f"- {r['id']}: {r['why']}" for r in skipped]
    pathlib.Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12 + len(s["by_source"])]))


if __name__ == "__main__":
    main()
