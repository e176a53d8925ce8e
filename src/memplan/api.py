"""The Python API launchers call: names or objects in, pydantic results out. The CLI is thin over this."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from memplan.estimator import finetune
from memplan.estimator import step as estimator
from memplan.estimator.breakdown import with_host_limit
from memplan.estimator.states import half_model
from memplan.inputs import defaults
from memplan.estimator.families import supported_attn
from memplan.search import suggestion as search
from memplan.inputs.catalog import resolve_model
from memplan.errors import UserError, validation_line
from memplan.inputs.constraints import bound_problem
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile, load_gpu
from memplan.inputs.workload import Workload
from memplan.search.plan import Suggestion
from memplan.search.request import SearchRequest


def resolve_spec(model: str | ModelSpec, head: str | None = None, trust_remote_code: bool = False) -> ModelSpec:
    """A ModelSpec as given, or resolved from a catalog name / Hugging Face id / config path."""
    if isinstance(model, ModelSpec):
        return model
    _check_type("model", model, str)
    _check_type("head", head, (str, type(None)))
    _check_type("trust_remote_code", trust_remote_code, bool)
    return resolve_model(model, head=head, trust_remote_code=trust_remote_code)


def resolve_gpu(gpu: str | GPUProfile) -> GPUProfile:
    """A GPUProfile as given, or loaded by name / alias / file."""
    if isinstance(gpu, GPUProfile):
        return gpu
    _check_type("gpu", gpu, str)
    return load_gpu(gpu)


def _check_type(name: str, value: Any, types: type | tuple[type, ...]) -> None:
    if not isinstance(value, types):
        raise UserError(f"{name}: expected {getattr(types, '__name__', 'a string')}, got {type(value).__name__} "
                        f"{value!r:.60}")


def _check_keywords(given: Iterable[str], valid: Iterable[str], call: str) -> None:
    """A misspelled keyword is refused with the closest valid one, never ignored."""
    valid = sorted(valid)
    for k in given:
        if k not in valid:
            close = difflib.get_close_matches(k, valid, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else f" (valid: {', '.join(valid)})"
            raise UserError(f"{call}() got an unknown keyword {k!r}{hint}")


def workload(**kwargs: Any) -> Workload:
    """A validated Workload; bad values (and unknown keywords) raise UserError with one line."""
    _check_keywords(kwargs, Workload.model_fields, "workload")
    try:
        return Workload(**{k: v for k, v in kwargs.items() if v is not None})
    except ValidationError as e:
        raise UserError(validation_line(e)) from None


def estimate(model: str | ModelSpec, gpu: str | GPUProfile, *, head: str | None = None,
             trust_remote_code: bool = False, cpu_mem: int | None = None, simulate: bool = True,
             **work: Any) -> estimator.MemoryBreakdown:
    """Predict the memory of one configuration.

    >>> memplan.estimate("bert-large", "v100-16g", micro_batch=4, seq_len=512, precision="fp32")
    work: the Workload fields (task, micro_batch, seq_len, grad_accum, precision, optim, grad_ckpt,
    attn, max_new_tokens, beams, momentum, zero_grad, headroom, kernels, tiled_mlp, and the layout: gpus,
    nodes, tp, pp, vpp, sp, zero, offload, fsdp, net_gbs). What is left out gets memplan's
    defaults (memplan.inputs.defaults), said in the result's `defaults`; cpu_mem: host RAM per node in
    bytes (default: the GPU profile's typical host), which what offload pins must fit. simulate: reserved and device
    used from the caching-allocator simulation of the step's allocations replayed in order, where it covers the
    configuration (one GPU training a whole replica, or serving; `reserved_from` says which; 0.01-0.35 s, cached;
    benchmarks/results/replay_speed.json); False: the
    segment arithmetic suggest's search ranks with (3-12 ms; docs/estimator.md).
    """
    _check_keywords(work, Workload.model_fields, "estimate")
    _check_type("simulate", simulate, bool)
    if cpu_mem is not None and (not isinstance(cpu_mem, int) or isinstance(cpu_mem, bool)):
        raise UserError(f"cpu_mem: host RAM per node in bytes, a positive integer; got {cpu_mem!r}")
    problem = None if cpu_mem is None else bound_problem("cpu_mem", cpu_mem)  # suggest's bound (SearchRequest)
    if problem:
        raise UserError(f"cpu_mem: {problem}")
    spec, prof = resolve_spec(model, head, trust_remote_code), resolve_gpu(gpu)
    if work.get("attn") is None:
        work["attn"] = defaults.attn(supported_attn(spec))
    given = {**work, "cpu_mem": cpu_mem}
    chosen_work = {k: v for k, v in defaults.choose(spec, prof, given).values.items() if k != "cpu_mem"}
    w = workload(**(work | chosen_work))
    chosen = defaults.choose(spec, prof, given, gpus=w.gpus)  # the host RAM of a node of w.gpus GPUs
    est = with_host_limit(estimator.estimate(spec, prof, w, simulate), chosen.values.get("cpu_mem", cpu_mem))
    said = chosen.said + finetune.assumed(spec, w, set(work), half_model(w))
    return est.model_copy(update={"defaults": said, "notes": est.notes + defaults.precision_notes(w)})


def suggest(model: str | ModelSpec, gpu: str | GPUProfile, *, head: str | None = None,
            trust_remote_code: bool = False, **options: Any) -> Suggestion:
    """Ranked plans that fit: the options are the fields of memplan.search.request.SearchRequest."""
    _check_keywords(options, SearchRequest.model_fields.keys() - {"spec", "gpu"}, "suggest")
    return search.suggest(resolve_spec(model, head, trust_remote_code), resolve_gpu(gpu), **options)
