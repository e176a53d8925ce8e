"""Wall time of cold `memplan suggest` CLI runs (a fresh Python process each), median of N.

    python benchmarks/cli_suggest.py [--runs 9] [--out benchmarks/results/cli_suggest.json]

Baseline side by side: `python -c pass` (interpreter start) and `python -c "import torch"`, the cost a
CLI that imports torch on its estimate path would pay before doing any work.
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

COMMANDS = {
    "memplan suggest --model bert-large --gpu v100-16g": [sys.executable, "-m", "memplan", "suggest", "--model",
                                                          "bert-large", "--gpu", "v100-16g"],
    "memplan estimate (bert-large, v100-16g, calibration case)": [
        sys.executable, "-m", "memplan", "estimate", "--model", "bert-large", "--gpu", "v100-16g", "--micro-batch",
        "4", "--seq-len", "512", "--precision", "fp32", "--attn", "eager", "--json"],
    "baseline: python -c pass": [sys.executable, "-c", "pass"],
    "baseline: python -c 'import torch'": [sys.executable, "-c", "import torch"],
}


def time_runs(cmd: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--out", default="benchmarks/results/cli_suggest.json")
    args = ap.parse_args()
    results = {}
    for name, cmd in COMMANDS.items():
        times = time_runs(cmd, args.runs)
        results[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                         "runs": times}
        print(f"{name:60s} median {statistics.median(times):.3f} s  (min {min(times):.3f}, max {max(times):.3f})")
    main_cmd = "memplan suggest --model bert-large --gpu v100-16g"
    ratio = results["baseline: python -c 'import torch'"]["median_s"] / results[main_cmd]["median_s"]
    print(f"suggest vs. a bare `import torch`: {ratio:.2f}x faster")
    save({"command": "python benchmarks/cli_suggest.py --runs %d" % args.runs, "machine": machine(),
          "results": results, "import_torch_over_suggest": ratio}, args.out)


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, Python "
            f"{platform.python_version()}")


def save(doc: dict, path: str) -> None:
    """Write the results atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
