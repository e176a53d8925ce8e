"""Multi-GPU memory: the ZeRO paper's floor, DeepSpeed's own estimators, Megatron's activation formulas,
and the invariants of sharding."""

import pytest
from hypothesis import given, settings, strategies as st

import memplan
from memplan.estimator.allocation import round_block
from memplan.estimator.activations import training_activations, total
from memplan.errors import UserError
from memplan.inputs.modelspec import ModelSpec, ParamGroup
from memplan.estimator.parallel import stage_params, zero_states
from memplan.estimator.rules import OPTIMIZERS, PRECISIONS

GB = 1e9


def _states(ts, spec, zero, n, offload="none"):
    """DeepSpeed bf16 with AdamW: the model in bf16, fp32 master and two fp32 moments (K = 12)."""
    return zero_states(ts, spec, zero=zero, dp=n, offload=offload, prec=PRECISIONS["bf16-pure"],
                       optim=OPTIMIZERS["adamw_torch_fused"], accumulating=False)


# ZeRO paper (Rajbhandari et al. 2020), Table 1: Psi = 7.5B, K = 12, per-GPU model-state GB for
# stage 1 (Pos), 2 (Pos+g), 3 (Pos+g+p).
ZERO_TABLE_1 = {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
                256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)}


@pytest.mark.parametrize("n", sorted(ZERO_TABLE_1))
def test_zero_paper_table_1_is_the_floor(n):
    spec = memplan.resolve_model("llama-2-7b")
    # one 7.5B-element tensor: no persistence threshold, no per-tensor effects, the paper's Psi
    ts = [ParamGroup(category="mlp", shape=(75_000, 100_000), count=1)]
    for stage, paper in zip((1, 2, 3), ZERO_TABLE_1[n]):
        z = _states(ts, spec, stage, n)
        model_states = z.weights + z.gradients + z.optimizer_states
        assert model_states / GB == pytest.approx(paper, rel=0.01, abs=0.006)
        # what DeepSpeed adds on top: the step's flattened + fp32 gradient partition (2 + 4 bytes / N);
        # stage 3 converts one sub-group (sub_group_size = 1e9 elements) at a time
        step = 7.5e9 / n if stage < 3 else min(7.5e9 / n, 1e9)
        assert z.step_transient == pytest.approx(6 * step, rel=1e-6)


DS_CASES = [("bert-large", 8, 1), ("gpt2-xl", 4, 2), ("llama-3.2-1b", 8, 2), ("llama-3.1-8b", 8, 1),
            ("mistral-7b", 8, 4), ("qwen2.5-0.5b", 2, 1), ("llama-2-13b", 8, 8)]


@pytest.fixture(scope="module")
def ds_estimators():
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    return stage_1_and_2.estimate_zero2_model_states_mem_needs, stage3.estimate_zero3_model_states_mem_needs


