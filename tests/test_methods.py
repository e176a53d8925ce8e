"""Fine-tuning methods through estimate and suggest (docs/finetune.md); the table against PEFT itself is
tests/test_finetune.py."""

import pytest

from memplan import api
from memplan.errors import UserError

GiB = 2**30


def test_lora_and_qlora_plans_fit_a_4090_where_full_fine_tuning_does_not():
    for method in ("lora", "qlora"):
        s = api.suggest("llama-3.1-8b", "rtx4090", method=method)
        assert s.plans and all(p.workload.method == method for p in s.plans)
    full = api.suggest("llama-3.1-8b", "rtx4090")
    assert not full.plans
    said = " ".join(full.notes)
    assert "--method lora" in said and "--method qlora" in said


def test_nothing_fits_names_the_method_and_the_text_says_its_gain_once(memplan_cli):
    out = memplan_cli("suggest", "--model", "llama-3.1-8b", "--gpu", "rtx4090").stdout
    assert "LoRA fits: --method lora or --method qlora" in out
    gain = "LoRA r8 on 4-bit weights (QLoRA) fits with micro batch"
    assert out.count(gain) == 1 and f"also fits: --method qlora: {gain}" in out


def test_a_model_without_peft_default_targets_is_offered_all_linear_by_name():
    # PEFT has no default target_modules for phi3: the alternative names the targets it assumes
    s = api.suggest("phi-3-mini", "rtx4090")
    assert not s.plans
    changes = [a.change for a in s.alternatives]
    assert "--method lora --lora-targets all-linear" in changes
    lora = next(a for a in s.alternatives if a.change.startswith("--method lora"))
    assert lora.plan.workload.lora_targets == ("all-linear",)
    # a model with a default keeps it, unnamed
    assert "--method lora" in [a.change for a in api.suggest("llama-3.1-8b", "rtx4090").alternatives]


def test_lora_trains_only_the_adapters_and_frees_their_states():
    full = api.estimate("llama-3.1-8b", "a100-80g", micro_batch=1, seq_len=512, precision="bf16")
    lora = api.estimate("llama-3.1-8b", "a100-80g", micro_batch=1, seq_len=512, precision="bf16", method="lora",
                        lora_r=16)
    assert lora.model.params_trainable == 32 * 16 * (4096 + 4096 + 4096 + 1024)  # r16 on q_proj, v_proj
    assert lora.breakdown["optimizer_states"] < full.breakdown["optimizer_states"] / 1000
    assert lora.breakdown["gradients"] < full.breakdown["gradients"] / 1000
    assert lora.breakdown["weights"] == pytest.approx(full.breakdown["weights"] / 2, rel=0.01)  # bf16 base
    assert sum(lora.activations_per_layer.values()) < sum(full.activations_per_layer.values())


def test_qlora_stores_4bit_weights_with_their_constants():
    e = api.estimate("llama-3.1-8b", "a100-80g", micro_batch=1, seq_len=512, precision="bf16", method="qlora")
    quantised = 32 * (4096 * 4096 * 2 + 1024 * 4096 * 2 + 3 * 4096 * 14336)
    embed_and_head = 2 * 128256 * 4096 * 4  # fp32 after prepare_model_for_kbit_training
    assert e.breakdown["weights"] == pytest.approx(quantised / 2 + embed_and_head, rel=0.01)
    assert e.breakdown["quant_constants"] == pytest.approx(quantised * (1 / 64 + 4 / 16384), rel=0.05)
    nodq = api.estimate("llama-3.1-8b", "a100-80g", micro_batch=1, seq_len=512, precision="bf16", method="qlora",
                        double_quant=False)
    assert nodq.breakdown["quant_constants"] == pytest.approx(quantised * 4 / 64, rel=0.05)


