"""The expandable-segments share (estimator/meters.py EXPANDABLE_SHARE) against the accuracy suite: for each training
case of results/accuracy.json, the expandable reserved the segment arithmetic would give with a share s of the
default mode's excess over allocated, against the allocator simulation of the traced allocations under
expandable_segments:True.

    python benchmarks/accuracy/expandable_share.py [--results benchmarks/accuracy/results/accuracy.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from memplan.estimator.meters import expandable_reserved, gpu_workspace
from memplan.inputs.profiles import load_gpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="benchmarks/accuracy/results/accuracy.json")
    args = ap.parse_args()
    doc = json.loads(open(args.results).read())
    ws = gpu_workspace(load_gpu(doc["gpu_profile"]), "train")
    cases = []
    for r in doc["results"]:
        m = {x["meter"]: x for x in r["meters"]}
        if r["case"].get("task", "train") != "train" or "peak_reserved (expandable_segments)" not in m:
            continue
        allocated = m["peak_allocated"]["predicted_bytes"] + ws  # verify compares tensors, workspace aside
        # the default mode's segment arithmetic: the meter's own figure before the replay became it (c8c2ed8)
        arithmetic = m.get("arithmetic_reserved (default)", m["peak_reserved"])["predicted_bytes"]
        cases.append((allocated, arithmetic, m["peak_reserved (expandable_segments)"]["measured_bytes"]))
    print(f"{len(cases)} training cases; error of the expandable reserved against the simulation, %")
    for share in (0.3, 0.5, 0.6, 0.7, 0.8, 1.0):
        errs = []
        for allocated, reserved, simulated in cases:
            pred = expandable_reserved(allocated, reserved, share)
            errs.append(100 * (pred / simulated - 1))
        print(f"share {share:.1f}: median |error| {statistics.median(map(abs, errs)):5.1f}, "
              f"min {min(errs):+6.1f}, max {max(errs):+6.1f}, below the simulation in {sum(e < 0 for e in errs)}")


if __name__ == "__main__":
    main()