@pytest.mark.parametrize("model,gpus,nodes", DS_CASES)
def test_model_states_against_deepspeed_estimators(ds_estimators, model, gpus, nodes):
    """DeepSpeed counts 2P + 18P/N (stage 2) and 4 x largest layer + 18P/N (stage 3). memplan's
    weights + gradients + optimizer states + the step's temporaries differ by exactly what DeepSpeed's
    estimators leave out, each found in its code (docs/parallel.md):
    - stage 2: the 2-byte flattened copy alive while the gradient partition is cast to fp32 (+2P/N);
    - stage 3: that copy and the 16-bit parameter partition (lp_param_buffer), less the fp32 gradient
      beyond one sub-group (the step converts sub_group_size elements at a time): +4P/N up to 1e9
      parameters per rank; the gathered
      layer is its own category (gathered_params), at least the 2 bytes of DeepSpeed's 4 x largest layer."""
    zero2, zero3 = ds_estimators
    spec = memplan.resolve_model(model)
    n = gpus * nodes
    P = spec.params_total
    for stage in (2, 3):
        e = memplan.estimate(spec, "a100-80g", precision="bf16", seq_len=128, gpus=gpus, nodes=nodes, zero=stage)
        b = e.breakdown
        z = _states(list(spec.params), spec, stage, n)
        ours = z.weights + z.gradients + z.optimizer_states + z.step_transient
        # the breakdown's weights hold the model's buffers too (states._with_buffers: unsharded, beside them)
        assert b["weights"] == z.weights + round_block(spec.buffer_bytes) and b["optimizer_states"] == z.optimizer_states
        persistent = z.weights - -(-(P - _persistent(spec)) // n) * 2 if stage == 3 else 0
        if stage == 2:
            _, ds_gpu = zero2(total_params=P, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=False)
            assert ours - ds_gpu == pytest.approx(2 * P / n, rel=1e-3, abs=64)
        else:
            largest = max(g.numel for g in spec.params)
            _, ds_gpu, _ = zero3(total_params=P, largest_layer_params=largest, num_gpus_per_node=gpus, num_nodes=nodes,
                              cpu_offload=False, cpu_offload_params=False, zero_init=True)
            # ours: 2 (16-bit partition) + 2 (grad partition) + 12 (master, moments) per P/N, plus the step's
            # 2 + 4 bytes on one sub-group (<= 1e9 elements) at a time; DeepSpeed: 18 per P/N
            step = 6 * min(P / n, 1e9)
            assert ours - (ds_gpu - 4 * largest) - persistent == pytest.approx(step - 2 * P / n, rel=2e-3, abs=64)
            assert z.gathered >= 2 * largest


Z3_MODELS = ("llama-2-7b", "llama-3.1-70b", "mixtral-8x7b")


def _ds_largest_layer(spec):
    """DeepSpeed's largest_layer_params: the most parameters one module owns itself (stage3.py model_to_params,
    recurse=False), which never treats a z3 leaf (Mixtral's MoE block) as one module."""
    from memplan.estimator.parallel import fetch_unit

    own = spec.model_copy(update={"model_type": "llama"})  # the same paths, no z3 leaf
    return fetch_unit(own, list(spec.params))


@pytest.mark.parametrize("model", Z3_MODELS)
def test_zero3_never_below_deepspeeds_estimator(ds_estimators, model):
    """llama-2-7b, llama-3.1-70b and mixtral-8x7b at 8 / 64 / 512 GPUs, offload none / optimizer / all: memplan's
    ZeRO-3 model states on one GPU in backward (weights, gradients, optimizer states, reduce bucket, gathered
    parameters with the fetch unit's full gradients) against estimate_zero3_model_states_mem_needs given the real
    largest module. memplan is never below it but where it says why:
    - offload none: DeepSpeed counts 18 bytes per P/N, a 4-byte gradient partition; 0.19.8 keeps the partition in
      the model's dtype unless grad_accum_dtype says otherwise (stage3.py: grad_partitions_flat_buffer of
      gradient_accumulation_dtype, by default the param dtype): 16 bytes, so memplan may be 2 P/N lower, never more.
    Everything else memplan holds beyond DeepSpeed's estimate is what the estimator leaves out: the coalesced fetch
    buffer beside the copied-out parameters, the prefetch bucket, the parameters kept for reuse at the turn to
    backward, the persistent parameters and the reduce bucket."""
    _, zero3 = ds_estimators
    from memplan.estimator.parallel import fetch_unit

    spec = memplan.resolve_model(model)
    P, LL = spec.params_total, _ds_largest_layer(spec)
    if model == "mixtral-8x7b":  # the real fetch unit: the whole sparse MoE block, router and fused experts
        assert LL == 3 * 8 * 4096 * 14336 and fetch_unit(spec, list(spec.params)) == LL + 8 * 4096
    for gpus, nodes in ((8, 1), (8, 8), (8, 64)):
        n = gpus * nodes
        for offload in ("none", "optimizer", "all"):
            z = _states(list(spec.params), spec, 3, n, offload)
            ours = z.weights + z.gradients + z.optimizer_states + z.comm_buffers + z.gathered
            _, ds, _ = zero3(total_params=P, largest_layer_params=LL, num_gpus_per_node=gpus, num_nodes=nodes,
                             cpu_offload=offload != "none", cpu_offload_params=offload == "all", zero_init=True)
            allowance = 2 * P / n if offload == "none" else 0  # the 2-byte gradient partition (docstring)
            assert ours >= ds - allowance, (model, n, offload, ours / GB, ds / GB)
            assert z.gathered >= 4 * LL  # DeepSpeed's 4 x largest layer: its parameters and gradients


def _persistent(spec):
    thr = 10 * spec.hidden_size  # the stage3_param_persistence_threshold memplan emits
    return sum(g.numel * g.count for g in spec.params if g.numel <= thr)


def test_offload_moves_states_to_the_host():
    spec = memplan.resolve_model("llama-3.1-8b")
    on = memplan.estimate(spec, "a100-40g", precision="bf16", seq_len=2048, gpus=8, zero=3, grad_ckpt="full")
    opt = memplan.estimate(spec, "a100-40g", precision="bf16", seq_len=2048, gpus=8, zero=3, grad_ckpt="full",
                           offload="optimizer")
    everything = memplan.estimate(spec, "a100-40g", precision="bf16", seq_len=2048, gpus=8, zero=3, grad_ckpt="full",
                                  offload="all")
    assert on.cpu_ram_per_node_bytes == 0
    assert everything.device_used_bytes < opt.device_used_bytes < on.device_used_bytes
    P = spec.params_total
    # master + moments + gradient partition + fp32 step copy: 18 B per parameter over the node's 8 GPUs
    assert opt.cpu_ram_per_node_bytes == pytest.approx(18 * P, rel=0.01)
    assert everything.cpu_ram_per_node_bytes == pytest.approx(20 * P, rel=0.01)


def _megatron_gpt(h=1024, a=16) -> ModelSpec:
    """The transformer of Korthikanti et al. 2022: LayerNorm, MHA with dropout, 4h GeLU MLP, fp16."""
    return ModelSpec(name="megatron-gpt", model_type="megatron_gpt", arch="decoder", head="causal-lm",
                     num_layers=1, hidden_size=h, num_heads=a, num_kv_heads=a, head_dim=h // a,
                     intermediate_size=4 * h, vocab_size=50304, max_position=4096, mlp="plain", activation="gelu",
                     norm="layernorm", position="learned", hidden_dropout=0.1, attention_dropout=0.1)


@pytest.mark.parametrize("tp,sp,selective", [(1, False, False), (2, False, False), (8, False, False),
                                             (4, True, False), (8, True, True), (1, False, True), (4, False, True)])
@pytest.mark.parametrize("s,b", [(2048, 1), (1024, 4)])
def test_activations_match_megatron_formulas(tp, sp, selective, s, b):
    """Korthikanti et al. 2022: per layer sbh(34 + 5as/h) bytes; with TP sbh(10 + 24/t + 5as/(ht));
    with TP + SP sbh(34 + 5as/h)/t; selective recompute drops the 5as/h term. Beyond the paper memplan
    counts LayerNorm's fp32 mean and rstd (2 norms x 2 x 4 bytes per token), which the paper neglects."""
    spec = _megatron_gpt()
    h, a = spec.hidden_size, spec.num_heads
    am = training_activations(spec, b, s, PRECISIONS["fp16-pure"], "eager", selective=selective, kv_cache=False,
                              tp=tp, sp=sp)
    core = 0 if selective else 5 * a * s / h
    if sp:
        megatron = s * b * h * (34 + core) / tp
    else:
        megatron = s * b * h * (10 + 24 / tp + core / tp)
    stats = 2 * 2 * 4 * s * b / (tp if sp else 1)
    assert total(am.layer) == pytest.approx(megatron + stats, rel=1e-9)


def test_tensor_parallel_shards_parameters():
    spec = memplan.resolve_model("llama-3.1-70b")
    full = sum(g.total for g in stage_params(spec, 1, 1, 0))
    assert full == spec.params_total
    tp8 = sum(g.total for g in stage_params(spec, 8, 1, 0))
    norms = spec.params_by_category()["norms"]
    assert tp8 == pytest.approx((spec.params_total - norms) / 8 + norms, rel=1e-6)
    # pipeline: every layer on exactly one stage; embeddings first, head last
    stages = [stage_params(spec, 1, 4, i) for i in range(4)]
    assert sum(g.total for s in stages for g in s) == spec.params_total
    assert any(g.category == "embeddings" for g in stages[0]) and not any(g.category == "head" for g in stages[0])
    assert any(g.category == "head" for g in stages[3])


def test_multi_gpu_flags_are_validated():
    with pytest.raises(UserError, match="divide"):
        memplan.estimate("llama-3.1-8b", "h100-80g", gpus=8, tp=3)
    with pytest.raises(UserError, match="incompatible with pipeline"):
        memplan.estimate("llama-3.1-8b", "h100-80g", gpus=8, pp=2, zero=3, precision="bf16")
    with pytest.raises(UserError, match="offload"):
        memplan.estimate("llama-3.1-8b", "h100-80g", gpus=8, offload="optimizer")
    with pytest.raises(UserError, match="KV heads"):
        memplan.estimate("llama-3.1-8b", "h100-80g", gpus=16, tp=16)


MODELS = ["bert-large", "gpt2-medium", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "t5-base", "mixtral-8x7b"]


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(MODELS), dp=st.sampled_from([2, 4, 8, 16, 64]), mb=st.sampled_from([1, 2, 4]),
       ckpt=st.sampled_from(["none", "selective", "full"]), accum=st.sampled_from([1, 4]),
       offload=st.sampled_from(["none", "optimizer"]))
