"""Which settings combine: one table of constraints that Workload validation, `estimate`, the search's
enumerator and the tests all read.

Each entry says when a configuration is INVALID (a predicate over the workload, and where it needs them
the model and the GPU), the one line the user sees, the Workload fields the predicate reads (so the
search can test it as soon as those are set, and never builds a candidate it refuses) and an example of a
configuration it refuses (tests parametrize over the table).

Entries that need only the workload are checked when a Workload is built; those that need the model or
the GPU by `check` (estimate) and by the search for every candidate.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import AfterValidator

from memplan.errors import UserError
from memplan.estimator.families import (
    family, full_attention_only, fused_loss_supported, model_types, supported_attn, tiled_mlp_supported,
)
from memplan.estimator.finetune import (
    ALL_LINEAR, default_targets, fused_names, has_module, linear_names, load_dtype, matches, renamed_targets,
    stack_blocks, unadapted_target, unpaired_fused, wrapped_adapter, wrapped_names,
)
from memplan.estimator.rules import INFER_PRECISIONS, OPTIMIZERS, TRAIN_PRECISIONS

if TYPE_CHECKING:
    from memplan.inputs.modelspec import ModelSpec
    from memplan.inputs.profiles import GPUProfile

# The optimizers memplan models under ZeRO (DeepSpeed's FusedAdam, DeepSpeedCPUAdam under offload) and FSDP.
ADAM_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# The precisions DeepSpeed's and FSDP's own mixed precision run (no pure-bf16 mode there).
SHARDED_PRECISIONS = ("fp32", "fp16", "bf16")
# A model_type without an analytic model (the constraints' examples of the traced path): a config path from the
# repository's root, where the tests run
TRACED_EXAMPLE = "benchmarks/accuracy/configs/cohere2-small.json"
# The fields that vary per cell of the search's table (micro batch x accumulation), not per candidate.
BATCH_FIELDS = frozenset({"micro_batch", "grad_accum"})


# -- bounds: how large a setting may be ---------------------------------------------------------------
# Each bound lies beyond every real workload (why: the largest real value we know of), so it refuses
# nothing that runs; and together they keep every byte count of a step below 2**63, so numpy's int64
# arithmetic in the estimator and the search never overflows (measured: llama-3.1-405b's 126 layers x
# 128 heads, eager fp32 attention, 2**21 tokens per sequence x 2 sequences: 6.4e17 bytes; 256 layers x
# 256 heads, the model bounds of inputs/hf.py: 2.6e18 < 9.2e18 = 2**63). The quadratic term is the
# eager attention scores, micro batch x heads x seq**2 per layer: MAX_SEQ_LEN x MAX_TOKENS bounds it.
@dataclass(frozen=True)
class Bound:
    low: float
    high: float
    unit: str
    why: str  # the largest real value: why `high` refuses nothing that runs


MAX_SEQ_LEN = 2**21  # 2,097,152
MAX_TOKENS = 2**22  # per GPU per micro batch: micro batch x beams x (sequence + new tokens)
BOUNDS: dict[str, Bound] = {
    "seq_len": Bound(1, MAX_SEQ_LEN, "tokens per sequence",
                     "twice the longest context of a supported family: Qwen2.5-7B-Instruct-1M, 1,010,000 positions"),
    "max_new_tokens": Bound(0, MAX_SEQ_LEN, "new tokens", "a generated sequence is a sequence"),
    "micro_batch": Bound(1, MAX_TOKENS, "sequences per GPU", "a micro batch holds at most 2**22 tokens"),
    "beams": Bound(1, 1024, "beams", "HF generate's beam search is used with 1-16 beams"),
    "grad_accum": Bound(1, 2**20, "accumulation steps", "the global batch bound"),
    "global_batch": Bound(1, 2**20, "sequences per step",
                          "Llama 3 405B trained with 2,048 x 8,192-token sequences per step (16M tokens)"),
    # a node is one NVLink domain (TP stays inside it): DGX GH200 has 256 GPUs in one, GB200 NVL72 72
    "gpus": Bound(1, 256, "GPUs per node", "DGX GH200: 256 GPUs in one NVLink domain"),
    "nodes": Bound(1, 2**15, "nodes", "the largest clusters have about 200,000 GPUs, 25,000 nodes of 8"),
    "tp": Bound(1, 256, "tensor-parallel ranks", "TP stays inside a node"),
    "pp": Bound(1, 256, "pipeline stages", "a stage holds at least one of at most 256 layers (inputs/hf.py)"),
    "vpp": Bound(1, 256, "virtual stages per GPU", "pp x vpp divides the layers"),
    # LoRA ranks in use run 1-256 (the LoRA paper used 1-64; rsLoRA tried up to 2048)
    "lora_r": Bound(1, 4096, "LoRA rank", "rsLoRA (Kalajdzievski 2023) trained ranks up to 2,048"),
    "trainable_layers": Bound(1, 256, "trainable blocks", "a model has at most 256 layers (inputs/hf.py)"),
    # inter-node bandwidth per GPU, GB/s: 1 Gbit/s Ethernet is 0.125 (1e-300 had priced a step at 1e298 s)
    "net_gbs": Bound(0.1, 1800, "GB/s per GPU", "NVLink 5's 1,800 GB/s per GPU, the fastest link a GPU has"),
    # verify's optimizer steps: the second reaches the steady state the estimate is (the first creates the states);
    # verify.run says so below 2
    "steps": Bound(2, 100, "optimizer steps", "the allocator repeats itself from the second step on"),
    # host RAM per node, bytes: the largest single servers hold 32 TiB (HPE Superdome Flex)
    "cpu_mem": Bound(2**20, 2**50, "bytes of host RAM per node", "the largest servers hold 32 TiB"),
}


def bound_problem(name: str, value: float) -> str | None:
    """Why `value` is outside the bound of setting `name` (NaN and infinities included), else None; the
    caller names the setting."""
    b = BOUNDS[name]
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if value < b.low:
        return f"must be at least {b.low:,}, got {value:,}"
    if value > b.high:
        return f"{value:,} is over memplan's bound of {b.high:,} {b.unit} ({b.why})"
    return None


def bounded(name: str) -> AfterValidator:
    """A pydantic validator (Annotated[int, bounded("seq_len")]) that applies BOUNDS[name]."""
    def check(value):
        problem = None if value is None else bound_problem(name, value)
        if problem:
            raise ValueError(problem)
        return value
    return AfterValidator(check)


def check_bound(name: str, value: float) -> None:
    """UserError where `value` is outside BOUNDS[name] (for a setting no pydantic model holds)."""
    problem = bound_problem(name, value)
    if problem:
        raise UserError(f"--{name.replace('_', '-')}: {problem}")


# A predicate or a message: (workload or any object with its field names, ModelSpec, GPUProfile).
Rule = Callable[[Any, "ModelSpec | None", "GPUProfile | None"], Any]


@dataclass(frozen=True)
class Constraint:
    name: str
    needs: Literal["workload", "gpu", "model"]
    reads: frozenset[str]  # the Workload fields `invalid` reads
    invalid: Rule  # True: the configuration is refused
    message: Rule | str  # the one line the user sees
    example: dict[str, Any] = field(default_factory=dict)  # Workload keyword arguments it refuses
    model: str = "gpt2"  # the model, its head (None: the model's default) and the GPU of the example
    head: str | None = None
    gpu: str = "a100-80g"

    def text(self, w: Any, spec: ModelSpec | None = None, gpu: GPUProfile | None = None) -> str:
        return self.message if isinstance(self.message, str) else self.message(w, spec, gpu)


def _no_attention(attn: str, m: ModelSpec) -> str:
    """Why the model has no such attention: transformers lacks it, or memplan's tiled kernels do not express the
    model's sliding-window or chunked layers (families.supported_attn)."""
    if attn == "memplan" and not full_attention_only(m):
        return (f"memplan's tiled attention does not express {m.model_type}'s sliding-window or chunked layers "
                "(it would fall back to eager attention)")
    return f"transformers has no {attn} attention for {m.model_type}"


