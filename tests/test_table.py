"""memplan.estimator.table (the search's numpy evaluation) equals the scalar estimator and cost model, cell by cell."""

import pytest
from hypothesis import given, settings, strategies as st

import memplan
from memplan.search import cost
from memplan.estimator import step as estimator
from memplan.estimator import table
from memplan.api import workload
from memplan.errors import UserError
from memplan.inputs import constraints

KNOBS = st.fixed_dictionaries({
    "zero": st.sampled_from([0, 1, 2, 3]), "fsdp": st.sampled_from(["none", "full-shard", "shard-grad-op", "hybrid-shard"]),
    "offload": st.sampled_from(["none", "optimizer", "all"]), "precision": st.sampled_from(["fp32", "bf16", "bf16-pure"]),
    "grad_ckpt": st.sampled_from(["none", "selective", "full"]), "attn": st.sampled_from(["sdpa", "eager"]),
    "sp": st.booleans(), "vpp": st.sampled_from([1, 2]), "zero_grad": st.sampled_from(["set-to-none", "zeros"]),
    "kernels": st.booleans(), "tiled_mlp": st.booleans(),
})


@settings(max_examples=60, deadline=None)
@given(model=st.sampled_from(["llama-3.1-8b", "gpt2-medium", "t5-base", "mixtral-8x7b", "qwen2.5-0.5b", "bert-large",
                              "vit-base"]),
       layout=st.sampled_from([(8, 1, 1, 1), (8, 2, 2, 2), (8, 1, 2, 4), (4, 1, 1, 2), (1, 1, 1, 1), (2, 4, 2, 1)]),
       gpu=st.sampled_from(["a100-80g", "h100-80g", "v100-16g"]),
       knobs=st.lists(KNOBS, min_size=1, max_size=12))
def test_table_equals_the_scalar_estimate(model, layout, gpu, knobs):
    gpus, nodes, tp, pp = layout
    spec, prof = memplan.resolve_model(model), memplan.load_gpu(gpu)
    per_rank, mbs = 12, [1, 2, 3, 4, 6, 12]
    bases = []
    for k in knobs:
        # make the draw valid rather than reject it: the table sees what the search would give it
        k = dict(k, fsdp=k["fsdp"] if k["zero"] == 0 and tp == pp == 1 else "none",
                 offload=k["offload"] if k["zero"] and (k["offload"] != "all" or k["zero"] == 3) else "none",
                 zero=k["zero"] if pp == 1 else min(k["zero"], 1), sp=k["sp"] and tp > 1,
                 vpp=k["vpp"] if pp > 1 else 1, kernels=k["kernels"] and tp == 1,
                 tiled_mlp=k["tiled_mlp"] and tp == 1)
        if k["zero"] == 0 and k["offload"] != "none":
            k["offload"] = "none"
        try:
            w = workload(task="train", micro_batch=1, grad_accum=per_rank, seq_len=128, gpus=gpus, nodes=nodes, tp=tp,
                         pp=pp, **k)
            constraints.check(spec, prof, w)
        except UserError:
            continue
        bases.append(w)
    if not bases:
        return
    t = table.evaluate(spec, prof, bases, mbs, per_rank)
    for b, w in enumerate(bases):
        for k, mb in enumerate(mbs):
            m = per_rank // mb
            p = estimator.peak(spec, prof, w, mb, m)
            assert (p.device_used, p.cpu_per_gpu, p.params_per_gpu, p.saved_activations, p.state_bytes) == (
                t.device_used[b, k], t.cpu_per_gpu[b, k], t.params_per_gpu[b, k], t.saved[b, k], t.state[b, k])
            steps = cost.step_time(spec, prof, w, p.saved_activations, p.state_bytes, p.params_per_gpu,
                                   w.precision != "fp32", mb, m)
            assert list(t.terms[:, b, k]) == pytest.approx(list(steps), rel=1e-9, abs=1e-12)


def test_activation_terms_are_affine_in_the_micro_batch():
    """The table builds every micro batch's activation tensors from the models at b = 1 and 2
    (c + mb * x); that holds exactly, tensor by tensor, for every catalog model (the fused loss aside: its
    blocks depend on the token count, and the table takes the scalar path for it)."""
    from memplan.estimator.activations import training_activations
    from memplan.inputs.catalog import list_models
    from memplan.estimator.rules import PRECISIONS
    lists = ("layer", "decoder_layer", "embed", "head_saved", "layer_input", "layer_core", "loss_forward",
             "loss_backward", "layer_backward")
    checked = 0
    for entry in list_models():
        spec, name = entry.spec, entry.name
        for prec, attn, ckpt in [("bf16", "sdpa", "none"), ("fp32", "eager", "selective"), ("bf16-pure", "eager", "full")]:
            seq = 256
            kw = dict(selective=ckpt == "selective", kv_cache=ckpt != "full")
            one = training_activations(spec, 1, seq, PRECISIONS[prec], attn, **kw)
            two = training_activations(spec, 2, seq, PRECISIONS[prec], attn, **kw)
            for mb in (3, 8):
                many = training_activations(spec, mb, seq, PRECISIONS[prec], attn, **kw)
                for lst in lists:
                    a, a2, b = getattr(one, lst), getattr(two, lst), getattr(many, lst)
                    assert [(t.name, t.count, t.rep) for t in a] == [(t.name, t.count, t.rep) for t in b]
                    x = [float(t2.nbytes) - float(t.nbytes) for t, t2 in zip(a, a2)]
                    c = [float(t.nbytes) - d for t, d in zip(a, x)]
                    assert [ci + mb * xi for ci, xi in zip(c, x)] == [float(t.nbytes) for t in b], (name, lst)
                    checked += len(a)
    assert checked > 1000


@pytest.mark.parametrize("model", ["t5-base", "gpt2-medium", "llama-3.1-8b", "mixtral-8x7b", "vit-base", "bert-large",
                                   "gemma2-2b"])
def test_table_equals_the_scalar_estimate_on_every_precision_and_checkpointing(model):
    """The fixed grid beside the hypothesis draws: each model on one GPU and on a TP 2 x PP 2 layout."""
    spec, prof = memplan.resolve_model(model), memplan.load_gpu("a100-80g")
    per_rank, mbs = 6, [1, 2, 3, 6]
    for gpus, tp, pp in ((1, 1, 1), (4, 2, 2)):
        bases = []
        for prec in ("fp32", "bf16", "bf16-pure"):
            for ckpt in ("none", "selective", "full"):
                for attn in ("sdpa", "eager"):
                    try:
                        w = workload(task="train", micro_batch=1, grad_accum=per_rank, seq_len=256, gpus=gpus,
                                     tp=tp, pp=pp, precision=prec, grad_ckpt=ckpt, attn=attn, sp=tp > 1)
                        constraints.check(spec, prof, w)
                    except UserError:
                        continue
                    bases.append(w)
        t = table.evaluate(spec, prof, bases, mbs, per_rank)
        for b, w in enumerate(bases):
            for k, mb in enumerate(mbs):
                p = estimator.peak(spec, prof, w, mb, per_rank // mb)
                assert (p.device_used, p.saved_activations) == (t.device_used[b, k], t.saved[b, k]), (w, mb)
