"""Peak tensor bytes of the loss head, eager PyTorch vs memplan.kernels.linear_cross_entropy, forward +
backward, counted by memplan's tracker (src/memplan/verify/tracer.py) on fake tensors: exact storage bytes,
each rounded to 512 B as the CUDA allocator rounds them, and no memory used.

    python benchmarks/kernel_memory.py [--hidden 4096 --vocab 128256 --tokens 8192] [--out ...]

Eager is transformers' ForCausalLMLoss path: logits = hidden @ W^T in bf16, up-cast to fp32,
cross_entropy. The inputs (hidden states, weight, targets) are not counted; the results (the gradients
of the hidden states and of the weight, in bf16) are counted in the peak and reported apart, so
"beyond the results" is the loss's own working memory.
"""

from __future__ import annotations

import argparse

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cli_suggest import machine, save  # same folder: run as python benchmarks/kernel_memory.py
from memplan.kernels import linear_cross_entropy
from memplan.kernels.cross_entropy import reference
from memplan.verify.tracer import LiveTracker


def peak(fn, hidden: int, vocab: int, tokens: int) -> dict:
    with FakeTensorMode():
        tracker = LiveTracker()
        with tracker:
            tracker.set_phase("data")  # the inputs, counted and then taken out below
            h = torch.empty(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
            w = torch.empty(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
            t = torch.zeros(tokens, dtype=torch.long)
            tracker.set_phase("forward")
            loss = fn(h, w, t)
            tracker.set_phase("backward")
            gh, gw = torch.autograd.grad(loss, (h, w))
        s = tracker.summarize()
    inputs = s.breakdown.get("inputs", 0)
    results = gh.untyped_storage().nbytes() + gw.untyped_storage().nbytes()
    return {"peak_bytes": s.peak_allocated - inputs, "inputs_bytes": inputs, "results_bytes": results,
            "beyond_results_bytes": s.peak_allocated - inputs - results, "peak_phase": s.peak_phase,
            "peak_op": s.peak_op}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default="benchmarks/results/kernel_memory.json")
    args = ap.parse_args()
    shape = (args.hidden, args.vocab, args.tokens)
    eager = peak(reference, *shape)
    tiled = peak(linear_cross_entropy, *shape)
    ratio = eager["beyond_results_bytes"] / tiled["beyond_results_bytes"]
    gib = 2 ** 30
    for name, r in (("eager", eager), ("memplan", tiled)):
        print(f"{name:8s} peak {r['peak_bytes'] / gib:7.2f} GiB, beyond the gradients "
              f"{r['beyond_results_bytes'] / gib:7.3f} GiB (at {r['peak_phase']}: {r['peak_op']})")
    print(f"loss working memory: {ratio:.1f}x less")
    save({"command": "python benchmarks/kernel_memory.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()
                                                               if k != "out"),
          "machine": machine(), "hidden": args.hidden, "vocab": args.vocab, "tokens": args.tokens, "dtype": "bf16",
          "eager": eager, "memplan": tiled, "beyond_results_ratio": ratio}, args.out)


if __name__ == "__main__":
    main()
