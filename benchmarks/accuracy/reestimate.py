"""This tree's estimates against every committed accuracy row, without tracing: each row's measured reserved (verify's
allocator simulation of the traced step, as committed) against the reserved this tree predicts for its case now, in
both allocator modes. What a change does to the suite, seconds after it is made; a rerun of the results files
(run.py) then only has to agree.

    python benchmarks/accuracy/reestimate.py [--only TEXT] [--all]

Prints each row whose error moved from the committed one (--all: every row) and, per meter, the median and max
|error| and the rows over 5 % across the files read (results/accuracy*.json; the CUDA and published ones aside, and
a case in several files counted in each)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from memplan import api

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from run import label  # noqa: E402  (the suite's case labels)

# the reserved meters of a results file and the allocator mode whose estimate each reads
METERS = {"peak_reserved": None, "peak_reserved (expandable_segments)": "expandable_segments"}


def files() -> list[Path]:
    return [p for p in sorted((HERE / "results").glob("accuracy*.json"))
            if "published" not in p.name and "cuda" not in p.name]


def predicted(case: dict, gpu: str) -> dict[str, float]:
    """Reserved bytes this tree predicts for a results row's case, by meter."""
    model = str(ROOT / case["model"]) if case["model"].endswith(".json") else case["model"]
    work = {k: v for k, v in case.items() if k not in ("model", "fast", "device")}
    est = api.estimate(api.resolve_spec(model, None, False), api.resolve_gpu(gpu), simulate=True, **work)
    own = "expandable_segments" if est.workload.expandable_segments else "default"
    return {meter: est.by_allocator[mode or own]["peak_reserved_bytes"] for meter, mode in METERS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="only rows whose file and label contain this text")
    ap.add_argument("--all", action="store_true", help="print every row, not only those that moved")
    args = ap.parse_args(argv)
    errors: dict[str, list[float]] = {meter: [] for meter in METERS}
    moved = 0
    for path in files():
        doc = json.loads(path.read_text())
        for row in doc["results"]:
            name = f"{path.stem} {label(row['case'])}"
            if args.only and args.only not in name:
                continue
            now = predicted(row["case"], doc.get("gpu_profile", "a100-80g"))
            cells = []
            for m in row["meters"]:
                if m["meter"] not in METERS:
                    continue
                err = 100 * (now[m["meter"]] - m["measured_bytes"]) / m["measured_bytes"]
                errors[m["meter"]].append(abs(err))
                changed = abs(round(err, 2) - m["error_pct"]) > 0.01
                moved += changed
                cells.append(f"{m['meter']}: {m['error_pct']:+.2f} -> {err:+.2f}{' *' if changed else ''}")
            if args.all or any(c.endswith("*") for c in cells):
                print(f"{name}  " + "  ".join(cells), flush=True)
    for meter, e in errors.items():
        if e:
            print(f"{meter}: {len(e)} rows, median {statistics.median(e):.2f} %, max {max(e):.2f} %, "
                  f"{sum(x > 5 for x in e)} over 5 %")
    print(f"moved: {moved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
