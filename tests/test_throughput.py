"""The speed model (search/operators.py, search/cost.py) against published runs and its own invariants
(benchmarks/throughput/compare.py is the script; results/ its committed output)."""

import json
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import memplan
from memplan.estimator.inference import decode_kv_traffic, kv_bytes_per_token, layer_windows
from memplan.estimator.rules import OPTIMIZERS, PRECISIONS
from memplan.inputs.workload import Workload
from memplan.search import cost, operators as ops

BENCH = pathlib.Path(__file__).parent.parent / "benchmarks" / "throughput"


@pytest.fixture(scope="module")
def compared(benchmark_module):
    compare = benchmark_module("throughput/compare.py")

    runs = json.loads((BENCH / "published_runs.json").read_text())
    rows, skipped = compare.evaluate(runs)
    return compare, runs, rows, skipped


def test_published_runs_bound(compared):
    """At least 25 runs from 4 sources on 3 GPU generations; median |error| within 15 %."""
    compare, _, rows, _ = compared
    s = compare.summary(rows)
    generations = {memplan.load_gpu(g).compute_capability[0] for g in s["gpus"]}
    assert s["runs"] >= 25 and s["sources"] >= 4 and len(generations) >= 3
    assert s["median_abs_error"] <= 0.15


def test_committed_results_are_current(compared):
    """results.json is what compare.py gives on this tree (rerun it after changing the model)."""
    _, _, rows, _ = compared
    committed = json.loads((BENCH / "results.json").read_text())["rows"]
    assert [r["id"] for r in committed] == [r["id"] for r in rows]
    assert [r["predicted"] for r in committed] == pytest.approx([r["predicted"] for r in rows], rel=1e-6)


def test_nf4_serving_reads_the_packed_weight_until_bitsandbytes_dequantises():
    """A batch-1 4096 x 4096 NF4 matmul on an A100 against a half one: bitsandbytes 0.40.0's release notes give
    3.4x (inner dimension >= 4096, Ampere), memplan's roofline within 25 %; past 4 rows memplan takes bitsandbytes
    0.50.2's fallback (dequantise to half first), so a prefill is slower than the half model's, never faster."""
    gpu = memplan.load_gpu("a100-80g")
    gen = cost.generation(gpu)
    g = ops.Gemm(1.0, 4096, 4096, 1, 1, True)
    flops_s, bytes_s = cost.peak_tflops(gpu, "fp16-pure") * 1e12 * gen.matmul, cost.achievable_bandwidth(gpu)
    half = cost._gemm_seconds(g, np.array([1.0]), flops_s, bytes_s, 2, gen.launch_s)[0]
    q = cost.SERVING_KERNELS["int4"]
    nf4 = cost._quant_gemm_seconds(g, np.array([1.0, 4096.0]), q, flops_s, bytes_s, gen.launch_s)
    assert half / nf4[0] == pytest.approx(3.4, rel=0.25)
    assert nf4[1] > cost._gemm_seconds(g, np.array([4096.0]), flops_s, bytes_s, 2, gen.launch_s)[0]
    kw = dict(task="infer", micro_batch=1, seq_len=512)
    int4, half = (memplan.estimate("llama-2-7b", "a100-80g", precision=p, max_new_tokens=0, **kw).step_time_s
                  for p in ("int4", "fp16-pure"))
    assert int4 > half  # a prefill of 512 tokens is compute-bound
    # a decode step's GPU time is weight-bound (int4 reads a quarter of the bytes), but transformers' host time per
    # kernel (SERVING_LAUNCH_S) hides it at batch 1: both steps are the host's, within 10 % of each other
    spec = memplan.resolve_model("llama-2-7b")
    ws = [memplan.estimate(spec, gpu, precision=p, max_new_tokens=128, simulate=False, **kw).workload
          for p in ("int4", "fp16-pure")]
    int4, half = (cost.decode_step_seconds(spec, gpu, w, launch_s=gen.launch_s) for w in ws)
    assert int4 < 0.8 * half
    int4, half = (cost.decode_step_seconds(spec, gpu, w) for w in ws)
    assert int4 == pytest.approx(half, rel=0.1)