def test_higher_zero_stage_never_needs_more_per_gpu(model, dp, mb, ckpt, accum, offload):
    """ZeRO-1 <= torch DDP, ZeRO-2 <= ZeRO-1 over dp >= 2 ranks, on the peak of allocated bytes (the
    reserved model depends on which moment is the peak, the activations' or the optimizer step's, and
    is not monotone across that switch; docs/estimator.md). ZeRO-3 <= ZeRO-2 holds where the gathered
    parameters (up to stage3_max_live_parameters = 1e9 elements, kept by the reuse distance) are smaller
    than what stage 3 partitions away: a model of at most ~2 x 1e9 parameters over 2 ranks can keep all
    of them gathered, which is how DeepSpeed behaves with its defaults (docs/parallel.md)."""
    spec = memplan.resolve_model(model)
    kw = dict(precision="bf16", seq_len=512, micro_batch=mb, grad_ckpt=ckpt, grad_accum=accum, gpus=dp)
    used = {z: memplan.estimate(spec, "h100-80g", zero=z, offload=offload if z else "none", **kw).peak_allocated_bytes
            for z in (0, 1, 2, 3)}
    if offload == "none":
        assert used[1] <= used[0]
    assert used[2] <= used[1]
    if spec.params_total * (1 - 1 / dp) >= 1e9 + max(g.numel for g in spec.params):
        assert used[3] <= used[2]


