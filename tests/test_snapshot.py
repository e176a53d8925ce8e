"""The numbers of a fixed grid (benchmarks/snapshot.py: 317 estimates and 13 searches over every family,
precision, optimizer, checkpointing, kernels, ZeRO / FSDP / TP / PP / SP, inference and the fine-tuning methods) against the
committed snapshot (benchmarks/results/snapshot.json), which was taken with each configuration computed
first in a fresh process. (snapshot_before.json is the one taken before the core redesign, kept with
snapshot_check.txt as the record that the redesign changed no number; snapshot.json differs from it
only where a later change meant to: see the commits that rewrote it.)

In one process and in any order, every configuration must give its fresh answer: a launcher calls the
API many times, and nothing one call computes may change another's answer."""

import importlib.util
import json
from pathlib import Path

from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("snapshot", ROOT / "benchmarks" / "snapshot.py")
snapshot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(snapshot)
FRESH = json.loads((ROOT / "benchmarks" / "results" / "snapshot.json").read_text())["configurations"]
ESTIMATES = [c for c in snapshot.grid() if c["kind"] == "estimate"]
# the configurations that differ only in the workload fields a cache could leave out
SIBLINGS = [c for c in ESTIMATES if c["model"] == "llama-3.1-8b" and ("fsdp" in c["kw"] or "zero" in c["kw"])]


def test_the_whole_grid_in_one_process_matches_the_fresh_snapshot():
    numbers = snapshot.compute(one_process=True)
    assert snapshot.differences(FRESH, numbers, 0.001) == []


@settings(max_examples=40, deadline=None)
@given(order=st.lists(st.one_of(st.sampled_from(SIBLINGS), st.sampled_from(ESTIMATES)), min_size=2, max_size=10))
def test_any_call_order_gives_each_configuration_its_fresh_answer(order):
    for case in order:
        assert snapshot.run_case(case) == FRESH[snapshot.key(case)], snapshot.key(case)