def test_llm_int8_adds_its_quantisation_kernels_to_the_gemm():
    """LLM.int8's outlier search, quantisation and dequantisation are memory-bound kernels of their own: a
    compute-bound 512-token prefill of Llama-2-7B is slower than the half model's by their bytes, not hidden
    under the GEMM's roofline. Per layer the q, k, v, o, gate and up projections read h features and down reads
    f; q, k, v, o and down write h, gate and up write f."""
    kw = dict(task="infer", micro_batch=1, seq_len=512)
    int8, half = (memplan.estimate("llama-2-7b", "a100-80g", precision=p, **kw).step_time_s
                  for p in ("int8", "fp16-pure"))
    q, h, f, T, layers = cost.SERVING_KERNELS["int8"], 4096, 11008, 512, 32
    extra = layers * T * (q.extra_in * (6 * h + f) + q.extra_out * (5 * h + 2 * f))
    assert int8 - half == pytest.approx(extra / cost.achievable_bandwidth(memplan.load_gpu("a100-80g")), rel=0.02)


def test_published_optimizers_map_unless_negated(compared):
    """A published optimizer maps to memplan's nearest by a name not preceded by "un": "unfused" BertAdam is not
    fused AdamW (it was, by a plain substring), apex's FusedAdam and FusedLAMB are, Composer's DecoupledAdamW is
    foreach AdamW."""
    compare, runs, _, skipped = compared
    by_optim = {}
    for run in runs:
        if compare._excluded(run) is None:
            by_optim.setdefault(run.get("optimizer"), compare.workload(run)["optim"])
    assert by_optim["adam (BertAdam, unfused)"] == "adamw_torch"
    assert by_optim["adam-fused (apex FusedAdam)"] == by_optim["lamb (apex FusedLAMB)"] == "adamw_torch_fused"
    assert by_optim["decoupled_adamw (Composer; mpt yaml default)"] == "adamw_torch"
    erred = {s["id"] for s in skipped if s["why"].startswith("the source's value is in error")}
    assert erred == {r["id"] for r in runs if r.get("data_error")} and len(erred) == 2


def test_v100_fp16_over_fp32_ratio(compared):
    """HF Trainer, bert-large, seq 512, batch 4, eager (perf_train_gpu_one): fp16 is 2.1x fp32 measured; the
    predicted ratio is within 25 % of it."""
    _, runs, rows, _ = compared
    by = {r["id"]: r for r in rows}
    measured = by["hf-v100-bertlarge-fp16-bs4"]["published"] / by["hf-v100-bertlarge-fp32-bs4"]["published"]
    predicted = by["hf-v100-bertlarge-fp16-bs4"]["predicted"] / by["hf-v100-bertlarge-fp32-bs4"]["predicted"]
    assert measured == pytest.approx(2.1, abs=0.01)
    assert predicted == pytest.approx(measured, rel=0.25)


def test_every_optimizer_has_step_bytes():
    assert set(OPTIMIZERS) <= set(cost.STEP_BYTES)


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gpt2", "bert-large", "mixtral-8x7b"])
def test_inventory_gemm_flops_are_six_n(model):
    """The inventory's GEMMs are the parameter table's matmuls: forward + both gradients of every trained weight
    give 6 x the active matmul parameters per token (Kaplan et al.), the count flops_per_token uses."""
    spec = memplan.resolve_model(model)
    o = ops.step_ops(ops.OpsKey.of(spec, Workload(seq_len=512)))
    gemm = sum(2 * g.rows * g.n * g.k * g.count * g.passes for g in o.layer_gemms + o.head_gemms)
    model_flops, _ = cost.flops_per_token(spec, 512, "eager", "none")
    attention = 3 * 4 * 512 * spec.num_heads * spec.head_dim * spec.total_layers
    matrices = 6 * (cost.active_params(spec) - spec.params_by_category().get("norms", 0))
    # biases and norms are no matmul; a classifier head runs on one token, not every one
    assert gemm == pytest.approx(matrices, rel=0.02)
    assert gemm + attention == pytest.approx(model_flops, rel=0.02)