def test_paged_optimizer_states_count_in_device_used_only():
    kw = dict(micro_batch=1, seq_len=512, precision="bf16")
    plain = api.estimate("gpt2-medium", "a100-80g", optim="adamw_8bit", **kw)
    paged = api.estimate("gpt2-medium", "a100-80g", optim="paged_adamw_8bit", **kw)
    assert paged.breakdown["paged_optimizer_states"] > 0
    assert paged.peak_allocated_bytes < plain.peak_allocated_bytes
    assert paged.breakdown["optimizer_states"] + paged.breakdown["paged_optimizer_states"] == \
        plain.breakdown["optimizer_states"]


def test_freeze_saves_activations_of_the_trained_blocks_only():
    """Untied head: the frozen blocks before the trained ones see no tensor that requires a gradient. A tied
    head trains the embedding matrix, so every block records (finetune.records_frozen_blocks), a frozen one
    without its linears' inputs and RMSNorm's normalised tensors (tests/test_finetune.py traces it)."""
    from memplan.estimator.activation_arrays import ActsKey
    from memplan.estimator.allocation import round_block
    from memplan.inputs.workload import Workload

    kw = dict(micro_batch=8, seq_len=2048, precision="bf16")  # the peak in backward, activations held
    two = api.estimate("llama-3.1-8b", "a100-80g", method="freeze", trainable_layers=2, **kw)
    eight = api.estimate("llama-3.1-8b", "a100-80g", method="freeze", trainable_layers=8, **kw)
    per_layer = sum(two.activations_per_layer.values())
    assert eight.breakdown["activations"] - two.breakdown["activations"] == pytest.approx(6 * per_layer, rel=0.01)
    tied = [api.estimate("llama-3.2-1b", "a100-80g", method="freeze", trainable_layers=k, **kw) for k in (2, 8)]
    am = ActsKey.of(api.resolve_spec("llama-3.2-1b", None, False), Workload(method="freeze", trainable_layers=2, **kw)).model(8)
    sizes = lambda ts: sum(int(round_block(t.nbytes)) * t.count for t in ts)  # noqa: E731
    weight_inputs = sizes(am.layer) - sizes(am.frozen_layer)
    assert weight_inputs > 0
    assert tied[1].breakdown["activations"] - tied[0].breakdown["activations"] == 6 * weight_inputs


@pytest.mark.parametrize("kw, words", [
    (dict(lora_r=16), "apply to --method lora or qlora"),
    (dict(method="lora", quant="int8"), "apply to --method qlora"),
    (dict(method="freeze"), "--trainable-layers"),
    (dict(method="lora", lora_targets="nonexistent"), "matches no linear layer"),
    (dict(method="qlora", quant="int8", double_quant=False), r"apply to 4-bit weights \(--quant nf4 or fp4\)"),
    (dict(method="qlora", quant="int8", quant_storage="bf16"), "not to LLM.int8"),
])
def test_method_options_are_refused_where_they_do_not_apply(kw, words):
    with pytest.raises(UserError, match=words):
        api.estimate("llama-3.2-1b", "a100-80g", **kw)


def test_int8_refuses_the_4bit_settings_before_the_gpu_is_asked():
    """LLM.int8 reads no bnb_4bit_* setting: --compute-dtype bf16 with it is refused for that, not because
    a V100 has no bf16; a 4-bit method still gets the GPU's reason."""
    with pytest.raises(UserError, match="not to LLM.int8"):
        api.estimate("gpt2", "v100-16g", method="qlora", quant="int8", precision="fp16", compute_dtype="bf16")
    with pytest.raises(UserError, match="has no bf16: --compute-dtype fp16"):
        api.estimate("gpt2", "v100-16g", method="qlora", precision="fp16", compute_dtype="bf16")
    assert api.estimate("gpt2", "v100-16g", method="qlora", quant="int8", precision="fp16").workload.quant == "int8"


