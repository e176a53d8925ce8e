"""Qwen3 and OLMo 2 as first-class families: their rows of the families table, the tensors their q/k norms and
OLMo 2's fp32-weighted norms add to the activation model, and the estimate against the fake tracer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memplan
from memplan.errors import UserError
from memplan.estimator.activations import TensorKind, total, training_activations
from memplan.estimator.families import family, model_types
from memplan.estimator.rules import PRECISIONS
from memplan.inputs.catalog import resolve_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks/accuracy/configs"


def test_rows_of_the_families_table():
    q3, o2 = family("qwen3"), family("olmo2")
    assert (q3.arch, q3.mlp, q3.norm, q3.position, q3.qk_norm, q3.norm_weight_fp32) == \
        ("decoder", "gated", "rmsnorm", "rotary", "head", False)
    assert (o2.qk_norm, o2.norm_weight_fp32, o2.norms_per_layer) == ("full", True, None)  # 2 post-norms a layer
    # PEFT 0.21.2's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: qwen3 -> q_proj, v_proj; no olmo2 entry
    assert (q3.lora_targets, o2.lora_targets) == (("q_proj", "v_proj"), ())
    for has in (lambda f: f.fused_loss_causal_base, lambda f: f.tiled_mlp, lambda f: f.memplan_attention,
                lambda f: f.selective):
        assert {"qwen3", "olmo2"} <= set(model_types(has))


def test_peft_default_targets_as_the_table_says():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_targets

    assert tuple(peft_targets["qwen3"]) == family("qwen3").lora_targets
    assert "olmo2" not in peft_targets
    with pytest.raises(UserError, match="target"):
        memplan.estimate("olmo-2-7b", "a100-80g", micro_batch=1, seq_len=512, precision="bf16", method="lora")
    lora = memplan.estimate("qwen3-8b", "a100-80g", micro_batch=1, seq_len=512, precision="bf16", method="lora")
    assert lora.peak_allocated_bytes < memplan.estimate("qwen3-8b", "a100-80g", micro_batch=1, seq_len=512,
                                                        precision="bf16").peak_allocated_bytes


def _layer(spec, precision, **kw):
    return training_activations(spec, 2, 512, PRECISIONS[precision], "sdpa", **kw).layer


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure", "fp32"])
def test_qwen3_q_k_norms_add_what_they_save(precision):
    """Against the same spec read as a llama (no q/k norm): per token, the fp32 copy of q and k (a*d + k*d
    values), one fp32 rstd per head, and the normalised tensor in the projection's dtype."""
    spec = resolve_model("qwen3-8b")
    plain = spec.model_copy(update={"model_type": "llama"})
    a, k, d, T, p = spec.num_heads, spec.num_kv_heads, spec.head_dim, 2 * 512, PRECISIONS[precision].act
    extra = total(_layer(spec, precision)) - total(_layer(plain, precision))
    assert extra == T * ((a + k) * d * (4 + p) + (a + k) * 4)
    # the normalised tensors are saved for the norms' weights only: a frozen base (LoRA) keeps the rest
    norm_inputs = [t for t in _layer(spec, precision) if t.name.endswith("_norm normalised")]
    assert all(t.kind is TensorKind.NORM_INPUT for t in norm_inputs) and len(norm_inputs) == 2


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_olmo2_norms_keep_fp32_normalised_tensors(precision):
    """Olmo2RMSNorm multiplies by its weight before casting back: the layer's two norms (and the final norm)
    save an fp32 normalised tensor, and q_norm / k_norm run over the whole projection (one rstd per token)."""
    spec = resolve_model("olmo-2-7b")
    plain = spec.model_copy(update={"model_type": "llama"})
    h, a, k, d, T = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, 2 * 512
    r = PRECISIONS[precision].residual
    extra = total(_layer(spec, precision)) - total(_layer(plain, precision))
    assert extra == T * (2 * h * (4 - r) + (a + k) * d * 8 + 2 * 4)


def _accuracy_cases(stem: str) -> list[dict]:
    cases = json.loads((ROOT / "benchmarks/accuracy/cases.json").read_text())["cases"]
    return [c for c in cases if c["model"].endswith(f"/{stem}.json")]


