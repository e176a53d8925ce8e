"""Fine-tuning methods under DeepSpeed ZeRO 1-3 and FSDP2 (docs/finetune.md, multi-GPU): what one GPU holds,
worked out here from the method's parameter table, and what the constraints refuse."""

import pytest

import memplan
from memplan import api
from memplan.errors import UserError
from memplan.estimator.allocation import round_block
from memplan.estimator.finetune import Tuning, stored_tensors, tuned_params
from memplan.estimator.states import StatesKey, stage_states
from memplan.inputs.workload import Workload

N = 4
BASE = dict(micro_batch=1, seq_len=512, precision="bf16", gpus=N)


def states(model: str, **kw):
    """(the GPU's model states less the model's buffers, the method's parameter table) for a workload: the
    buffers (llama's rotary inv_freq, one 512-byte block) sit beside the weights unsharded (states._with_buffers)."""
    spec = memplan.resolve_model(model)
    w = Workload(**{**BASE, **kw})
    s = stage_states(StatesKey.of(spec, w, 0))
    assert spec.buffer_bytes and s.weights > round_block(spec.buffer_bytes)
    return s._replace(weights=s.weights - round_block(spec.buffer_bytes)), tuned_params(spec, Tuning.of(w)), spec


def part(x: int) -> int:
    return -(-x // N)


def split(table, spec):
    """(trained elements, frozen elements, elements under ZeRO-3's persistence threshold of 10 x hidden)."""
    trained = sum(g.total for g in table if g.trainable)
    frozen = sum(g.total for g in table if not g.trainable)
    persistent = sum(g.total for g in table if g.numel <= 10 * spec.hidden_size)
    return trained, frozen, persistent


@pytest.mark.parametrize("zero", [1, 2])
def test_lora_under_zero12_keeps_the_base_whole_and_partitions_the_adapters_states(zero):
    s, table, spec = states("llama-3.1-8b", method="lora", zero=zero)
    trained, frozen, _ = split(table, spec)
    assert trained == 3_407_872  # r8 on q_proj and v_proj, 32 layers
    assert s.weights == 2 * (trained + frozen)  # DeepSpeed casts every float parameter to bf16, none partitioned
    assert s.adapters == 2 * trained
    assert s.states == 12 * part(trained)  # fp32 master + Adam's two moments of the adapters only, / N
    assert s.grads == (2 * trained if zero == 1 else 2 * part(trained))
    assert s.gathered == 0 and s.quant_constants == 0


def test_lora_under_zero3_partitions_the_frozen_base_too():
    s, table, spec = states("llama-3.1-8b", method="lora", zero=3)
    trained, frozen, persistent = split(table, spec)
    # LoRA's r x 4096 and 4096 x r matrices are under the threshold: every rank keeps them whole
    assert persistent == trained + 65 * 4096
    assert s.weights == 2 * (part(trained + frozen - persistent) + persistent)
    assert s.adapters == 2 * trained  # persistent: whole
    assert s.weights - s.adapters == pytest.approx(2 * frozen / N, rel=0.001)  # the base weights / 4
    assert s.states == 12 * part(trained) and s.grads == 2 * part(trained)
    assert s.gathered > 0


@pytest.mark.parametrize("fsdp", ["full-shard", "shard-grad-op"])
def test_lora_under_fsdp2_shards_the_half_base_and_the_fp32_adapters(fsdp):
    s, table, spec = states("llama-3.1-8b", method="lora", fsdp=fsdp)
    trained, frozen, _ = split(table, spec)
    assert s.weights == 2 * part(frozen) + 4 * part(trained)  # accelerate up-casts only the trained ones
    assert s.adapters == 4 * part(trained)
    assert s.grads == 4 * part(trained) and s.states == 8 * part(trained)  # the fp32 shard is the master
    full, _, _ = states("llama-3.1-8b", fsdp=fsdp)
    if fsdp == "shard-grad-op":  # every parameter stays gathered in bf16 from forward to backward
        assert s.gathered == 2 * (trained + frozen)
    else:  # units of the layers: LoRA's adapters are in their layer's unit
        assert s.gathered > full.gathered


@pytest.mark.parametrize("kw", [dict(zero=3), dict(fsdp="full-shard")], ids=["zero3", "fsdp"])
def test_qlora_sharded_packs_4bit_weights_in_bf16_and_replicates_their_constants(kw):
    s, table, spec = states("llama-3.1-8b", method="qlora", quant_storage="bf16", **kw)
    quantised = [g for g in table if g.store == "4bit-dq"]
    packed = sum(-(-int(stored_tensors(g, 2)[0][0]) // 2) * g.count for g in quantised)  # bf16 elements
    constants = sum(int(b * c) for g in quantised for b, c in stored_tensors(g, 2)[1:])
    assert packed == pytest.approx(sum(g.total for g in quantised) / 4, rel=1e-6)  # 4 values per bf16
    assert s.quant_constants == constants  # the quant_state is no parameter: every rank holds it all
    trained, frozen, _ = split(table, spec)
    floats = frozen - sum(g.total for g in quantised)  # embeddings, head, norms
    if "zero" in kw:  # DeepSpeed casts the fp32 norms / embeddings of prepare_model_for_kbit_training to bf16
        sharded = 2 * part(packed + floats + trained - 65 * 4096 - trained)
        assert s.weights - constants == pytest.approx(sharded + 2 * (65 * 4096 + trained), abs=64)
    else:  # FSDP2 keeps them fp32 (frozen), the packed weights bf16, the adapters fp32
        assert s.weights - constants == 2 * part(packed) + 4 * part(floats + trained)
    single = api.estimate("llama-3.1-8b", "a100-80g", micro_batch=1, seq_len=512, precision="bf16", method="qlora")
    assert s.weights < single.breakdown["weights"] / 2


def test_freeze_under_zero_and_fsdp():
    z2, table, spec = states("llama-3.1-8b", method="freeze", trainable_layers=2, zero=2)
    trained, frozen, _ = split(table, spec)
    assert z2.weights == 2 * (trained + frozen) and z2.states == 12 * part(trained)
    z3, _, _ = states("llama-3.1-8b", method="freeze", trainable_layers=2, zero=3)
    assert z3.weights == pytest.approx(2 * (trained + frozen) / N, rel=0.001)
    fs, _, _ = states("llama-3.1-8b", method="freeze", trainable_layers=2, fsdp="full-shard")
    assert fs.weights == 4 * part(trained + frozen)  # freeze loads fp32, as full fine-tuning does
    assert fs.grads == 4 * part(trained) and fs.states == 8 * part(trained)
    full, _, _ = states("llama-3.1-8b", fsdp="full-shard")
    assert fs.gathered == full.gathered  # the same units: freeze's split groups are counted per layer


def test_deepspeed_estimators_count_every_parameter_as_trainable():
    """DeepSpeed's estimate_zero3_model_states_mem_needs / estimate_zero2_... take the model's parameter count
    (model_to_params: every parameter, frozen or not) and charge 18 bytes / N for each: for LoRA they give
    the states of full fine-tuning. memplan's model states are within 15 % of DeepSpeed's for full fine-tuning
    and under a fifth of them for LoRA (docs/finetune.md)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    spec = memplan.resolve_model("llama-3.1-8b")
    P = spec.params_total
    _, ds3, _ = estimate_zero3_model_states_mem_needs(P, 0, num_gpus_per_node=N, cpu_offload=False)
    _, ds2 = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=N, cpu_offload=False)

    def model_states(s):
        return s.weights + s.grads + s.states + s.temp

    for zero, ds in ((3, ds3), (2, ds2)):
        full, _, _ = states("llama-3.1-8b", zero=zero)
        lora, _, _ = states("llama-3.1-8b", method="lora", zero=zero)
        assert model_states(full) == pytest.approx(ds, rel=0.15)
        assert model_states(lora) < ds / 5 if zero == 3 else model_states(lora) < ds / 2


@pytest.mark.parametrize("kw, words", [
    (dict(method="lora", tp=2), "with --tp or --pp it is not modelled"),
    (dict(method="freeze", trainable_layers=2, pp=2, grad_accum=2), "with --tp or --pp it is not modelled"),
    (dict(method="lora", fsdp="hybrid-shard", nodes=2), "hybrid-shard \\(FSDP1"),
    (dict(method="qlora", zero=3), "needs --quant-storage bf16"),
    (dict(method="qlora", fsdp="full-shard", precision="fp16", quant_storage="bf16"), "needs --quant-storage fp16"),
    (dict(method="qlora", quant="int8", fsdp="full-shard"), "LLM.int8"),
    (dict(method="qlora", zero=3, quant_storage="bf16", offload="all"), "--offload all"),
])
def test_refused_combinations(kw, words):
    with pytest.raises(UserError, match=words):
        api.estimate("llama-3.1-8b", "a100-80g", **{**BASE, **kw})


@pytest.mark.parametrize("kw", [dict(method="qlora", zero=2), dict(method="qlora", quant="int8", zero=2),
                                dict(method="lora", zero=3, offload="all"), dict(method="qlora", zero=3,
                                                                                 quant_storage="bf16", offload="optimizer")])
def test_allowed_combinations(kw):
    e = api.estimate("llama-3.1-8b", "a100-80g", **{**BASE, **kw})
    # the adapters' optimizer states: on the GPU, or in host RAM under offload
    held = e.breakdown["optimizer_states"] if kw.get("offload", "none") == "none" else e.cpu_ram_per_node_bytes
    assert e.peak_allocated_bytes > 0 and held > 0


def test_cli_estimates_and_refuses_the_same(memplan_cli):
    ok = memplan_cli("estimate", "--model", "llama-3.1-8b", "--gpu", "a100-80g", "--gpus", "4", "--method", "qlora",
                     "--zero", "3", "--quant-storage", "bf16", "--json")
    assert ok.returncode == 0, ok.stderr
    bad = memplan_cli("estimate", "--model", "llama-3.1-8b", "--gpu", "a100-80g", "--gpus", "4", "--method", "qlora",
                      "--fsdp", "full-shard")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--quant-storage bf16" in bad.stderr


def test_suggest_combines_methods_with_zero_and_fsdp():
    s = api.suggest("llama-3.1-70b", "a100-80g", gpus=8, seq_len=1024, global_batch=16, method="lora", top=50)
    assert s.plans and all(p.workload.method == "lora" for p in s.plans)
    shardings = {(p.zero_stage, p.fsdp) for p in s.plans + s.pareto}
    assert any(z == 3 or f in ("full-shard", "shard-grad-op") for z, f in shardings), shardings


def test_lora_adapters_compute_in_half_in_a_half_model():
    # DeepSpeed casts the fp32 adapters to half; FSDP2 gathers them in param_dtype: lora_A saves the half
    # input it shares with the other adapted linears reading it, and the rank-r intermediate is half
    one = api.estimate("llama-3.1-8b", "a100-80g", method="lora", micro_batch=1, seq_len=512, precision="bf16-pure")
    assert one.activations_per_layer["lora: A input (cast to the adapters' width)"] == 2 * 4 * 512 * 4096  # q, v
    for kw in (dict(zero=3), dict(zero=2), dict(fsdp="full-shard")):
        e = api.estimate("llama-3.1-8b", "a100-80g", method="lora", micro_batch=1, seq_len=512, precision="bf16",
                         gpus=4, **kw)
        terms = {k: v for k, v in e.activations_per_layer.items() if k.startswith("lora")}
        assert terms == {"lora: A input (the linear's input)": 2 * 512 * 4096,
                         "lora: rank-r intermediate (B input)": 2 * 2 * 512 * 8}, kw


def test_freeze_keeps_only_the_trained_blocks_activations_when_sharded():
    # whether a frozen block records is the method's, not the sharding's: ZeRO and FSDP count the last K
    # blocks as a single GPU does (the half model keeps less than autocast: no fp32 norm inputs)
    base = dict(method="freeze", trainable_layers=2, precision="bf16", micro_batch=4, seq_len=2048, gpus=2)
    ddp = api.estimate("llama-3.1-8b", "a100-80g", **base).breakdown["activations"]
    full = api.estimate("llama-3.1-8b", "a100-80g", precision="bf16", micro_batch=4, seq_len=2048, gpus=2,
                        zero=2).breakdown["activations"]
    for kw in (dict(zero=2), dict(zero=3), dict(fsdp="full-shard")):
        acts = api.estimate("llama-3.1-8b", "a100-80g", **base, **kw).breakdown["activations"]
        assert 0.8 * ddp < acts <= ddp < full / 4, kw


def test_a_half_stored_trained_head_has_half_gradients():
    # LoRA over a bf16 base with modules_to_save=lm_head: the trained copy is stored half, its gradient too
    w = Workload(method="lora", modules_to_save=("lm_head",), precision="bf16", seq_len=512)
    spec = api.resolve_spec("llama-2-7b")
    st = stage_states(StatesKey.of(spec, w, 0))
    head = [g for g in tuned_params(spec, Tuning.of(w)) if g.category == "head" and g.trainable]
    assert head and st.head_grads == sum(g.numel * 2 for g in head)


def test_fsdp_runs_autocast_over_its_half_parameters():
    """accelerate wraps the forward in autocast under FSDP too (Accelerator.native_amp leaves out only DeepSpeed and
    Megatron-LM), over the half parameters FSDP gathers: eager GPT-2's softmax keeps fp32 probabilities where
    DeepSpeed's pure half model keeps half ones; BERT's stream after its embedding LayerNorm is fp32, as on one
    GPU under autocast; Llama's RMSNorm casts back to the input's dtype, so its stream stays half either way."""
    def acts(model, attn, **kw):
        return api.estimate(model, "a100-80g", precision="bf16", micro_batch=2, seq_len=512, attn=attn, gpus=4,
                            **kw).activations_per_layer
    assert sum(acts("gpt2", "eager", fsdp="full-shard").values()) > sum(acts("gpt2", "eager", zero=3).values())
    one_gpu = api.estimate("bert-base", "a100-80g", precision="bf16", micro_batch=2, seq_len=512, attn="sdpa")
    assert acts("bert-base", "sdpa", fsdp="full-shard") == one_gpu.activations_per_layer
    assert acts("llama-3.2-1b", "sdpa", fsdp="full-shard") == acts("llama-3.2-1b", "sdpa", zero=3)
    # LoRA too, its adapters gathered half: lora_A reads the half input as it is, under autocast or not
    lora = acts("gpt2", "eager", fsdp="full-shard", method="lora")
    assert sum(lora.values()) > sum(acts("gpt2", "eager", zero=3, method="lora").values())
    assert "lora: A input (the linear's input)" in lora and "lora: A input (autocast half copy)" not in lora
