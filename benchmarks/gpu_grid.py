"""Issue 17's GPU grid: real training steps on the GPU in hand, each beside memplan's prediction: the step time,
the three meters (peak allocated, peak reserved, NVML's device used) from the segment arithmetic, and the
reserved memory of the estimate's own allocations replayed through the allocator simulation
(`simulated_reserved_bytes`), in both allocator modes.

    python benchmarks/gpu_grid.py [--max-seconds 420] [--out benchmarks/results/gpu_grid]
    python benchmarks/gpu_grid.py --dry-run      # the grid and its predictions; no GPU needed

Each run is `memplan verify --device cuda --json` in a fresh process: its own CUDA context, and
PYTORCH_CUDA_ALLOC_CONF set before CUDA starts (expandable segments or the default allocator; verify refuses a
plan whose mode is not the process's). Runs go case by case, both modes each, until --max-seconds would be
passed, so a short lease still gives whole pairs. The raw verify documents go into OUT.json with the command and
the device; OUT.md tabulates predicted against measured.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import memplan

HERE = pathlib.Path(__file__).parent
MiB = 2**20

# 2-3 models x precision x micro batch x recompute x attention (the grid), bert-large's first row the
# V100 calibration point's setup (docs/contract.md), sized for one 80 GB GPU
GRID = [
    dict(model="bert-large", seq_len=512, micro_batch=4, precision="fp32", attn="eager", optim="adamw_torch_fused"),
    dict(model="bert-large", seq_len=512, micro_batch=4, precision="fp32", attn="sdpa", optim="adamw_torch_fused"),
    dict(model="bert-large", seq_len=512, micro_batch=8, precision="bf16", attn="sdpa", optim="adamw_torch_fused"),
    dict(model="bert-large", seq_len=512, micro_batch=8, precision="bf16", attn="sdpa", grad_ckpt="full"),
    dict(model="llama-3.2-1b", seq_len=1024, micro_batch=4, precision="bf16", attn="sdpa"),
    dict(model="llama-3.2-1b", seq_len=1024, micro_batch=2, precision="bf16", attn="eager"),
    dict(model="llama-3.2-1b", seq_len=1024, micro_batch=8, precision="bf16", attn="sdpa", grad_ckpt="full"),
    dict(model="llama-3.2-1b", seq_len=1024, micro_batch=4, precision="bf16-pure", attn="sdpa"),
    dict(model="qwen2.5-0.5b", seq_len=2048, micro_batch=4, precision="bf16", attn="sdpa"),
    dict(model="qwen2.5-0.5b", seq_len=2048, micro_batch=8, precision="bf16", attn="sdpa", grad_ckpt="full"),
]
STEPS = 4  # the first creates the optimizer state; verify's step time is the median of the rest
MODES = (False, True)  # expandable segments off, on


def command(case: dict, expandable: bool) -> list[str]:
    args = [sys.executable, "-m", "memplan", "verify", "--device", "cuda", "--gpu", "auto", "--steps", str(STEPS),
            "--json", "--expandable-segments" if expandable else "--no-expandable-segments"]
    for k, v in case.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def environment(expandable: bool) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def run_one(case: dict, expandable: bool) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(command(case, expandable), env=environment(expandable), capture_output=True, text=True)
    out = {"case": case, "expandable_segments": expandable, "seconds": round(time.perf_counter() - t0, 1),
           "returncode": p.returncode}
    if p.returncode == 0:
        out["verify"] = json.loads(p.stdout)
    else:
        out["stderr"] = p.stderr.strip().splitlines()[-1:] if p.stderr.strip() else []
    return out


def row(r: dict) -> str:
    """One markdown row: step time and each meter, predicted / measured, and the replayed reserved."""
    case, mode = r["case"], "expandable" if r["expandable_segments"] else "default"
    label = " ".join(f"{v}" for v in case.values())
    if r["returncode"] != 0:
        return f"| {label} | {mode} | failed: {' '.join(r['stderr'])} |||||"
    v = r["verify"]
    est, meters = v["estimate"], {m["meter"]: m for m in v["meters"]}
    replay = (est.get("by_allocator") or {}).get("expandable_segments" if r["expandable_segments"] else "default",
                                                 {}).get("simulated_reserved_bytes")
    reserved = meters["peak_reserved"]["measured_bytes"]
    cells = [f"{est['step_time_s']:.3f} / {v['step_time_s']:.3f} ({100 * (est['step_time_s'] / v['step_time_s'] - 1):+.1f} %)"]
    for name in ("peak_allocated", "peak_reserved", "device_used"):
        m = meters[name]
        cells.append(f"{m['predicted_bytes'] / MiB:,.0f} / {m['measured_bytes'] / MiB:,.0f} ({m['error_pct']:+.1f} %)")
    cells.append(f"{replay / MiB:,.0f} ({100 * (replay / reserved - 1):+.1f} %)" if replay else "")
    return f"| {label} | {mode} | " + " | ".join(cells) + " |"


def report(results: list[dict], device: str, cmd: str) -> str:
    lines = [f"# GPU grid on {device}", "", f"`{cmd}`", "",
             "Predicted / measured: step seconds (median of steps 2-4), then MiB; the replayed reserved is the "
             "estimate's own allocations through the allocator simulation, against the measured reserved.", "",
             "| case | allocator | step s | peak allocated | peak reserved | device used | replayed reserved |",
             "|---|---|---|---|---|---|---|"]
    lines += [row(r) for r in results]
    done = [r for r in results if r["returncode"] == 0]
    if done:
        errs = {k: [abs(m["error_pct"]) for r in done for m in r["verify"]["meters"] if m["meter"] == k]
                for k in ("peak_allocated", "peak_reserved", "device_used")}
        lines += ["", "Median |error|: " + ", ".join(f"{k} {statistics.median(v):.1f} %" for k, v in errs.items())]
    return "\n".join(lines) + "\n"


def dry_run() -> None:
    """The grid with its predictions (no GPU): what a lent GPU would be asked to measure."""
    for case in GRID:
        for expandable in MODES:
            e = memplan.estimate(case["model"], "h100-80g", simulate=True, expandable_segments=expandable,
                                 **{k: v for k, v in case.items() if k != "model"})
            mode = "expandable_segments" if expandable else "default"
            replay = e.by_allocator[mode].get("simulated_reserved_bytes", 0)
            print(f"{' '.join(map(str, case.values())):62s} {mode:19s} step {e.step_time_s:.3f} s  allocated "
                  f"{e.peak_allocated_bytes / MiB:,.0f}  reserved {e.peak_reserved_bytes / MiB:,.0f}  replayed "
                  f"{replay / MiB:,.0f} MiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-seconds", type=float, default=420.0, help="start no run past this many seconds")
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_grid"))
    ap.add_argument("--dry-run", action="store_true", help="print the grid and its predictions (no GPU)")
    args = ap.parse_args()
    if args.dry_run:
        dry_run()
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_grid: no CUDA GPU is visible to torch (use --dry-run to see the grid)", file=sys.stderr)
        return 2
    device, t0, results = torch.cuda.get_device_name(), time.perf_counter(), []
    for case in GRID:
        for expandable in MODES:
            if results and time.perf_counter() - t0 + max(r["seconds"] for r in results) > args.max_seconds:
                break
            results.append(run_one(case, expandable))
            print(row(results[-1]), flush=True)
    cmd = "python benchmarks/gpu_grid.py " + " ".join(sys.argv[1:])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "device": device, "results": results}, indent=1))
    out.with_suffix(".md").write_text(report(results, device, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
