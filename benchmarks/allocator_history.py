"""memplan's allocator simulation (estimator/allocator.py) against the CUDA caching allocator's own record of real
runs (benchmarks/gpu_memory_history.py: every alloc, free and segment event of a `verify --device cuda` run).

    python benchmarks/allocator_history.py [HISTORY.pkl.gz ...]   (default: results/gpu_lease2/hist_*.pkl.gz)

For each record, the recorded allocations and frees are fed, in order and from the model's build on, to the
simulation; verify's empty_cache before the measured step (fresh_peaks: the last release of segments before the
step's own) releases the segments that are wholly free, as torch does. Beside the measured step's peak reserved:
  - from the build: the simulation of the whole record (default allocator only: empty_cache's unmapping of
    expandable segments' free pages is not modelled);
  - packed: the measured step's allocations over the weights packed from the first byte, as the estimate
    assumes and as from_pretrained (or verify's GPU build since this record) loads them.
"""
import gzip
import pathlib
import pickle
import sys

from memplan.estimator.allocator import CachingAllocator, simulate

HERE = pathlib.Path(__file__).parent / "results" / "gpu_lease2"
MiB = 2**20
GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def load(path) -> dict:
    with gzip.open(path, "rb") as f:
        return pickle.load(f)


def step_start(trace: list[dict]) -> int:
    """The event that ends fresh_peaks' empty_cache: the last segment release before the step's own (the final
    release, after the step, is verify's clean-up); -1 where the record has no release before the steps."""
    runs, prev = [], -2
    for i, e in enumerate(trace):
        if GROWS.get(e["action"], 0) < 0:
            if i != prev + 1:
                runs.append(i)
            prev = i
            runs[-1] = i
    return runs[-2] if len(runs) > 1 else -1  # training: verify empties no cache before its steps


def measured(trace: list[dict], start: int) -> int:
    """Peak reserved after `start`, from the record's segment events."""
    r = sum(GROWS.get(e["action"], 0) * e["size"] for e in trace[:start + 1])
    peak = r
    for e in trace[start + 1:]:
        r += GROWS.get(e["action"], 0) * e["size"]
        peak = max(peak, r)
    return peak


def from_build(trace: list[dict], start: int) -> int:
    """The simulation of every recorded allocation from the first, the wholly free segments released at start."""
    a, keys, n = CachingAllocator(), {}, 0
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            n += 1
            keys[e["addr"]] = n
            a.malloc(n, e["size"])
        elif e["action"] == "free_completed":
            a.free(keys.pop(e["addr"]))
        if i == start:
            a.empty_cache()
    return a.peak_reserved


def live_at(trace: list[dict], index: int) -> dict[int, int]:
    """The blocks allocated after the record's event `index` (-1: none yet; len(trace) - 1: at its end), address ->
    bytes."""
    live: dict[int, int] = {}
    for e in trace[:index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return live


def packed(trace: list[dict], start: int, expandable: bool) -> int:
    """The step's allocations after the blocks live at start, allocated first in address order."""
    events, keys, n = [], {}, 0
    for addr, size in sorted(live_at(trace, start).items()):
        n += 1
        keys[addr] = n
        events.append((n, size))
    for e in trace[start + 1:]:
        if e["action"] == "alloc":
            n += 1
            keys[e["addr"]] = n
            events.append((n, e["size"]))
        elif e["action"] == "free_completed":
            events.append((keys.pop(e["addr"]), -1))
    return simulate(events, expandable=expandable).peak_reserved


def compare(path) -> dict:
    doc = load(path)
    trace = doc["device_traces"][0]
    start = step_start(trace)
    expandable = doc["report"]["workload"]["expandable_segments"]  # verify checked it against the allocator
    estimate = next(m["predicted_bytes"] for m in doc["report"]["meters"] if m["meter"] == "peak_reserved")
    return {"run": pathlib.Path(path).name, "expandable": expandable, "measured": measured(trace, start),
            "from_build": None if expandable else from_build(trace, start), "packed": packed(trace, start, expandable),
            "estimate": estimate}


def main() -> int:
    paths = sys.argv[1:] or sorted(str(p) for p in HERE.glob("hist_*.pkl.gz"))
    print("| record | allocator | measured MiB | simulated from the build | packed weights | estimate |")
    print("|---|---|---:|---:|---:|---:|")
    for p in paths:
        r = compare(p)
        fb = "" if r["from_build"] is None else f"{r['from_build'] / MiB:,.0f}"
        print(f"| {r['run']} | {'expandable' if r['expandable'] else 'default'} | {r['measured'] / MiB:,.0f} | {fb} | "
              f"{r['packed'] / MiB:,.0f} | {r['estimate'] / MiB:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
