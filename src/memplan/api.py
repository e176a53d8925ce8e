"""The Python API launchers call: names or objects in, pydantic results out. The CLI is thin over this."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from memplan.estimator import step as estimator
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
             trust_remote_code: bool = False, **work: Any) -> estimator.MemoryBreakdown:
    """Predict the memory of one configuration.

    >>> memplan.estimate("bert-large", "v100-16g", micro_batch=4, seq_len=512, precision="fp32")
    work: the Workload fields (task, micro_batch, seq_len, grad_accum, precision, optim, grad_ckpt,
    attn, max_new_tokens, beams, momentum, zero_grad, headroom).
    """
    spec = resolve_spec(model, head, trust_remote_code)
    if work.get("attn") is None:  # sdpa, transformers' default, where the model has it
        work["attn"] = "sdpa" if "sdpa" in supported_attn(spec) else "eager"
    return estimator.estimate(spec, resolve_gpu(gpu), workload(**work))


def suggest(model: str | ModelSpec, gpu: str | GPUProfile, *, head: str | None = None,
            trust_remote_code: bool = False, **options: Any) -> search.Suggestion:
    """Ranked plans that fit: the options are the fields of memplan.search.request.SearchRequest."""
    return search.suggest(resolve_spec(model, head, trust_remote_code), resolve_gpu(gpu), **options)
