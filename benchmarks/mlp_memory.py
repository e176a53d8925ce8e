"""Peak tensor bytes of one gated MLP's forward + backward, untiled vs memplan.kernels.mlp.tiled_mlp, with
transformers' activation (silu(gate) * up) or memplan's fused gated_act, counted by memplan's tracker
(src/memplan/verify/tracer.py) on fake tensors: exact storage bytes, each rounded to 512 B as the CUDA
allocator rounds them, and no memory used.

    python benchmarks/mlp_memory.py [--hidden 4096 --intermediate 14336 --tokens 4096 8192 16384 32768]

Default: Llama-3-8B's MLP (hidden 4096, intermediate 14336, SwiGLU) in bf16 (weights and activations).
The inputs (x, the three weights, the output's gradient) are allocated in a "data" phase and not
counted; the results (the gradients of x and of the weights, bf16) are counted in the peak and reported
apart, so "beyond the results" is the MLP's own working memory. "at the end of forward" is what the
layer holds between its forward and its backward (its output included): in a model this is paid by
every layer at once, while the backward's working memory is paid by one layer at a time.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from cli_suggest import machine, save  # same folder: run as python benchmarks/mlp_memory.py
from memplan.kernels.mlp import default_chunk, gated_act, reference_gated, tiled_mlp
from memplan.estimator.allocation import round_block
from memplan.verify.tracer import LiveTracker


def eager_mlp(x, wg, wu, wd):
    """transformers' LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x))."""
    return F.linear(reference_gated(F.linear(x, wg), F.linear(x, wu), "silu"), wd)


def fused_mlp(x, wg, wu, wd):
    return F.linear(gated_act(F.linear(x, wg), F.linear(x, wu), "silu"), wd)


def live_at(tracker: LiveTracker, phase: str) -> int:
    """Rounded bytes live when `phase` began (replaying the tracker's alloc / free events)."""
    pos = next(p for p, name in tracker.marks if name == phase)
    live = 0
    for e in tracker.events[:pos]:
        live += round_block(tracker.allocs[e].nbytes) if e >= 0 else -round_block(tracker.allocs[~e].nbytes)
    return live


def peak(mlp, tiled: bool, hidden: int, inter: int, tokens: int) -> dict:
    with FakeTensorMode():
        tracker = LiveTracker()
        with tracker:
            tracker.set_phase("data")  # the inputs, counted and then taken out below
            bf16 = dict(dtype=torch.bfloat16, requires_grad=True)
            x = torch.empty(tokens, hidden, **bf16)
            ps = [torch.empty(inter, hidden, **bf16), torch.empty(inter, hidden, **bf16),
                  torch.empty(hidden, inter, **bf16)]
            grad_out = torch.empty(tokens, hidden, dtype=torch.bfloat16)
            tracker.set_phase("forward")
            out = tiled_mlp(lambda h: mlp(h, *ps), x, ps) if tiled else mlp(x, *ps)
            tracker.set_phase("backward")
            grads = torch.autograd.grad(out, [x, *ps], grad_out)
        s = tracker.summarize()
        inputs = s.breakdown.get("inputs", 0)
        forward_end = live_at(tracker, "backward") - inputs
    results = sum(round_block(g.untyped_storage().nbytes()) for g in grads)
    return {"peak_bytes": s.peak_allocated - inputs, "results_bytes": results,
            "beyond_results_bytes": s.peak_allocated - inputs - results, "forward_end_bytes": forward_end,
            "peak_phase": s.peak_phase, "peak_op": s.peak_op}


CONFIGS = {"untiled": (eager_mlp, False), "untiled + gated_act": (fused_mlp, False),
           "tiled": (eager_mlp, True), "tiled + gated_act": (fused_mlp, True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--out", default="benchmarks/results/mlp_memory.json")
    args = ap.parse_args()
    gib = 2 ** 30
    chunk = default_chunk(args.hidden)
    rows = []
    for tokens in args.tokens:
        row = {"tokens": tokens, "chunks": -(-tokens // chunk)}
        for name, (mlp, tiled) in CONFIGS.items():
            row[name] = r = peak(mlp, tiled, args.hidden, args.intermediate, tokens)
            print(f"{tokens:6d} tokens  {name:20s} peak {r['peak_bytes'] / gib:6.2f} GiB, beyond the gradients "
                  f"{r['beyond_results_bytes'] / gib:6.2f} GiB, at the end of forward "
                  f"{r['forward_end_bytes'] / gib:6.2f} GiB (peak at {r['peak_phase']}: {r['peak_op']})")
        row["beyond_results_ratio"] = row["untiled"]["beyond_results_bytes"] / row["tiled"]["beyond_results_bytes"]
        row["forward_end_ratio"] = row["untiled"]["forward_end_bytes"] / row["tiled"]["forward_end_bytes"]
        print(f"{tokens:6d} tokens  tiled vs untiled: working memory {row['beyond_results_ratio']:.1f}x less, "
              f"held between forward and backward {row['forward_end_ratio']:.1f}x less")
        rows.append(row)
    save({"command": "python benchmarks/mlp_memory.py --hidden %d --intermediate %d --tokens %s"
                     % (args.hidden, args.intermediate, " ".join(map(str, args.tokens))),
          "machine": machine(), "hidden": args.hidden, "intermediate": args.intermediate, "dtype": "bf16",
          "activation": "silu", "chunk_tokens": chunk, "results": rows}, args.out)


if __name__ == "__main__":
    main()
