"""A fixed grid of estimates and searches, and a JSON snapshot of their numbers, to hold a refactor to
"no number changes".

    python benchmarks/snapshot.py --write benchmarks/results/snapshot.json   # take a snapshot
    python benchmarks/snapshot.py --check benchmarks/results/snapshot.json   # compare with one
    python benchmarks/snapshot.py --check FILE --one-process                 # all in one process

benchmarks/results/snapshot.json is the current one (tests/test_snapshot.py); snapshot_before.json was
taken before the core redesign, on the grid of that time (its GPT-2 rows asked for 2,048 tokens, past
GPT-2's 1,024 learned positions, which memplan now refuses).

Every configuration goes through the public API (memplan.estimate / memplan.suggest), so the script
runs unchanged across a redesign of what is behind it. By default each configuration is computed in
its own forked process (forked after `import memplan`, before anything is estimated), so nothing one
configuration computes can reach another; `--one-process` runs them all in one process in grid order,
as a launcher would. `--check` compares every meter (allocated, reserved, device used), every
breakdown category, the host RAM, and each search's ranked plans and step times, and fails on any
difference over --tol (0.1 % by default).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
import time

import memplan

METERS = ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes", "cpu_ram_per_node_bytes",
          "params_per_gpu")
PLAN_FIELDS = ("micro_batch", "grad_accum", "dp", "tp", "pp", "zero_stage", "precision", "optim", "grad_ckpt",
               "attn", "sp", "vpp", "offload", "fsdp", "kernels", "tiled_mlp")


def _estimates() -> list[dict]:
    """(model, gpu, keyword arguments) of every estimate in the grid, in a fixed order."""
    grid: list[dict] = []

    def add(model: str, gpu: str, **kw) -> None:
        grid.append({"kind": "estimate", "model": model, "gpu": gpu, "kw": kw})

    # every family on one GPU: precision x checkpointing x attention, one optimizer each
    families = {  # model -> the attention implementations it has
        "bert-base": ("eager", "sdpa"), "roberta-base": ("eager", "sdpa"), "distilbert-base": ("eager", "sdpa"),
        "gpt2": ("eager", "sdpa", "flash"), "opt-350m": ("eager", "sdpa", "flash"),
        "pythia-410m": ("eager", "sdpa", "flash"), "t5-small": ("eager", "sdpa"),
        "llama-3.2-1b": ("eager", "sdpa", "flash"), "qwen2.5-0.5b": ("sdpa", "flash"),
        "gemma-2-2b": ("eager", "flash"), "phi-3-mini": ("sdpa", "flash"), "mistral-7b": ("sdpa", "flash"),
        "mixtral-8x7b": ("sdpa", "flash"), "vit-base": ("eager", "sdpa"),
    }
    seq = {"vit-base": 197, "t5-small": 512, "bert-base": 512, "roberta-base": 512, "distilbert-base": 512}
    for model, attns in families.items():
        for i, (prec, ckpt) in enumerate(itertools.product(("fp32", "bf16", "bf16-pure"), ("none", "selective", "full"))):
            attn = attns[i % len(attns)]
            if attn == "flash" and prec == "fp32":
                attn = attns[0]
            add(model, "a100-80g", micro_batch=1 + i % 4, seq_len=seq.get(model, 1024), precision=prec,
                grad_ckpt=ckpt, attn=attn)
    # every optimizer, with and without accumulation and zero_grad=zeros
    optims = ("adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_8bit", "paged_adamw_32bit",
              "adafactor", "sgd", "adagrad", "rmsprop", "lion_32bit", "lion_8bit", "paged_lion_8bit")
    for i, opt in enumerate(optims):
        add("gpt2-medium", "a10g-24g", micro_batch=2, seq_len=1024, precision=("fp16", "fp32")[i % 2], optim=opt,
            grad_accum=1 + i % 3, zero_grad=("set-to-none", "zeros")[i % 2], attn="sdpa")
        add("llama-3.2-1b", "rtx4090-24g", micro_batch=1, seq_len=2048, precision="bf16-pure", optim=opt,
            grad_ckpt="full", attn="sdpa", momentum=0.9 if opt in ("sgd", "rmsprop") else 0.0)
    # memplan's kernels: the fused loss, the tiled MLP, the tiled attention
    for model in ("gpt2", "llama-3.2-1b", "qwen2.5-0.5b", "gemma-2-2b", "mistral-7b"):
        for prec, ckpt, tiled in (("bf16", "none", False), ("bf16-pure", "none", True), ("fp32", "full", False),
                                  ("bf16", "selective", True)):
            # no tiled attention for Gemma 2 (soft-capping), GPT-2 (attention dropout), Mistral (its sliding window)
            attn = "memplan" if model not in ("gemma-2-2b", "gpt2", "mistral-7b") and prec != "fp32" else "eager"
            seq = 1024 if model == "gpt2" else 2048  # GPT-2 has 1,024 learned positions
            add(model, "h100-80g", micro_batch=2 * 2048 // seq, seq_len=seq, precision=prec, grad_ckpt=ckpt,
                attn=attn, kernels=True, tiled_mlp=tiled)
    add("bert-base", "a100-80g", head="masked-lm", micro_batch=16, seq_len=512, precision="bf16-pure", kernels=True)
    add("bert-base", "a100-80g", head="masked-lm", micro_batch=16, seq_len=512, precision="bf16", attn="eager")
    # DDP, DeepSpeed ZeRO 1-3 with offload, FSDP (including hybrid across nodes)
    for model, gpu in (("llama-3.1-8b", "a100-40g"), ("qwen2.5-7b", "h100-80g"), ("gpt2-xl", "v100-32g")):
        prec = "fp16" if gpu.startswith("v100") else "bf16"
        attn = "sdpa"
        seq = 1024 if model == "gpt2-xl" else 2048  # GPT-2 has 1,024 learned positions
        for zero, offload in ((0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "optimizer"),
                              (2, "optimizer"), (3, "optimizer"), (3, "all")):
            add(model, gpu, gpus=8, zero=zero, offload=offload, precision=prec, micro_batch=2, seq_len=seq,
                grad_accum=1 + zero % 2, grad_ckpt="full", attn=attn)
        for fsdp in ("full-shard", "shard-grad-op", "hybrid-shard"):
            add(model, gpu, gpus=8, nodes=2, fsdp=fsdp, precision=prec, micro_batch=1, seq_len=seq, attn=attn,
                grad_ckpt="selective")
    # hybrid shard on 8 x 2, then on 4 x 4 in one process: a stage cache keyed without the GPUs per node
    # once gave the 4 x 4 run the 8 x 2 run's states
    for gpus, nodes in ((8, 2), (4, 4), (2, 8), (8, 2)):
        add("llama-3.1-8b", "h100-80g", gpus=gpus, nodes=nodes, fsdp="hybrid-shard", micro_batch=1, seq_len=2048,
            precision="bf16", attn="flash")
    # tensor, sequence and pipeline parallelism, interleaved schedules, ZeRO-1 with PP
    for model in ("llama-3.1-70b", "qwen2.5-72b", "mixtral-8x7b", "llama-2-13b"):
        for tp, pp, sp, vpp, zero in ((8, 1, False, 1, 0), (8, 1, True, 1, 1), (4, 2, True, 1, 0), (2, 4, False, 2, 1),
                                      (8, 4, True, 2, 1), (1, 8, False, 1, 0)):
            add(model, "h100-80g", gpus=8, nodes=4, tp=tp, pp=pp, sp=sp, vpp=vpp, zero=zero, precision="bf16",
                micro_batch=1, grad_accum=16, seq_len=4096, attn="flash", grad_ckpt=("none", "selective")[pp % 2])
    # inference: every weight format, prefill only, generation with beams, encoders and encoder-decoders
    for i, prec in enumerate(("fp32", "fp16", "bf16", "fp16-pure", "bf16-pure", "int8", "int4")):
        add("llama-3.1-8b", "l4-24g", task="infer", precision=prec, micro_batch=1 + i, seq_len=1024, attn="sdpa")
        add("mistral-7b", "a10g-24g", task="infer", precision=prec, micro_batch=2, seq_len=512,
            max_new_tokens=256 * (1 + i % 3), beams=1 + i % 2, attn="sdpa")
    for model in ("bert-large", "t5-base", "vit-large", "gemma-2-9b", "gpt2-large", "qwen2.5-0.5b"):
        add(model, "t4-16g", task="infer", precision="fp16-pure", micro_batch=8,
            seq_len={"vit-large": 197, "bert-large": 512}.get(model, 512), attn="eager",
            max_new_tokens=0 if model in ("bert-large", "vit-large") else 128)
    # fine-tuning methods (docs/finetune.md): LoRA / QLoRA / int8 / freeze over the families, tied and untied
    # heads, dropout, all-linear, modules_to_save, fp32 and pure bf16 bases, paged optimizer, checkpointing
    methods = [dict(method="lora"), dict(method="lora", lora_targets="all-linear", lora_dropout=0.1),
               dict(method="qlora"), dict(method="qlora", quant="int8"),
               dict(method="qlora", double_quant=False, precision="bf16-pure"), dict(method="freeze", trainable_layers=2),
               dict(method="lora", precision="fp32"), dict(method="lora", precision="fp16", optim="paged_adamw_8bit"),
               dict(method="lora", grad_ckpt="full")]
    for model in ("llama-3.2-1b", "gpt2", "bert-base", "t5-small", "qwen2.5-0.5b", "gemma-2-2b", "llama-3.1-8b"):
        for m in methods:
            attn = "eager" if model == "gemma-2-2b" else "sdpa"  # transformers has no sdpa for gemma2
            add(model, "a100-80g", **({"micro_batch": 2, "seq_len": 256, "precision": "bf16", "attn": attn} | m))
    add("llama-3.2-1b", "a100-80g", method="lora", modules_to_save="lm_head", micro_batch=2, seq_len=256,
        precision="bf16", attn="sdpa")
    add("mixtral-8x7b", "a100-80g", method="lora", lora_targets="q_proj,v_proj", micro_batch=2, seq_len=256,
        precision="bf16", attn="sdpa")
    return grid


def _searches() -> list[dict]:
    grid: list[dict] = []

    def add(model: str, gpu: str, **kw) -> None:
        grid.append({"kind": "suggest", "model": model, "gpu": gpu, "kw": kw})

    add("bert-large", "v100-16g")
    add("gpt2", "t4-16g", seq_len=1024, global_batch=64, precision="any", optim="any")
    add("llama-3.2-1b", "a10g-24g", seq_len=2048, global_batch=64)
    add("llama-3.1-8b", "rtx4090-24g", seq_len=2048, global_batch=32)
    add("qwen2.5-0.5b", "h100-80g", seq_len=8192, global_batch=16, kernels=True, tiled_mlp=True)
    add("mistral-7b", "a100-40g", gpus=8, seq_len=4096, global_batch=256)
    add("llama-3.1-70b", "h100-80g", gpus=8, nodes=8, seq_len=4096, global_batch=1024)
    add("mixtral-8x7b", "h100-80g", gpus=8, nodes=2, seq_len=4096, global_batch=128, objective="min-gpus")
    add("llama-3.1-8b", "a100-80g", gpus=8, nodes=2, seq_len=2048, global_batch=256, fsdp="hybrid-shard")
    add("llama-3.1-8b", "l4-24g", task="infer", seq_len=1024, global_batch=8)
    add("t5-base", "a10g-24g", seq_len=512, global_batch=64, objective="headroom")
    add("llama-3.1-8b", "rtx4090-24g", seq_len=2048, global_batch=32, method="any", lora_r=16)
    add("gpt2", "t4-16g", seq_len=512, global_batch=64, method="any", trainable_layers=2)
    return grid


def grid() -> list[dict]:
    return _estimates() + _searches()


def key(case: dict) -> str:
    kw = ",".join(f"{k}={v}" for k, v in sorted(case["kw"].items()))
    return f"{case['kind']} {case['model']} {case['gpu']} {kw}"


def _estimate_numbers(est) -> dict:
    out = {m: int(getattr(est, m)) for m in METERS}
    out["breakdown"] = {k: int(v) for k, v in est.breakdown.items()}
    out["peak_phase"] = est.peak_phase
    out["fits"] = bool(est.fits)
    return out


def run_case(case: dict) -> dict:
    kw = dict(case["kw"])
    try:
        if case["kind"] == "estimate":
            return _estimate_numbers(memplan.estimate(case["model"], case["gpu"], **kw))
        s = memplan.suggest(case["model"], case["gpu"], **kw)
        plans = [{**{f: getattr(p, f) for f in PLAN_FIELDS}, "step_seconds": p.step_seconds,
                  "samples_per_s": p.samples_per_s, **_estimate_numbers(p.estimate)} for p in s.plans]
        return {"candidates": s.candidates, "plans": plans}
    except memplan.UserError as e:
        return {"error": str(e)}


def compute(one_process: bool) -> dict[str, dict]:
    cases = grid()
    if one_process:
        results = [run_case(c) for c in cases]
    else:
        with mp.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
            results = pool.map(run_case, cases, chunksize=1)
    return {key(c): r for c, r in zip(cases, results)}


def differences(old, new, tol: float, path: str = "") -> list[str]:
    """Every leaf that differs: numbers by more than `tol` (relative), anything else at all."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{path}/{k}: only in the snapshot" for k in old if k not in new]
        out += [f"{path}/{k}: only in this run" for k in new if k not in old]
        for k in old:
            if k in new:
                out += differences(old[k], new[k], tol, f"{path}/{k}")
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: {len(old)} entries -> {len(new)}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, tol, f"{path}[{i}]")]
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool):
        if abs(new - old) > tol * max(abs(old), 1e-30):
            return [f"{path}: {old} -> {new} ({(new - old) / max(abs(old), 1e-30):+.3%})"]
        return []
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="write the snapshot to this JSON file")
    ap.add_argument("--check", help="compare with this snapshot")
    ap.add_argument("--one-process", action="store_true", help="every configuration in this one process")
    ap.add_argument("--tol", type=float, default=0.001, help="relative tolerance of a number (0.001 = 0.1 %%)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    numbers = compute(args.one_process)
    seconds = time.perf_counter() - t0
    n_est = sum(k.startswith("estimate") for k in numbers)
    print(f"{len(numbers)} configurations ({n_est} estimates, {len(numbers) - n_est} searches) in {seconds:.1f} s"
          f" ({'one process' if args.one_process else 'one forked process each'})")
    if args.write:
        with open(args.write, "w") as f:
            json.dump({"memplan": memplan.__version__, "configurations": numbers}, f, indent=1, sort_keys=True)
        print(f"wrote {args.write}")
    if args.check:
        with open(args.check) as f:
            old = json.load(f)["configurations"]
        diffs = differences(old, numbers, args.tol)
        for d in diffs:
            print(d)
        changed = {d.split("/")[1] for d in diffs}
        print(f"{len(numbers) - len(changed)} of {len(numbers)} configurations equal within {args.tol:.1%}; "
              f"{len(changed)} differ")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