# Worlds on which something fits without offload at global batch 16: the small models on two or more GPUs
# of 16 GB and up (or one GPU for qwen2.5-0.5b), llama-3.1-8b on four 40 GB A100s.
FITTING = st.one_of(
    st.tuples(st.sampled_from(["gpt2-xl", "llama-3.2-1b", "opt-1.3b"]), st.sampled_from(["t4-16g", "a10g-24g"]),
              st.sampled_from([2, 4])),
    st.tuples(st.sampled_from(["gpt2-xl", "llama-3.2-1b", "opt-1.3b", "qwen2.5-0.5b"]), st.just("a100-40g"),
              st.sampled_from([1, 2, 4])),
    st.tuples(st.just("qwen2.5-0.5b"), st.sampled_from(["t4-16g", "a10g-24g"]), st.sampled_from([1, 2, 4])),
    st.tuples(st.just("llama-3.1-8b"), st.just("a100-40g"), st.just(4)),
)


@settings(max_examples=20, deadline=None)
@given(world=FITTING, seq=st.sampled_from([512, 1024]))
def test_more_gpus_never_make_a_fitting_plan_stop_fitting(world, seq):
    """If something fits on N GPUs, something fits on 2N (the global batch kept, divisible by both);
    and a sharded plan (ZeRO, FSDP) run with twice the data-parallel ranks still fits as it is.
    (A DDP plan on one GPU can stop fitting on two: DDP's buckets copy every gradient; the search then
    finds the sharded plan instead, which the first half checks.)"""
    kw = dict(seq_len=seq, global_batch=16, offload="none", top=3)
    model, gpu, gpus = world
    small = memplan.suggest(model, gpu, gpus=gpus, **kw)
    assert small.plans
    assert memplan.suggest(model, gpu, gpus=2 * gpus, **kw).plans
    for p in small.plans:
        if not (p.zero_stage or p.fsdp != "none") or p.grad_accum % 2:
            continue
        e = memplan.estimate(model, gpu, seq_len=seq, micro_batch=p.micro_batch, grad_accum=p.grad_accum // 2,
                             precision=p.precision, optim=p.optim, grad_ckpt=p.grad_ckpt, attn=p.attn,
                             gpus=2 * gpus, tp=p.tp, pp=p.pp, zero=p.zero_stage, fsdp=p.fsdp, kernels=p.kernels,
                             tiled_mlp=p.tiled_mlp)
        assert e.fits and e.device_used_bytes <= p.estimate.device_used_bytes


