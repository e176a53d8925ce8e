"""The nine GPU-memory readings of the transformers docs' "Efficient Training on a Single GPU" (bert-large on a
V100 16 GB, HF Trainer, early 2022) against memplan's device used, from the segment arithmetic (the meter) and
from the replay of the estimate's own allocations through the allocator simulation plus the CUDA context, and
from the replay plus what the runs' torch saved that memplan's supported torch does not.

    python benchmarks/accuracy/published_hf_v100.py

The runs' stack was torch <= 1.10 (the doc's nvidia-smi is dated 2022-01-11; 1.11 came out in March 2022), whose
softmax saved its input for backward beside its output (pytorch/pytorch#49600 and #64000; PR #65242, in 1.11,
saves only the input's dtype). BERT's eager attention saves its fp32 masked scores that way: 4 bytes x b x heads x
s^2 in every layer that holds its saved tensors at the peak (all of them; one, the recomputed one, under gradient
checkpointing). `torch110_mib` adds that term to the replay. memplan models the torch it supports (>= 2.4), so the
term stays out of the estimator.

The runs, their setup and their meter are in published_hf_v100.json; the first is the calibration point of
docs/contract.md. Nothing here is fitted. Writes results/published-hf-v100.json and .md.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 2**20


def predictions(spec: dict) -> list[dict]:
    """Each run's measured NVML used beside the arithmetic's and the replay's device used, in MiB."""
    from memplan import api

    rows = []
    for run in spec["runs"]:
        work = spec["common"] | run["workload"]
        e = api.estimate(**work)
        replay = e.device_used_bytes  # the meter: the replay + the CUDA context
        arithmetic = e.by_allocator["default"]["arithmetic_reserved_bytes"] + e.breakdown["cuda_context"]
        rows.append({"name": run["name"], "measured_mib": run["mib"], "arithmetic_mib": arithmetic / MiB,
                     "replay_mib": replay / MiB, "torch110_mib": (replay + softmax_input(work)) / MiB,
                     "allocated_mib": e.peak_allocated_bytes / MiB})
    return rows


def softmax_input(work: dict) -> int:
    """Bytes torch <= 1.10 held beyond today's torch at the step's peak: each layer's fp32 softmax input (b x a x
    s x s), in every layer under no checkpointing, in the one being recomputed under full checkpointing."""
    from memplan import api

    spec = api.resolve_spec(work["model"], None, False)
    b, s = work.get("micro_batch", 1), work["seq_len"]
    layers = 1 if work.get("grad_ckpt", "none") == "full" else spec.num_layers
    return 4 * b * spec.num_heads * s * s * layers


def table(rows: list[dict]) -> str:
    def err(r, k):
        return 100 * (r[k] / r["measured_mib"] - 1)

    lines = ["# HF docs' V100 memory readings against memplan", "",
             "`python benchmarks/accuracy/published_hf_v100.py` (runs and setup: published_hf_v100.json)", "",
             "| run | NVML MiB | arithmetic MiB | error | replay MiB | error | replay + torch 1.10's softmax input "
             "| error |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['measured_mib']:,} | {r['arithmetic_mib']:,.0f} | {err(r, 'arithmetic_mib'):+.1f} % "
              f"| {r['replay_mib']:,.0f} | {err(r, 'replay_mib'):+.1f} % | {r['torch110_mib']:,.0f} | "
              f"{err(r, 'torch110_mib'):+.1f} % |" for r in rows]
    for k, name in (("arithmetic_mib", "arithmetic"), ("replay_mib", "replay"),
                    ("torch110_mib", "replay + torch 1.10's softmax input")):
        errs = [err(r, k) for r in rows]
        lines.append(f"\n{name}: median |error| {statistics.median(map(abs, errs)):.1f} %, from {min(errs):+.1f} "
                     f"to {max(errs):+.1f} %")
    return "\n".join(lines) + "\n"


def main() -> int:
    spec = json.loads((HERE / "published_hf_v100.json").read_text())
    rows = predictions(spec)
    out = HERE / "results" / "published-hf-v100"
    out.with_suffix(".json").write_text(json.dumps({"command": "python benchmarks/accuracy/published_hf_v100.py",
                                                    "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
