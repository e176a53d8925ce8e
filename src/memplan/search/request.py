"""What the user asked `suggest` for, validated once: the model, the GPU and suggest's options."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from memplan.errors import UserError, validation_line
from memplan.inputs.constraints import bounded
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import KNOBS_OF, METHOD_KNOBS, Workload, module_names

OBJECTIVES = ("throughput", "min-gpus", "headroom")
METHODS = ("full", "lora", "qlora", "freeze")
# the request's fields whose CLI option has another name
OPTION_NAMES = {"global_batch": "batch-size"}
Choice = str | int | None  # a value, a comma list, 'any', or None for memplan's default


def parse_choice(value, every: Iterable[str], default: list[str], what: str, canon=lambda x: x,
                 known: Iterable[str] | None = None) -> list[str]:
    """A knob option's values: None: the default; 'any': every value; else a comma list of names, each one
    of `known` (the names that exist; `every` unless given: a name that exists but cannot run here is left
    to the constraints table, which says why)."""
    if value is None:
        return default
    if str(value).strip().lower() == "any":
        return list(every)
    names = list(every if known is None else known)
    out = []
    for item in str(value).split(","):
        try:
            item = canon(item.strip().lower())
        except ValueError as e:  # canonical_optim's "unknown optimizer ..."
            raise UserError(str(e)) from None
        if item not in names:
            raise UserError(f"unknown {what} {item!r} (choose from {', '.join(names)}, or 'any')")
        out.append(item)
    return out


class SearchRequest(BaseModel):
    """suggest's options. The knob options (precision ... fsdp) take one value, a comma list, or 'any'
    (None: memplan's default, said in Suggestion.defaults); `space` parses them against the model and GPU.
    Strict like Workload: a wrong type is refused, not converted; bounds: constraints.BOUNDS."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True, strict=True)

    spec: ModelSpec
    gpu: GPUProfile
    task: Literal["train", "infer"] = "train"
    seq_len: Annotated[int | None, bounded("seq_len")] = None
    global_batch: Annotated[int | None, bounded("global_batch")] = None
    precision: Choice = None
    optim: Choice = None
    grad_ckpt: Choice = None
    attn: Choice = None
    # infer: one greedy generate call per batch (0: one scoring forward), as estimate's; validated by Workload
    max_new_tokens: Annotated[int, bounded("max_new_tokens")] = 0
    beams: Annotated[int, bounded("beams")] = 1
    kv_cache: Literal["dynamic", "static"] = "dynamic"
    momentum: float = 0.0  # momentum, headroom, zero_grad, net_gbs: validated by Workload (common())
    headroom: float = 0.05
    zero_grad: str = "set-to-none"
    top: int = Field(5, ge=1)
    gpus: Annotated[int, bounded("gpus")] = 1
    nodes: Annotated[int, bounded("nodes")] = 1
    zero: Choice = None
    offload: Choice = None
    tp: Choice = None
    pp: Choice = None
    sp: Choice = None
    vpp: Choice = None
    fsdp: Choice = None
    # None: off (defaults.KERNELS / TILED_MLP); tried as an alternative on one GPU where the model has them
    kernels: bool | None = None
    tiled_mlp: bool | None = None
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. None: memplan turns it on for a plan that fits only
    # with it (the emitted launch.sh exports it); True: every plan runs with it; False: none does
    expandable_segments: bool | None = None
    cpu_mem: Annotated[int | None, bounded("cpu_mem")] = None  # host RAM per node, bytes: offload plans must fit it
    net_gbs: float | None = None
    # the fine-tuning method: one, a comma list, or 'any' (full, lora, qlora); None: full fine-tuning, and
    # the plans LoRA and QLoRA would allow are offered as alternatives. Rank, targets and the quantisation
    # are the user's (they change the model): the same for every candidate (docs/finetune.md)
    method: Choice = None
    lora_r: Annotated[int, bounded("lora_r")] = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()
    modules_to_save: tuple[str, ...] = ()
    quant: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "auto"
    quant_storage: str = "uint8"
    trainable_layers: int | None = None
    objective: Literal[OBJECTIVES] = "throughput"  # type: ignore[valid-type]

    @field_validator("lora_targets", "modules_to_save", mode="before")
    @classmethod
    def _names(cls, v) -> tuple[str, ...]:
        return module_names(v)

    @model_validator(mode="after")
    def _consistent(self) -> SearchRequest:
        try:  # the fields every candidate shares, validated once here rather than refused per candidate
            Workload(**self.common())
            methods = self.methods
            for m in dict.fromkeys(methods):  # each method named, with the knobs it reads as the user gave them
                Workload(**self.common(), **self.tuning(m))
            # a knob none of the methods reads would be dropped from every plan: refused as estimate refuses it
            # (the constraints table's entry for the knob, which full fine-tuning never reads)
            unread = sorted(self.model_fields_set & set(METHOD_KNOBS) - {k for m in methods for k in KNOBS_OF[m]})
            if unread:
                Workload(**self.common(), method="full", **{k: getattr(self, k) for k in unread})
        except ValidationError as e:
            raise ValueError(validation_line(e, options=True, renamed=OPTION_NAMES)) from None
        return self

    @classmethod
    def of(cls, spec: ModelSpec, gpu: GPUProfile, **options: Any) -> SearchRequest:
        """The request, or a UserError with one line."""
        try:
            return cls(spec=spec, gpu=gpu, **options)
        except ValidationError as e:
            raise UserError(validation_line(e, options=True, renamed=OPTION_NAMES)) from None

    @property
    def train(self) -> bool:
        return self.task == "train"

    @property
    def methods(self) -> list[str]:
        """The fine-tuning methods searched: --method's names; 'any': full, lora, qlora, and freeze where
        --trainable-layers says how many blocks it trains (inference: full only); None: full fine-tuning.
        A UserError for a name that is no method."""
        every = (["full", "lora", "qlora"] + (["freeze"] if self.trainable_layers is not None else [])
                 if self.train else ["full"])
        return parse_choice(self.method, every, ["full"], "method", known=METHODS)

    def common(self) -> dict[str, Any]:
        """The Workload fields every candidate shares."""
        return dict(task=self.task, momentum=self.momentum, headroom=self.headroom, zero_grad=self.zero_grad,
                    net_gbs=self.net_gbs, expandable_segments=bool(self.expandable_segments),
                    max_new_tokens=self.max_new_tokens, beams=self.beams, kv_cache=self.kv_cache)

    def tuning(self, method: str) -> dict[str, Any]:
        """The Workload's method fields for one method: the user's knobs where the method reads them
        (workload.KNOBS_OF), the Workload's defaults elsewhere."""
        return {"method": method} | {k: getattr(self, k) if k in KNOBS_OF[method] else Workload.model_fields[k].default
                                     for k in METHOD_KNOBS}
