"""Workload: what the user wants to run (task, batch, sequence, precision, optimizer, ...), validated."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memplan.estimator.rules import OPTIM_ALIASES, OPTIMIZERS
from memplan.inputs.constraints import bounded, workload_problem

Finite = Field(allow_inf_nan=False)  # a float setting: NaN and infinities are refused, not compared
# transformers' attn_implementation names -> memplan's
ATTN_ALIASES = {"flash_attention_2": "flash", "flash-attn": "flash", "flash2": "flash", "sdpa": "sdpa", "eager": "eager",
                "flash": "flash", "memplan": "memplan"}


def canonical_optim(name: str) -> str:
    key = name.strip().lower()
    key = OPTIM_ALIASES.get(key, key)
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r} (choose from adamw, {', '.join(OPTIMIZERS)})")
    return key


def module_names(v) -> tuple[str, ...]:
    """A comma-separated string or a list of module names, as a tuple (order kept, blanks refused)."""
    items = v.split(",") if isinstance(v, str) else list(v)
    names = tuple(str(x).strip() for x in items)
    if any(not n for n in names):
        raise ValueError(f"empty module name in {v!r}")
    return names


LORA_KNOBS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "modules_to_save")
QUANT_KNOBS = ("quant", "double_quant", "compute_dtype", "quant_storage")
# The method fields each method reads; the others keep their defaults (constraints.py refuses them set).
KNOBS_OF = {"full": (), "lora": LORA_KNOBS, "qlora": LORA_KNOBS + QUANT_KNOBS,
            "freeze": ("modules_to_save", "trainable_layers")}
METHOD_KNOBS = LORA_KNOBS + QUANT_KNOBS + ("trainable_layers",)


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
    # generate's KV cache (transformers 5.23 cache_utils.py): "dynamic" (DynamicCache, the default) grows by
    # torch.cat; "static" (cache_implementation="static", StaticCache) allocates seq_len + max_new_tokens per
    # full-attention layer and the window per sliding one before the first token
    kv_cache: Literal["dynamic", "static"] = "dynamic"
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
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching allocator grows one segment per pool by
    # mapping pages at its end, instead of cudaMalloc'ing a segment per miss (reserved, device used)
    expandable_segments: bool = False
    # inter-node GB/s per GPU (cost model; None: by GPU generation)
    net_gbs: Annotated[float, Finite, bounded("net_gbs")] | None = None
    # -- fine-tuning method (docs/finetune.md) ---------------------------------------------------------
    # full: every parameter trained. lora: the base frozen in its load dtype, PEFT LoRA adapters trained.
    # qlora: the base's linear layers quantised by bitsandbytes (`quant`), LoRA adapters trained.
    # freeze: the model as in full fine-tuning, only the last `trainable_layers` blocks and the head trained.
    method: Literal["full", "lora", "qlora", "freeze"] = "full"
    # peft.LoraConfig's names and defaults (peft 0.21, tuners/lora/config.py): r=8, lora_alpha=8, lora_dropout=0
    lora_r: Annotated[int, bounded("lora_r")] = 8
    lora_alpha: Annotated[float, Finite] = Field(8.0, gt=0)
    lora_dropout: Annotated[float, Finite] = Field(0.0, ge=0.0, lt=1.0)
    # target_modules: module names ("q_proj", "mlp.c_proj") or ("all-linear",); (): PEFT's default for the
    # model type (estimator/finetune.py)
    lora_targets: tuple[str, ...] = ()
    # modules trained in full beside the adapters (PEFT modules_to_save; with freeze: trained as well)
    modules_to_save: tuple[str, ...] = ()
    # transformers.BitsAndBytesConfig: nf4 / fp4 (load_in_4bit, bnb_4bit_quant_type) or int8 (load_in_8bit)
    quant: Literal["nf4", "fp4", "int8"] = "nf4"
    double_quant: bool = True  # bnb_4bit_use_double_quant (the QLoRA recipe; BitsAndBytesConfig's default is off)
    # bnb_4bit_compute_dtype; auto: the precision's half type (fp32 under --precision fp32)
    compute_dtype: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    # bnb_4bit_quant_storage: the dtype the packed 4-bit weights are stored as (the same bytes; FSDP needs
    # it equal to the float parameters' dtype to flatten them together)
    quant_storage: Literal["uint8", "fp16", "bf16", "fp32"] = "uint8"
    trainable_layers: Annotated[int, bounded("trainable_layers")] | None = None  # freeze: the last K blocks

    @field_validator("lora_targets", "modules_to_save", mode="before")
    @classmethod
    def _names(cls, v) -> tuple[str, ...]:
        return module_names(v)

    @field_validator("attn", mode="before")
    @classmethod
    def _attn(cls, v: str) -> str:
        key = str(v).strip().lower()
        if key == "flash_attention_3":  # it had been read as FlashAttention-2 on any GPU, an A100 too
            raise ValueError("flash_attention_3 (FlashAttention-3, Hopper only) is not modelled; flash is "
                             "FlashAttention-2 (flash_attention_2)")
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

    @field_validator("method", mode="before")
    @classmethod
    def _method(cls, v: str) -> str:  # as suggest's --method reads it (search/request.py parse_choice)
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