@pytest.mark.parametrize("kw, words", [
    (dict(method="full,lora", quant="int8"), "apply to --method qlora"),
    (dict(method="full,lora", double_quant=False), "apply to --method qlora"),
    (dict(method="lora,qlora", trainable_layers=2), "--trainable-layers applies to --method freeze"),
    (dict(method="full,qlora", lora_r=16, quant="int8", trainable_layers=2), "--trainable-layers applies"),
    (dict(method="full", lora_r=16), "apply to --method lora or qlora"),
    (dict(method="full,freeze"), "--method freeze needs --trainable-layers"),  # was a traceback
    (dict(method="full,lorra"), "unknown method 'lorra'"),
])
def test_suggest_refuses_an_option_no_named_method_reads(kw, words):
    """A method knob that none of the methods named reads would be dropped from every plan: refused as
    estimate refuses it for one method, before any search."""
    with pytest.raises(UserError, match=words):
        api.suggest("gpt2", "a100-80g", **kw)


def test_method_names_are_case_insensitive_everywhere(memplan_cli):
    assert api.estimate("gpt2", "a100-80g", method=" LoRA").workload.method == "lora"
    assert memplan_cli("estimate", "--model", "gpt2", "--gpu", "a100-80g", "--method", "QLoRA").returncode == 0
    assert api.suggest("gpt2", "a100-80g", method="LoRA", top=1).plans[0].method == "lora"
    with pytest.raises(UserError, match="method"):
        api.estimate("gpt2", "a100-80g", method="lorra")


def test_suggest_keeps_an_option_one_named_method_reads():
    s = api.suggest("gpt2", "a100-80g", method="lora,qlora", quant="int8", top=20)
    assert {p.workload.quant for p in s.plans if p.method == "qlora"} == {"int8"}


def test_cli_method_options(memplan_cli):
    out = memplan_cli("estimate", "--model", "qwen2.5-0.5b", "--gpu", "t4-16g", "--method", "qlora", "--precision",
                      "fp16", "--lora-targets", "all-linear", "--json")
    assert out.returncode == 0, out.stderr
    assert '"method": "qlora"' in out.stdout
    bad = memplan_cli("estimate", "--model", "phi-3-mini", "--gpu", "a100-80g", "--method", "lora")
    assert bad.returncode == 2 and "no default LoRA target" in bad.stderr
    tuned = memplan_cli("estimate", "--model", "gpt2", "--gpu", "a100-80g", "--method", "qlora", "--lora-r", "16")
    assert "train bf16, qlora nf4 r16, micro batch 1" in tuned.stdout  # the workload line names the method
    frozen = memplan_cli("estimate", "--model", "gpt2", "--gpu", "a100-80g", "--method", "freeze", "--trainable-layers", "2")
    assert "train bf16, freeze K=2, micro batch 1" in frozen.stdout
    assert "train bf16, micro batch 1" in memplan_cli("estimate", "--model", "gpt2", "--gpu", "a100-80g").stdout
    dropped = memplan_cli("suggest", "--model", "gpt2", "--gpu", "a100-80g", "--method", "full,lora", "--quant", "int8")
    assert dropped.returncode == 2 and dropped.stderr.count("\n") == 1 and "apply to --method qlora" in dropped.stderr


def test_modules_to_save_names_a_tied_head():
    """A tied lm_head has no parameter of its own in the table, but PEFT wraps it and trains a copy of the
    embedding matrix (tests/test_finetune.py checks the count against PEFT)."""
    e = api.estimate("llama-3.2-1b", "a100-80g", micro_batch=1, seq_len=256, precision="bf16", method="lora",
                     modules_to_save="lm_head")
    lora = 16 * (2048 + 2048 + 2048 + 512) * 8  # r8 on q_proj (2048 -> 2048) and v_proj (2048 -> 512)
    assert e.model.params_trainable == 128256 * 2048 + lora
    with pytest.raises(UserError, match="no module of llama-3.2-1b is named 'lm_heads'"):
        api.estimate("llama-3.2-1b", "a100-80g", method="lora", modules_to_save="lm_heads")