def test_recompute_adds_a_forward():
    spec = memplan.resolve_model("llama-3.1-8b")
    none = ops.step_ops(ops.OpsKey.of(spec, Workload(grad_ckpt="none")))
    full = ops.step_ops(ops.OpsKey.of(spec, Workload(grad_ckpt="full")))
    f = lambda o: sum(2 * g.n * g.k * g.count * g.passes for g in o.layer_gemms)  # noqa: E731
    assert f(full) == pytest.approx(f(none) * 4 / 3)
    gpu = memplan.load_gpu("a100-80g")
    t = np.array([4096.0])
    ratio = cost.micro_seconds(full, gpu, "bf16", t, 4096) / cost.micro_seconds(none, gpu, "bf16", t, 4096)
    assert 1.2 < ratio[0] < 1.4  # Chen et al. 2016 / Korthikanti et al. 2022: about one more forward


def test_freeze_runs_the_frozen_blocks_forward_only():
    """Under freeze with a frozen embedding autograd records nothing below the trained blocks: their matmuls run
    forward only, with no input gradient, no attention backward and nothing recomputed. On the lent H200
    (benchmarks/results/gpu_lease/gpu_grid_wide.json) bert-base b32 s512 fp32 training its last 2 blocks stepped in
    0.0968 s; priced with every frozen block's backward the model said 0.204 s (+110 %)."""
    spec = memplan.resolve_model("bert-base")
    frozen = Workload(method="freeze", trainable_layers=2, grad_ckpt="full")
    o = ops.step_ops(ops.OpsKey.of(spec, frozen))
    layers = [g for g in o.layer_gemms]
    trained_passes = {g.passes for g in layers if g.count == 2}  # 2 trained blocks: forward, both gradients, again
    frozen_passes = {g.passes for g in layers if g.count == 10}
    assert trained_passes == {4} and frozen_passes == {1}
    assert o.attn_flops == pytest.approx(ops.attention_forward_flops(spec, "eager") * (1 + 2 / 12 * 3))
    e = memplan.estimate("bert-base", "h200", seq_len=512, micro_batch=32, precision="fp32", attn="sdpa",
                         method="freeze", trainable_layers=2)
    assert e.step_time_s == pytest.approx(0.0968, rel=0.25)


def test_the_optimizer_steps_only_what_trains():
    """The optimizer step, clipping, accumulation and the gradient collectives touch the trained parameters only:
    LoRA's adapters, not the frozen base. On the lent H200 (benchmarks/results/gpu_lease/gpu_grid_wide.json)
    Llama-3.1-8B LoRA b2 s2048 bf16 stepped in 0.307 / 0.303 s; stepping all 8 B parameters the model said 0.403 s
    (+31 %)."""
    e = memplan.estimate("llama-3.1-8b", "h200", seq_len=2048, micro_batch=2, precision="bf16", attn="sdpa",
                         method="lora")
    assert e.step_time_s == pytest.approx(0.305, rel=0.1)
    gpu, w = memplan.load_gpu("h200"), Workload(method="lora")
    spec = memplan.resolve_model("llama-3.1-8b")
    params, trained = np.array([[8.0e9]]), np.array([[3.4e6]])
    step = cost._optimizer(spec, gpu, [w], np.array([[1.0]]), params, trained, cost.achievable_bandwidth(gpu))
    assert step[0, 0] == pytest.approx(cost._step_bytes(w) * 3.4e6 / cost.achievable_bandwidth(gpu))
    # a Python-loop optimizer dispatches per trained tensor: LoRA's q / v adapters, two per target in 32 layers
    assert cost._trained_tensors(spec, Workload(method="lora", optim="adafactor")) == 2 * 2 * 32
    assert cost._trained_tensors(spec, Workload(optim="adafactor")) == spec.num_tensors


