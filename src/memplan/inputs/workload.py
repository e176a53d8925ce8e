"""Workload: what the user wants to run (task, batch, sequence, precision, optimizer, ...), validated."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memplan.estimator.rules import OPTIM_ALIASES, OPTIMIZERS
from memplan.inputs.constraints import bounded, workload_problem

Finite = Field(allow_inf_nan=False)  # a float setting: NaN and infinities are refused, not compared
# transformers' attn_implementation names -> memplan's
ATTN_ALIASES = {"flash_attention_2": "flash", "flash_attention_3": "flash", "flash-attn": "flash",
                "flash2": "flash", "sdpa": "sdpa", "eager": "eager", "flash": "flash", "memplan": "memplan"}


def canonical_optim(name: str) -> str:
    key = name.strip().lower()
    key = OPTIM_ALIASES.get(key, key)
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r} (choose from adamw, {', '.join(OPTIMIZERS)})")
    return key


class Workload(BaseModel):
    # strict: a string micro batch or a float GPU count is refused, not converted (the API's callers
    # get a UserError naming the field); extra: a misspelled field is refused, not ignored.
    # Bounds: constraints.BOUNDS (each with why no real workload exceeds it).
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    task: Literal["train", "infer"] = "train"
    micro_batch: Annotated[int, bounded("micro_batch")] = 1
    seq_len: Annotated[int, bounded("seq_len")] = 512
    grad_accum: Annotated[int, bounded("grad_accum")] = 1
    precision: str = "fp32"
    optim: str = "adamw_torch_fused"
    momentum: Annotated[float, Finite] = Field(0.0, ge=0.0)  # SGD / RMSprop momentum from the optimizer arguments
    # selective: Megatron-style, recompute only the attention core (Korthikanti et al. 2022)
    grad_ckpt: Literal["none", "selective", "full"] = "none"
    # memplan: memplan.kernels' tiled attention (attn_implementation "memplan", docs/kernels.md)
    attn: Literal["eager", "sdpa", "flash", "memplan"] = "sdpa"
    max_new_tokens: Annotated[int, bounded("max_new_tokens")] = 0
    beams: Annotated[int, bounded("beams")] = 1
    # torch >= 2.0 optimizer.zero_grad() and HF Trainer's model.zero_grad() free the grads
    # (set_to_none=True); torch 1.x filled them with zeros, so they stayed allocated between steps.
    zero_grad: Literal["set-to-none", "zeros"] = "set-to-none"
    headroom: Annotated[float, Finite] = Field(0.05, ge=0.0, lt=1.0)  # fraction of GPU memory kept free
    # -- multi-GPU (docs/parallel.md) -----------------------------------------------------------------
    gpus: Annotated[int, bounded("gpus")] = 1  # GPUs per node
    nodes: Annotated[int, bounded("nodes")] = 1
    tp: Annotated[int, bounded("tp")] = 1  # tensor parallel degree, inside a node
    pp: Annotated[int, bounded("pp")] = 1  # pipeline stages
    vpp: Annotated[int, bounded("vpp")] = 1  # virtual stages per GPU: > 1 is the interleaved 1F1B schedule
    sp: bool = False  # sequence parallel (with tp > 1)
    zero: int = Field(0, ge=0, le=3)  # 0: torch DDP; 1-3: DeepSpeed ZeRO stage
    offload: Literal["none", "optimizer", "all"] = "none"  # DeepSpeed offload to CPU ("all": + parameters)
    # PyTorch FSDP2 through accelerate, instead of DeepSpeed (docs/parallel.md): full-shard ~ ZeRO-3,
    # shard-grad-op ~ ZeRO-2, hybrid-shard = full-shard inside a node, replicated across nodes
    fsdp: Literal["none", "full-shard", "shard-grad-op", "hybrid-shard"] = "none"
    # memplan.kernels' fused linear + cross-entropy (memplan.kernels.apply(model)): no b*s*V logits
    kernels: bool = False
    # memplan.kernels' tiled MLP (apply(model, mlp=True)): each layer's MLP over chunks of tokens, recomputed
    # in backward, so a layer keeps only the MLP's input (docs/kernels.md)
    tiled_mlp: bool = False
    net_gbs: Annotated[float, Finite] | None = Field(None, gt=0)  # inter-node GB/s per GPU (cost model; None: by GPU generation)

    @field_validator("attn", mode="before")
    @classmethod
    def _attn(cls, v: str) -> str:
        key = str(v).strip().lower()
        if key not in ATTN_ALIASES:
            raise ValueError(f"unknown attention {v!r} (eager, sdpa, flash / flash_attention_2, memplan)")
        return ATTN_ALIASES[key]

    @field_validator("optim", mode="before")
    @classmethod
    def _optim(cls, v: str) -> str:
        return canonical_optim(str(v))

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, v: str) -> str:
        return str(v).strip().lower()

    @model_validator(mode="after")
    def _check(self) -> "Workload":
        problem = workload_problem(self)  # the workload-only entries of the constraints table
        if problem:
            raise ValueError(problem)
        return self

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the GPUs that are neither tensor nor pipeline parallel."""
        return self.world // (self.tp * self.pp)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp
