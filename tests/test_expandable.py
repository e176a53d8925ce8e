"""PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True end to end: the estimate in both allocator modes, suggest
turning it on for a plan that fits only with it, and the launch files exporting it."""

import subprocess

import pytest

import memplan
from memplan.emit import launch
from memplan.verify.run import alloc_conf, check_allocator_mode

KW = dict(seq_len=2048, precision="bf16", grad_ckpt="none", attn="sdpa", optim="adamw_torch_fused")
GPU = "a100-40g"


@pytest.fixture(scope="module")
def between():
    """A headroom whose usable memory lies between the two modes' device used for llama-3.2-1b at batch 1: 32 MiB
    over what expandable segments need, where the default allocator, even releasing its cached segments when
    it reaches the usable memory (about 0.1 GiB more), runs out."""
    e = memplan.estimate("llama-3.2-1b", GPU, micro_batch=1, **KW)
    default = e.by_allocator["default"]["device_used_bytes"]
    expandable = e.by_allocator["expandable_segments"]["device_used_bytes"]
    assert expandable < default  # one segment per pool: no per-segment rounding of the large tensors
    return e, round(1 - (expandable + (32 << 20)) / e.capacity_bytes, 6)


def test_estimate_reports_both_modes(between):
    e, _ = between
    assert e.peak_reserved_bytes == e.by_allocator["default"]["peak_reserved_bytes"]
    on = memplan.estimate("llama-3.2-1b", GPU, micro_batch=1, expandable_segments=True, **KW)
    assert on.peak_reserved_bytes == e.by_allocator["expandable_segments"]["peak_reserved_bytes"]
    assert on.peak_allocated_bytes == e.peak_allocated_bytes  # the allocator mode changes no tensor
    assert on.peak_reserved_bytes >= on.peak_allocated_bytes
    assert on.reserved_from == "replay"  # whole pages, and the cuBLAS workspace beside them
    assert (on.peak_reserved_bytes - on.breakdown["workspace"]) % (2 * 2**20) == 0


def test_estimate_says_when_expandable_segments_make_it_fit(between):
    _, headroom = between
    e = memplan.estimate("llama-3.2-1b", GPU, micro_batch=1, headroom=headroom, **KW)
    assert not e.fits and "expandable_segments:True" in e.notes[-1]


def test_suggest_turns_it_on_only_where_it_makes_a_plan_fit(tmp_path):
    """The search filters with its segment arithmetic, then confirms each plan it shows by the replay of its
    allocations, which also picks the allocator (search.evaluate.confirm). Llama-3.2-1B bf16 at micro batch 4, 2,048
    tokens, full recompute: the replay reserves 33.9 GiB under the default allocator and 32.2 GiB with expandable
    segments. With the usable memory between the two replays, the default allocator does not fit even when it
    releases its cached segments and retries (the replay held to the usable memory), so the plan runs with
    expandable segments; with them refused, micro batch 4 is no plan."""
    kw = KW | dict(seq_len=2048, grad_ckpt="full")
    e = memplan.estimate("llama-3.2-1b", GPU, micro_batch=4, **kw)
    default, expandable = (e.by_allocator[m]["device_used_bytes"] for m in ("default", "expandable_segments"))
    assert expandable < default
    headroom = round(1 - (default + expandable) / 2 / e.capacity_bytes, 4)
    s = memplan.suggest("llama-3.2-1b", GPU, global_batch=4, headroom=headroom, zero="0", **kw)
    best = s.plans[0]
    assert best.micro_batch == 4 and best.expandable_segments and best.estimate.fits
    assert best.model_dump()["expandable_segments"] is True
    assert best.estimate.device_used_bytes == expandable
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in n for n in s.notes)
    off = memplan.suggest("llama-3.2-1b", GPU, global_batch=4, headroom=headroom, zero="0", expandable_segments=False,
                          **kw)
    assert not any(p.micro_batch == 4 for p in off.plans)
    roomy = memplan.suggest("llama-3.2-1b", GPU, global_batch=4, zero="0", **kw)
    assert roomy.plans and not any(p.expandable_segments for p in roomy.plans)
    # the launch files export it before anything starts CUDA
    spec = memplan.resolve_model("llama-3.2-1b")
    section = launch.launch_section(best, {"train.py"}, spec)
    # both names: torch 2.13 reads PYTORCH_ALLOC_CONF, older releases the alias (and verify accepts the run)
    both = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    assert section["env"] == dict.fromkeys(both, "expandable_segments:True")
    check_allocator_mode(True, alloc_conf(section["env"]))
    script = tmp_path / "launch.sh"
    script.write_text(launch.launch_script(section))
    for name in section["env"]:
        assert f"export {name}=expandable_segments:True\n" in script.read_text()
    subprocess.run(["sh", "-n", str(script)], check=True)  # valid shell
    assert launch.launch_section(roomy.plans[0], {"train.py"}, spec)["env"] == {}


def test_torch_accepts_the_setting():
    """The value launch.sh exports is one PyTorch's allocator config parses (on the CPU build, the parser is
    shared: torch._C._accelerator_setAllocatorSettings)."""
    torch = pytest.importorskip("torch")
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        pytest.skip("this torch has no allocator-settings parser on the CPU")
    setter("expandable_segments:True")
    setter("expandable_segments:False")
    with pytest.raises((RuntimeError, ValueError)):  # the parser checks the value
        setter("expandable_segments:Yes")


def test_serving_search_flags_exactly_the_plans_that_need_expandable_segments():
    """Serving's search (search/evaluate.py _infer, a loop over micro batches) filters with the segment arithmetic,
    then replays the plans it shows (confirm): a plan is marked expandable when, and only when, its replayed
    default-mode device used does not fit, held to the usable memory as the allocator is (it releases its cached
    segments first). With the usable memory between the arithmetic's two modes at micro batch 4 the search alone
    would mark it; the replay decides."""
    kw = dict(task="infer", seq_len=4096)
    e = memplan.estimate("llama-3.2-3b", "t4-16g", micro_batch=4, simulate=False, **kw)
    default = e.by_allocator["default"]["device_used_bytes"]
    expandable = e.by_allocator["expandable_segments"]["device_used_bytes"]
    assert expandable < default
    headroom = round(1 - (default + expandable) / 2 / e.capacity_bytes, 5)
    s = memplan.suggest("llama-3.2-3b", "t4-16g", global_batch=8, headroom=headroom, top=50, **kw)
    assert 4 in {p.micro_batch for p in s.plans} and any(p.expandable_segments for p in s.plans)
    for p in s.plans:
        w = p.workload
        plain = memplan.estimate("llama-3.2-3b", "t4-16g", micro_batch=w.micro_batch, attn=w.attn,
                                 precision=w.precision, headroom=headroom, expandable_segments=False, **kw)
        assert p.estimate.reserved_from == "replay"
        assert p.expandable_segments == (not plain.fits), p.micro_batch