"""The traced path: a model_type without an analytic activation model is traced, fitted, cached and estimated
like an analytic one (estimator/traced.py, inputs/trace.py; docs/estimator.md, "Traced coefficients")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import memplan
from memplan.errors import UserError
from memplan.estimator import traced
from memplan.estimator.families import activation_method
from memplan.estimator.rules import PRECISIONS
from memplan.inputs.hf import config_json, prepare_config
from memplan.inputs.trace import SAVED

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks/accuracy/configs"
COHERE2 = str(CONFIGS / "cohere2-small.json")


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """A cache of this module's own: the first estimate of each key traces, as on a new machine."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MEMPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("memplan-cache")))
    traced.coefficients.cache_clear()
    yield
    traced.coefficients.cache_clear()
    mp.undo()


@pytest.mark.parametrize("name, arch", [("cohere2", "decoder"), ("electra", "encoder"), ("bart", "encoder-decoder"),
                                        ("mt5", "encoder-decoder")])
def test_unknown_model_types_are_traced_with_their_architecture(name, arch):
    spec = memplan.resolve_model(str(CONFIGS / f"{name}-small.json"))
    assert activation_method(spec) == "traced" and spec.arch == arch and spec.traced_config
    assert activation_method(memplan.resolve_model("llama-3.2-1b")) == "analytic"