def test_small_micro_batches_are_bandwidth_bound():
    """A roofline per GEMM: at one token a matmul reads its whole weight, so per-token time falls with the batch
    (decode-like shapes), while at thousands of tokens it is flat (compute-bound)."""
    spec = memplan.resolve_model("llama-3.1-8b")
    o = ops.step_ops(ops.OpsKey.of(spec, Workload()))
    gpu = memplan.load_gpu("h100-80g")
    t = np.array([1.0, 8.0, 4096.0, 8192.0])
    per_token = cost.micro_seconds(o, gpu, "bf16", t, 1, forward_only=True) / t
    assert per_token[0] > 5 * per_token[1] > 5 * per_token[2]
    assert per_token[3] == pytest.approx(per_token[2], rel=0.1)


def test_every_kernel_is_no_faster_than_its_launch():
    """The host floor per class of kernels: at one token a micro batch takes at least every GEMM's, the attention
    core's and the element-wise kernels' launches, one after another, autocast's casts among the element-wise
    ones (a cast per fp32 linear weight and bias, and per fp32 input of a half op, each forward and backward)."""
    spec = memplan.resolve_model("bert-large")
    o = ops.step_ops(ops.OpsKey.of(spec, Workload(attn="eager")))
    gpu = memplan.load_gpu("v100-16g")
    casts = 2 * (24 * (6 + 6) + 24 * (4 + 2))  # q k v o up down weights and biases; q k v up inputs, eager softmax
    assert (o.weight_casts + o.input_casts) * 2 == casts
    launches = o.core_kernels + o.elementwise_kernels + casts + sum(
        g.count * g.passes for g in o.layer_gemms + o.head_gemms)
    t = cost.micro_seconds(o, gpu, "fp16", np.array([1.0]), 1)
    floor = launches * cost.generation(gpu).launch_s
    weight_casts = o.cast_params * ops.AUTOCAST_CAST_BYTES / cost.achievable_bandwidth(gpu)  # per micro batch
    assert floor <= t[0] and t[0] == pytest.approx(floor + weight_casts, rel=0.02)  # nothing else at one token
    t32 = cost.micro_seconds(o, gpu, "fp32", np.array([1.0]), 1)[0]  # no casts (its weights' reads are more)
    assert floor - casts * cost.generation(gpu).launch_s <= t32 < t[0]


def test_micro_batches_price_the_precision_the_activations_have():
    """DeepSpeed trains a half model without autocast, so a ZeRO bf16 step's micro batch costs what bf16-pure's
    does (no casts, a half residual stream); FSDP autocasts over half weights: casts of the norms' fp32 outputs,
    none of the weights but LoRA's fp32 adapters; DDP under autocast pays both (states.activation_precision is
    the one rule)."""
    spec = memplan.resolve_model("llama-3.2-1b")
    gpu = memplan.load_gpu("a100-80g")

    def compute(**kw):
        w = Workload(micro_batch=2, seq_len=1024, gpus=8, **kw)
        ones = np.ones((1, 1))
        return cost.step_time(spec, gpu, [w], np.array([2]), np.array([1]), ones, ones, ones)[0, 0, 0]

    pure = compute(precision="bf16-pure")
    assert compute(precision="bf16", zero=2) == pytest.approx(pure, rel=1e-9)
    fsdp, ddp = compute(precision="bf16", fsdp="full-shard"), compute(precision="bf16")
    assert pure <= fsdp < ddp  # FSDP's input casts launch under the bandwidth-bound kernels at 2048 tokens
    o = ops.step_ops(ops.OpsKey.of(spec, Workload(attn="sdpa")))
    casts = [cost._cast_launches(o, PRECISIONS[p], False, True) for p in ("bf16", "bf16-halfbase", "bf16-pure")]
    assert casts == [(o.weight_casts + o.input_casts) * 2, o.input_casts * 2, 0.0]
    # LoRA over a half base: autocast casts the fp32 adapters (q_proj and v_proj: A and B), not the half base
    lo = ops.step_ops(ops.OpsKey.of(spec, Workload(attn="sdpa", method="lora", precision="bf16")))
    assert lo.weight_casts == 0 and lo.fp32_weight_casts == spec.num_layers * 2 * 2
    assert cost._cast_launches(lo, PRECISIONS["bf16-halfbase"], False, True) == (lo.fp32_weight_casts
                                                                                  + lo.input_casts) * 2


