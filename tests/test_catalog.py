"""The bundled catalog: stored specs equal a fresh meta-device build, anchors, and `--model` resolution."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memplan.inputs import catalog
from memplan.inputs.catalog import get_entry, list_models, resolve_model
from memplan.errors import UserError

ENTRIES = list_models()


# -- (a) every stored spec is what the real model on the meta device gives ---------------------------------
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_stored_spec_matches_meta_model(entry):
    from memplan.inputs.hf import meta_param_count, spec_from_config

    before = json.dumps(entry.config, sort_keys=True)
    assert meta_param_count(entry.config, entry.spec.head) == entry.spec.params_total
    fresh = spec_from_config(entry.config, entry.name, hf_id=entry.hf_id)
    assert json.dumps(entry.config, sort_keys=True) == before, "building must not mutate the stored config"
    assert fresh == entry.spec, "catalog.json is stale: run scripts/build_catalog.py"
    assert "other" not in entry.spec.params_by_category(), "a parameter escaped CATEGORY_RULES"


# -- (b) anchors from outside the code --------------------------------------------------------------------
def test_anchor_param_counts():
    bert = resolve_model("bert-large")
    assert (bert.head, bert.num_labels, bert.params_total) == ("sequence-classification", 2, 335_143_938)
    llama = resolve_model("llama-3.1-405b")
    assert (llama.head, llama.params_total) == ("causal-lm", 405_853_388_800)


def test_qwen3_and_olmo2_counts_match_their_model_cards():
    """Anchors from outside the code: Qwen3's model cards (0.6B / 8.2B / 32.8B total, 0.44B / 6.95B / 31.2B
    non-embedding) and OLMo 2 7B's 7.3B; the exact numbers are the meta-device model's (test (a))."""
    for name, total, non_embedding in (("qwen3-0.6b", 0.6e9, 0.44e9), ("qwen3-8b", 8.2e9, 6.95e9),
                                       ("qwen3-32b", 32.8e9, 31.2e9), ("olmo-2-7b", 7.3e9, None)):
        spec = resolve_model(name)
        by = spec.params_by_category()
        assert abs(spec.params_total - total) / total < 0.01, name
        if non_embedding:
            assert abs(spec.params_total - by["embeddings"] - by.get("head", 0) - non_embedding) / non_embedding < 0.01
    assert resolve_model("qwen3-0.6b").params_total == 596_049_920  # tied: lm_head is embed_tokens
    assert resolve_model("olmo-2-7b").params_total == 7_298_617_344
    # q_norm / k_norm: per head (head_dim) in Qwen3, over the whole projection in OLMo 2
    q3 = {g.module: g.shape for g in resolve_model("qwen3-8b").params if g.category == "norms"}
    o2 = {g.module: g.shape for g in resolve_model("olmo-2-7b").params if g.category == "norms"}
    assert q3["model.layers.*.self_attn.q_norm"] == q3["model.layers.*.self_attn.k_norm"] == (128,)
    assert o2["model.layers.*.self_attn.q_norm"] == o2["model.layers.*.self_attn.k_norm"] == (4096,)
    assert "model.layers.*.input_layernorm" not in o2 and "model.layers.*.post_feedforward_layernorm" in o2


def test_code_family_counts_match_their_model_cards():
    """Anchors from outside the code: StarCoder2-15B's 15B (16B class, lm_head untied), OctoCoder's (StarCoder's)
    15.5B and Falcon-7B's 7B (the hub's 7.2B counts the tied lm_head again); exact numbers from the meta model."""
    for name, card, total in (("starcoder2-15b", 15.5e9, 15_957_889_024), ("octocoder", 15.5e9, 15_517_456_384),
                              ("falcon-7b", 7.0e9, 6_921_720_704)):
        spec = resolve_model(name)
        assert spec.params_total == total and abs(total - card) / card < 0.04, name
    assert resolve_model("octocoder").num_kv_heads == resolve_model("falcon-7b").num_kv_heads == 1  # multi-query
    assert (resolve_model("starcoder2-15b").num_kv_heads, resolve_model("starcoder2-15b").sliding_window) == (4, 4096)


def test_2025_dense_counts_match_their_anchors():
    """Llama 3.3 70B is Llama 3.1 70B's architecture; Mistral Small 3 has Mistral Small 3.2's published text
    parameter count (23,572,403,200: the same text layout); Phi-4 is the model card's 14B (14.7B on the hub)."""
    assert resolve_model("llama-3.3-70b").params_total == resolve_model("llama-3.1-70b").params_total
    assert resolve_model("mistral-small-24b").params_total == 23_572_403_200
    assert resolve_model("smollm3-3b").params_total == 3_075_098_624  # the model card's 3B
    phi4 = resolve_model("phi-4")
    assert phi4.params_total == 14_659_507_200 and (phi4.model_type, phi4.num_kv_heads) == ("phi3", 10)


