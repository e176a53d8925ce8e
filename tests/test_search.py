"""suggest: every plan fits and honours the global batch; defaults are said; knobs stay closed by default."""

import pytest
from hypothesis import given, settings, strategies as st

import memplan
from memplan.errors import UserError
from memplan.search.rank import speed_key


def test_bert_large_v100_plan_fits_without_bf16():
    s = memplan.suggest("bert-large", "v100-16g")
    assert s.plans, s.notes
    for p in s.plans:
        assert p.estimate.fits and p.estimate.device_used_bytes <= p.estimate.capacity_bytes
        assert "bf16" not in p.precision
        assert p.optim == "adamw_torch_fused"  # the optimizer is not changed unless allowed
        assert p.micro_batch * p.grad_accum * p.dp == p.global_batch == 32
    assert any("seq-len 512" in d for d in s.defaults) and s.global_batch_default  # batch 32: memplan chose it
    speeds = [speed_key(p.samples_per_s) for p in s.plans]
    assert speeds == sorted(speeds, reverse=True)


def test_a_plan_the_arithmetic_puts_just_over_is_kept_when_its_replay_fits():
    """bert-large fp16 on a V100 16 GB at micro batch 16: the segment arithmetic the search filters with says
    15.95 GiB device used, over the 14.99 usable; the replay of its allocations says 14.95 and fits, and it is
    the fastest plan (suggestion.promote). Without the replay's say (simulate=False) it would not be a plan."""
    s = memplan.suggest("bert-large", "v100-16g")
    best = s.plans[0]
    assert (best.micro_batch, best.grad_ckpt, best.estimate.reserved_from) == (16, "none", "replay")
    assert best.estimate.fits and best.samples_per_s > max(p.samples_per_s for p in s.plans if p.micro_batch < 16)
    fast = memplan.estimate("bert-large", "v100-16g", micro_batch=16, grad_accum=2, seq_len=512, precision="fp16",
                            attn="sdpa", simulate=False)
    assert not fast.fits


def test_estimate_reports_the_speed_suggest_ranks_by():
    """estimate's step_time_s / samples_per_s / tokens_per_s / mfu for a plan's own workload are the plan's
    (issue 17): one speed model, read by both."""
    s = memplan.suggest("bert-base", "t4-16g", seq_len=128, global_batch=32)
    for p in s.plans[:3]:
        w = p.workload.model_dump(exclude={"headroom"})
        e = memplan.estimate("bert-base", "t4-16g", **w)
        assert e.step_time_s == pytest.approx(p.step_seconds) and e.samples_per_s == pytest.approx(p.samples_per_s)
        assert e.tokens_per_s == pytest.approx(p.tokens_per_s) and e.mfu == pytest.approx(p.mfu)
        assert e.tokens_per_s == pytest.approx(e.samples_per_s * 128)
    serve = memplan.estimate("llama-3.2-1b", "a100-80g", task="infer", micro_batch=4, seq_len=512, max_new_tokens=8)
    assert serve.step_time_s > 0 and 0 < serve.mfu < 1


def test_other_optimizers_only_reported_unless_allowed():
    closed = memplan.suggest("gpt2-xl", "a10g-24g", seq_len=1024)
    assert {p.optim for p in closed.plans} <= {"adamw_torch_fused"}
    opened = memplan.suggest("gpt2-xl", "a10g-24g", seq_len=1024, optim="any", top=8)
    assert len({p.optim for p in opened.plans}) > 1


def test_nothing_fits_says_so():
    # ZeRO-Offload would fit the GPU but needs 1.3 TB of host RAM; with 256 GiB nothing fits
    s = memplan.suggest("llama-2-70b", "t4-16g", seq_len=4096, cpu_mem=256 << 30)
    assert not s.plans and "nothing fits" in s.notes[-1] and "it fits on" in s.notes[-1]
    assert "offload would fit with" in s.notes[-1]  # and says how much host RAM it would take
    offload = memplan.suggest("llama-2-70b", "t4-16g", seq_len=4096, cpu_mem=2048 << 30)
    assert offload.plans and offload.plans[0].offload == "all" and "host RAM" in offload.notes[-1]


def test_bad_choices_are_user_errors():
    with pytest.raises(UserError):
        memplan.suggest("gpt2", "a100-80g", precision="fp8")
    with pytest.raises(UserError):
        memplan.suggest("gpt2", "a100-80g", seq_len=4096)  # gpt2 has 1024 learned positions


@settings(max_examples=15, deadline=None)
@given(model=st.sampled_from(["bert-base", "gpt2", "opt-350m", "llama-3.2-1b", "t5-small", "vit-base"]),
       gpu=st.sampled_from(["t4-16g", "a10g-24g", "a100-40g", "h100-80g"]),
       batch=st.sampled_from([8, 12, 32, 64]),
       seq=st.sampled_from([128, 256, 512]))
def test_every_plan_fits_and_honours_global_batch(model, gpu, batch, seq):
    seq = None if model == "vit-base" else seq  # a ViT reads its patches: --seq-len does not apply
    s = memplan.suggest(model, gpu, global_batch=batch, seq_len=seq, top=8)
    for p in s.plans:
        assert p.estimate.fits
        assert p.micro_batch * p.grad_accum * p.dp == batch
    speeds = [speed_key(p.samples_per_s) for p in s.plans]
    assert speeds == sorted(speeds, reverse=True)


