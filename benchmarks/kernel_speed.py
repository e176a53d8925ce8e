"""Speed of memplan's kernels on a CUDA GPU: forward + backward of each implementation of a case, median
of `triton.testing.do_bench`, and the peak memory one step allocates beyond its inputs.

    python benchmarks/kernel_speed.py [--hidden 4096 --vocab 128256 --tokens 8192] [--cases ...] [--out ...]

Cases (CASES: name -> (setup, {implementation: step})); the first implementation is the one the others
are set beside:
- linear_cross_entropy: the loss head in bf16, memplan's Triton kernels, the tiled PyTorch path and
  eager (`reference`: whole logits, fp32 up-cast, torch's cross_entropy, as transformers'
  ForCausalLMLoss).
- attention: causal attention, b=1, 32 query heads / 8 KV heads, d=128, `--tokens` positions, bf16:
  memplan's Triton kernels, torch SDPA (enable_gqa; flash on sm80+), the tiled PyTorch path and eager.
- gated_act: act(gate) * up (SiLU) over `--tokens` x 14336 bf16, Triton vs eager.
Autotuning runs in a warm-up step before timing.

Without CUDA it exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from cli_suggest import machine, save  # same folder: run as python benchmarks/kernel_speed.py
from memplan.kernels import linear_cross_entropy
from memplan.kernels.attention import attention
from memplan.kernels.attention import reference as attention_reference
from memplan.kernels.cross_entropy import reference
from memplan.kernels.mlp import gated_act, reference_gated


def loss_setup(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device="cuda", generator=gen) * args.hidden ** -0.5).to(torch.bfloat16)
    t = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)
    return h, w.requires_grad_(), t


def grads_of(fn):
    """One training step of any kernel: forward, then the gradients of every input that requires one."""
    def step(*xs):
        out = fn(*xs)
        torch.autograd.grad(out, [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad], torch.ones_like(out))
    return step


def attention_setup(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, args.tokens, 128, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
               for heads in (32, 8, 8))
    return q, k, v


def gated_setup(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(args.tokens, 14336, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
                 for _ in range(2))


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


CASES = {
    "linear_cross_entropy": (loss_setup, {
        "triton": grads_of(functools.partial(linear_cross_entropy, backend="triton")),
        "torch (tiled)": grads_of(functools.partial(linear_cross_entropy, backend="torch")),
        "eager": grads_of(reference),
    }),
    "attention": (attention_setup, {
        "triton": grads_of(functools.partial(attention, causal=True, backend="triton")),
        "sdpa": grads_of(_sdpa),
        "torch (tiled)": grads_of(functools.partial(attention, causal=True, backend="torch")),
        "eager": grads_of(functools.partial(attention_reference, causal=True)),
    }),
    "gated_act": (gated_setup, {
        "triton": grads_of(functools.partial(gated_act, backend="triton")),
        "eager": grads_of(reference_gated),
    }),
}


def measure(step, inputs) -> dict:
    from triton.testing import do_bench

    step(*inputs)  # warm-up: compiles and autotunes outside the timing
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"median_ms": do_bench(lambda: step(*inputs), return_mode="median"), "peak_bytes_beyond_inputs": peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default="benchmarks/results/kernel_speed.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernel_speed.py times CUDA kernels: no CUDA GPU here")
        sys.exit(2)
    import triton

    results = {}
    for name in args.cases:
        setup, impls = CASES[name]
        inputs = setup(args)
        rows = {impl: measure(step, inputs) for impl, step in impls.items()}
        first = next(iter(rows))
        for impl, r in rows.items():
            r["ratio_to_" + first] = r["median_ms"] / rows[first]["median_ms"]
            print(f"{name}  {impl:14s} {r['median_ms']:9.2f} ms  {r['ratio_to_' + first]:5.2f}x {first}'s time, "
                  f"peak {r['peak_bytes_beyond_inputs'] / 2 ** 30:6.2f} GiB beyond the inputs")
        results[name] = rows
        del inputs
        torch.cuda.empty_cache()
    save({"command": "python benchmarks/kernel_speed.py " + " ".join(
              f"--{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items() if k != "out"),
          "machine": machine(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
          "triton": triton.__version__, "hidden": args.hidden, "vocab": args.vocab, "tokens": args.tokens,
          "dtype": "bf16", "timing": "triton.testing.do_bench median, forward + backward", "cases": results}, args.out)


if __name__ == "__main__":
    main()
