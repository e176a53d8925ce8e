"""Peak tensor bytes of causal self-attention, forward + backward, eager vs memplan's tiled attention
(memplan.kernels.attention, the PyTorch path), over sequence lengths, counted by memplan's tracker
(src/memplan/verify/tracer.py) on fake tensors: exact storage bytes, each rounded to 512 B as the CUDA
allocator rounds them, and no memory used (which is why eager can be "run" at 32k: 128 GiB of fp32 softmax).

    python benchmarks/attention_memory.py [--batch 1 --heads 32 --head-dim 128 --seqs 1024,...] [--out ...]

Eager is `memplan.kernels.attention.reference`, transformers' eager_attention_forward computation (bf16
scores, fp32 softmax, bf16 probabilities). The inputs (q, k, v) are not counted; the results (dq, dk, dv
in bf16) are counted in the peak and reported apart, so "beyond the results" is attention's own working
memory: quadratic in s for eager (b*h*s^2 scores and probabilities), linear for the tiled path (the
output, the output gradient, the fp32 log-sum-exp and D: the "marginal" column, the bytes one more
token costs) plus a constant (the block temporaries: an fp32 score block of at most 16 MiB and its kin).
"""

from __future__ import annotations

import argparse

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cli_suggest import machine, save  # same folder: run as python benchmarks/attention_memory.py
from memplan.kernels.attention import attention, reference
from memplan.verify.tracer import LiveTracker


def peak(fn, batch: int, heads: int, head_dim: int, seq: int) -> dict:
    with FakeTensorMode():
        tracker = LiveTracker()
        with tracker:
            tracker.set_phase("data")  # the inputs, counted and then taken out below
            q, k, v = (torch.empty(batch, heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            tracker.set_phase("forward")
            out = fn(q, k, v, causal=True)
            tracker.set_phase("backward")
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            del out
        s = tracker.summarize()
    inputs = s.breakdown.get("inputs", 0)
    results = sum(g.untyped_storage().nbytes() for g in grads)
    beyond = s.peak_allocated - inputs - results
    return {"peak_bytes": s.peak_allocated - inputs, "inputs_bytes": inputs, "results_bytes": results,
            "beyond_results_bytes": beyond, "beyond_results_bytes_per_token": beyond / seq,
            "peak_phase": s.peak_phase, "peak_op": s.peak_op}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--out", default="benchmarks/results/attention_memory.json")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    shape = (args.batch, args.heads, args.head_dim)
    rows = []
    gib = 2 ** 30
    print(f"working memory beyond dq/dk/dv (b={args.batch}, h={args.heads}, d={args.head_dim}, bf16, causal)")
    print(f"{'seq':>6s} {'eager GiB':>10s} {'tiled GiB':>10s} {'ratio':>7s} {'eager B/tok^2':>14s} "
          f"{'tiled B/tok':>12s} {'tiled marginal B/tok':>21s}")
    for seq in seqs:
        eager = peak(reference, *shape, seq)
        tiled = peak(attention, *shape, seq)
        ratio = eager["beyond_results_bytes"] / tiled["beyond_results_bytes"]
        row = {"seq": seq, "eager": eager, "memplan": tiled, "beyond_results_ratio": ratio,
               "eager_beyond_results_bytes_per_token_squared": eager["beyond_results_bytes"] / seq ** 2}
        if rows:  # the slope since the previous length: what one more token costs
            prev = rows[-1]
            row["memplan_marginal_bytes_per_token"] = ((tiled["beyond_results_bytes"]
                                                        - prev["memplan"]["beyond_results_bytes"])
                                                       / (seq - prev["seq"]))
        rows.append(row)
        marginal = row.get("memplan_marginal_bytes_per_token")
        print(f"{seq:6d} {eager['beyond_results_bytes'] / gib:10.3f} {tiled['beyond_results_bytes'] / gib:10.3f} "
              f"{ratio:6.1f}x {row['eager_beyond_results_bytes_per_token_squared']:14.1f} "
              f"{tiled['beyond_results_bytes_per_token']:12.0f} {'' if marginal is None else f'{marginal:21.0f}'}")
    print(f"peaks: eager at {rows[-1]['eager']['peak_phase']} ({rows[-1]['eager']['peak_op']}), tiled at "
          f"{rows[-1]['memplan']['peak_phase']} ({rows[-1]['memplan']['peak_op']})")
    save({"command": f"python benchmarks/attention_memory.py --batch {args.batch} --heads {args.heads} "
                     f"--head-dim {args.head_dim} --seqs {args.seqs}",
          "machine": machine(), "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "dtype": "bf16",
          "causal": True, "path": "memplan: the tiled PyTorch path with its default tiles; eager: reference",
          "results": rows}, args.out)


if __name__ == "__main__":
    main()
