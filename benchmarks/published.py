"""The cost model against published findings on GPT training at scale (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", A100 80GB, 8 per node, 8x 200
Gb/s InfiniBand per node: memplan's a100-80g profile with its default 25 GB/s per GPU across nodes).

    python benchmarks/published.py [--out benchmarks/results/published.json]

The paper's measurements are compared on what a ranking model must get right, the choices and the
trends; absolute TFLOP/s are printed beside the paper's for reference. Paper TFLOP/s count the
recomputed forward (their eq. 3), so memplan's are converted the same way (hardware FLOPs).
tests/test_parallel.py asserts the three findings.
"""

from __future__ import annotations

import argparse

import memplan
from memplan.search.cost import flops_per_token
from memplan.inputs.modelspec import megatron_gpt
from memplan.search.suggestion import suggest

from cli_suggest import machine, save  # same folder: run as python benchmarks/published.py

A100 = "a100-80g"


def hardware_tflops(spec, plan) -> float:
    """TFLOP/s per GPU counting recomputation, as the paper does."""
    _, hw = flops_per_token(spec, plan.seq_len, plan.attn, plan.grad_ckpt)
    return hw * plan.tokens_per_s / (plan.dp * plan.tp * plan.pp) / 1e12


def best(spec, gpus: int, nodes: int, batch: int, **kw):
    s = suggest(spec, memplan.load_gpu(A100), seq_len=2048, global_batch=batch, gpus=gpus, nodes=nodes, top=1,
                precision="bf16", attn="flash", offload="none", **kw)
    return s.plans[0]


def layout(p) -> str:
    return (f"tp {p.tp} x pp {p.pp}{f' (x{p.vpp})' if p.vpp > 1 else ''} x dp {p.dp}, ZeRO-{p.zero_stage}, "
            f"micro {p.micro_batch} x {p.grad_accum}, ckpt {p.grad_ckpt}")


def findings() -> dict:
    out = {}
    # 5.4.1 / Takeaway #1: for a large model, tensor parallelism up to the GPUs of a node, pipeline across
    # nodes (Figure 13: a 162B model on 64 GPUs; here GPT-3 175B, 96 layers)
    gpt3 = megatron_gpt(96, 12288, 96)
    p = best(gpt3, 8, 8, 512, zero="0,1")
    out["large model on 64 GPUs: TP = GPUs per node, PP across nodes"] = {
        "paper": "t = 8 (GPUs per node), pipeline over nodes (Figure 13, Takeaway #1)",
        "memplan": layout(p), "holds": p.tp == 8 and p.pp > 1}
    # 5.4.3 / Takeaway #2-3: a model that fits is best scaled by data parallelism (Figures 14-15: 5.9B)
    small = megatron_gpt(32, 3840, 32)
    p = best(small, 8, 8, 512, zero="0,1")
    out["5.9B on 64 GPUs: data parallelism"] = {
        "paper": "t = 1, p = 1 is fastest once the model fits (Figures 14 and 15)",
        "memplan": layout(p), "holds": p.tp == 1 and p.pp == 1}
    # 5.2 / Figure 10: GPT-3 175B at a fixed global batch, doubling the GPUs: ZeRO-3 without model
    # parallelism collapses (cross-node all-gathers no longer hidden), PTD-P holds
    rows = {}
    for gpus_total in (768, 1536):
        z3 = best(gpt3, 8, gpus_total // 8, 1536, zero="3", tp="1", pp="1")
        ptdp = best(gpt3, 8, gpus_total // 8, 1536, zero="0,1", tp="8")
        rows[gpus_total] = {"zero3_tflops": hardware_tflops(gpt3, z3), "ptdp_tflops": hardware_tflops(gpt3, ptdp),
                            "zero3_plan": layout(z3), "ptdp_plan": layout(ptdp)}
    z_drop = rows[1536]["zero3_tflops"] / rows[768]["zero3_tflops"]
    p_drop = rows[1536]["ptdp_tflops"] / rows[768]["ptdp_tflops"]
    out["175B, fixed batch 1536, 768 -> 1536 GPUs"] = {
        "paper": "ZeRO-3 per-GPU throughput roughly thirds (~143 -> ~44 TFLOP/s read off Figure 10), PTD-P "
                 "holds (~150 -> ~143); PTD-P ahead by ~70 % at the larger count (5.2)",
        "memplan": {str(k): v for k, v in rows.items()}, "zero3_ratio": z_drop, "ptdp_ratio": p_drop,
        # memplan reproduces the direction and PTD-P's lead, not the whole collapse: its ZeRO-3 pays NCCL's ring
        # latency and the prefetch-bounded overlap (search/cost.py), not DeepSpeed 2021's other overheads
        "holds": z_drop < 0.7 and p_drop > 0.85 and rows[1536]["ptdp_tflops"] > 1.3 * rows[1536]["zero3_tflops"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/published.json")
    args = ap.parse_args()
    res = findings()
    for name, r in res.items():
        print(f"{'holds' if r['holds'] else 'FAILS'}: {name}\n  paper:   {r['paper']}\n  memplan: {r['memplan']}")
    save({"command": "python benchmarks/published.py", "machine": machine(), "findings": res}, args.out)


if __name__ == "__main__":
    main()
