"""Speed of the multi-GPU search.

    python benchmarks/search_speed.py [--runs 7] [--out benchmarks/results/search_speed.json]

1. The issue's must-show CLI call, cold (a fresh process each run), median wall time, beside
   `python -c pass` and `memplan suggest --model bert-large --gpu v100-16g` as baselines.
2. Candidates evaluated per second inside one process: a candidate is one full setting of every knob
   (layout, ZeRO, offload, SP, interleaving, precision, optimizer, checkpointing, attention, micro
   batch) whose per-GPU memory was estimated and, if it fits, whose step time was modelled. Cold:
   the first search of a process (the estimator's caches empty), timed after the imports (numpy takes
   ~0.08 s to import; the CLI times in 1. include it); warm: the same search again. Every candidate is
   evaluated (memplan.estimator.step.evaluate, a table per layout): none is pruned.
3. Llama 3.1 405B on 1024 H100s (128 nodes of 8), seq 8192, global batch 2048.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from cli_suggest import machine, save, time_runs  # same folder: run as python benchmarks/search_speed.py

MUST_SHOW = ["suggest", "--model", "llama-3.1-70b", "--gpu", "h100-80g", "--gpus", "8", "--nodes", "8",
             "--seq-len", "4096", "--batch-size", "1024", "--json"]
CLI = {
    "memplan " + " ".join(MUST_SHOW): [sys.executable, "-m", "memplan", *MUST_SHOW],
    "baseline: memplan suggest --model bert-large --gpu v100-16g": [
        sys.executable, "-m", "memplan", "suggest", "--model", "bert-large", "--gpu", "v100-16g", "--json"],
    "baseline: python -c pass": [sys.executable, "-c", "pass"],
}
SEARCHES = {
    "llama-3.1-70b, 64 x h100-80g, seq 4096, batch 1024": ("llama-3.1-70b", "h100-80g", 8, 8, 4096, 1024),
    "llama-3.1-405b, 1024 x h100-80g, seq 8192, batch 2048": ("llama-3.1-405b", "h100-80g", 8, 128, 8192, 2048),
}


SEARCH_CHILD = """
import json, sys, time
import memplan
import memplan.estimator.step  # numpy and the step, imported before the clock starts: the search itself is timed
model, gpu, gpus, nodes, seq, batch = json.loads(sys.argv[1])
spec, prof = memplan.resolve_model(model), memplan.load_gpu(gpu)
out = []
for _ in range(2):  # cold, then warm
    t0 = time.perf_counter()
    s = memplan.suggest(spec, prof, seq_len=seq, global_batch=batch, gpus=gpus, nodes=nodes)
    dt = time.perf_counter() - t0
    best = s.plans[0]
    out.append({"seconds": dt, "candidates": s.candidates,
                "best": {k: getattr(best, k) for k in ("dp", "tp", "pp", "vpp", "sp", "zero_stage", "offload",
                                                        "micro_batch", "grad_accum", "grad_ckpt", "attn",
                                                        "tokens_per_s", "mfu")}})
print(json.dumps(out))
"""


def time_search(args: tuple, runs: int) -> dict:
    """Fresh process per run, so 'cold' really is the first search of a process."""
    cold, warm, cands, best = [], [], 0, None
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", SEARCH_CHILD, json.dumps(args)], check=True, capture_output=True,
                           text=True)
        first, second = json.loads(r.stdout.strip().splitlines()[-1])
        cold.append(first["seconds"])
        warm.append(second["seconds"])
        cands, best = first["candidates"], first["best"]
    return {"candidates": cands, "cold_median_s": statistics.median(cold), "warm_median_s": statistics.median(warm),
            "cold_candidates_per_s": cands / statistics.median(cold),
            "warm_candidates_per_s": cands / statistics.median(warm),
            "cold_runs": cold, "warm_runs": warm, "best_plan": best}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/search_speed.json")
    args = ap.parse_args()
    cli = {}
    for name, cmd in CLI.items():
        times = time_runs(cmd, args.runs)
        cli[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": times}
        print(f"{name:100s} median {statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f})")
    searches = {}
    for name, a in SEARCHES.items():
        r = time_search(a, args.runs)
        searches[name] = r
        print(f"{name}: {r['candidates']:,} candidates evaluated; cold {r['cold_median_s']:.3f} s = {r['cold_candidates_per_s']:,.0f}/s, warm "
              f"{r['warm_median_s']:.3f} s = {r['warm_candidates_per_s']:,.0f}/s")
    save({"command": f"python benchmarks/search_speed.py --runs {args.runs}", "machine": machine(), "cli": cli,
          "searches": searches}, args.out)


if __name__ == "__main__":
    main()