def test_gemma3_counts_and_layer_types():
    """Gemma 3's text models (the vision tower of 4B / 27B not counted): 1B, 3.9B and 27.0B of the model cards'
    1B / 4B / 27B, every sixth layer global."""
    for name, total in (("gemma-3-1b", 999_885_952), ("gemma-3-4b", 3_880_263_168), ("gemma-3-27b", 27_009_346_304)):
        spec = resolve_model(name)
        assert spec.params_total == total and spec.model_type == "gemma3_text", name
        assert spec.layer_types.count("full_attention") == spec.num_layers // 6


def test_qwen3_moe_counts_match_their_model_cards():
    """Qwen3-30B-A3B's 30.5B and Qwen3-235B-A22B's 235B total: 128 fused experts a layer, 8 per token."""
    for name, card, total in (("qwen3-30b-a3b", 30.5e9, 30_532_122_624), ("qwen3-235b-a22b", 235e9, 235_093_634_560)):
        spec = resolve_model(name)
        assert spec.params_total == total and abs(total - card) / card < 0.01, name
        assert (spec.num_experts, spec.experts_per_token, spec.dense_layers) == (128, 8, 0)
    assert resolve_model("qwen3-30b-a3b").expert_width == 768


def test_gpt_oss_counts_match_their_model_cards():
    """gpt-oss-20b's 21B and gpt-oss-120b's 117B total (bf16, as transformers builds them: the hub's MXFP4 experts
    are a storage format), half the layers sliding over 128 tokens."""
    for name, card, total in (("gpt-oss-20b", 21e9, 20_914_757_184), ("gpt-oss-120b", 117e9, 116_829_156_672)):
        spec = resolve_model(name)
        assert spec.params_total == total and abs(total - card) / card < 0.01, name
        assert spec.layer_types.count("sliding_attention") == spec.num_layers // 2 and spec.sliding_window == 128


def test_catalog_is_complete_and_names_unique():
    names = [n.lower() for e in ENTRIES for n in e.names]
    assert len(names) == len(set(names)), "a name/alias/hub id maps to two entries"
    # 40 + deepseek-v3 / r1, starcoder2-15b, octocoder, falcon-7b, llama-3.3-70b, phi-4, mistral-small-24b,
    # gemma-3-1b / 4b / 27b, qwen3-30b-a3b / 235b-a22b, smollm3-3b, gpt-oss-20b / 120b,
    # llama-4-scout-17b-16e (issue 16)
    assert len(ENTRIES) == 57
    assert all(e.source and e.config["model_type"] == e.spec.model_type for e in ENTRIES)


# -- (c) name resolution ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, expected",
    [
        ("bert-base", "bert-base"),
        ("bert-large", "bert-large"),
        ("distilbert-base", "distilbert-base"),
        ("bert-large-uncased", "bert-large"),  # legacy un-namespaced hub id
        ("google-bert/bert-large-uncased", "bert-large"),  # hub id
        ("meta-llama/Meta-Llama-3.1-8B", "llama-3.1-8b"),  # legacy repo name
        ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
        ("t5-small", "t5-small"),
        ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
        ("BERT-Large", "bert-large"),  # any case
        ("META-LLAMA/LLAMA-2-7B-HF", "llama-2-7b"),
        ("  gpt2  ", "gpt2"),
        ("Qwen/Qwen3-8B", "qwen3-8b"),
        ("allenai/OLMo-2-1124-7B", "olmo-2-7b"),
        ("olmo2-7b", "olmo-2-7b"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
        ("deepseek-ai/DeepSeek-R1", "deepseek-r1"),
    ],
)
def test_resolve_names(name, expected):
    spec = resolve_model(name)
    assert spec.name == expected
    assert spec is get_entry(expected).spec  # the stored table, not a rebuild


def test_every_name_resolves_to_its_entry():
    for e in ENTRIES:
        for n in e.names:
            assert resolve_model(n) is e.spec, n


def test_did_you_mean():
    with pytest.raises(UserError, match=r"unknown model 'bert-lage'; did you mean: bert-large\b") as ei:
        resolve_model("bert-lage")
    assert "bert-base" in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(UserError, match="memplan models"):
        resolve_model("zzzzzz")


def test_other_head_is_rebuilt():
    spec = resolve_model("bert-large", head="base")
    assert (spec.name, spec.head, spec.params_total) == ("bert-large", "base", 335_141_888)  # no classifier
    assert resolve_model("bert-large", head="sequence-classification") is get_entry("bert-large").spec


def test_local_config_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(get_entry("gpt2").config))
    for arg in (str(tmp_path), str(tmp_path / "config.json")):
        spec = resolve_model(arg)
        assert spec.params_total == 124_439_808 and spec.name == tmp_path.name and spec.hf_id is None