def _c(name: str, needs: str, reads: str, invalid: Rule, message: Rule | str, example: dict, **where: str) -> Constraint:
    return Constraint(name, needs, frozenset(reads.split()), invalid, message, example, **where)  # type: ignore[arg-type]


# -- the model facts (attention implementations, kernel support) ----------------------------------------


def precisions_of(task: str) -> tuple[str, ...]:
    """The precisions a task has (training: mixed or pure; inference: weight formats too)."""
    return TRAIN_PRECISIONS if task == "train" else INFER_PRECISIONS


@functools.cache
def changed(w: Any, *knobs: str) -> str | None:
    """The first of these settings whose value differs from the Workload's default (a value the user set), else
    None (the defaults read when first asked: workload.py imports this module)."""
    from memplan.inputs.workload import Workload

    return next((k for k in knobs if getattr(w, k) != Workload.model_fields[k].default), None)


def _cc(gpu: GPUProfile) -> str:
    return ".".join(map(str, gpu.compute_capability))


TABLE: tuple[Constraint, ...] = (
    # -- the workload alone (Workload validation); first violation wins, in this order -------------------
    _c("precision-for-task", "workload", "task precision",
       lambda w, m, g: w.precision not in precisions_of(w.task),
       lambda w, m, g: f"precision {w.precision!r} is not valid for --task {w.task} "
                       f"(choose from {', '.join(precisions_of(w.task))})",
       {"precision": "int8"}),
    _c("checkpointing-trains", "workload", "task grad_ckpt",
       lambda w, m, g: w.task == "infer" and w.grad_ckpt != "none",
       "--grad-ckpt applies to training only", {"task": "infer", "precision": "fp16", "grad_ckpt": "full"}),
    _c("generation-serves", "workload", "task max_new_tokens beams",
       lambda w, m, g: w.task != "infer" and (w.max_new_tokens > 0 or w.beams > 1),
       "--max-new-tokens and --beams apply to serving (--task infer); training runs no generate",
       {"max_new_tokens": 16}),
    _c("static-cache-generates", "workload", "kv_cache task max_new_tokens",
       lambda w, m, g: w.kv_cache == "static" and (w.task != "infer" or w.max_new_tokens == 0),
       "--kv-cache static applies to generation (--task infer with --max-new-tokens)",
       {"task": "infer", "precision": "fp16", "kv_cache": "static"}),
    _c("beams-generate", "workload", "task max_new_tokens beams",
       lambda w, m, g: w.task == "infer" and w.beams > 1 and w.max_new_tokens == 0,
       "--beams applies to generation (--max-new-tokens); a scoring forward has no beams",
       {"task": "infer", "precision": "fp16", "beams": 4}),
    # serving reads none of these: accepted, they were echoed in the workload as if they had been used (serving's
    # grad_accum is its micro batches in sequence, the search's split of the batch)
    _c("training-options-train", "workload", "task zero_grad momentum optim",
       lambda w, m, g: w.task == "infer" and changed(w, "zero_grad", "momentum", "optim") is not None,
       lambda w, m, g: {"zero_grad": "--zero-grad", "momentum": "--optim-args momentum=", "optim": "--optim"}[
           changed(w, "zero_grad", "momentum", "optim")] + " applies to training only",
       {"task": "infer", "precision": "fp16", "optim": "sgd"}),
    # torch's SGD and RMSprop take momentum; the others' constructors have no such argument (TypeError)
    _c("momentum-optimizers", "workload", "task momentum optim",
       lambda w, m, g: w.task == "train" and w.momentum != 0
       and w.optim in OPTIMIZERS and not OPTIMIZERS[w.optim].momentum_arg,
       lambda w, m, g: f"--optim-args momentum= applies to {', '.join(n for n, r in OPTIMIZERS.items() if r.momentum_arg)}"
                       f" (torch.optim.SGD, RMSprop), not {w.optim}",
       {"momentum": 0.9}),
    _c("flash-needs-half", "workload", "attn precision",
       lambda w, m, g: w.attn == "flash" and w.precision == "fp32",
       "flash attention needs fp16 or bf16 (FlashAttention-2 has no fp32 kernels)", {"attn": "flash", "precision": "fp32"}),
    _c("tp-pp-divide-world", "workload", "gpus nodes tp pp",
       lambda w, m, g: (w.gpus * w.nodes) % (w.tp * w.pp) != 0,
       lambda w, m, g: f"--tp {w.tp} x --pp {w.pp} must divide the {w.gpus * w.nodes} GPUs",
       {"gpus": 4, "pp": 3}),
    _c("tp-inside-node", "workload", "tp gpus",
       lambda w, m, g: w.tp > w.gpus,
       lambda w, m, g: f"--tp {w.tp} must stay inside a node of {w.gpus} GPUs", {"gpus": 2, "nodes": 2, "tp": 4}),
    _c("sp-needs-tp", "workload", "sp tp",
       lambda w, m, g: w.sp and w.tp == 1, "--sp (sequence parallel) needs --tp > 1", {"sp": True}),
    # Megatron's sequence parallelism splits the sequence dimension evenly over the TP ranks
    # (core/tensor_parallel/mappings.py _split_along_first_dim asserts dim_size % world_size == 0)
    _c("sp-divides-seq", "workload", "sp tp seq_len",
       lambda w, m, g: w.sp and w.tp > 1 and w.seq_len % w.tp != 0,
       lambda w, m, g: f"--sp splits the sequence over the --tp {w.tp} ranks: --seq-len {w.seq_len:,} does not divide",
       {"sp": True, "tp": 2, "gpus": 2, "seq_len": 127}),
    _c("vpp-needs-pp", "workload", "vpp pp",
       lambda w, m, g: w.vpp > 1 and w.pp == 1, "--vpp (interleaved pipeline) needs --pp > 1", {"vpp": 2}),
    _c("offload-needs-zero", "workload", "offload zero",
       lambda w, m, g: w.offload != "none" and w.zero == 0,
       "--offload needs a DeepSpeed ZeRO stage (--zero 1, 2 or 3)", {"offload": "optimizer"}),
    _c("offload-all-needs-zero3", "workload", "offload zero",
       lambda w, m, g: w.offload == "all" and w.zero != 3,
       "--offload all (parameters too) needs --zero 3", {"offload": "all", "zero": 2}),
    _c("zero-precision", "workload", "zero precision",
       lambda w, m, g: w.zero > 0 and w.precision not in SHARDED_PRECISIONS,
       lambda w, m, g: f"DeepSpeed runs fp32, fp16 or bf16 (its own mixed precision); not {w.precision}",
       {"zero": 1, "precision": "bf16-pure"}),
    _c("zero-adam", "workload", "zero optim",
       lambda w, m, g: w.zero > 0 and w.optim not in ADAM_OPTIMS,
       lambda w, m, g: "under ZeRO memplan plans DeepSpeed's Adam (FusedAdam / DeepSpeedCPUAdam): "
                       f"--optim adamw, not {w.optim}",
       {"zero": 2, "optim": "adafactor"}),
    # deepspeed/runtime/pipe/engine.py asserts it
    _c("pipeline-zero01", "workload", "pp zero",
       lambda w, m, g: w.pp > 1 and w.zero > 1,
       "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism (DeepSpeed); use --zero 0 or 1",
       {"gpus": 2, "pp": 2, "zero": 2, "grad_accum": 2}),
    _c("fsdp-pure-dp", "workload", "fsdp zero tp pp",
       lambda w, m, g: w.fsdp != "none" and (w.zero > 0 or w.tp > 1 or w.pp > 1),
       "--fsdp is pure data parallelism here: not with --zero, --tp or --pp",
       {"gpus": 2, "fsdp": "full-shard", "zero": 1}),
    _c("fsdp-precision", "workload", "fsdp precision",
       lambda w, m, g: w.fsdp != "none" and w.precision not in SHARDED_PRECISIONS,
       lambda w, m, g: f"FSDP mixed precision is fp16 or bf16 (or fp32), not {w.precision}",
       {"gpus": 2, "fsdp": "full-shard", "precision": "bf16-pure"}),
    _c("fsdp-trains", "workload", "fsdp task",
       lambda w, m, g: w.fsdp != "none" and w.task == "infer",
       "--fsdp applies to training", {"gpus": 2, "fsdp": "full-shard", "task": "infer", "precision": "fp16"}),
    _c("fsdp-adam", "workload", "fsdp optim",
       lambda w, m, g: w.fsdp != "none" and w.optim not in ADAM_OPTIMS,
       lambda w, m, g: f"memplan models FSDP with AdamW (--optim adamw), not {w.optim}",
       {"gpus": 2, "fsdp": "shard-grad-op", "optim": "sgd"}),
    _c("kernels-train-no-tp", "workload", "kernels task tp",
       lambda w, m, g: w.kernels and (w.task == "infer" or w.tp > 1),
       "--kernels (the fused loss) is for training without tensor parallelism",
       {"gpus": 2, "tp": 2, "kernels": True}),
    _c("tiled-mlp-train-no-tp", "workload", "tiled_mlp task tp",
       lambda w, m, g: w.tiled_mlp and (w.task == "infer" or w.tp > 1),
       "--tiled-mlp is for training without tensor parallelism", {"gpus": 2, "tp": 2, "tiled_mlp": True}),
    _c("zero-trains", "workload", "zero task",
       lambda w, m, g: w.zero > 0 and w.task == "infer",
       "--zero applies to training", {"zero": 1, "task": "infer", "precision": "fp16"}),
    _c("tp-pp-train", "workload", "tp pp task",
       lambda w, m, g: (w.pp > 1 or w.tp > 1) and w.task == "infer",
       "--tp / --pp apply to training (tensor-parallel inference is not modelled yet)",
       {"gpus": 2, "tp": 2, "task": "infer", "precision": "fp16"}),
    # the interleaved 1F1B schedule runs the micro batches in groups of pp (Narayanan et al. 2021;
    # Megatron-LM asserts num_microbatches % pipeline_model_parallel_size == 0 when interleaving)
    _c("vpp-micro-batches", "workload", "vpp pp grad_accum",
       lambda w, m, g: w.vpp > 1 and w.grad_accum % w.pp != 0,
       lambda w, m, g: f"--vpp {w.vpp} (interleaved pipeline) needs the accumulation steps ({w.grad_accum}) "
                       f"to be a multiple of --pp {w.pp}",
       {"gpus": 2, "pp": 2, "vpp": 2, "grad_accum": 3}),
    # the bound that keeps the eager attention scores (micro batch x heads x seq**2) inside int64 (BOUNDS)
    _c("tokens-per-micro-batch", "workload", "micro_batch beams seq_len max_new_tokens",
       lambda w, m, g: w.micro_batch * w.beams * (w.seq_len + w.max_new_tokens) > MAX_TOKENS,
       lambda w, m, g: f"micro batch {w.micro_batch:,} x {w.beams} beams x {w.seq_len + w.max_new_tokens:,} tokens "
                       f"is over memplan's bound of {MAX_TOKENS:,} tokens per GPU per micro batch (no GPU holds "
                       "the activations of that many)",
       {"micro_batch": 4096, "seq_len": 2048}),
    # -- fine-tuning methods (docs/finetune.md) ----------------------------------------------------------
    _c("method-trains", "workload", "method task",
       lambda w, m, g: w.method != "full" and w.task == "infer",
       "--method applies to training", {"method": "lora", "task": "infer", "precision": "fp16"}),
    _c("lora-options-need-lora", "workload", "method lora_r lora_alpha lora_dropout lora_targets",
       lambda w, m, g: w.method not in ("lora", "qlora") and changed(w, "lora_r", "lora_alpha", "lora_dropout",
                                                                     "lora_targets"),
       "--lora-r, --lora-alpha, --lora-dropout and --lora-targets apply to --method lora or qlora",
       {"lora_r": 16}),
    _c("modules-to-save-need-method", "workload", "method modules_to_save",
       lambda w, m, g: w.method == "full" and w.modules_to_save,
       "--modules-to-save applies to --method lora, qlora or freeze (full fine-tuning trains everything)",
       {"modules_to_save": ("lm_head",)}),
    _c("quant-options-need-qlora", "workload", "method quant double_quant compute_dtype quant_storage",
       lambda w, m, g: w.method != "qlora" and changed(w, "quant", "double_quant", "compute_dtype", "quant_storage"),
       "--quant, --no-double-quant, --compute-dtype and --quant-storage apply to --method qlora",
       {"method": "lora", "quant": "int8"}),
    # LLM.int8 is BitsAndBytesConfig(load_in_8bit=True): the bnb_4bit_* settings are not read (emit writes
    # load_in_8bit alone), so they would change nothing
    _c("four-bit-options-need-4bit", "workload", "method quant double_quant compute_dtype quant_storage",
       lambda w, m, g: w.method == "qlora" and w.quant == "int8" and changed(w, "double_quant", "compute_dtype",
                                                                             "quant_storage"),
       "--no-double-quant, --compute-dtype and --quant-storage apply to 4-bit weights (--quant nf4 or fp4), "
       "not to LLM.int8 (--quant int8)",
       {"method": "qlora", "quant": "int8", "compute_dtype": "fp16"}),
    _c("freeze-needs-layers", "workload", "method trainable_layers",
       lambda w, m, g: (w.method == "freeze") != (w.trainable_layers is not None),
       lambda w, m, g: ("--method freeze needs --trainable-layers K (the last K blocks are trained)"
                        if w.method == "freeze" else "--trainable-layers applies to --method freeze"),
       {"method": "freeze"}),
    # a method runs on one GPU, DDP, ZeRO 1-3 or FSDP2 (docs/finetune.md, multi-GPU)
    _c("method-no-tp-pp", "workload", "method tp pp",
       lambda w, m, g: w.method != "full" and (w.tp > 1 or w.pp > 1),
       lambda w, m, g: f"--method {w.method} is modelled on one GPU, DDP, ZeRO (--zero 1-3) or FSDP; with --tp "
                       "or --pp it is not modelled yet",
       {"method": "lora", "gpus": 2, "tp": 2}),
    # FSDP1 flattens a unit's parameters into one FlatParameter: one dtype per unit, and a gradient for
    # the frozen ones beside trained ones (torch 2.13 distributed/fsdp/fully_sharded_data_parallel.py,
    # use_orig_params); hybrid-shard is FSDP1 here (emit/common.py FSDP_LAYOUT)
    _c("method-no-fsdp1", "workload", "method fsdp",
       lambda w, m, g: w.method != "full" and w.fsdp == "hybrid-shard",
       lambda w, m, g: f"--method {w.method} under --fsdp hybrid-shard (FSDP1: flat parameters of one dtype, "
                       "gradients for frozen parameters in a trained unit) is not modelled; use full-shard or "
                       "shard-grad-op (FSDP2)",
       {"method": "lora", "gpus": 2, "nodes": 2, "fsdp": "hybrid-shard"}),
    # ZeRO-3 and FSDP shard a parameter as a tensor of the model's float dtype: LLM.int8's Int8Params
    # (int8 data, its SCB beside it) has no such form; accelerate 1.15 leaves it to no sharding either
    _c("qlora-int8-unsharded", "workload", "method quant zero fsdp",
       lambda w, m, g: w.method == "qlora" and w.quant == "int8" and (w.zero == 3 or w.fsdp != "none"),
       "--method qlora --quant int8 (LLM.int8) is modelled on one GPU, DDP or ZeRO-1/2, not under ZeRO-3 or FSDP",
       {"method": "qlora", "quant": "int8", "gpus": 2, "zero": 3}),
    # a 4-bit weight is sharded as one tensor of bnb_4bit_quant_storage's dtype, and DeepSpeed and FSDP hold
    # (and gather) the float parameters in the load dtype (finetune.load_dtype: the precision's half type,
    # fp32 under fp32): accelerate 1.15 leaves a non-floating one out of FSDP2 (utils/fsdp_utils.py
    # fsdp2_prepare_model: "Default uint8 quant_storage cannot survive fully_shard's DTensor conversion")
    # and transformers sets FSDP's param_dtype to it
    # (distributed/fsdp.py update_fsdp_plugin_peft); ZeRO-3 flattens it with the half parameters (peft
    # docs, "Use PEFT QLoRA and DeepSpeed with ZeRO3": bnb_4bit_quant_storage=torch.bfloat16)
    _c("qlora-sharded-storage", "workload", "method quant quant_storage precision zero fsdp",
       lambda w, m, g: w.method == "qlora" and w.quant != "int8" and (w.zero == 3 or w.fsdp != "none")
       and w.quant_storage != load_dtype(w),
       lambda w, m, g: f"--method qlora under {'--zero 3' if w.zero == 3 else '--fsdp'} needs --quant-storage "
                       f"{load_dtype(w)} (the 4-bit weights are sharded as tensors of the model's "
                       f"dtype), not {w.quant_storage}",
       {"method": "qlora", "gpus": 2, "zero": 3, "precision": "bf16"}),
    _c("qlora-no-param-offload", "workload", "method offload",
       lambda w, m, g: w.method == "qlora" and w.offload == "all",
       "--method qlora with --offload all (4-bit weights offloaded by ZeRO-3) is not modelled; use --offload optimizer",
       {"method": "qlora", "quant_storage": "bf16", "precision": "bf16", "zero": 3, "offload": "all"}),
    _c("method-no-kernels", "workload", "method kernels tiled_mlp grad_ckpt",
       lambda w, m, g: w.method != "full" and (w.kernels or w.tiled_mlp or w.grad_ckpt == "selective"),
       lambda w, m, g: f"--method {w.method} is modelled with --grad-ckpt none or full and without memplan's "
                       "kernels (--kernels, --tiled-mlp)",
       {"method": "lora", "grad_ckpt": "selective"}),
    # -- the hardware ---------------------------------------------------------------------------------
    _c("bf16-needs-sm80", "gpu", "precision",
       lambda w, m, g: "bf16" in w.precision and not g.bf16,
       lambda w, m, g: f"{g.name} (sm {_cc(g)}) has no bf16 support (needs compute capability >= 8.0); "
                       f"use --precision {w.precision.replace('bf16', 'fp16')}",
       {"precision": "bf16"}, gpu="v100-16g"),
    _c("compute-dtype-bf16-needs-sm80", "gpu", "compute_dtype",
       lambda w, m, g: w.compute_dtype == "bf16" and not g.bf16,
       lambda w, m, g: f"{g.name} (sm {_cc(g)}) has no bf16: --compute-dtype fp16",
       {"method": "qlora", "precision": "fp16", "compute_dtype": "bf16"}, gpu="v100-16g"),
    _c("flash-needs-sm80", "gpu", "attn",
       lambda w, m, g: w.attn == "flash" and not g.flash_attention,
       lambda w, m, g: f"FlashAttention-2 needs compute capability >= 8.0; {g.name} is sm {_cc(g)} "
                       "(use --attn sdpa)",
       {"attn": "flash", "precision": "fp16"}, gpu="v100-16g"),
    # -- the model ------------------------------------------------------------------------------------
    # a ViT reads an image as its patches + CLS, whatever the sequence length says: say so rather than echo it
    _c("vision-seq-len", "model", "seq_len",
       lambda w, m, g: m.arch == "vision" and w.seq_len != m.seq_positions,
       lambda w, m, g: f"{m.name} reads a {m.image_size}x{m.image_size} image as {m.seq_positions} tokens "
                       f"({m.seq_positions - 1} patches + CLS): --seq-len {w.seq_len} does not apply (omit it)",
       {"seq_len": 1000}, model="vit-base"),
    _c("attention-of-model", "model", "attn",
       lambda w, m, g: w.attn not in supported_attn(m),
       lambda w, m, g: f"{_no_attention(w.attn, m)} (choose from {', '.join(supported_attn(m))})",
       {"attn": "sdpa"}, model="gemma-2-2b"),
    _c("memplan-attention-dropout", "model", "attn task",
       lambda w, m, g: w.attn == "memplan" and w.task == "train" and m.attention_dropout > 0,
       lambda w, m, g: f"--attn memplan has no attention dropout and {m.name}'s config has "
                       f"{m.attention_dropout:g}: set the config's attention dropout to 0, or choose another --attn",
       {"attn": "memplan"}),
    # AutoTP / Megatron split the attention heads and the KV heads: both must divide
    _c("tp-divides-heads", "model", "tp",
       lambda w, m, g: w.tp > 1 and (m.num_heads % w.tp != 0 or m.num_kv_heads % w.tp != 0),
       lambda w, m, g: f"--tp {w.tp} must divide {m.name}'s {m.num_heads} attention heads and "
                       f"{m.num_kv_heads} KV heads",
       {"gpus": 8, "tp": 8}),
    _c("pp-within-layers", "model", "pp",
       lambda w, m, g: w.pp > m.total_layers,
       lambda w, m, g: f"--pp {w.pp} exceeds {m.name}'s {m.total_layers} layers",
       {"gpus": 16, "pp": 16, "grad_accum": 16}),
    _c("tiled-mlp-of-model", "model", "tiled_mlp",
       lambda w, m, g: w.tiled_mlp and not tiled_mlp_supported(m),
       lambda w, m, g: f"--tiled-mlp: memplan.kernels.apply tiles the dense MLPs of "
                       f"{', '.join(model_types(lambda f: f.tiled_mlp))}; "
                       f"not {m.model_type}{' (mixture of experts)' if m.is_moe else ''}",
       {"tiled_mlp": True}, model="t5-small"),
    _c("kernels-of-model", "model", "kernels",
       lambda w, m, g: w.kernels and not fused_loss_supported(m),
       lambda w, m, g: f"--kernels: the fused loss patches the causal LMs of "
                       f"{', '.join(model_types(lambda f: f.fused_loss_causal_base))} "
                       f"and the masked LMs of {', '.join(model_types(lambda f: f.fused_loss_mlm_base))}; "
                       f"not {m.model_type} ({m.head})",
       {"kernels": True}, model="t5-small"),
    # the traced path (estimator/traced.py) fits one GPU's full training step of the model as transformers runs it:
    # no tensor-parallel split, no adapters or frozen blocks, no selective recomputation, no generation
    _c("traced-scope", "model", "task tp sp method grad_ckpt",
       lambda w, m, g: bool(m.traced_config) and (w.task != "train" or w.tp > 1 or w.method != "full"
                                                  or w.grad_ckpt == "selective"),
       lambda w, m, g: f"{m.model_type} has traced coefficients (no analytic model), which cover full training "
                       "with --grad-ckpt none or full on each GPU's whole model (data parallel, ZeRO, FSDP, "
                       "pipeline stages); not " + ("--task infer" if w.task != "train" else f"--tp {w.tp}"
                                                   if w.tp > 1 else f"--method {w.method}" if w.method != "full"
                                                   else "--grad-ckpt selective"),
       {"grad_ckpt": "selective"}, model=TRACED_EXAMPLE),
    # memplan.selective recomputes the attention core through transformers' attention interface
    # (AttentionInterface), which a family with its own attention code does not call (families.Family.selective)
    _c("selective-family", "model", "grad_ckpt",
       lambda w, m, g: w.grad_ckpt == "selective" and not m.traced_config and not family(m.model_type).selective,
       lambda w, m, g: f"--grad-ckpt selective recomputes the attention core through transformers' attention "
                       f"interface, which {m.model_type} does not use; the families that do: "
                       f"{', '.join(model_types(lambda f: f.selective))}",
       {"grad_ckpt": "selective"}, model="falcon-7b"),
    _c("generation-needs-lm-head", "model", "max_new_tokens",
       lambda w, m, g: w.max_new_tokens > 0 and m.arch in ("decoder", "encoder-decoder")
       and m.head not in ("causal-lm", "seq2seq-lm"),
       lambda w, m, g: f"--max-new-tokens generates tokens, which needs a language-model head: {m.name} has "
                       f"--head {m.head}",
       {"task": "infer", "precision": "fp16", "max_new_tokens": 8}, head="sequence-classification"),
    _c("generation-needs-decoder", "model", "max_new_tokens",
       lambda w, m, g: w.max_new_tokens > 0 and m.arch in ("encoder", "vision"),
       lambda w, m, g: f"{m.name} is an encoder: --max-new-tokens needs a decoder or encoder-decoder",
       {"task": "infer", "precision": "fp16", "max_new_tokens": 8}, model="bert-base"),
    # a learned position table has max_position rows: transformers indexes past it and fails
    _c("positions-learned", "model", "seq_len max_new_tokens",
       lambda w, m, g: m.position == "learned" and m.arch != "vision" and 0 < m.max_position
       < w.seq_len + w.max_new_tokens,
       lambda w, m, g: f"--seq-len {w.seq_len:,}" + (f" + --max-new-tokens {w.max_new_tokens:,}" if w.max_new_tokens
                                                    else "") + f" exceeds {m.name}'s {m.max_position:,} learned positions",
       {"seq_len": 2048}),
    _c("lora-default-targets", "model", "method lora_targets",
       lambda w, m, g: w.method in ("lora", "qlora") and not w.lora_targets and not default_targets(m),
       lambda w, m, g: f"PEFT applies no default LoRA target modules for {m.model_type}: name them with --lora-targets "
                       f"(module names such as {', '.join(linear_names(m)[:4])}, or all-linear)",
       {"method": "lora"}, model="phi-3-mini"),
    # PEFT takes a MoE family's v4 names (gate_proj, w1, ...) off target_modules by model type, so they name no linear
    # layer, dense ones included, and count only where the fused experts exist (finetune.fused_names)
    _c("lora-targets-exist", "model", "method lora_targets",
       lambda w, m, g: w.method in ("lora", "qlora") and w.lora_targets and w.lora_targets != (ALL_LINEAR,)
       and not any(matches(p.module, tuple(set(w.lora_targets) - set(renamed_targets(m)))) for p in m.params
                   if p.weight_of)
       and not set(w.lora_targets) & set(fused_names(m)),
       lambda w, m, g: f"--lora-targets {','.join(w.lora_targets)} matches no linear layer of {m.name} "
                       f"(its linear modules: {', '.join(n for n in linear_names(m) if n not in renamed_targets(m))}"
                       + (f"; its fused experts: {', '.join(fused_names(m))}" if fused_names(m) else "")
                       + ", or all-linear)",
       {"method": "lora", "lora_targets": ("nonexistent",)}),
    # PEFT 0.21 (tuners/lora/layer.py dispatch_default) puts its own adapters on an nn.Embedding or a convolution
    # and refuses any other module without a linear weight (a norm: model.py _create_new_module, "Target module ...
    # is not supported"); memplan models the linear layers' and fused experts' adapters only, so a target naming such
    # a module is refused, not dropped while the others are adapted
    _c("lora-targets-linear", "model", "method lora_targets",
       lambda w, m, g: w.method in ("lora", "qlora") and unadapted_target(m, w.lora_targets) is not None,
       lambda w, m, g: "--lora-targets {0} names {1}, which has no linear weight: memplan models LoRA on linear "
                       "layers and fused experts (PEFT puts its embedding or convolution LoRA there, or refuses "
                       "the module)".format(*unadapted_target(m, w.lora_targets)),
       {"method": "lora", "lora_targets": ("q_proj", "embed_tokens")}, model="llama-3.2-1b"),
    _c("lora-target-saved", "model", "method lora_targets modules_to_save",
       lambda w, m, g: w.method in ("lora", "qlora") and wrapped_adapter(m, w.lora_targets, w.modules_to_save)
       is not None,
       lambda w, m, g: f"--lora-targets {','.join(w.lora_targets) or 'PEFT default'} adapts "
                       f"{wrapped_adapter(m, w.lora_targets, w.modules_to_save)}, which modules_to_save "
                       f"({', '.join(wrapped_names(m, w.modules_to_save))}) then wraps: PEFT "
                       "refuses a LoRA layer there; name the linear layers without it",
       {"method": "lora", "lora_targets": ("all-linear",)}, model="distilbert-base"),
    # transformers 5 fuses a MoE layer's experts into one module; PEFT adapts them through the v4 names, and two of
    # them (w1 and w3, gate_proj and up_proj) become one tensor, gate_up_proj, which it cannot adapt half of
    _c("lora-fused-pair", "model", "method lora_targets",
       lambda w, m, g: w.method in ("lora", "qlora") and unpaired_fused(m, w.lora_targets) is not None,
       lambda w, m, g: "--lora-targets names {0} without {1}: transformers fuses both into the experts' {2}_proj, "
                       "which PEFT adapts whole; name both".format(*unpaired_fused(m, w.lora_targets)),
       {"method": "lora", "lora_targets": ("w1",)}, model="mixtral-8x7b"),
    _c("modules-to-save-exist", "model", "method modules_to_save",
       lambda w, m, g: any(not has_module(m, n) for n in w.modules_to_save),
       lambda w, m, g: f"--modules-to-save: no module of {m.name} is named "
                       f"{next(n for n in w.modules_to_save if not has_module(m, n))!r}",
       {"method": "lora", "modules_to_save": ("nonexistent",)}),
    _c("trainable-layers-within-model", "model", "trainable_layers",
       lambda w, m, g: w.trainable_layers is not None and w.trainable_layers > stack_blocks(m),
       lambda w, m, g: f"--trainable-layers {w.trainable_layers} exceeds {m.name}'s {stack_blocks(m)} blocks",
       {"method": "freeze", "trainable_layers": 99}),
    # each virtual stage holds layers / (pp * vpp) whole layers (Megatron-LM asserts the division)
    _c("vpp-divides-layers", "model", "pp vpp",
       lambda w, m, g: w.vpp > 1 and m.total_layers % (w.pp * w.vpp) != 0,
       lambda w, m, g: f"--pp {w.pp} x --vpp {w.vpp} must divide {m.name}'s {m.total_layers} layers",
       {"gpus": 8, "pp": 8, "vpp": 2, "grad_accum": 8}),
)