# -- serving: generate's decode steps ----------------------------------------------------------------------------

def _serve(model, gpu, new, **kw):
    return memplan.estimate(model, gpu, task="infer", precision="fp16-pure", micro_batch=1, seq_len=512,
                            max_new_tokens=new, **kw)


def test_decode_steps_read_the_weights_every_token():
    """A batch-1 decode step reads every weight once (the GEMMs' rooflines are bandwidth-bound at one token), so
    each new token costs at least the weights' bytes at the achievable bandwidth, and the time grows linearly
    with the new tokens (the KV cache adds a little per step)."""
    spec = memplan.resolve_model("llama-3.1-8b")
    gpu = memplan.load_gpu("a100-80g")
    t1, t65, t129 = (_serve("llama-3.1-8b", "a100-80g", n).step_time_s for n in (1, 65, 129))
    per_token = (t129 - t1) / 128
    weights = 2 * (cost.active_params(spec) - spec.vocab_size * spec.hidden_size)  # the input embedding is a lookup
    assert per_token >= weights / (gpu.memory_bandwidth_gbs * 1e9 * cost.generation(gpu).bandwidth)
    assert (t65 - t1) / 64 == pytest.approx(per_token, rel=0.02)


def test_generate_rates_count_new_tokens():
    e = _serve("llama-3.1-8b", "a100-80g", 128)
    assert e.samples_per_s == pytest.approx(1 / e.step_time_s)
    assert e.tokens_per_s == pytest.approx(128 / e.step_time_s)
    scoring = _serve("llama-3.1-8b", "a100-80g", 0)
    assert scoring.tokens_per_s == pytest.approx(512 / scoring.step_time_s)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(prompt=st.integers(1, 300), new=st.integers(0, 300), window=st.one_of(st.none(), st.integers(1, 400)))
def test_decode_kv_traffic_closed_form(prompt, new, window):
    """decode_kv_traffic's closed form against summing the steps: step k of new - 1 attends to prompt + k keys, a
    sliding layer to min(prompt + k, window) of them (Gemma 2 alternates both); the dynamic cache moves them 3
    times a step."""
    spec = memplan.resolve_model("gemma-2-2b")
    spec = spec.model_copy(update={"sliding_window": window}) if window else spec
    per_token = kv_bytes_per_token(spec, 2, 2)
    windows = layer_windows(spec)
    steps = sum(min(prompt + k, w) if w else prompt + k for k in range(1, new) for w in windows)
    assert decode_kv_traffic(spec, 1, prompt, new, 2, 2, False) == 3 * per_token * steps


def test_static_cache_reads_its_whole_length():
    """StaticCache reads its whole preallocated length once a step (768 tokens here); DynamicCache's torch.cat reads
    and writes its growing cache besides the attention's read (3 x 513 to 3 x 767 tokens): the dynamic call moves
    more and takes longer, everything else being equal."""
    dynamic = _serve("llama-3.1-8b", "a100-80g", 256, kv_cache="dynamic")
    static = _serve("llama-3.1-8b", "a100-80g", 256, kv_cache="static")
    assert static.step_time_s < dynamic.step_time_s
    spec = memplan.resolve_model("llama-3.1-8b")
    assert decode_kv_traffic(spec, 1, 512, 256, 2, 2, True) == 255 * kv_bytes_per_token(spec, 2, 2) * 768 * 32


