"""The Python API launchers call: names or objects in, pydantic results out. The CLI is thin over this."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from memplan.estimator import step as estimator
from memplan.estimator.breakdown import with_host_limit
from memplan.inputs import defaults
from memplan.estimator.families import supported_attn
from memplan.search import suggestion as search
from memplan.inputs.catalog import resolve_model
from memplan.errors import UserError
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile, load_gpu
from memplan.inputs.workload import Workload


def resolve_spec(model: str | ModelSpec, head: str | None = None, trust_remote_code: bool = False) -> ModelSpec:
    """A ModelSpec as given, or resolved from a catalog name / Hugging Face id / config path."""
    return model if isinstance(model, ModelSpec) else resolve_model(model, head=head, trust_remote_code=trust_remote_code)


def resolve_gpu(gpu: str | GPUProfile) -> GPUProfile:
    """A GPUProfile as given, or loaded by name / alias / file."""
    return gpu if isinstance(gpu, GPUProfile) else load_gpu(gpu)


def _validation_message(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def workload(**kwargs: Any) -> Workload:
    """A validated Workload; bad values raise UserError with one line."""
    try:
        return Workload(**{k: v for k, v in kwargs.items() if v is not None})
    except ValidationError as e:
        raise UserError(_validation_message(e)) from None


def estimate(model: str | ModelSpec, gpu: str | GPUProfile, *, head: str | None = None,
             trust_remote_code: bool = False, cpu_mem: int | None = None, **work: Any) -> estimator.MemoryBreakdown:
    """Predict the memory of one configuration.

    >>> memplan.estimate("bert-large", "v100-16g", micro_batch=4, seq_len=512, precision="fp32")
    work: the Workload fields (task, micro_batch, seq_len, grad_accum, precision, optim, grad_ckpt,
    attn, max_new_tokens, beams, momentum, zero_grad, headroom). What is left out gets memplan's
    defaults (memplan.inputs.defaults), said in the result's `defaults`; cpu_mem: host RAM per node in
    bytes (default: the GPU profile's typical host), which what offload pins must fit.
    """
    if cpu_mem is not None and (not isinstance(cpu_mem, int) or isinstance(cpu_mem, bool) or cpu_mem <= 0):
        raise UserError(f"cpu_mem: host RAM per node in bytes, a positive integer; got {cpu_mem!r}")
    spec, prof = resolve_spec(model, head, trust_remote_code), resolve_gpu(gpu)
    if work.get("attn") is None:
        work["attn"] = defaults.attn(supported_attn(spec))
    given = {**work, "cpu_mem": cpu_mem}
    w = workload(**(work | defaults.choose(spec, prof, given).values | {"cpu_mem": None}))  # None: left out
    chosen = defaults.choose(spec, prof, given, gpus=w.gpus)  # the host RAM of a node of w.gpus GPUs
    est = with_host_limit(estimator.estimate(spec, prof, w), chosen.values.get("cpu_mem", cpu_mem))
    return est.model_copy(update={"defaults": chosen.said, "notes": est.notes + defaults.precision_notes(w)})


def suggest(model: str | ModelSpec, gpu: str | GPUProfile, *, head: str | None = None,
            trust_remote_code: bool = False, **options: Any) -> search.Suggestion:
    """Ranked plans that fit: the options are the fields of memplan.search.request.SearchRequest."""
    return search.suggest(resolve_spec(model, head, trust_remote_code), resolve_gpu(gpu), **options)