@pytest.mark.parametrize(
    "content, message",
    [("{not json", "not valid JSON"), ('{"hidden_size": 8}', "no 'model_type'"), ("[1, 2]", "no 'model_type'")],
)
def test_bad_local_config(tmp_path, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(UserError, match=message):
        resolve_model(str(bad))


def test_missing_local_paths(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        resolve_model(str(tmp_path / "missing.json"))
    with pytest.raises(UserError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(UserError, match="empty model name"):
        resolve_model("")


def test_unreachable_hub_id(monkeypatch):
    import huggingface_hub.constants

    # Never touch the network: the env var for any child process, the constant for this one (read at import).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as ei:
        resolve_model("no-such-org/no-such-model-3f9a")
    msg = str(ei.value)
    assert msg.startswith("cannot resolve model 'no-such-org/no-such-model-3f9a': not in the catalog")
    assert "\n" not in msg


@pytest.mark.parametrize("proxy", ["http://host:99999", "http://[::1"])
def test_a_malformed_proxy_is_an_unreachable_hub(monkeypatch, proxy):
    """urlsplit raises on a port past 65535 or a broken IPv6 host: the probe says unreachable, no traceback."""
    from memplan.inputs import catalog

    monkeypatch.setenv("HTTPS_PROXY", proxy)
    monkeypatch.setenv("https_proxy", proxy)
    assert catalog.hub_reachable(0.1) is False


def test_a_silent_hub_ends_in_one_line_within_the_lookup_deadline(monkeypatch):
    """A proxy that accepts the connection and never answers had held `memplan estimate` past 400 s (the probe only
    opens a TCP connection): the whole lookup now has a deadline (catalog.HUB_LOOKUP_SECONDS, 30 s)."""
    import time

    import huggingface_hub.constants

    from memplan.inputs import catalog

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(catalog, "hub_reachable", lambda: True)
    monkeypatch.setattr(catalog, "_auto_config", lambda *a: time.sleep(30))
    monkeypatch.setattr(catalog, "HUB_LOOKUP_SECONDS", 0.2)
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="accepted the connection but gave no config.json within 0 s"):
        resolve_model("someorg/silent-model-3f9a")
    assert time.perf_counter() - t0 < 5


def test_hub_id_through_transformers(monkeypatch):
    """A reachable/cached hub id goes AutoConfig -> spec_from_config (AutoConfig faked: no network)."""
    import transformers

    from memplan.inputs.hf import load_config

    cfg = load_config(get_entry("gpt2").config)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda name, **kw: cfg)
    monkeypatch.setattr(catalog, "hub_reachable", lambda: True)
    spec = resolve_model("someone/gpt2-copy")
    assert (spec.name, spec.hf_id, spec.params_total) == ("someone/gpt2-copy", "someone/gpt2-copy", 124_439_808)


# -- (d) the catalog path imports no torch -----------------------------------------------------------------
def test_catalog_lookup_does_not_import_torch():
    code = (
        "import sys, memplan.inputs.catalog as c; c.resolve_model('bert-large'); c.list_models(); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- (e) category split ----------------------------------------------------------------------------------
def test_tied_embeddings_counted_once():
    spec = resolve_model("llama-3.2-1b")
    by = spec.params_by_category()
    assert spec.tie_embeddings and spec.head == "causal-lm"
    assert "head" not in by  # lm_head.weight is embed_tokens.weight: one tensor, listed once
    assert [g.shape for g in spec.params if g.category == "embeddings"] == [(128256, 2048)]
    assert spec.params_total == 1_235_814_400


def test_untied_head_and_moe_split():
    llama = resolve_model("llama-3.1-8b").params_by_category()
    assert llama["head"] == llama["embeddings"] == 128256 * 4096
    mixtral = resolve_model("mixtral-8x7b")
    by = mixtral.params_by_category()
    assert by["router"] == 32 * 8 * 4096  # one (experts x hidden) gate per layer
    assert by["experts"] == 32 * 8 * 3 * 4096 * 14336
    assert mixtral.is_moe and (mixtral.num_experts, mixtral.experts_per_token) == (8, 2)


def test_raw_json_read_once():
    catalog._raw.cache_clear()
    catalog._entry.cache_clear()
    resolve_model("gpt2")
    resolve_model("t5-base")
    assert catalog._raw.cache_info().misses == 1


def test_family_without_an_activation_model_takes_the_traced_path():
    """The config reader takes its architecture facts from the families table; a model_type without a row is read
    for the traced path (estimator/traced.py), with the default head of the architecture transformers gives it."""
    from memplan.inputs.hf import prepare_config

    assert prepare_config({"model_type": "bloom", "n_layer": 2}, None)[1] == "causal-lm"
    assert prepare_config(get_entry("t5-small").config, None)[1] == "seq2seq-lm"  # the family's default head