def test_the_accuracy_suite_has_the_must_show_cases():
    for stem in ("qwen3-small", "olmo2-small"):
        got = {(c["precision"], c.get("grad_ckpt", c.get("task"))) for c in _accuracy_cases(stem)}
        assert {("bf16", "none"), ("bf16", "full"), ("bf16-pure", "none"), ("bf16-pure", "full"),
                ("bf16", "infer"), ("bf16-pure", "infer")} <= got
        assert json.loads((CONFIGS / f"{stem}.json").read_text())["model_type"] == stem.split("-")[0]


@pytest.mark.parametrize("stem, precision, grad_ckpt", [("qwen3-small", "bf16", "none"),
                                                        ("qwen3-small", "bf16-pure", "none"),
                                                        ("olmo2-small", "bf16", "none"),
                                                        ("olmo2-small", "bf16-pure", "none")])
def test_estimate_within_2_percent_of_the_fake_trace(stem, precision, grad_ckpt):
    """The small configurations of the accuracy suite (2 layers, hidden 256, GQA 8/4), where the q/k norms
    are 5-7 % of the peak: the estimate is within 2 % of the fake tracer's peak allocated."""
    from memplan.verify.run import run

    r = run(model=str(CONFIGS / f"{stem}.json"), gpu="a100-80g", device="fake", steps=2, micro_batch=2, seq_len=512,
            precision=precision, attn="sdpa", optim="adamw_torch_fused", grad_ckpt=grad_ckpt)
    assert abs(r.meters[0].error_pct) <= 2, r.breakdown


def test_selective_recompute_holds_the_rotary_q_and_k_in_fp32():
    """Under selective recomputation the checkpointed core keeps its inputs: q and k after the rotary embedding,
    which over an fp32 model under autocast are fp32 (cos / sin in the hidden states' dtype), not the half casts
    SDPA saves without the checkpoint. Counted at half width the estimate was 1.7 % under this trace, and 3.6 %
    under the lent H200's Qwen3-0.6B b8 s2048 (75,246 MiB measured; benchmarks/results/gpu_lease/gpu_grid_wide.json)."""
    from memplan.verify.run import run

    r = run(model=str(CONFIGS / "qwen3-small.json"), gpu="a100-80g", device="fake", steps=2, micro_batch=2,
            seq_len=512, precision="bf16", attn="sdpa", optim="adamw_torch_fused", grad_ckpt="selective")
    assert abs(r.meters[0].error_pct) <= 0.5, r.breakdown
    big = memplan.estimate("qwen3-0.6b", "h200", micro_batch=8, seq_len=2048, precision="bf16", attn="sdpa",
                           grad_ckpt="selective")
    assert big.peak_allocated_bytes / 2**20 == pytest.approx(75246.357, rel=0.005)


def test_speed_model_moves_the_q_k_norms():
    """The q / k norms are element-wise kernels the step runs: NORM_MOVES per element of q and k per layer, beside
    the layer's own norms (the same spec read as a llama has none)."""
    from memplan.inputs.workload import Workload
    from memplan.search import operators as ops

    spec = resolve_model("qwen3-8b")
    plain = spec.model_copy(update={"model_type": "llama"})
    w = Workload(seq_len=512)
    extra = ops.step_ops(ops.OpsKey.of(spec, w)).stream_moves - ops.step_ops(ops.OpsKey.of(plain, w)).stream_moves
    qk = (spec.num_heads + spec.num_kv_heads) * spec.head_dim
    assert extra == pytest.approx(ops.NORM_MOVES * qk * spec.num_layers)


def test_kernels_and_tiled_mlp_are_planned_for_both():
    for name in ("qwen3-0.6b", "olmo-2-7b"):
        plain = memplan.estimate(name, "a100-80g", micro_batch=1, seq_len=4096, precision="bf16")
        tiled = memplan.estimate(name, "a100-80g", micro_batch=1, seq_len=4096, precision="bf16", kernels=True,
                                 tiled_mlp=True, attn="memplan")
        assert tiled.peak_allocated_bytes < plain.peak_allocated_bytes, name
