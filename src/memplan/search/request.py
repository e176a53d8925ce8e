"""What the user asked `suggest` for, validated once: the model, the GPU and suggest's options."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from memplan.errors import UserError
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import Workload

OBJECTIVES = ("throughput", "min-gpus", "headroom")
Choice = str | int | None  # a value, a comma list, 'any', or None for memplan's default


class SearchRequest(BaseModel):
    """suggest's options. The knob options (precision ... fsdp) take one value, a comma list, or 'any'
    (None: memplan's default, said in Suggestion.defaults); `space` parses them against the model and GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    spec: ModelSpec
    gpu: GPUProfile
    task: Literal["train", "infer"] = "train"
    seq_len: int | None = None
    global_batch: int | None = None
    precision: Choice = None
    optim: Choice = None
    grad_ckpt: Choice = None
    attn: Choice = None
    momentum: float = 0.0
    headroom: float = 0.05
    zero_grad: str = "set-to-none"
    top: int = 5
    gpus: int = 1
    nodes: int = 1
    zero: Choice = None
    offload: Choice = None
    tp: Choice = None
    pp: Choice = None
    sp: Choice = None
    vpp: Choice = None
    fsdp: Choice = None
    kernels: bool | None = None  # None: searched on one GPU where the model has them
    tiled_mlp: bool | None = None
    cpu_mem: int | None = None  # host RAM per node, bytes: offload plans must fit it
    net_gbs: float | None = None
    objective: str = "throughput"

    @field_validator("top")
    @classmethod
    def _top(cls, v: int) -> int:
        if v < 1:
            raise ValueError("--top must be at least 1")
        return v

    @field_validator("gpus", "nodes")
    @classmethod
    def _world(cls, v: int) -> int:
        if v < 1:
            raise ValueError("--gpus and --nodes must be at least 1")
        return v

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: str) -> str:
        if v not in OBJECTIVES:
            raise ValueError(f"unknown objective {v!r} (choose from {', '.join(OBJECTIVES)})")
        return v

    @field_validator("seq_len", "global_batch")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("--batch-size and --seq-len must be positive")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> SearchRequest:
        spec, seq = self.spec, self.seq_len
        if seq and spec.arch != "vision" and spec.max_position and seq > spec.max_position and spec.position == "learned":
            raise ValueError(f"--seq-len {seq} exceeds {spec.name}'s {spec.max_position} learned positions")
        try:  # the fields every candidate shares, validated once here rather than refused per candidate
            Workload(**self.common())
        except ValidationError as e:
            err = e.errors()[0]
            option = str(err["loc"][0]).replace("_", "-")
            raise ValueError(f"--{option}: {err['msg'].removeprefix('Value error, ')}") from None
        return self

    @classmethod
    def of(cls, spec: ModelSpec, gpu: GPUProfile, **options: Any) -> SearchRequest:
        """The request, or a UserError with one line."""
        try:
            return cls(spec=spec, gpu=gpu, **options)
        except ValidationError as e:
            err = e.errors()[0]
            msg = err["msg"].removeprefix("Value error, ")
            # our own messages name the option; pydantic's say which field they are about
            raise UserError(msg if err["type"] == "value_error" else f"{'.'.join(map(str, err['loc']))}: {msg}") from None

    @property
    def train(self) -> bool:
        return self.task == "train"

    def common(self) -> dict[str, Any]:
        """The Workload fields every candidate shares."""
        return dict(task=self.task, momentum=self.momentum, headroom=self.headroom, zero_grad=self.zero_grad,
                    net_gbs=self.net_gbs)
