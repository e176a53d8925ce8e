"""Speed of the multi-GPU search, optionally side by side with another checkout of memplan.

    python benchmarks/search_speed.py [--runs 9] [--out benchmarks/results/search_speed.json]
                                      [--baseline SRC]

1. The must-show CLI call, cold (a fresh process each run), median wall time, beside `python -c pass`
   and `memplan suggest --model bert-large --gpu v100-16g`.
2. Candidates evaluated per second inside one process: a candidate is one full setting of every knob
   (layout, ZeRO, offload, SP, interleaving, precision, optimizer, checkpointing, attention, micro
   batch) whose per-GPU memory was estimated and, if it fits, whose step time was modelled. Cold:
   the first search of a process (the estimator's caches empty), timed after the imports (numpy and
   memplan; the CLI times in 1. include them); warm: the same search again. Every candidate is
   evaluated (memplan.estimator.step.evaluate, a table per layout): none is pruned.
3. Llama 3.1 405B on 1024 H100s (128 nodes of 8), seq 8192, global batch 2048.

--baseline SRC runs every measurement again with PYTHONPATH=SRC (another checkout's source folder,
e.g. a git worktree of an older commit: its `src` or, before the src layout, a folder holding a
`memplan` package), alternating run by run, so both see the same machine state; the results give
both medians and their ratio. This machine's speed varies by 2x from hour to hour (`python -c pass`
is timed in the same run to show it), so compare only numbers from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from cli_suggest import machine, save  # same folder: run as python benchmarks/search_speed.py

MUST_SHOW = ["suggest", "--model", "llama-3.1-70b", "--gpu", "h100-80g", "--gpus", "8", "--nodes", "8",
             "--seq-len", "4096", "--batch-size", "1024", "--json"]
CLI = {
    "memplan " + " ".join(MUST_SHOW): [sys.executable, "-m", "memplan", *MUST_SHOW],
    "memplan suggest --model bert-large --gpu v100-16g": [
        sys.executable, "-m", "memplan", "suggest", "--model", "bert-large", "--gpu", "v100-16g", "--json"],
    "python -c pass": [sys.executable, "-c", "pass"],
}
SEARCHES = {
    "llama-3.1-70b, 64 x h100-80g, seq 4096, batch 1024": ("llama-3.1-70b", "h100-80g", 8, 8, 4096, 1024),
    "llama-3.1-405b, 1024 x h100-80g, seq 8192, batch 2048": ("llama-3.1-405b", "h100-80g", 8, 128, 8192, 2048),
}

SEARCH_CHILD = """
import json, sys, time
import numpy, memplan  # imported before the clock starts: the search itself is timed
model, gpu, gpus, nodes, seq, batch = json.loads(sys.argv[1])
spec, prof = memplan.resolve_model(model), memplan.load_gpu(gpu)
out = []
for _ in range(2):  # cold, then warm
    t0 = time.perf_counter()
    s = memplan.suggest(spec, prof, seq_len=seq, global_batch=batch, gpus=gpus, nodes=nodes)
    out.append({"seconds": time.perf_counter() - t0, "candidates": s.candidates})
print(json.dumps(out))
"""


def _env(src: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.path.abspath(src)
    return env


def _wall(cmd: list[str], src: str | None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(src))
    return time.perf_counter() - t0


def _search(args: tuple, src: str | None) -> tuple[float, float, int]:
    r = subprocess.run([sys.executable, "-c", SEARCH_CHILD, json.dumps(args)], check=True, capture_output=True,
                       text=True, env=_env(src))
    cold, warm = json.loads(r.stdout.strip().splitlines()[-1])
    return cold["seconds"], warm["seconds"], cold["candidates"]


def _summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": times}


def measure(runs: int, baseline: str | None) -> dict:
    """Every measurement `runs` times, this checkout and the baseline alternating."""
    sides = {"this": None} | ({"baseline": baseline} if baseline else {})
    cli = {name: {side: [] for side in sides} for name in CLI}
    searches = {name: {side: {"cold": [], "warm": [], "candidates": 0} for side in sides} for name in SEARCHES}
    for _ in range(runs):
        for side, src in sides.items():
            for name, cmd in CLI.items():
                cli[name][side].append(_wall(cmd, src))
            for name, a in SEARCHES.items():
                cold, warm, n = _search(a, src)
                s = searches[name][side]
                s["cold"].append(cold)
                s["warm"].append(warm)
                s["candidates"] = n
    return {"cli": {n: {side: _summary(t) for side, t in v.items()} for n, v in cli.items()},
            "searches": {n: {side: _rates(s) for side, s in v.items()} for n, v in searches.items()}}


def _rates(s: dict) -> dict:
    cold, warm = statistics.median(s["cold"]), statistics.median(s["warm"])
    return {"candidates": s["candidates"], "cold_median_s": cold, "warm_median_s": warm,
            "cold_candidates_per_s": s["candidates"] / cold, "warm_candidates_per_s": s["candidates"] / warm,
            "cold_runs": s["cold"], "warm_runs": s["warm"]}


def report(r: dict) -> None:
    for name, sides in r["cli"].items():
        line = "  ".join(f"{side} {v['median_s']:.3f} s" for side, v in sides.items())
        ratio = (f"  (this / baseline {sides['this']['median_s'] / sides['baseline']['median_s']:.2f})"
                 if "baseline" in sides else "")
        print(f"{name:100s} median {line}{ratio}")
    for name, sides in r["searches"].items():
        for side, v in sides.items():
            print(f"{name} [{side}]: {v['candidates']:,} candidates; cold {v['cold_median_s']:.3f} s = "
                  f"{v['cold_candidates_per_s']:,.0f}/s, warm {v['warm_median_s']:.3f} s = "
                  f"{v['warm_candidates_per_s']:,.0f}/s")
        if "baseline" in sides:
            t, b = sides["this"], sides["baseline"]
            print(f"  this / baseline: cold {t['cold_median_s'] / b['cold_median_s']:.2f}, "
                  f"warm {t['warm_median_s'] / b['warm_median_s']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--out", default="benchmarks/results/search_speed.json")
    ap.add_argument("--baseline", help="another checkout's source folder, timed alternately (PYTHONPATH)")
    args = ap.parse_args()
    r = measure(args.runs, args.baseline)
    report(r)
    command = f"python benchmarks/search_speed.py --runs {args.runs}" + (
        f" --baseline {args.baseline}" if args.baseline else "")
    save({"command": command, "machine": machine(), **r}, args.out)


if __name__ == "__main__":
    main()
