"""The constraints table: each entry's example is refused by estimate with that entry's message, each
predicate reads only the fields it declares, and suggest never plans what the table refuses."""

import pytest

import memplan
from memplan.inputs import constraints
from memplan.inputs.workload import Workload

TABLE = {c.name: c for c in constraints.TABLE}
# suggest's options that name a Workload field; sp is "on" / "off" there
SUGGEST_OPTIONS = ("task", "precision", "optim", "grad_ckpt", "attn", "gpus", "nodes", "zero", "offload", "tp", "pp",
                   "sp", "vpp", "fsdp", "kernels", "tiled_mlp")


def _draft(c: constraints.Constraint) -> Workload:
    """The example with the Workload's defaults, unvalidated (it is invalid on purpose)."""
    return Workload.model_construct(**c.example)


class Reads:
    """Records the fields a predicate reads."""

    def __init__(self, w):
        self.w, self.read = w, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self.w, name)


def test_names_are_unique_and_scopes_known():
    assert len(TABLE) == len(constraints.TABLE)
    assert {c.needs for c in constraints.TABLE} == {"workload", "gpu", "model"}


@pytest.mark.parametrize("name", TABLE)
def test_estimate_refuses_the_example_with_the_message(name):
    c = TABLE[name]
    spec, gpu = memplan.resolve_model(c.model, c.head), memplan.load_gpu(c.gpu)
    w = _draft(c)
    assert constraints.first_violation(w, spec, gpu) is c, "the example should break this entry first"
    with pytest.raises(memplan.UserError) as e:
        memplan.estimate(c.model, c.gpu, head=c.head, **c.example)
    assert str(e.value) == c.text(w, spec, gpu)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", TABLE)
def test_each_predicate_reads_only_the_fields_it_declares(name):
    c = TABLE[name]
    spec, gpu = memplan.resolve_model(c.model, c.head), memplan.load_gpu(c.gpu)
    for w in (_draft(c), Workload()):  # the refused example and a valid default
        seen = Reads(w)
        c.invalid(seen, spec, gpu)
        assert seen.read <= c.reads, f"{name} reads {seen.read - c.reads} without declaring it"


@pytest.mark.parametrize("name", TABLE)
def test_suggest_never_plans_what_the_table_refuses(name):
    """suggest asked for the example's values (as far as its options go) either refuses them by name or
    plans only what every entry allows."""
    c = TABLE[name]
    spec, gpu = memplan.resolve_model(c.model, c.head), memplan.load_gpu(c.gpu)
    options = {k: v for k, v in c.example.items() if k in SUGGEST_OPTIONS}
    if "sp" in options:
        options["sp"] = "on" if options["sp"] else "off"
    try:
        s = memplan.suggest(spec, gpu, seq_len=128, global_batch=16, top=50, **options)
    except memplan.UserError as e:
        assert "\n" not in str(e)
        return
    for p in s.plans + s.pareto + [a.plan for a in s.alternatives]:
        assert constraints.first_violation(p.workload, spec, gpu) is None, p.workload


def test_search_enumerator_tests_each_entry_once_its_fields_are_set():
    spec, gpu = memplan.resolve_model("gpt2"), memplan.load_gpu("a100-80g")
    fixed = dict(task="train", gpus=4, nodes=1)
    got = list(constraints.assignments(fixed, [("tp", [1, 2, 3, 4]), ("pp", [1, 2, 3, 4])], spec, gpu))
    # 3 does not divide 4 GPUs; every tp here divides gpt2's 12 heads
    assert [(a["tp"], a["pp"]) for a in got] == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)]
    # an entry reading a field that is never set is left to the caller (the micro batch rule here)
    assert all("grad_accum" not in a for a in got)


# -- bounds (constraints.BOUNDS): refused past them, and inside int64 at them ---------------------------
@pytest.mark.parametrize("name", constraints.BOUNDS)
def test_each_bound_refuses_past_its_ends_and_non_finite_numbers(name):
    b = constraints.BOUNDS[name]
    assert b.why and b.unit
    assert constraints.bound_problem(name, b.low) is None and constraints.bound_problem(name, b.high) is None
    assert "at least" in constraints.bound_problem(name, b.low - 1)
    assert "over memplan's bound" in constraints.bound_problem(name, b.high + 1)
    assert "finite" in constraints.bound_problem(name, float("nan"))
    if name in Workload.model_fields:
        with pytest.raises(ValueError, match="over memplan's bound"):
            Workload(**{name: b.high + 1})


@pytest.mark.parametrize("fixed, choices, says", [
    ({"gpus": 8, "nodes": 1}, {"tp": [3], "pp": [1, 2, 4, 8]}, "--tp 3 x --pp 1 must divide the 8 GPUs"),
    ({"gpus": 1, "nodes": 1}, {"sp": [True], "tp": [1]}, "--sp (sequence parallel) needs --tp > 1"),
    ({"gpus": 8, "nodes": 1}, {"sp": [True], "tp": [1, 2]}, None),  # some layout has TP: allowed
    ({"gpus": 2, "nodes": 1, "task": "train"}, {"zero": [0, 1], "offload": ["all"]}, "--offload all"),
])
def test_suggest_refuses_a_named_value_no_candidate_could_use(fixed, choices, says):
    spec, gpu = memplan.resolve_model("gpt2"), memplan.load_gpu("a100-80g")
    got = constraints.refusal(fixed, choices, spec, gpu)
    assert got == says if says is None else says in got


@pytest.mark.parametrize("layers, heads", [(126, 128), (256, 256)])
def test_the_largest_step_at_the_bounds_stays_inside_int64(layers, heads):
    """llama-3.1-405b's layers and heads, and the model bounds of inputs/hf.py (CONFIG_DIMS), at the
    sequence and token bounds with eager fp32 attention and no checkpointing: the largest quadratic term."""
    import warnings

    from memplan.estimator.step import estimate

    spec = memplan.resolve_model("llama-3.1-405b").model_copy(update=dict(
        num_layers=layers, num_heads=heads, num_kv_heads=heads // 16, head_dim=128, hidden_size=heads * 128))
    w = Workload(micro_batch=constraints.MAX_TOKENS // constraints.MAX_SEQ_LEN, seq_len=constraints.MAX_SEQ_LEN,
                 precision="fp32", attn="eager", optim="sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy overflow or NaN cast fails the test
        e = estimate(spec, memplan.load_gpu("h100-80g"), w)
    numbers = [e.peak_allocated_bytes, e.peak_reserved_bytes, e.device_used_bytes, *e.breakdown.values(),
               *e.phases.values()]
    assert all(0 <= n < 2**63 for n in numbers)
    assert e.device_used_bytes > 10**17  # the quadratic term is there: not a wrapped-around small number
