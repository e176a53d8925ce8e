"""The fuzz drivers shared by tests/test_fuzz.py (about 1,000 cases in the suite) and benchmarks/fuzz.py
(10,000 and more): hypothesis strategies of `memplan estimate` / `suggest` command lines and of API calls,
valid and invalid values of every option, and the contract each call must keep (docs/contract.md):

- the CLI exits 0, 2 or 3; on 2 it prints exactly one line on stderr, never a traceback;
- the API returns, or raises UserError with a one-line message; no other exception type;
- every call ends within CALL_SECONDS;
- every number a successful estimate reports (the three meters, the breakdown, the phases, host RAM) is
  finite and non-negative, and no numpy warning (an int64 overflow, a NaN cast) is raised on the way.

A driver never raises on a broken contract: it returns an Outcome whose `problems` say what broke, so
the benchmark can count them and the test can show them.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import signal
import time
import warnings
from typing import Any, NamedTuple

from hypothesis import strategies as st

import memplan
from memplan.cli.commands import main

CALL_SECONDS = 5.0  # the promise: a refusal within 5 s; a valid call here is a cheap one too
HANG_SECONDS = 30  # a call still running then is stopped and counted as a hang


class Hang(BaseException):
    """Raised in a call that ran past HANG_SECONDS (a BaseException: no `except Exception` in memplan
    swallows it)."""


@contextlib.contextmanager
def watchdog():
    """Stop the call after HANG_SECONDS (SIGALRM: the main thread, where pytest and the benchmark run)."""
    def stop(signum, frame):
        raise Hang(f"still running after {HANG_SECONDS} s")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(HANG_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

MODELS = ["gpt2", "bert-base", "t5-small", "vit-base", "llama-3.2-1b", "qwen2.5-0.5b", "gemma-2-2b", "mixtral-8x7b",
          "llama-3.1-8b", "llama-3.1-405b", "distilbert-base", "opt-350m", "phi-3-mini"]
SMALL_MODELS = ["gpt2", "bert-base", "t5-small", "vit-base", "qwen2.5-0.5b"]  # suggest's cheap searches
GPUS = ["a100", "a100-80g", "h100-80g", "v100-16g", "t4-16g", "rtx4090-24g", "l4-24g", "h200-141g"]
HUGE = [str(2**63), str(2**64 + 1), "99999999999999999999", "1e300", "1e400"]
JUNK = ["", ",", " ", "-", "nan", "inf", "-inf", "NaN", "-1", "0", "-0.1", "1.5", "abc", "x" * 300, "any,", "1,,2",
        "\u00e9\u00e8", "0x10", "1_000", *HUGE]


def _ints(low: int, high: int):
    """Valid integers of an option, as text."""
    return st.integers(low, high).map(str)


def _junk():
    return st.one_of(st.sampled_from(JUNK), st.text(st.characters(blacklist_categories=("Cs",)), max_size=12))


def _value(valid, weight_valid: int = 10):
    """A value of an option: valid weight_valid times in weight_valid + 1, junk otherwise."""
    return st.integers(0, weight_valid).flatmap(lambda i: _junk() if i == 0 else valid)


# option -> strategy of its text value (None: a flag), for `estimate`; suggest adds and changes a few below
ESTIMATE_OPTIONS: dict[str, Any] = {
    "--task": _value(st.sampled_from(["train", "infer"])),
    "--seq-len": _value(st.one_of(_ints(1, 4096), st.sampled_from(["197", "2097152", "2097153", "100000000"]))),
    "--optim": _value(st.sampled_from(["adamw", "adamw_torch", "sgd", "adafactor", "lion_8bit", "adamw_bnb_8bit",
                                       "galore_adamw"])),
    "--optim-args": _value(st.sampled_from(["momentum=0.9", "momentum=0", "momentum=-1", "momentum=nan",
                                            "momentum=abc", "nesterov=True", "momentum=1e300"])),
    "--attn": _value(st.sampled_from(["eager", "sdpa", "flash", "memplan", "flash_attention_2"])),
    "--zero-grad": _value(st.sampled_from(["set-to-none", "zeros"])),
    "--headroom": _value(st.sampled_from(["0", "0.05", "0.5", "0.99", "1", "-0.1", "1.5"])),
    "--kernels": None,
    "--tiled-mlp": None,
    "--json": None,
    "-b": _value(st.one_of(_ints(1, 64), st.sampled_from(["4096", "4194304", "100000000"]))),
    "--grad-accum": _value(st.one_of(_ints(1, 16), st.sampled_from(["1048576", "1048577"]))),
    "--precision": _value(st.sampled_from(["fp32", "fp16", "bf16", "bf16-pure", "fp16-pure", "int8", "int4", "fp8"])),
    "--grad-ckpt": _value(st.sampled_from(["none", "selective", "full"])),
    "--max-new-tokens": _value(st.one_of(_ints(0, 512), st.sampled_from(["2097152"]))),
    "--beams": _value(st.one_of(_ints(1, 8), st.sampled_from(["1024", "1025"]))),
    "--gpus": _value(st.one_of(st.sampled_from(["1", "2", "4", "8", "256", "257"]))),
    "--nodes": _value(st.sampled_from(["1", "2", "4", "32768", "32769"])),
    "--zero": _value(st.sampled_from(["0", "1", "2", "3", "5"])),
    "--fsdp": _value(st.sampled_from(["none", "full-shard", "shard-grad-op", "hybrid-shard"])),
    "--offload": _value(st.sampled_from(["none", "optimizer", "all"])),
    "--tp": _value(st.sampled_from(["1", "2", "3", "4", "8", "16", "-2"])),
    "--pp": _value(st.sampled_from(["1", "2", "3", "4", "-1"])),
    "--sp": _value(st.sampled_from(["on", "off"])),
    "--vpp": _value(st.sampled_from(["1", "2", "3"])),
    "--cpu-mem": _value(st.sampled_from(["64", "512", "0.5", "1048576", "1048577", "0"])),
}
SUGGEST_OPTIONS: dict[str, Any] = {
    **{k: v for k, v in ESTIMATE_OPTIONS.items() if k not in ("-b", "--grad-accum", "--max-new-tokens", "--beams")},
    "--batch-size": _value(st.one_of(_ints(1, 16), st.sampled_from(["1048576", "1048577", "1000000000"]))),
    "--precision": _value(st.sampled_from(["bf16", "fp16", "fp32", "any", "bf16,fp16", "fp8", "bf16,"])),
    "--grad-ckpt": _value(st.sampled_from(["none", "full", "any", "none,full", "sometimes"])),
    "--optim": _value(st.sampled_from(["adamw", "sgd,adamw", "any", "galore_adamw", ","])),
    "--gpus": _value(st.sampled_from(["1", "2", "257"])),  # small spaces: the suite stays fast
    "--nodes": _value(st.sampled_from(["1", "32769"])),
    "--top": _value(st.sampled_from(["1", "3", "0", "-1", "1000"])),
    "--objective": _value(st.sampled_from(["throughput", "min-gpus", "headroom", "fastest"])),
    "--net-gbs": _value(st.sampled_from(["25", "400", "0", "-1", "nan", "inf"])),
    "--zero": _value(st.sampled_from(["0", "1", "2", "3", "any", "1,2", "5"])),
    "--tp": _value(st.sampled_from(["1", "2", "any", "1,2", "3", "16", "-2", "0"])),
    "--pp": _value(st.sampled_from(["1", "2", "any", "3", "-1", "0"])),
    "--vpp": _value(st.sampled_from(["1", "2", "any", "0"])),
}


@st.composite
def command_lines(draw, command: str) -> list[str]:
    """`memplan COMMAND --model M --gpu G [options]`: a few options, each valid or not."""
    options = ESTIMATE_OPTIONS if command == "estimate" else SUGGEST_OPTIONS
    models = MODELS if command == "estimate" else SMALL_MODELS
    args = [command, "--model", draw(_value(st.sampled_from(models), 30)), "--gpu",
            draw(_value(st.sampled_from(GPUS), 30))]
    for name in draw(st.lists(st.sampled_from(sorted(options)), max_size=4 if command == "estimate" else 3,
                              unique=True)):
        value = options[name]
        args += [name] if value is None else [name, draw(value)]
    if command == "suggest" and "--batch-size" not in args:
        args += ["--batch-size", "4"]  # small spaces: the default 32 doubles the micro batches searched
    return args


class Outcome(NamedTuple):
    kind: str  # "cli estimate", "api suggest", ...
    call: str  # the command line or the call, to reproduce it
    result: str  # "exit 0" / "exit 2" / "ok" / "UserError" / another exception's type
    seconds: float
    problems: list[str]  # the contract it broke (empty: kept)


def meter_problems(doc: dict) -> list[str]:
    """Every number of an estimate's JSON that is not finite or is negative (headroom_bytes may be
    negative: it is what is left, and a plan that does not fit has less than nothing)."""
    numbers = [(k, doc[k]) for k in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes",
                                     "capacity_bytes", "usable_bytes", "cpu_ram_per_node_bytes", "params_per_gpu")]
    numbers += [(f"breakdown.{k}", v) for k, v in doc["breakdown"].items()]
    numbers += [(f"phases.{k}", v) for k, v in doc["phases"].items()]
    numbers += [(f"activations_per_layer.{k}", v) for k, v in doc["activations_per_layer"].items()]
    return [f"{k} = {v}" for k, v in numbers if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)]


def _estimates_in(doc: Any) -> list[dict]:
    """The estimate documents in a --json output (an estimate, or a suggestion's plans)."""
    if isinstance(doc, dict) and "peak_allocated_bytes" in doc:
        return [doc]
    if isinstance(doc, dict) and "plans" in doc:
        return [p["estimate"] for p in doc["plans"] + doc.get("pareto", [])]
    return []


def run_cli(args: list[str], kind: str = "cli") -> Outcome:
    """`memplan ARGS` in this process, and the contract it kept or broke."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    problems: list[str] = []
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        try:
            with watchdog():
                main(args)
            code: Any = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except (Exception, Hang) as e:  # the contract is broken: say how, never raise
            code = type(e).__name__
            problems.append(f"raised {type(e).__name__}: {e}")
    seconds = time.perf_counter() - t0
    lines = err.getvalue().strip().splitlines()
    problems += _cli_problems(code, lines, out.getvalue(), "--json" in args)
    problems += [f"warning: {w.category.__name__}: {w.message}" for w in caught
                 if issubclass(w.category, RuntimeWarning)]
    if seconds > CALL_SECONDS:
        problems.append(f"took {seconds:.1f} s")
    return Outcome(kind, "memplan " + " ".join(repr(a) if not a or " " in a else a for a in args),
                   f"exit {code}", seconds, problems)


def _cli_problems(code: Any, err_lines: list[str], out: str, as_json: bool) -> list[str]:
    problems = []
    if code not in (0, 2, 3):
        problems.append(f"exit {code}")
    if "Traceback" in "\n".join(err_lines):
        problems.append("traceback on stderr")
    if code == 2 and (len(err_lines) != 1 or not err_lines[0].startswith("memplan: error: ")):
        problems.append(f"exit 2 with {len(err_lines)} stderr lines: {err_lines[:3]}")
    if code == 0 and as_json:
        try:
            doc = json.loads(out)
        except ValueError:
            return problems + ["--json printed no JSON document"]
        problems += [p for e in _estimates_in(doc) for p in meter_problems(e)]
    return problems


# -- the API: keyword arguments, valid, invalid, misspelled and of the wrong type ----------------------
API_VALUES: dict[str, Any] = {
    "task": st.sampled_from(["train", "infer", "serve", 1]),
    "micro_batch": st.one_of(st.integers(-2, 64), st.sampled_from([2**22, 2**63, "8", 8.0, None, True])),
    "seq_len": st.one_of(st.integers(-1, 4096), st.sampled_from([2**21 + 1, 2**64, "512", 512.5, None])),
    "grad_accum": st.one_of(st.integers(0, 8), st.sampled_from([2**20 + 1, "2"])),
    "precision": st.sampled_from(["fp32", "fp16", "bf16", "bf16-pure", "int4", "fp8", 16, None]),
    "optim": st.sampled_from(["adamw", "sgd", "adafactor", "galore_adamw", "", None, 3]),
    "grad_ckpt": st.sampled_from(["none", "selective", "full", "some", None]),
    "attn": st.sampled_from(["eager", "sdpa", "flash", "memplan", "xformers", None]),
    "headroom": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, 0.05, "0.1"])),
    "momentum": st.one_of(st.floats(-1, 2), st.sampled_from([float("nan"), float("inf"), "0.9"])),
    "gpus": st.one_of(st.integers(-1, 8), st.sampled_from([257, 2**63, 2.0, "2"])),
    "nodes": st.sampled_from([1, 2, 0, 2**15 + 1, 1.5]),
    "tp": st.sampled_from([1, 2, 4, 3, 0, -2, 2**63]),
    "pp": st.sampled_from([1, 2, 3, 0, -1]),
    "zero": st.sampled_from([0, 1, 2, 3, 4, -1, "2"]),
    "max_new_tokens": st.sampled_from([0, 16, 2**21 + 1, -1]),
    "beams": st.sampled_from([1, 2, 0, 1025]),
}
SUGGEST_VALUES: dict[str, Any] = {
    **{k: API_VALUES[k] for k in ("task", "seq_len", "precision", "optim", "grad_ckpt", "attn", "headroom", "momentum")},
    "global_batch": st.sampled_from([1, 2, 4, 0, -4, 2**20 + 1, 2**63, "4", 4.0]),
    "gpus": st.sampled_from([1, 2, 0, 257, 2.0]),
    "tp": st.sampled_from([None, 1, 2, "any", "3", "0", 2.5]),
    "zero": st.sampled_from([None, 0, "1,2", "5", -1]),
    "top": st.sampled_from([1, 3, 0, -1, "3"]),
    "cpu_mem": st.sampled_from([None, 2**36, 0, -1, 2**51, 1.5e10]),
    "net_gbs": st.sampled_from([None, 25.0, 0.0, float("nan"), float("inf")]),
    "objective": st.sampled_from(["throughput", "min-gpus", "fast"]),
}


def _misspelled(name: str):
    """A keyword one edit away from `name` (a letter dropped, doubled or an s added); not one of the
    call's own parameters (estimate(..., gpu=1) is Python's TypeError, before memplan runs)."""
    return st.sampled_from([name + "s", name[:-1], name[0] + name, name.replace("_", "")]).filter(
        lambda k: k not in ("model", "gpu", "head", "trust_remote_code"))


@st.composite
def api_calls(draw, kind: str) -> tuple[str, str, dict[str, Any]]:
    values = API_VALUES if kind == "estimate" else SUGGEST_VALUES
    model = draw(_value(st.sampled_from(MODELS if kind == "estimate" else SMALL_MODELS), 30))
    gpu = draw(_value(st.sampled_from(GPUS), 30).flatmap(lambda g: st.sampled_from([g, g, g, None, 7])))
    kwargs = {k: draw(values[k]) for k in draw(st.lists(st.sampled_from(sorted(values)), max_size=4, unique=True))}
    if draw(st.integers(0, 9)) == 0:  # a misspelled keyword: refused with the closest valid one
        kwargs[draw(st.sampled_from(sorted(values)).flatmap(_misspelled))] = 1
    if kind == "suggest":
        kwargs.setdefault("global_batch", 4)  # small spaces
    return model, gpu, kwargs


def _keywords(kind: str) -> set[str]:
    """The keywords memplan.estimate / memplan.suggest take besides model, gpu, head, trust_remote_code."""
    from memplan.inputs.workload import Workload
    from memplan.search.request import SearchRequest

    return set(Workload.model_fields) if kind == "estimate" else set(SearchRequest.model_fields) - {"spec", "gpu"}


def run_api(kind: str, model: Any, gpu: Any, kwargs: dict[str, Any]) -> Outcome:
    """memplan.estimate / memplan.suggest(model, gpu, **kwargs), and the contract it kept or broke."""
    t0 = time.perf_counter()
    problems: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with watchdog():
                result = getattr(memplan, kind)(model, gpu, **kwargs)
            outcome = "ok"
            if set(kwargs) - _keywords(kind):
                problems.append(f"accepted unknown keywords {sorted(set(kwargs) - _keywords(kind))}")
            docs = [result] if kind == "estimate" else [p.estimate for p in result.plans + result.pareto]
            problems += [p for d in docs for p in meter_problems(d.model_dump())]
        except memplan.UserError as e:
            outcome = "UserError"
            if "\n" in str(e) or not str(e):
                problems.append(f"UserError message is not one line: {str(e)!r:.200}")
        except (Exception, Hang) as e:
            outcome = type(e).__name__
            problems.append(f"raised {type(e).__name__}: {e}")
    seconds = time.perf_counter() - t0
    problems += [f"warning: {w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, RuntimeWarning)]
    if seconds > CALL_SECONDS:
        problems.append(f"took {seconds:.1f} s")
    call = f"memplan.{kind}({model!r}, {gpu!r}{''.join(f', {k}={v!r}' for k, v in kwargs.items())})"
    return Outcome(f"api {kind}", call, outcome, seconds, problems)