@settings(max_examples=100, deadline=None, derandomize=True)
@given(prompt=st.integers(1, 300), new=st.integers(0, 300), window=st.one_of(st.none(), st.integers(1, 400)))
def test_cudnn_rebuilds_count_the_layers_whose_keys_grew(prompt, new, window):
    """cuDNN builds a graph per new (query, key) shape (search/cost.py CUDNN_GRAPH_S): decode step k of new - 1
    gives a full layer prompt + k keys, a new length each step, and a sliding one min(prompt + k, window): one
    build per distinct length (Gemma 3 interleaves five sliding layers with a full one)."""
    spec = memplan.resolve_model("gemma-3-1b")
    spec = spec.model_copy(update={"sliding_window": window}) if window else spec
    gpu = memplan.load_gpu("h100-80g")
    w = memplan.estimate(spec, gpu, task="infer", seq_len=prompt, max_new_tokens=new, attn="sdpa",
                         simulate=False).workload
    lengths = [{prompt + k if kind != "sliding_attention" else min(prompt + k, spec.sliding_window)
                for k in range(1, new)} for kind in spec.attention_kinds]
    assert cost.cudnn_rebuilds(spec, gpu, w) == sum(map(len, lengths))
    fp32 = memplan.estimate(spec, gpu, task="infer", seq_len=prompt, max_new_tokens=new, attn="sdpa",
                            precision="fp32", simulate=False).workload
    assert cost.cudnn_rebuilds(spec, gpu, fp32) == 0  # cuDNN's SDPA takes half inputs only


def test_cudnn_graph_builds_only_where_torch_picks_cudnn():
    """PyTorch puts cuDNN attention first on compute capability 9.x / 10.x only, for SDPA; eager attention and a
    static cache (one key length) build nothing. Measured on the H200 (benchmarks/results/gpu_lease2/decode.json),
    an SDPA decode step of Llama-3.2-1B took 94 ms with cuDNN and 15 ms without."""
    spec = memplan.resolve_model("llama-3.2-1b")
    kw = dict(task="infer", seq_len=1024, micro_batch=8, max_new_tokens=256, simulate=False)
    h200 = memplan.load_gpu("h200")
    sdpa = memplan.estimate(spec, h200, attn="sdpa", **kw)
    assert cost.cudnn_rebuilds(spec, h200, sdpa.workload) == 255 * 16
    for gpu, attn, cache in (("a100-80g", "sdpa", "dynamic"), ("h200", "eager", "dynamic"),
                             ("h200", "sdpa", "static")):
        e = memplan.estimate(spec, gpu, attn=attn, kv_cache=cache, **kw)
        assert cost.cudnn_rebuilds(spec, memplan.load_gpu(gpu), e.workload) == 0
    eager = memplan.estimate(spec, h200, attn="eager", **kw)
    # measured decode steps (serving_speed.py): SDPA 54-57 ms at b 8, eager 13.5-17.6 ms at b 4 and 8
    assert sdpa.step_time_s > 3 * eager.step_time_s


def test_a_decode_step_is_host_bound_at_the_serving_launch_floor():
    """A small model's decode step is its kernels' host time (search/cost.py SERVING_LAUNCH_S): the H200 measured
    Llama-3.2-1B's at 13.5-17.6 ms with eager attention, where the training launch floor gave 3 ms."""
    spec, gpu = memplan.resolve_model("llama-3.2-1b"), memplan.load_gpu("h200")
    w = memplan.estimate(spec, gpu, task="infer", seq_len=1024, micro_batch=8, max_new_tokens=36, attn="eager",
                         simulate=False).workload
    assert cost.decode_step_seconds(spec, gpu, w) == pytest.approx(0.0176, rel=0.2)
    assert cost.decode_step_seconds(spec, gpu, w, launch_s=cost.generation(gpu).launch_s) < 0.005
