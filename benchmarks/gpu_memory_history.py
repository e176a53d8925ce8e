"""The CUDA caching allocator's own record of one `verify --device cuda` run: every alloc, free and segment
event in order (torch.cuda.memory._record_memory_history, no stack frames), with the verify report, gzipped. It is
what the allocator simulation (estimator/allocator.py) is checked against where a real run's reserved differs
from the simulation of the traced allocations.

    [PYTORCH_ALLOC_CONF=expandable_segments:True] python benchmarks/gpu_memory_history.py OUT.pkl.gz model=M [key=value ...]

The pairs after OUT are `memplan.verify.run.run`'s keywords (task=infer micro_batch=4 expandable_segments=true ...);
verify refuses an allocator setting that is not the workload's.
"""
import gzip
import os
import pickle
import sys

import torch


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def main() -> int:
    if len(sys.argv) < 3 or not all("=" in a for a in sys.argv[2:]):
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_memory_history: no CUDA GPU is visible to torch", file=sys.stderr)
        return 2
    out, kw = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])
    kw = {k: _value(v) for k, v in kw.items()}
    from memplan.verify.run import alloc_conf, run

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=2_000_000)
    rep = run(gpu="auto", device="cuda", **kw)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    doc = {"kwargs": kw, "alloc_conf": alloc_conf(os.environ), "torch": torch.__version__,
           "report": rep.model_dump(mode="json"), "device_traces": snap["device_traces"]}
    with gzip.open(out, "wb") as f:
        pickle.dump(doc, f)
    print(out, {m.meter: (m.predicted_bytes >> 20, m.measured_bytes >> 20) for m in rep.meters},
          sum(len(t) for t in snap["device_traces"]), "events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
