"""Fuzzing the promise of docs/contract.md: bad input is refused in one line with exit 2 (UserError from
the API), never a traceback, a hang or an overflowed number. Hypothesis drives the CLI in this process
and the API with valid and invalid values of every option (tests/fuzz_cases.py: the drivers
benchmarks/fuzz.py runs 10,000 times); about 1,000 cases here, mostly cheap estimates."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from fuzz_cases import api_calls, command_lines, run_api, run_cli  # tests/fuzz_cases.py



def fuzz(n: int) -> settings:
    """n cases; the contract's own time bound (fuzz_cases.CALL_SECONDS) replaces hypothesis' deadline."""
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def warm():
    """The first call of a process imports the CLI's renderer (rich): not part of any case's time."""
    run_cli(["estimate", "--model", "gpt2", "--gpu", "a100"])


def _kept(outcome) -> None:
    assert not outcome.problems, f"{outcome.call}\n-> {outcome.result}: {outcome.problems}"


@fuzz(400)
@given(args=command_lines("estimate"))
def test_estimate_command_lines_keep_the_contract(args):
    _kept(run_cli(args))


@fuzz(80)
@given(args=command_lines("suggest"))
def test_suggest_command_lines_keep_the_contract(args):
    _kept(run_cli(args))


@fuzz(300)
@given(call=api_calls("estimate"))
def test_api_estimate_raises_only_user_errors(call):
    _kept(run_api("estimate", *call))


@fuzz(60)
@given(call=api_calls("suggest"))
def test_api_suggest_raises_only_user_errors(call):
    _kept(run_api("suggest", *call))