WORKLOAD = tuple(c for c in TABLE if c.needs == "workload")
MODEL_AND_GPU = tuple(c for c in TABLE if c.needs != "workload")


def first_violation(w: Any, spec: ModelSpec | None = None, gpu: GPUProfile | None = None,
                    entries: Sequence[Constraint] = TABLE) -> Constraint | None:
    """The first entry that refuses `w` (anything with the Workload's field names)."""
    for c in entries:  # a plain loop: the search asks this about every candidate
        if c.invalid(w, spec, gpu):
            return c
    return None


def workload_problem(w: Any) -> str | None:
    """The message of the first workload-only entry that refuses `w` (Workload validation)."""
    c = first_violation(w, entries=WORKLOAD)
    return None if c is None else c.text(w)


def check(spec: ModelSpec, gpu: GPUProfile, w: Any) -> None:
    """Refuse what the GPU or the model cannot run, with the reason (the workload alone was checked when
    it was built)."""
    c = first_violation(w, spec, gpu, MODEL_AND_GPU)
    if c is not None:
        raise UserError(c.text(w, spec, gpu))


class Draft:
    """A partial workload: the fields set so far, read as attributes (a predicate that reads a field it
    does not declare fails here with AttributeError instead of passing silently). The fields live in the
    instance's __dict__, so reading one is a plain attribute lookup: the search reads thousands."""

    def __init__(self, fields: Any = (), **more: Any) -> None:
        self.__dict__.update(fields, **more)

    def __setitem__(self, name: str, value: Any) -> None:
        self.__dict__[name] = value

    def __delitem__(self, name: str) -> None:
        del self.__dict__[name]

    def __ior__(self, fields: dict[str, Any]) -> "Draft":
        self.__dict__.update(fields)
        return self

    def update(self, fields: Any) -> None:
        self.__dict__.update(fields)

    def keys(self):
        return self.__dict__.keys()

    def fields(self) -> dict[str, Any]:
        return dict(self.__dict__)


