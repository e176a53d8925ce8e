"""Where a training step's time goes, by the speed model's operator classes (docs/cost-model.md): one configuration
profiled with torch.profiler, each kernel's device time summed by class (GEMMs, the attention core, the optimizer,
the rest: element-wise and reductions), beside the step's wall time and the host's time in Python, and beside the
speed model's own terms for the same step. Made for the steps the lent H200 found under-predicted and noisy
(docs/cost-model.md: T5, GPT-2, bert-large bf16): whether the GPU or the host sets their time.

    python benchmarks/gpu_profile.py --model t5-base --seq-len 512 --micro-batch 8 --precision bf16 --attn sdpa
    python benchmarks/gpu_profile.py ... --device cpu     # the same on the CPU (CPU ops), to check the script

Runs memplan verify's own step (verify.run.setup, make_batch, train_steps): the first two steps warm up, the
profiled steps follow. Writes --out (JSON) with the command. Classes are read off kernel names (cuBLAS / CUTLASS
GEMMs, flash / efficient / fmha attention, the fused optimizer's multi-tensor kernels), so a kernel the patterns
miss lands in "other": the JSON lists the largest kernels of each class to check that by eye.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch

import memplan

# kernel-name patterns per class, first match wins (names as CUDA kernels or CPU aten ops report them)
CLASSES = (
    ("loss", re.compile(r"log_?softmax|nll_loss|cross_entropy", re.I)),
    ("attention", re.compile(r"flash|fmha|efficient_attention|scaled_dot_product|softmax", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|sm90_xmma|ampere_.*_s16816|nvjet|aten::(mm|bmm|addmm|matmul|linear)", re.I)),
    ("optimizer", re.compile(r"multi_tensor|fused_adam|_fused_adamw|foreach|adam", re.I)),
)


def classify(name: str) -> str:
    return next((cls for cls, pat in CLASSES if pat.search(name)), "other")


def step_fn(args):
    """The verify step for the configuration: (one training step as a callable, the estimate)."""
    from memplan import api
    from memplan.inputs.catalog import resolve_config
    from memplan.verify.run import autocast_dtype, make_batch, setup, train_steps

    work = dict(seq_len=args.seq_len, micro_batch=args.micro_batch, precision=args.precision, attn=args.attn,
                grad_ckpt=args.grad_ckpt, method=args.method)
    est = api.estimate(args.model, args.gpu, **work)
    w = est.workload
    config, head = resolve_config(args.model, None, False)
    model, head, optimizer, dtype = setup(config, head, w, args.device)
    half = autocast_dtype(w)
    autocast = (lambda: torch.autocast(args.device, dtype=half)) if half is not None else None

    def one() -> None:
        train_steps(model, lambda: make_batch(model, head, w.micro_batch, w.seq_len, dtype, args.device),
                    optimizer, w, 1, autocast=autocast)

    return one, est


def profile(one, device: str, steps: int) -> dict:
    """Device (or CPU op) time by class over `steps` profiled steps, the wall time per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    t0 = time.perf_counter()  # the wall time without the profiler, whose overhead is host time
    for _ in range(steps):
        one()
    wall = (time.perf_counter() - t0) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            one()
    by_class: dict[str, float] = {}
    kernels: dict[str, float] = {}
    top: dict[str, list] = {}
    for ev in prof.key_averages():
        # CUDA: the kernels only (an aten op's self device time repeats its kernels'); CPU: the aten ops
        if device == "cuda" and ev.device_type != DeviceType.CUDA or device != "cuda" and not ev.key.startswith(
                "aten::"):
            continue
        us = ev.self_device_time_total if device == "cuda" else ev.self_cpu_time_total
        if us <= 0:
            continue
        cls = classify(ev.key)
        by_class[cls] = by_class.get(cls, 0.0) + us / 1e6 / steps
        kernels[cls] = kernels.get(cls, 0.0) + ev.count / steps
        top.setdefault(cls, []).append((us / 1e6 / steps, ev.key[:120], ev.count // steps))
    return {"wall_s": wall, "by_class_s": by_class, "busy_s": sum(by_class.values()), "kernels_per_step": kernels,
            "largest": {k: sorted(v, reverse=True)[:8] for k, v in top.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpu", default="auto")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--grad-ckpt", default="none")
    ap.add_argument("--method", default="full")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (after two warm-up steps)")
    ap.add_argument("--out", default="benchmarks/results/gpu_profile.json")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: no CUDA GPU is visible to torch (--device cpu checks the script)", file=sys.stderr)
        return 2
    one, est = step_fn(args)
    for _ in range(2):
        one()
    doc = {"command": "python benchmarks/gpu_profile.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
           "memplan": memplan.__version__, "predicted_step_s": est.step_time_s,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    doc |= profile(one, args.device, args.steps)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: doc[k] for k in ("predicted_step_s", "wall_s", "busy_s", "by_class_s", "kernels_per_step")},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