def test_qlora_says_which_parameters_4bit_leaves_alone():
    # transformers 5's fused MoE experts are 3-D parameters, not nn.Linear: bnb keeps them, prepare up-casts
    moe = api.estimate("mixtral-8x7b", "h100", method="qlora", lora_targets="all-linear", seq_len=256)
    note = next(n for n in moe.notes if n.startswith("4-bit quantisation leaves"))
    assert "45.1B" in note and "mlp.experts" in note
    assert moe.breakdown["weights"] > 45e9 * 4  # fp32 experts
    dense = api.estimate("llama-3.1-8b", "h100", method="qlora", seq_len=256)
    assert not any(n.startswith("4-bit quantisation leaves") for n in dense.notes)


@pytest.mark.parametrize("model, stream_bytes", [("bert-base", 4), ("gpt2", 2)])
def test_lora_residual_stream_is_fp32_after_an_embedding_layernorm(model, stream_bytes):
    """Over a bf16 base under autocast, BERT's embeddings end with a LayerNorm that autocast runs in fp32, and
    each half output added to that stream promotes: what full checkpointing keeps per layer is fp32. GPT-2's
    embeddings are a bf16 sum, and its stream stays bf16 (tests/test_finetune.py traces the saved norms)."""
    from memplan.estimator.activation_arrays import ActsKey
    from memplan.inputs.workload import Workload

    spec = api.resolve_spec(model, None, False)
    w = Workload(method="lora", precision="bf16", micro_batch=2, seq_len=256, grad_ckpt="full")
    kept = ActsKey.of(spec, w).model(2).layer_input
    assert [t.nbytes for t in kept] == [stream_bytes * spec.hidden_size * 2 * 256]


def test_the_defaults_line_says_what_the_method_assumes():
    e = api.estimate("llama-3.2-1b", "a100-80g", method="qlora", lora_r=16, seq_len=256)
    said = "; ".join(e.defaults)
    assert "LoRA targets q_proj,v_proj (PEFT's default for llama" in said
    assert "LoRA alpha 8, dropout 0" in said and "r 16" not in said  # the rank was given
    assert "nf4, double quantisation, compute dtype bf16, storage uint8" in said
    sharded = api.estimate("llama-3.2-1b", "a100-80g", method="lora", seq_len=256, gpus=2, zero=2)
    assert "adapters half in the model" in "; ".join(sharded.defaults)
    full = api.estimate("llama-3.2-1b", "a100-80g", seq_len=256)
    assert not any("LoRA" in d for d in full.defaults)


def test_freeze_says_a_tied_embedding_trains():
    """freeze trains the input embedding a tied head shares its weight with (GPT-2's wte): the defaults line
    says so rather than 'embeddings frozen'."""
    tied = api.estimate("gpt2", "a100-80g", method="freeze", trainable_layers=2)
    assert "embeddings frozen but transformer.wte, the tied head's weight, trained with it" in "; ".join(tied.defaults)
    assert tied.model.params_trainable > 50257 * 768  # wte is counted as trained
    untied = api.estimate("llama-3.1-8b", "a100-80g", method="freeze", trainable_layers=2, seq_len=256)
    assert "embeddings frozen (--modules-to-save to train them)" in untied.defaults
    saved = api.estimate("gpt2", "a100-80g", method="freeze", trainable_layers=2, modules_to_save="wpe")
    assert not any(d.startswith("embeddings") for d in saved.defaults)


