"""Workload: what the user wants to run (task, batch, sequence, precision, optimizer, ...), validated."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .rules import INFER_PRECISIONS, OPTIM_ALIASES, OPTIMIZERS, TRAIN_PRECISIONS

# transformers' attn_implementation names -> memplan's
ATTN_ALIASES = {"flash_attention_2": "flash", "flash_attention_3": "flash", "flash-attn": "flash",
                "flash2": "flash", "sdpa": "sdpa", "eager": "eager", "flash": "flash"}


def canonical_optim(name: str) -> str:
    key = name.strip().lower()
    key = OPTIM_ALIASES.get(key, key)
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r} (choose from adamw, {', '.join(OPTIMIZERS)})")
    return key


class Workload(BaseModel):
    model_config = ConfigDict(frozen=True)

    task: Literal["train", "infer"] = "train"
    micro_batch: int = Field(1, ge=1)
    seq_len: int = Field(512, ge=1)
    grad_accum: int = Field(1, ge=1)
    precision: str = "fp32"
    optim: str = "adamw_torch_fused"
    momentum: float = Field(0.0, ge=0.0)  # SGD / RMSprop momentum from the optimizer arguments
    # selective: Megatron-style, recompute only the attention core (Korthikanti et al. 2022)
    grad_ckpt: Literal["none", "selective", "full"] = "none"
    attn: Literal["eager", "sdpa", "flash"] = "sdpa"
    max_new_tokens: int = Field(0, ge=0)
    beams: int = Field(1, ge=1)
    # torch >= 2.0 optimizer.zero_grad() and HF Trainer's model.zero_grad() free the grads
    # (set_to_none=True); torch 1.x filled them with zeros, so they stayed allocated between steps.
    zero_grad: Literal["set-to-none", "zeros"] = "set-to-none"
    headroom: float = Field(0.05, ge=0.0, lt=1.0)  # fraction of GPU memory kept free

    @field_validator("attn", mode="before")
    @classmethod
    def _attn(cls, v: str) -> str:
        key = str(v).strip().lower()
        if key not in ATTN_ALIASES:
            raise ValueError(f"unknown attention {v!r} (eager, sdpa, flash / flash_attention_2)")
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
        allowed = TRAIN_PRECISIONS if self.task == "train" else INFER_PRECISIONS
        if self.precision not in allowed:
            raise ValueError(f"precision {self.precision!r} is not valid for --task {self.task} "
                             f"(choose from {', '.join(allowed)})")
        if self.task == "infer" and self.grad_ckpt != "none":
            raise ValueError("--grad-ckpt applies to training only")
        if self.attn == "flash" and self.precision in ("fp32",):
            raise ValueError("flash attention needs fp16 or bf16 (FlashAttention-2 has no fp32 kernels)")
        return self

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len