@pytest.mark.parametrize("config, says", [
    ({"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}, "state-space"),
    ({"model_type": "qwen2_vl", "vision_config": {}, "hidden_size": 64}, "vision-language"),
    ({"model_type": "whisper", "d_model": 64, "encoder_attention_heads": 4, "decoder_attention_heads": 4}, "speech"),
])
def test_what_cannot_be_traced_is_refused_by_name(tmp_path, config, says):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(UserError, match=says):
        memplan.resolve_model(str(path))


def test_fit_recovers_a_polynomial_and_measures_a_misfit():
    points = [(b, s) for s in (32, 192, 352, 512) for b in (1, 2)]
    true = np.array([7.0, 3.0, 5.0, 11.0, 13.0, 17.0])
    values = np.array([[traced.evaluate(tuple(true), b, s)] for b, s in points])
    coef, err = traced.fit(points, values)
    assert np.allclose(coef[0], true) and err < 1e-9
    values[3, 0] *= 1.5  # one trace off the polynomial
    assert traced.fit(points, values)[1] > 0.01


def test_estimate_says_traced_and_matches_the_fake_trace():
    """Estimate vs verify --device fake on a model memplan has no analytic model of (Cohere2: one LayerNorm
    for a parallel attention + MLP block, sliding and full layers), under full checkpointing (its forward's
    sequence and the recompute's; without checkpointing: the accuracy suite, results/accuracy-traced.md, which this
    test ran too until the suite needed its 12 s)."""
    from memplan.verify.run import run

    for ckpt in ("full",):
        work = dict(precision="bf16", seq_len=512, micro_batch=2, grad_ckpt=ckpt, optim="adamw_torch_fused")
        est = memplan.estimate(COHERE2, "a100-80g", **work)
        said = [n for n in est.notes if "traced coefficients of cohere2" in n]
        assert said and Path(said[0].rpartition("cached in ")[2]).is_file()  # the file the estimate read
        rep = run(model=COHERE2, gpu="a100-80g", device="fake", **work)
        assert abs(rep.meters[0].error_pct) <= 3.0, (ckpt, rep.meters[0])
        # the replay of the traced sequences against the simulation of the traced step (each window one tensor
        # before: +8.5 % / +8.2 %)
        replayed = next(m for m in rep.meters if m.meter == "peak_reserved")
        assert abs(replayed.error_pct) <= 3.0, (ckpt, replayed)


def test_coefficients_are_read_back_from_disk_and_keyed_by_content(monkeypatch):
    spec = memplan.resolve_model(COHERE2)
    prec = PRECISIONS["bf16"]
    key = traced.key_of(spec, 512, prec, "sdpa", False)
    first = traced.coefficients(key)
    assert Path(first.path).is_file() and Path(first.path).parent == traced.cache_dir()
    traced.coefficients.cache_clear()

    def no_trace(key):
        raise AssertionError("traced again instead of reading the cache")

    monkeypatch.setattr("memplan.inputs.trace.trace_points", no_trace)
    assert traced.coefficients(key) == first
    # another config (one layer more) is another key
    other = spec.model_copy(update={"traced_config": spec.traced_config.replace('"num_hidden_layers": 4',
                                                                                '"num_hidden_layers": 5')})
    assert traced.key_of(other, 512, prec, "sdpa", False).digest != key.digest


def test_traced_agrees_with_the_analytic_model():
    """The same model traced and analytic (a copy of its spec with traced_config set) within 2 %."""
    path = CONFIGS / "llama-small.json"
    spec = memplan.resolve_model(str(path))
    cfg, _ = prepare_config(json.loads(path.read_text()), spec.head)
    as_traced = spec.model_copy(update={"traced_config": config_json(cfg)})
    work = dict(precision="bf16", seq_len=512, micro_batch=3, optim="adamw_torch_fused")
    a = memplan.estimate(spec, "a100-80g", **work).peak_allocated_bytes
    t = memplan.estimate(as_traced, "a100-80g", **work).peak_allocated_bytes
    assert abs(t - a) / a <= 0.02


def test_sequences_hold_what_the_windows_peak_at():
    """A window's sequence (its own storages in order) peaks at the window's fitted moment: the same bytes, in
    tensors the replay can place (inputs/trace.py sequence)."""
    # llama-small traced as test_traced_agrees_with_the_analytic_model traces it (its key is cached by then): one
    # layer type, so one traced block
    path = CONFIGS / "llama-small.json"
    spec = memplan.resolve_model(str(path))
    cfg, _ = prepare_config(json.loads(path.read_text()), spec.head)
    as_traced = spec.model_copy(update={"traced_config": config_json(cfg)})
    am = traced.activations(traced.key_of(as_traced, 512, PRECISIONS["bf16"], "sdpa", False), 3, 512)
    for name in ("loss_forward", "layer_forward"):
        live, peak, born, died = {}, 0.0, set(), set()
        for n, nbytes in am.sequences[name]:
            if n >= 0:
                live[n] = nbytes
                born.add(n)
            elif n > SAVED:
                assert ~n in born and ~n not in died  # a death follows its birth, once
                died.add(~n)
                live.pop(~n)
            peak = max(peak, sum(live.values()))
        if name == "loss_forward":
            assert peak == pytest.approx(am.loss_forward[0].nbytes, rel=0.03)  # events not in every trace dropped
    # the block's saved tensors born where the trace made them, all but its input (the previous block's output)
    markers = [SAVED - n for n, _ in am.sequences["layer_forward"] if n <= SAVED]
    assert markers == list(range(1, len(am.layer)))


def test_a_launchers_hundredth_call_gives_its_first_answer():
    work = dict(precision="bf16", seq_len=512, micro_batch=2, optim="adamw_torch_fused")
    first = memplan.estimate(COHERE2, "a100-80g", **work).peak_allocated_bytes
    memplan.estimate(COHERE2, "a100-80g", precision="bf16-pure", seq_len=512, micro_batch=4)
    assert all(memplan.estimate(COHERE2, "a100-80g", **work).peak_allocated_bytes == first for _ in range(3))


def test_a_traced_models_positions_bound_the_sequence_only_where_they_are_a_table():
    """mT5's relative buckets take any length (as t5-small's do); BART's learned table has 1,024 rows."""
    assert memplan.estimate(str(CONFIGS / "mt5-small.json"), "a100-80g", seq_len=1024).peak_allocated_bytes > 0
    with pytest.raises(UserError, match="1,024 learned positions"):
        memplan.estimate(str(CONFIGS / "bart-small.json"), "a100-80g", seq_len=2048)


def test_each_layer_type_replays_its_own_traced_block():
    """Cohere 2's sliding and full layers save different storages. The mean layer weighs each type's block by its
    share (3 of 4 layers slide): sizes no real layer has, which pack into segments as none does (cohere2-small
    bf16-pure b2 s512 was -5.0 % against the simulation of its trace, exaone4-small bf16 -5.1 %; now 0.0 %). Each
    traced block is kept whole with its own forward and backward, and the replay gives each layer its type's."""
    from memplan.estimator.activation_arrays import ActsKey
    from memplan.inputs.workload import Workload

    spec = memplan.resolve_model(COHERE2)
    w = Workload(precision="bf16", seq_len=512, micro_batch=2, optim="adamw_torch_fused")
    acts = ActsKey.of(spec, w)
    key, types = acts.trace_key, sorted(set(spec.layer_types))
    blocks = traced.coefficients(key).blocks
    assert sorted(blk.layer_type for blk in blocks[1:]) == types  # block 0 (the first layer) is traced apart
    mean = acts.model(2)
    own = {t: traced.activations(key, 2, 512, traced.block_of(key, False, 1, t)) for t in types}
    total = lambda am: sum(x.nbytes for x in am.layer)  # noqa: E731
    share = {t: spec.layer_types.count(t) / spec.num_layers for t in types}
    assert total(mean) == pytest.approx(sum(share[t] * total(own[t]) for t in types), rel=1e-6)
    # the MLP's intermediates (b s f bf16) are in each type's list whole, in the mean layer's at a share only
    f_bytes = 2 * 512 * spec.intermediate_size * 2
    assert all(any(x.nbytes == pytest.approx(f_bytes, rel=1e-3) for x in own[t].layer) for t in types)
    assert not any(x.nbytes == pytest.approx(f_bytes, rel=1e-3) for x in mean.layer)
    for t in types:  # each forward's markers name its own block's storages, in order (its input may be born before)
        markers = [SAVED - n for n, _ in own[t].sequences["layer_forward"] if n <= SAVED]
        assert markers == sorted(set(markers)) and set(range(1, len(own[t].layer))) <= set(markers) <= set(
            range(len(own[t].layer)))
    assert own[types[0]].sequences["layer_backward"] != own[types[1]].sequences["layer_backward"]
    layers = acts.layer_models(2)  # the first block its own (test_each_stacks_first_block_replays_its_own)
    assert [next(t for t in types if am == own[t]) for am in layers[1:]] == list(spec.layer_types[1:])


def test_each_stacks_first_block_replays_its_own():
    """T5's first blocks compute the position bias the others are handed: their forward makes the relative-position
    buckets' int64 s x s transients (2 MiB at s 512) and they keep more. The step counts the more as one storage
    with the embeddings (kind FIRST_BLOCK); the replay makes each first block's own list and forward instead of it.
    Each stack's blocks replay their own backward (the encoder's has no cross-attention)."""
    from memplan.estimator.activation_arrays import ActsKey
    from memplan.estimator.activations import TensorKind
    from memplan.inputs.workload import Workload

    spec = memplan.resolve_model(str(CONFIGS / "mt5-small.json"))
    acts = ActsKey.of(spec, Workload(precision="bf16", seq_len=512, micro_batch=2, optim="adamw_torch_fused"))
    mean, layers, enc = acts.model(2), acts.layer_models(2), spec.num_layers
    assert len(layers) == enc + spec.num_decoder_layers
    rest = [b for b in range(len(layers)) if b not in (0, enc)]
    assert all(layers[b].layer == mean.layer and layers[b].decoder_layer == mean.decoder_layer for b in rest)
    backward = lambda b: layers[b].sequences["layer_backward"]  # noqa: E731
    assert backward(len(layers) - 1) == mean.sequences["layer_backward"] != backward(1)
    lumps = [t for t in mean.embed if t.kind is TensorKind.FIRST_BLOCK]
    total = lambda ts: sum(t.nbytes for t in ts)  # noqa: E731
    assert len(lumps) == 2 and all(t.nbytes > 0 for t in lumps)
    assert total(layers[0].layer) == pytest.approx(total(mean.layer) + lumps[0].nbytes, rel=1e-6)
    assert total(layers[enc].decoder_layer) == pytest.approx(total(mean.decoder_layer) + lumps[1].nbytes, rel=1e-6)
    # the buckets' transients (the rest of a block's 2 MiB ones: its d_ff-wide intermediates, b s 1024 bf16)
    buckets = lambda am: sum(n >= 0 and x == pytest.approx(8 * 512 * 512, rel=1e-3)  # noqa: E731
                             for n, x in am.sequences["layer_forward"])
    assert all(buckets(layers[b]) >= buckets(mean) + 8 for b in (0, enc))


# one row per way a traced block replays its own (accuracy-traced.json, verify's simulation of the traced step):
# each layer type's block (cohere2-small was -5.0 %), each stack's first block and a decoder block's own markers
# (mt5-small was -6.4 %), each block's backward (electra-small under full recompute was +2.8 %)
TRACED_ROWS = [("cohere2-small", "bf16-pure", "none"), ("mt5-small", "bf16-pure", "none"),
               ("electra-small", "bf16", "full")]


@pytest.mark.parametrize("name,precision,ckpt", TRACED_ROWS, ids=[f"{n}-{p}-{c}" for n, p, c in TRACED_ROWS])
def test_traced_replay_matches_the_committed_simulation_of_traced_steps(name, precision, ckpt):
    rows = json.loads((ROOT / "benchmarks/accuracy/results/accuracy-traced.json").read_text())["results"]
    row = next(r for r in rows if Path(r["case"]["model"]).stem == name and r["case"]["precision"] == precision
               and r["case"]["grad_ckpt"] == ckpt and r["case"]["micro_batch"] == 2 and r["case"]["seq_len"] == 512)
    case = {k: v for k, v in row["case"].items() if k not in ("model", "device")}
    e = memplan.estimate(str(ROOT / row["case"]["model"]), "a100-80g", **case)
    measured = {m["meter"]: m["measured_bytes"] for m in row["meters"]}["peak_reserved"]
    assert e.reserved_from == "replay"
    assert e.peak_reserved_bytes == pytest.approx(measured, rel=0.015)