Axis = tuple[str | tuple[str, ...], Sequence[Any]]  # a field (or fields set together) and its values


def assignments(fixed: dict[str, Any], axes: Sequence[Axis], spec: ModelSpec,
                gpu: GPUProfile) -> list[dict[str, Any]]:
    """Every assignment of `axes` (in order) on top of `fixed` that no entry refuses. Each entry is
    tested as soon as every field it reads is set, so a refused prefix is not expanded; entries that
    read a field neither fixed nor in the axes are left to the caller."""
    names = [(a,) if isinstance(a, str) else a for a, _ in axes]
    known = set(fixed)
    todo = list(TABLE)
    stages = []  # stages[i]: the entries whose fields are all set once the first i axes are
    for fields in [()] + names:
        known.update(fields)
        stages.append([c for c in todo if c.reads <= known])
        todo = [c for c in todo if not c.reads <= known]
    draft, out = Draft(fixed), []
    if first_violation(draft, spec, gpu, stages[0]) is None:
        _expand(draft, [(n, v) for n, (_, v) in zip(names, axes)], stages[1:], spec, gpu, out)
    return out


def _expand(draft: Draft, axes: list, stages: list, spec, gpu, out: list) -> None:
    """Depth first over the axes, appending every allowed leaf to `out` (a plain recursion: the search
    expands thousands of nodes per layout, and a generator chain would pass each leaf up every level)."""
    if not axes:
        out.append(draft.fields())
        return
    (names, values), checks = axes[0], stages[0]
    rest, later = axes[1:], stages[1:]
    for v in values:
        if len(names) == 1:
            draft[names[0]] = v
        else:
            draft.update(zip(names, v))
        if not checks or first_violation(draft, spec, gpu, checks) is None:
            _expand(draft, rest, later, spec, gpu, out)
    for n in names:
        del draft[n]