def test_ranking_is_deterministic():
    a = memplan.suggest("llama-3.1-8b", "a100-40g", seq_len=2048, global_batch=64, gpus=8, top=10)
    b = memplan.suggest("llama-3.1-8b", "a100-40g", seq_len=2048, global_batch=64, gpus=8, top=10)
    strip = lambda s: [p.model_dump(exclude={"estimate"}) for p in s.plans]  # noqa: E731
    assert strip(a) == strip(b) and a.why == b.why


def test_llama_70b_on_64_h100_must_show():
    s = memplan.suggest("llama-3.1-70b", "h100-80g", seq_len=4096, global_batch=1024, gpus=8, nodes=8, top=10)
    assert s.plans and s.why and s.pareto
    for p in s.plans:
        assert p.estimate.fits and p.micro_batch * p.grad_accum * p.dp == p.global_batch == 1024
        assert p.dp * p.tp * p.pp == 64 and p.tp <= 8
    # the Pareto front trades memory for speed monotonically
    mem = [p.estimate.device_used_bytes for p in s.pareto]
    speed = [p.samples_per_s for p in s.pareto]
    assert mem == sorted(mem) and speed == sorted(speed)


def test_nothing_fits_names_the_fewest_gpus():
    s = memplan.suggest("llama-3.1-70b", "a100-80g", seq_len=4096, global_batch=64, offload="none", zero="0,1,2,3")
    assert not s.plans
    assert "it fits on" in s.notes[-1]


def test_min_gpus_objective():
    s = memplan.suggest("llama-3.1-8b", "a100-80g", seq_len=2048, global_batch=64, gpus=8, offload="none",
                        objective="min-gpus")
    assert s.plans and s.gpus * s.nodes < 8


def test_fsdp_states_and_strategies():
    """FSDP2 under accelerate's mixed precision: fp32 shards of params, grads and Adam's moments
    (4 + 4 + 8 bytes per parameter / N); full-shard gathers a couple of layers and the root unit,
    shard-grad-op keeps every parameter gathered in half from forward to backward, hybrid shards
    over one node only."""
    spec = memplan.resolve_model("llama-3.1-8b")
    P = spec.params_total
    kw = dict(precision="bf16", seq_len=2048, grad_ckpt="full", gpus=8, nodes=2)
    full = memplan.estimate(spec, "a100-80g", fsdp="full-shard", **kw)
    sgo = memplan.estimate(spec, "a100-80g", fsdp="shard-grad-op", **kw)
    hybrid = memplan.estimate(spec, "a100-80g", fsdp="hybrid-shard", **kw)
    b = full.breakdown
    assert b["weights"] == pytest.approx(4 * P / 16, rel=1e-6)
    assert b["optimizer_states"] == pytest.approx(8 * P / 16, rel=1e-6)
    assert sgo.breakdown["gathered_params"] == 2 * P
    assert hybrid.breakdown["weights"] == pytest.approx(4 * P / 8, rel=1e-6)
    assert full.device_used_bytes < hybrid.device_used_bytes and full.device_used_bytes < sgo.device_used_bytes
    with pytest.raises(UserError):
        memplan.estimate(spec, "a100-80g", fsdp="full-shard", zero=3, **kw)


def test_verify_refuses_multi_gpu_plans(tmp_path):
    from memplan.verify.run import run

    s = memplan.suggest("gpt2", "a100-80g", seq_len=128, global_batch=8, gpus=2, top=1)
    plan = tmp_path / "plan.json"
    plan.write_text(s.model_dump_json())
    with pytest.raises(UserError, match="multi-GPU"):
        run(model=None, gpu=None, plan_file=str(plan), device="fake", steps=2)


def test_cost_model_reproduces_published_findings(benchmark_module):
    """benchmarks/published.py: Narayanan et al. 2021's layout findings hold in memplan's ranking."""
    for name, r in benchmark_module("published.py").findings().items():
        assert r["holds"], (name, r["memplan"])
