"""Workload: what the user wants to run (task, batch, sequence, precision, optimizer, ...), validated."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memplan.estimator.rules import INFER_PRECISIONS, OPTIM_ALIASES, OPTIMIZERS, TRAIN_PRECISIONS

# The optimizers memplan models under ZeRO (DeepSpeed's FusedAdam, DeepSpeedCPUAdam under offload) and FSDP.
ADAM_OPTIMS = ("adamw_torch", "adamw_torch_fused")
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
    # memplan: memplan.kernels' tiled attention (attn_implementation "memplan", docs/kernels.md)
    attn: Literal["eager", "sdpa", "flash", "memplan"] = "sdpa"
    max_new_tokens: int = Field(0, ge=0)
    beams: int = Field(1, ge=1)
    # torch >= 2.0 optimizer.zero_grad() and HF Trainer's model.zero_grad() free the grads
    # (set_to_none=True); torch 1.x filled them with zeros, so they stayed allocated between steps.
    zero_grad: Literal["set-to-none", "zeros"] = "set-to-none"
    headroom: float = Field(0.05, ge=0.0, lt=1.0)  # fraction of GPU memory kept free
    # -- multi-GPU (docs/parallel.md) -----------------------------------------------------------------
    gpus: int = Field(1, ge=1)  # GPUs per node
    nodes: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)  # tensor parallel degree, inside a node
    pp: int = Field(1, ge=1)  # pipeline stages
    vpp: int = Field(1, ge=1)  # virtual stages per GPU: > 1 is the interleaved 1F1B schedule
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
    net_gbs: float | None = Field(None, gt=0)  # inter-node GB/s per GPU (cost model; None: by GPU generation)

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
        allowed = TRAIN_PRECISIONS if self.task == "train" else INFER_PRECISIONS
        if self.precision not in allowed:
            raise ValueError(f"precision {self.precision!r} is not valid for --task {self.task} "
                             f"(choose from {', '.join(allowed)})")
        if self.task == "infer" and self.grad_ckpt != "none":
            raise ValueError("--grad-ckpt applies to training only")
        if self.attn == "flash" and self.precision in ("fp32",):
            raise ValueError("flash attention needs fp16 or bf16 (FlashAttention-2 has no fp32 kernels)")
        world = self.gpus * self.nodes
        if world % (self.tp * self.pp):
            raise ValueError(f"--tp {self.tp} x --pp {self.pp} must divide the {world} GPUs")
        if self.tp > self.gpus:
            raise ValueError(f"--tp {self.tp} must stay inside a node of {self.gpus} GPUs")
        if self.sp and self.tp == 1:
            raise ValueError("--sp (sequence parallel) needs --tp > 1")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("--vpp (interleaved pipeline) needs --pp > 1")
        if self.offload != "none" and self.zero == 0:
            raise ValueError("--offload needs a DeepSpeed ZeRO stage (--zero 1, 2 or 3)")
        if self.offload == "all" and self.zero != 3:
            raise ValueError("--offload all (parameters too) needs --zero 3")
        if self.zero and self.precision not in ("fp32", "fp16", "bf16"):
            raise ValueError("DeepSpeed runs fp32, fp16 or bf16 (its own mixed precision); "
                             f"not {self.precision}")
        if self.zero and self.optim not in ADAM_OPTIMS:
            raise ValueError(f"under ZeRO memplan plans DeepSpeed's Adam (FusedAdam / DeepSpeedCPUAdam): "
                             f"--optim adamw, not {self.optim}")
        if self.pp > 1 and self.zero > 1:
            # deepspeed/runtime/pipe/engine.py asserts it
            raise ValueError("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism (DeepSpeed); use --zero 0 or 1")
        if self.fsdp != "none":
            if self.zero or self.tp > 1 or self.pp > 1:
                raise ValueError("--fsdp is pure data parallelism here: not with --zero, --tp or --pp")
            if self.precision not in ("fp32", "fp16", "bf16"):
                raise ValueError(f"FSDP mixed precision is fp16 or bf16 (or fp32), not {self.precision}")
            if self.task == "infer":
                raise ValueError("--fsdp applies to training")
            if self.optim not in ADAM_OPTIMS:
                raise ValueError(f"memplan models FSDP with AdamW (--optim adamw), not {self.optim}")
        if self.kernels and (self.task == "infer" or self.tp > 1):
            raise ValueError("--kernels (the fused loss) is for training without tensor parallelism")
        if self.tiled_mlp and (self.task == "infer" or self.tp > 1):
            raise ValueError("--tiled-mlp is for training without tensor parallelism")
        if self.zero and self.task == "infer":
            raise ValueError("--zero applies to training")
        if (self.pp > 1 or self.tp > 1) and self.task == "infer":
            raise ValueError("--tp / --pp apply to training (tensor-parallel inference is not modelled yet)")
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