def allowed(fixed: dict[str, Any], name: str, values: Sequence[Any], spec: ModelSpec, gpu: GPUProfile) -> list:
    """The values of one field that no entry reading it (and otherwise only fields in `fixed`) refuses."""
    entries = [c for c in TABLE if name in c.reads and c.reads <= fixed.keys() | {name}]
    return [v for v in values if first_violation(Draft(fixed, **{name: v}), spec, gpu, entries) is None]


def batch_allowed(bases: Sequence[Any], mbs: Sequence[int], per_rank: int, spec: ModelSpec,
                  gpu: GPUProfile) -> list[list[bool]]:
    """For each candidate and micro batch (accumulation per_rank // mb): whether the entries that read
    the micro batch or the accumulation allow it."""
    entries = [c for c in TABLE if c.reads & BATCH_FIELDS]
    reads = sorted(set().union(*(c.reads for c in entries)) - BATCH_FIELDS)
    seen: dict[tuple, list[bool]] = {}
    out = []
    for w in bases:
        values = tuple(getattr(w, f) for f in reads)
        if values not in seen:
            seen[values] = [first_violation(Draft(zip(reads, values), micro_batch=mb, grad_accum=per_rank // mb),
                                            spec, gpu, entries) is None for mb in mbs]
        out.append(seen[values])
    return out


def refusal(fixed: dict[str, Any], choices: dict[str, Sequence[Any]], spec: ModelSpec, gpu: GPUProfile) -> str | None:
    """The message of the first entry that refuses `fixed` whatever values the fields in `choices` take
    (suggest: a value the user named that no candidate could use, refused as estimate refuses it, rather
    than a search where nothing fits). Entries reading a field in neither are left to the search."""
    for c in TABLE:
        free = sorted(c.reads - fixed.keys())
        if any(f not in choices for f in free):
            continue
        first = None
        for combo in itertools.product(*(choices[f] for f in free)):
            d = Draft(fixed, **dict(zip(free, combo)))
            if not c.invalid(d, spec, gpu):
                break
            first = first or d
        else:
            if first is not None:
                return c.text(first, spec, gpu)
    return None
