"""What the GPU in hand reaches per operator class, beside the speed model's constants for its generation
(`search/cost.py` GENERATIONS, docs/cost-model.md): the matmul rate at the shapes of gpu_grid.py's models, fused
attention (SDPA) forward + backward, memory-bound kernels' bandwidth, the host's time per eager op, and the
optimizer step. Each is a fraction of the profile's datasheet peak, as the constants are.

    python benchmarks/gpu_ops.py [--out benchmarks/results/gpu_ops.json]

Times are CUDA-event medians of repeated calls after a warm-up; the host's time per op is wall time of a loop of
tiny ops that never waits on the GPU. Needs a CUDA build of torch; exits 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

import memplan

HERE = pathlib.Path(__file__).parent

# (tokens, in, out) of the linears of gpu_grid.py's models at its micro batches: bert-large b8 s512, Llama-3.2-1B
# b4 s1024 (q / o, k / v, MLP up and down, the LM head), Qwen2.5-0.5B b4 s2048 (MLP up, down, LM head)
GEMMS = [(4096, 1024, 1024), (4096, 1024, 4096), (4096, 4096, 1024),
         (4096, 2048, 2048), (4096, 2048, 512), (4096, 2048, 8192), (4096, 8192, 2048), (4096, 2048, 128256),
         (8192, 896, 4864), (8192, 4864, 896), (8192, 896, 151936)]
# (batch, query heads, kv heads, seq, head dim, causal) of the same models
ATTENTION = [(8, 16, 16, 512, 64, False), (4, 32, 8, 1024, 64, True), (4, 14, 2, 2048, 64, True)]
ELEMENTS = 64 * 2**20


def timed(fn, reps: int = 20) -> float:
    """Median seconds of one call, CUDA events around each after three warm-up calls."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def gemms(prof) -> list[dict]:
    rows = []
    for dtype, peak in ((torch.bfloat16, prof.tflops["bf16"]), (torch.float32, prof.tflops["fp32"])):
        for m, k, n in GEMMS:
            x, w = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(n, k, device="cuda", dtype=dtype)
            fwd = timed(lambda: x @ w.t())
            dx = timed(lambda: (x @ w.t()) @ w)  # one forward and the input gradient's shape
            flops = 2 * m * k * n
            rows.append({"dtype": str(dtype).split(".")[1], "m": m, "k": k, "n": n, "forward_s": fwd,
                         "tflops": flops / fwd / 1e12, "fraction_of_peak": flops / fwd / 1e12 / peak,
                         "forward_plus_dgrad_s": dx})
            del x, w
    return rows


def attention(prof) -> list[dict]:
    rows = []
    for b, hq, hk, s, d, causal in ATTENTION:
        q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")

        grad = torch.ones(b, hq, s, d, device="cuda", dtype=torch.bfloat16)

        def step():  # forward and the three input gradients, nothing accumulated into .grad
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hk)
            torch.autograd.grad(o, (q, k, v), grad)

        t = timed(step)
        flops = 4 * b * hq * s * s * d * 3 * (0.5 if causal else 1.0)  # QK^T and PV, x3 with backward
        rows.append({"b": b, "heads": hq, "kv_heads": hk, "seq": s, "head_dim": d, "causal": causal,
                     "fwd_bwd_s": t, "tflops": flops / t / 1e12,
                     "fraction_of_peak": flops / t / 1e12 / prof.tflops["bf16"]})
    return rows


def bandwidth(prof) -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        x, y = torch.randn(ELEMENTS, device="cuda", dtype=dtype), torch.randn(ELEMENTS, device="cuda", dtype=dtype)
        h = x.view(-1, 2048)
        ops = {"add": (lambda: x + y, 3), "layer_norm": (lambda: torch.nn.functional.layer_norm(h, (2048,)), 2),
               "softmax": (lambda: torch.softmax(h, -1), 2), "copy": (lambda: x.clone(), 2)}
        for name, (fn, moves) in ops.items():
            t = timed(fn)
            gbs = moves * ELEMENTS * x.element_size() / t / 1e9
            rows.append({"op": name, "dtype": str(dtype).split(".")[1], "elements": ELEMENTS, "seconds": t,
                         "gbs": gbs, "fraction_of_peak": gbs / prof.memory_bandwidth_gbs})
        del x, y, h
    return rows


def host_per_op() -> dict:
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x = x + 1
    torch.cuda.synchronize()
    n, t0 = 5000, time.perf_counter()
    for _ in range(n):
        x = x + 1
    launched = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return {"ops": n, "seconds_per_op": launched}


def optimizer_step() -> list[dict]:
    rows = []
    numel = 1_235_814_400  # Llama-3.2-1B's parameters (memplan's catalog)
    sizes = [numel // 146] * 146  # as many tensors as its 16 layers and the embedding hold
    for name, kw in (("adamw_fused", {"fused": True}), ("adamw_foreach", {"foreach": True})):
        ps = [torch.zeros(n, device="cuda", requires_grad=True) for n in sizes]
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-4, **kw)
        t = timed(opt.step, reps=5)
        rows.append({"optimizer": name, "params": sum(sizes), "tensors": len(sizes), "step_s": t})
        del ps, opt
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_ops.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_ops: no CUDA GPU is visible to torch", file=sys.stderr)
        return 2
    from memplan.inputs.profiles import load_gpu

    prof = load_gpu("auto")
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default, pinned: fp32 GEMMs against the fp32 peak
    doc = {"command": "python benchmarks/gpu_ops.py", "device": torch.cuda.get_device_name(),
           "profile": prof.name, "torch": torch.__version__, "memplan": memplan.__version__,
           "allow_tf32": torch.backends.cuda.matmul.allow_tf32}
    for name, fn in (("gemm", gemms), ("attention", attention), ("bandwidth", bandwidth)):
        doc[name] = fn(prof)
        print(name, json.dumps(doc[name][-1]), flush=True)
    doc["host"] = host_per_op()
    doc["optimizer"] = optimizer_step()
    pathlib.Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("host", "optimizer")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
