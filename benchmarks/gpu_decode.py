"""Where a greedy decode step's time goes on a GPU: transformers' forward of one token per sequence over a
DynamicCache, eager attention against SDPA (with PyTorch's cuDNN attention backend allowed, then not), the
median wall time of 32 synchronised steps and a torch.profiler table of 3 more (the ops with the most host time,
the kernels with the most device time, the SDPA kernels that ran).

Why: the H200 lease of 2026-11-27 (results/gpu_lease2/serve_grid*.json) measured SDPA decode steps at 47-80 ms
where eager Llama-3.2-1B took 13.5 ms, and memplan's serving model predicted about 3 ms.

    python benchmarks/gpu_decode.py --out results/gpu_lease2/decode.json      (CUDA; --device cpu checks it)
"""
import argparse
import json
import statistics
import sys
import time

import torch


def build(model: str, attn: str, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from memplan.inputs.catalog import resolve_config

    d, _ = resolve_config(model, None, False)
    d = dict(d)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    return m.eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step(m, token, cache):
    logits = m(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return logits[:, -1, :].float().argmax(dim=-1, keepdim=True)


def measure(model: str, attn: str, cudnn: bool, b: int, prompt: int, device: str, steps: int) -> dict:
    from transformers import DynamicCache

    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    m = build(model, attn, device)
    ids = torch.randint(0, m.config.vocab_size, (b, prompt), device=device)
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        token = step(m, ids, cache)
        times = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            token = step(m, token, cache)
            sync(device)
            times.append(time.perf_counter() - t0)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda"
                                                         else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                token = step(m, token, cache)
            sync(device)
    ev = prof.key_averages()
    host = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    dev = sorted(ev, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:12]
    sdpa = {e.key: e.count for e in ev if any(k in e.key.lower() for k in ("cudnn", "flash", "fmha", "efficient",
                                                                              "attention"))}
    del m, cache
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"model": model, "attn": attn, "cudnn_sdp": cudnn, "micro_batch": b, "prompt": prompt,
            "step_median_s": statistics.median(times), "step_min_s": min(times),
            "host_top_us_per_step": [(e.key, round(e.self_cpu_time_total / 3, 1), e.count // 3) for e in host],
            "device_top_us_per_step": [(e.key, round(getattr(e, "self_device_time_total", 0) / 3, 1), e.count // 3)
                                       for e in dev],
            "attention_ops": sdpa}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default="benchmarks/results/gpu_lease2/decode.json")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_decode: no CUDA GPU is visible to torch (--device cpu checks the script)", file=sys.stderr)
        return 2
    small = args.device == "cpu"
    cases = [("llama-3.2-1b", 8, 1024), ("gpt2", 32, 512)]
    variants = [("eager", True), ("sdpa", True), ("sdpa", False)]
    runs = []
    for model, b, prompt in cases:
        for attn, cudnn in variants:
            r = measure(model, attn, cudnn, 1 if small else b, 16 if small else prompt, args.device,
                        2 if small else args.steps)
            runs.append(r)
            print(f"{model} {attn} cudnn={cudnn}: {1e3 * r['step_median_s']:.1f} ms", flush=True)
            doc = {"command": "python benchmarks/gpu_decode.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
                   "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "runs": runs}
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