@settings(max_examples=15, deadline=None)
@given(model=st.sampled_from(["gpt2", "llama-3.2-1b", "llama-3.1-8b", "t5-small"]),
       gpu=st.sampled_from(["t4-16g", "a10g-24g", "a100-40g"]), gpus=st.sampled_from([1, 4]),
       batch=st.sampled_from([8, 32]))
def test_every_inference_plan_fits(model, gpu, gpus, batch):
    s = memplan.suggest(model, gpu, task="infer", global_batch=batch, seq_len=256, gpus=gpus, top=10)
    for p in s.plans:
        assert p.estimate.fits and p.estimate.device_used_bytes <= p.estimate.usable_bytes
        assert p.micro_batch * p.grad_accum * p.dp == batch


@pytest.mark.parametrize("options, message", [
    ({"top": 0}, "--top: Input should be greater than or equal to 1"),
    ({"gpus": 0}, "--gpus: must be at least 1, got 0"),
    ({"objective": "fastest"}, "--objective: Input should be 'throughput', 'min-gpus' or 'headroom'"),
    ({"global_batch": -4}, "--batch-size: must be at least 1"),
    ({"headroom": 1.5}, "--headroom: "),
    ({"tp": "0", "gpus": 2}, "--tp: a degree is at least 1"),
    ({"zero": "4"}, "unknown zero '4'"),
    ({"micro_batch": 2}, "suggest() got an unknown keyword 'micro_batch'"),  # not an option of suggest
    ({"grad_ckpt": "full", "task": "infer"}, "--grad-ckpt applies to training only"),  # named: refused as estimate does
    ({"tp": "4", "gpus": 2}, "--tp 4 x --pp 1 must divide the 2 GPUs"),
])
def test_bad_requests_are_one_line_user_errors(options, message):
    with pytest.raises(UserError) as e:
        memplan.suggest("gpt2", "a100-80g", **options)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_plan_is_its_workload_with_the_flat_json_keys():
    s = memplan.suggest("gpt2", "a100-80g", seq_len=256, global_batch=16, gpus=4, top=3)
    for p in s.plans:
        w, doc = p.workload, p.model_dump(mode="json")
        assert p.estimate.workload == w
        assert (doc["micro_batch"], doc["grad_accum"], doc["zero_stage"], doc["dp"], doc["global_batch"]) == (
            w.micro_batch, w.grad_accum, w.zero, w.dp, 16)
        assert "workload" not in doc  # the JSON keeps the flat keys launchers and `verify --plan` read


@pytest.mark.parametrize("call, says", [
    (lambda: memplan.estimate("llama-3.1-8b", "a100", micro_batchs=8, precison="bf16"),
     "estimate() got an unknown keyword 'micro_batchs'; did you mean 'micro_batch'?"),
    (lambda: memplan.suggest("gpt2", "a100", global_bach=8), "did you mean 'global_batch'?"),
    (lambda: memplan.suggest("gpt2", "a100", precison="bf16"), "did you mean 'precision'?"),
    (lambda: memplan.estimate("gpt2", "a100", micro_batch="8"), "micro_batch: Input should be a valid integer, got str '8'"),
    (lambda: memplan.estimate("gpt2", "a100", gpus=2.0), "gpus: Input should be a valid integer, got float 2.0"),
    (lambda: memplan.suggest("gpt2", "a100", gpus=2.0), "--gpus: Input should be a valid integer, got float 2.0"),
    (lambda: memplan.suggest("gpt2", "a100", global_batch="8"), "--batch-size: Input should be a valid integer"),
    (lambda: memplan.estimate(None, "a100"), "model: expected str, got NoneType"),
    (lambda: memplan.estimate("gpt2", 80), "gpu: expected str, got int"),
    (lambda: memplan.workload(seq_lenn=4), "workload() got an unknown keyword 'seq_lenn'; did you mean 'seq_len'?"),
])
def test_the_api_refuses_misspelled_keywords_and_wrong_types(call, says):
    with pytest.raises(UserError) as e:
        call()
    assert says in str(e.value) and "\n" not in str(e.value)


def test_suggest_ranks_serving_plans_by_their_generate_call():
    """suggest --task infer --max-new-tokens prices the whole generate call: on Hopper SDPA's decode pays cuDNN's
    graph builds (search/cost.py CUDNN_GRAPH_S) and falls behind FlashAttention-2 and eager; on an A100 it ties
    FlashAttention-2. Training refuses generation's options rather than ignoring them."""
    kw = dict(task="infer", seq_len=1024, max_new_tokens=64, simulate=False)
    rates = {gpu: {a: memplan.estimate("llama-3.2-1b", gpu, attn=a, micro_batch=8, **kw).tokens_per_s
                   for a in ("flash", "sdpa", "eager")} for gpu in ("h100-80g", "a100-80g")}
    assert rates["h100-80g"]["sdpa"] < rates["h100-80g"]["eager"] < rates["h100-80g"]["flash"]
    assert rates["a100-80g"]["sdpa"] == pytest.approx(rates["a100-80g"]["flash"])
    s = memplan.suggest("llama-3.2-1b", "h100-80g", task="infer", seq_len=1024, max_new_tokens=64, top=3)
    assert s.plans and s.plans[0].workload.attn == "flash" and s.plans[0].workload.max_new_tokens == 64
    with pytest.raises(memplan.UserError, match="apply to serving"):
        memplan.suggest("llama-3.2-1b", "h100-80g", max_new_tokens=16)
