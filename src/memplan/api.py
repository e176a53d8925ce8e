"""The Python API launchers call: names or objects in, pydantic results out. The CLI is thin over this."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from memplan.estimator import step as estimator
from memplan.estimator.families import supported_attn
from memplan.search import suggestion as search
from memplan.inputs.catalog import resolve_model
from memplan.errors import UserError, validation_line
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile, load_gpu
from memplan.inputs.workload import Workload
from memplan.search.request import SearchRequest
from memplan.search.space import default_seq_len


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
             trust_remote_code: bool = False, **work: Any) -> estimator.MemoryBreakdown:
    """Predict the memory of one configuration.

    >>> memplan.estimate("bert-large", "v100-16g", micro_batch=4, seq_len=512, precision="fp32")
    work: the Workload fields (task, micro_batch, seq_len, grad_accum, precision, optim, grad_ckpt,
    attn, max_new_tokens, beams, momentum, zero_grad, headroom, the parallel layout); seq_len defaults to
    the CLI's default (search.space.default_seq_len: the model maximum, capped; a ViT's patches + CLS).
    """
    _check_keywords(work, Workload.model_fields, "estimate")
    spec = resolve_spec(model, head, trust_remote_code)
    if work.get("attn") is None:  # sdpa, transformers' default, where the model has it
        work["attn"] = "sdpa" if "sdpa" in supported_attn(spec) else "eager"
    if work.get("seq_len") is None:
        task = work.get("task") or "train"
        work["seq_len"] = default_seq_len(spec, task if task in ("train", "infer") else "train")
    return estimator.estimate(spec, resolve_gpu(gpu), workload(**work))


def suggest(model: str | ModelSpec, gpu: str | GPUProfile, *, head: str | None = None,
            trust_remote_code: bool = False, **options: Any) -> search.Suggestion:
    """Ranked plans that fit: the options are the fields of memplan.search.request.SearchRequest."""
    _check_keywords(options, SearchRequest.model_fields.keys() - {"spec", "gpu"}, "suggest")
    return search.suggest(resolve_spec(model, head, trust_remote_code), resolve_gpu(gpu), **options)
