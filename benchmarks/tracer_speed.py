"""Wall time of tracing one training workload with memplan's tracer vs. PyTorch's MemTracker.

    python benchmarks/tracer_speed.py [--runs 3] [--model bert-large] [--out benchmarks/results/tracer_speed.json]

Both sides trace the same work without any real memory: the full-size model as FakeTensors, micro batch 4,
sequence 512, fp32, eager attention, AdamW(foreach=True), two optimizer steps (the first one creates the
optimizer state). Each step is HF Trainer's: forward with the labels -> loss, loss.backward(),
clip_grad_norm_(1.0), optimizer.step(), optimizer.zero_grad() (set to None).

- memplan: `memplan.verify.run.run_traced(..., "fake", 2)`: model built on meta and materialized as FakeTensors,
  every storage recorded by `tracer.LiveTracker` under `cudasim.CudaSemantics` (what the step keeps on a
  CUDA GPU, here a V100: sm 7.0), then replayed once to find the peak.
- MemTracker: `torch.distributed._tools.mem_tracker.MemTracker` under `FakeTensorMode`, used as its docs
  and tests (test/distributed/_tools/test_mem_tracker.py) show: `track_external(model, optimizer)`, the
  steps inside `with tracker`, `reset_mod_stats()` after the first step (without it the second forward of
  the root module raises NotImplementedError), then `get_tracker_snapshot("peak")[device]["Total"]`.
  The model is built by `memplan.inputs.hf.build_model` (transformers' from_config) inside FakeTensorMode on
  the CPU device; a CPU-only torch cannot index or move fake CUDA tensors, so that is the device it gets.

Each run is a fresh subprocess, so import caches and warm state favour neither side. The child imports
torch, transformers and the model's modeling module first, then times from just before the model build to
after the second step (memplan: the whole `run_traced` call, which includes its replay for the peak);
the child's total wall time (interpreter start and imports included) is reported too. Sides alternate.

Why the peaks differ:
- Rounding. memplan rounds every storage up to the CUDA caching allocator's 512 B block (a few hundred KiB
  over the whole run). MemTracker rounds to 512 B only for tensors whose device type is "cuda"
  (`_WeakRefInfo._calculate_mem_consumed`); these are CPU FakeTensors, so it counts exact storage bytes.
- Dropout (the large part). `at::dropout` takes the fused `native_dropout` (1-byte bool mask saved for
  backward) only on CUDA; on the CPU it multiplies by a float noise tensor (4 bytes per element). MemTracker
  sees the CPU kernel, memplan replays the CUDA one. For BERT-large at 4 x 512 that is ~1.5 GB of
  activations. The extra `memtracker-cuda-dropout` run (not timed in the ratio; --skip-dropout-check
  leaves it out) swaps F.dropout for native_dropout on the MemTracker side to show how close the peaks are
  on the same kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import version

MIB = 2**20
MICRO_BATCH, SEQ_LEN, STEPS = 4, 512, 2
SM = (7, 0)  # V100, as in the memplan calibration case


# -- children: one traced run each, result printed as one JSON line -------------------------------------
def preload(config) -> None:
    """Import what either side uses before the timer starts (transformers loads model modules lazily);
    the same list on both sides, so neither pays an import inside its timed part."""
    import importlib

    mt = config["model_type"]
    for name in ("torch", "transformers", f"transformers.models.{mt}.modeling_{mt}",
                 "torch._subclasses.fake_tensor", "torch.distributed._tools.mem_tracker",
                 "memplan.verify.cudasim", "memplan.inputs.hf", "memplan.verify.optimizers", "memplan.verify.tracer"):
        importlib.import_module(name)


def child_memplan(model_name: str) -> dict:
    from memplan import api
    from memplan.inputs.catalog import resolve_config
    from memplan.verify.run import run_traced

    cfg, head = resolve_config(model_name)
    preload(cfg)
    w = api.workload(micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, precision="fp32", attn="eager", optim="adamw_torch")
    t0 = time.perf_counter()
    r = run_traced(cfg, head, w, SM, "fake", STEPS)
    traced_s = time.perf_counter() - t0
    s = r["summary"]
    return {"traced_s": traced_s, "step_s": r["times"], "peak_bytes": s.peak_allocated,
            "peak_where": f"{s.peak_phase} / {s.peak_op}", "peak_breakdown": s.breakdown}


def child_memtracker(model_name: str, cuda_dropout: bool = False) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from memplan.inputs.catalog import resolve_config
    from memplan.inputs.hf import build_model
    from memplan.verify.run import make_batch

    cfg, head = resolve_config(model_name)
    preload(cfg)
    if cuda_dropout:  # what at::dropout runs on CUDA: native_dropout, a bool mask instead of a float noise
        def dropout(x, p=0.5, training=True, inplace=False):
            return torch.ops.aten.native_dropout(x, p, True)[0] if training and p > 0 else x
        torch.nn.functional.dropout = dropout

    t0 = time.perf_counter()
    with FakeTensorMode():
        model, head = build_model(cfg, head, "eager")
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=5e-5, foreach=True)
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        step_s = []
        with tracker:
            for step in range(STEPS):
                ts = time.perf_counter()
                # input_ids int64 (4, 512) in [0, vocab), labels (4,) in [0, num_labels): memplan's batch
                batch = make_batch(model, head, MICRO_BATCH, SEQ_LEN, torch.float32, "cpu")
                loss = model(**batch).loss
                del batch
                loss.backward()
                del loss
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step == 0:
                    tracker.reset_mod_stats()  # MemTracker refuses a second root forward otherwise
                step_s.append(time.perf_counter() - ts)
        peak = tracker.get_tracker_snapshot("peak")
    traced_s = time.perf_counter() - t0
    dev = torch.device("cpu")
    return {"traced_s": traced_s, "step_s": step_s, "peak_bytes": peak[dev]["Total"],
            "peak_breakdown": {getattr(k, "value", k): v for k, v in peak[dev].items() if k != "Total"}}


CHILDREN = {
    "memplan": child_memplan,
    "memtracker": child_memtracker,
    "memtracker-cuda-dropout": lambda model: child_memtracker(model, cuda_dropout=True),
}


# -- parent: fresh subprocess per run, table, JSON ------------------------------------------------------
def run_child(side: str, model: str) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--model", model]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    total_s = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{side} run failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["total_s"] = total_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default="bert-large")
    ap.add_argument("--out", default="benchmarks/results/tracer_speed.json")
    ap.add_argument("--skip-dropout-check", action="store_true", help="leave out the memtracker-cuda-dropout run")
    ap.add_argument("--child", choices=CHILDREN, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child](args.model)))
        return

    sides = ("memplan", "memtracker")
    runs = {side: [] for side in sides}
    for i in range(args.runs):
        for side in sides:  # alternate, so drift in machine load hits both sides alike
            r = run_child(side, args.model)
            runs[side].append(r)
            print(f"run {i + 1}/{args.runs} {side:10s} traced {r['traced_s']:6.2f} s  total {r['total_s']:6.2f} s  "
                  f"peak {r['peak_bytes'] / MIB:9.1f} MiB", flush=True)

    med = {side: {k: statistics.median(r[k] for r in runs[side]) for k in ("traced_s", "total_s")} for side in sides}
    peaks = {side: runs[side][0]["peak_bytes"] for side in sides}
    assert all(r["peak_bytes"] == peaks[side] for side in sides for r in runs[side]), "peak changed between runs"
    ratio = {k: med["memtracker"][k] / med["memplan"][k] for k in ("traced_s", "total_s")}
    diff_pct = 100.0 * (peaks["memtracker"] - peaks["memplan"]) / peaks["memplan"]
    check = None if args.skip_dropout_check else run_child("memtracker-cuda-dropout", args.model)

    print(f"\n{args.model}, micro batch {MICRO_BATCH} x {SEQ_LEN}, fp32, eager, AdamW, {STEPS} steps, "
          f"{args.runs} runs each (medians)")
    print(f"{'':12s} {'traced s':>9s} {'total s':>9s} {'peak MiB':>10s}")
    for side in sides:
        print(f"{side:12s} {med[side]['traced_s']:9.2f} {med[side]['total_s']:9.2f} {peaks[side] / MIB:10.1f}")
    print(f"MemTracker / memplan: {ratio['traced_s']:.2f}x traced, {ratio['total_s']:.2f}x child total")
    print(f"peak difference (MemTracker - memplan) / memplan: {diff_pct:+.2f} %")
    if check:
        check["diff_pct_vs_memplan"] = 100.0 * (check["peak_bytes"] - peaks["memplan"]) / peaks["memplan"]
        print(f"MemTracker with CUDA's native_dropout: peak {check['peak_bytes'] / MIB:.1f} MiB "
              f"({check['diff_pct_vs_memplan']:+.4f} % vs memplan)")

    doc = {
        "command": " ".join(["python", "benchmarks/tracer_speed.py"] + sys.argv[1:]),
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "python": platform.python_version(), "cpu_count": os.cpu_count(),
                    "torch": version("torch"), "transformers": version("transformers")},
        "workload": {"model": args.model, "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "precision": "fp32",
                     "attn": "eager", "optimizer": "AdamW(foreach=True)", "steps": STEPS, "device": "fake (CPU)",
                     "memplan_sm": list(SM)},
        "runs": runs,
        "median_s": med,
        "ratio_memtracker_over_memplan": ratio,
        "peak_bytes": peaks,
        "peak_mib": {side: peaks[side] / MIB for side in sides},
        "peak_diff_pct": diff_pct,
        "memtracker_cuda_dropout_check": check,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