def test_the_quantisation_item_names_whose_defaults_they_are():
    """nf4 and double quantisation are QLoRA's recipe, memplan's defaults: BitsAndBytesConfig's own are
    fp4 without double quantisation, computing in fp32 (transformers 5.23 utils/quantization_config.py)."""
    import torch
    from transformers import BitsAndBytesConfig

    own = BitsAndBytesConfig(load_in_4bit=True)
    assert (own.bnb_4bit_quant_type, own.bnb_4bit_use_double_quant, own.bnb_4bit_compute_dtype,
            own.bnb_4bit_quant_storage) == ("fp4", False, torch.float32, torch.uint8)
    item = next(d for d in api.estimate("gpt2", "a100-80g", method="qlora").defaults if "compute dtype" in d)
    assert "memplan's defaults, after QLoRA: BitsAndBytesConfig's own are fp4 without double quantisation" in item
    assert "BitsAndBytesConfig's defaults" not in item
    # only the settings not given are said; with all four given, or LLM.int8, none
    some = api.estimate("gpt2", "a100-80g", method="qlora", quant="fp4", quant_storage="bf16").defaults
    assert any(d.startswith("double quantisation, compute dtype bf16 (memplan's") for d in some)
    every = dict(quant="nf4", double_quant=True, compute_dtype="bf16", quant_storage="uint8")
    for kw in (every, dict(quant="int8")):
        assert not any("quantisation" in d or "compute dtype" in d
                       for d in api.estimate("gpt2", "a100-80g", method="qlora", **kw).defaults)


@pytest.mark.parametrize("gpu, dtype", [("a100-80g", "bf16"), ("v100-16g", "fp16")])
def test_estimate_and_suggest_say_the_same_compute_dtype(gpu, dtype):
    """The compute dtype follows the precision: suggest says it for the precision its plans run, as
    estimate does for the same question (it said fp32, the Workload's default precision)."""
    e = api.estimate("gpt2", gpu, method="qlora")
    s = api.suggest("gpt2", gpu, method="qlora", top=1)
    item = next(d for d in e.defaults if "compute dtype" in d)
    assert f"compute dtype {dtype}," in item and s.plans[0].precision == dtype
    assert item in s.defaults


def test_suggest_says_the_adapters_dtype_where_the_plans_agree():
    def adapters(**kw):
        return [d for d in api.suggest("gpt2", "a100-80g", method="lora", top=1, **kw).defaults
                if d.startswith("adapters")]
    assert adapters() == ["adapters fp32 (PEFT's autocast_adapter_dtype)"]
    assert adapters(gpus=2) == []  # DDP and ZeRO / FSDP plans: it depends on the plan
    assert adapters(gpus=2, zero="2")[0].startswith("adapters half in the model")


def test_why_this_plan_compares_plans_of_the_same_method():
    """--method any: the best plan is LoRA, and LoRA has no selective checkpointing (method-no-kernels), so
    no plan 'changes only the checkpointing' to selective: the full fine-tuning plan that does is another
    method, not a one-knob change."""
    s = api.suggest("gpt2", "t4-16g", method="any", top=3)
    assert s.plans[0].method == "lora" and any(p.method == "full" and p.grad_ckpt == "selective"
                                               for p in api.suggest("gpt2", "t4-16g", top=20).plans)
    assert ("checkpointing selective instead of checkpointing none: does not fit or is not possible with the rest "
            "of this plan") in s.why


def test_plans_say_their_method():
    s = api.suggest("llama-3.1-8b", "rtx4090", method="any")
    assert {p.method for p in s.plans} <= {"lora", "qlora"} and s.plans
    assert all(p.model_dump(mode="json")["method"] == p.workload.method for p in s.plans)
    assert s.searched["method"] == ["full", "lora", "qlora"]
    assert any(d.startswith("LoRA targets q_proj,v_proj") for d in s.defaults)


def test_an_adapted_pooler_reads_one_token_per_sequence():
    # all-linear adapts BERT's pooler, which reads the CLS token only: its LoRA input is b tokens, not b x s
    from memplan.estimator.activation_arrays import ActsKey
    from memplan.inputs.workload import Workload

    spec = api.resolve_spec("bert-base", None, False)
    w = Workload(method="lora", lora_targets=("all-linear",), precision="bf16", micro_batch=2, seq_len=256)
    head = [t for t in ActsKey.of(spec, w).model(2).head_saved if t.name.startswith("lora: A input")]
    assert [t.nbytes for t in head] == [2 * 768 * 2]  # autocast half copy of 2 pooled tokens
