"""Byte rules: one table per kind of state, each row with its source. Pure data, no torch.

docs/byte-rules.md explains every row; the estimator only looks rules up here.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- element widths -------------------------------------------------------------------------------
# Bytes of one element of the dtypes the rules name outside a Precision (torch.finfo(dtype).bits // 8;
# torch.bool is one byte): fp32 up-casts and statistics (softmax / log_softmax outputs, norm mean / rstd,
# log-sum-exp), the master copy and moments of mixed-precision optimizers; autocast's half copies;
# dropout masks (native_dropout saves a bool mask).
FP32 = 4
HALF = 2
MASK = 1

# -- precision ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """How one training/inference precision stores parameters, gradients and activations.

    param/grad: bytes per element of the model's parameters and their .grad.
    act: bytes of a matmul output (linear layers, attention scores) in the forward.
    residual: bytes of the residual stream and norm outputs. Under torch.autocast, layer_norm and
      softmax run in fp32 and a residual add of a half and an fp32 tensor promotes to fp32
      (PyTorch "CUDA Ops that can autocast to float32" and type promotion), so the stream stays fp32.
    autocast: autocast makes half copies of the fp32 weights that it caches for the forward; the
      copies are saved by the matmuls for backward, so they live until each layer's backward. The
      "-halfbase" (LoRA over a half base) and "-qlora" rows are activation widths only
      (states.activation_precision): their param / grad are never read, the method's table stores those.
    half: the half dtype used for compute ("fp16"/"bf16") or None.
    """

    name: str
    param: float
    grad: float
    act: int
    residual: int
    autocast: bool
    half: str | None
    source: str


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", 4, 4, 4, 4, False, None, "torch default dtype float32"),
        Precision("fp16", 4, 4, 2, 4, True, "fp16",
                  "HF Trainer fp16=True: torch.autocast(float16) over an fp32 model + GradScaler"),
        Precision("bf16", 4, 4, 2, 4, True, "bf16", "HF Trainer bf16=True: torch.autocast(bfloat16), fp32 model"),
        Precision("bf16-pure", 2, 2, 2, 2, False, "bf16", "model.to(torch.bfloat16): weights, grads, states in bf16"),
        Precision("fp16-pure", 2, 2, 2, 2, False, "fp16", "model.half(): inference only (fp16 training diverges)"),
        # LoRA over a base loaded in the half type with the Trainer's autocast on (estimator/states.py
        # activation_precision): the residual stream is half, and autocast passes half inputs as they are
        Precision("bf16-halfbase", 2, 2, 2, 2, True, "bf16", "LoRA: torch_dtype=bfloat16 base, Trainer bf16=True"),
        Precision("fp16-halfbase", 2, 2, 2, 2, True, "fp16", "LoRA: torch_dtype=float16 base, Trainer fp16=True"),
        # QLoRA under autocast: bitsandbytes' 4-bit layers cast their output back to the fp32 input's dtype
        # (bitsandbytes nn/modules.py Linear4bit.forward: out.to(inp_dtype)), so the linears' outputs are
        # fp32; attention still runs on autocast's half casts (activations._attention)
        Precision("bf16-qlora", 4, 4, 4, 4, True, "bf16", "QLoRA: fp32 norms and embeddings, Trainer bf16=True"),
        Precision("fp16-qlora", 4, 4, 4, 4, True, "fp16", "QLoRA: fp32 norms and embeddings, Trainer fp16=True"),
    )
}
TRAIN_PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure")


@dataclass(frozen=True)
class WeightFormat:
    """Inference weight storage: the store bitsandbytes gives the linear weights it quantises (the ParamGroup store
    finetune.stored_tensors lays out) and the bytes per element of every other weight."""

    name: str
    store: str  # the quantised linear weights' ParamGroup store ("int8", "4bit"); "": none quantised
    other: float  # bytes/param of every weight not quantised (all of them, or embeddings, norms, lm_head, biases)
    compute: str  # dtype of activations
    source: str

    @property
    def quantised(self) -> bool:
        """bitsandbytes' formats (int8, int4)."""
        return bool(self.store)


# bitsandbytes LLM.int8: the int8 weight and one fp32 scale per output row (SCB), two tensors; NF4
# (BitsAndBytesConfig default, no double quant): the packed 4-bit weight, its 16-entry code and an fp32 absmax per
# block of 64, three tensors (finetune.stored_tensors lays them out, inference.served_tensors reads them).
# transformers keeps lm_head/embeddings/norms unquantised (get_keys_to_not_convert).
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    w.name: w
    for w in (
        WeightFormat("fp32", "", 4, "fp32", "float32 weights"),
        WeightFormat("fp16", "", 4, "fp16", "fp32 weights under autocast: 4 + 2 (cached half copy) = 6 B/param, "
                     "the HF docs' mixed-precision inference rule"),
        WeightFormat("bf16", "", 4, "bf16", "as fp16, with bfloat16 copies"),
        WeightFormat("fp16-pure", "", 2, "fp16", "torch_dtype=float16"),
        WeightFormat("bf16-pure", "", 2, "bf16", "torch_dtype=bfloat16"),
        WeightFormat("int8", "int8", 2, "fp16", "bitsandbytes LLM.int8 (load_in_8bit): the int8 weight and an fp32 "
                     "scale per output row (SCB)"),
        WeightFormat("int4", "4bit", 2, "fp16", "bitsandbytes NF4 (load_in_4bit, no double quantisation): the packed "
                     "weight, its 16-entry fp32 code and an fp32 absmax per block of 64"),
    )
}
INFER_PRECISIONS = tuple(WEIGHT_FORMATS)

# torch's names of memplan's dtype names (torch.<name>): what the emitted files and verify build
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "uint8": "uint8"}

# bitsandbytes 0.50 training formats (functional.py quantize_4bit / quantize_blockwise, nn/modules.py
# Int8Params; estimator/finetune.py stored_tensors): 4-bit blocks of 64 values share one absmax; double
# quantisation stores those absmax in 8 bit with one fp32 absmax per 256 of them; get_4bit_type's code is
# 16 fp32 values per weight, and double quantisation keeps a 256-entry one per weight too; LLM.int8 keeps one fp32 scale per output row (SCB).
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
NF4_CODE_BYTES = 16 * 4
# the 256-entry fp32 dynamic map of the nested state (functional.create_dynamic_map), copied per weight by
# quantize_blockwise (code.to(A.device, copy=True))
DYNAMIC_CODE_BYTES = 256 * 4
INT8_SCALE_BYTES = 4

# -- optimizers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimRule:
    """Optimizer state per parameter.

    states: number of full-size state tensors per parameter, stored in the parameter's dtype (torch
      creates them with zeros_like(param)); for 8-bit optimizers, the count of 1-byte states.
    quantized: 8-bit states (bitsandbytes, blockwise 256 with one fp32 absmax per block) for tensors
      with >= min_8bit_size elements; smaller tensors keep 32-bit states.
    factored: Adafactor's second moment is rows + cols per matrix (full for vectors).
    foreach_temp: full-size temporaries during step() (torch's _multi_tensor_adam: exp_avg_sq.sqrt()
      for the whole group at once), in units of the parameter bytes.
    per_tensor_temp: fp32 temporaries of one tensor during step() (per-parameter loops), the largest tensor's.
    half_param_temp: more fp32 copies a half (fp16 / bf16) parameter adds to them: its gradient's and its own.
    """

    name: str
    states: int
    quantized: bool = False
    factored: bool = False
    foreach_temp: float = 0.0
    per_tensor_temp: float = 0.0
    half_param_temp: float = 0.0
    paged: bool = False
    momentum_arg: bool = False  # one extra state when optim args set momentum > 0 (SGD, RMSprop)
    source: str = ""

    def state_count(self, momentum: bool) -> int:
        """State tensors per parameter: `states`, and the momentum buffer when optim args ask for one."""
        return self.states + (1 if self.momentum_arg and momentum else 0)


BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes Optimizer8bit(min_8bit_size=4096)
BNB_BLOCK = 256  # bitsandbytes blockwise 8-bit optimizer states: one fp32 absmax per 256 values

OPTIMIZERS: dict[str, OptimRule] = {
    o.name: o
    for o in (
        OptimRule("adamw_torch", 2, foreach_temp=1.0,
                  source="torch.optim.AdamW, foreach=True on CUDA: exp_avg + exp_avg_sq; _foreach_sqrt temp"),
        OptimRule("adamw_torch_fused", 2, source="torch.optim.AdamW(fused=True): one kernel, no temporaries"),
        OptimRule("adamw_bnb_8bit", 2, quantized=True, source="bitsandbytes AdamW8bit, blockwise"),
        OptimRule("adamw_8bit", 2, quantized=True, source="alias of adamw_bnb_8bit in transformers"),
        OptimRule("paged_adamw_8bit", 2, quantized=True, paged=True, source="bitsandbytes PagedAdamW8bit"),
        OptimRule("paged_adamw_32bit", 2, paged=True, source="bitsandbytes PagedAdamW32bit"),
        # transformers 5.24 optimization.py Adafactor.step, per parameter: (grad**2) + eps (the square and the
        # sum live together), then _approx_sq_grad's row x col product beside the old update: two full-size fp32
        # tensors at once; a half parameter also has grad.float() and p.float() alive through its step. Traced
        # (gpt2 b1 s128, the 50257 x 768 embedding): the step's temporaries peak at 2.0 x its fp32 size with fp32
        # parameters, 4.0 x in bf16-pure (the rule was 3.0 for both: +11.8 % and -13.9 % on peak allocated)
        OptimRule("adafactor", 1, factored=True, per_tensor_temp=2.0, half_param_temp=2.0,
                  source="transformers.optimization.Adafactor, beta1=None: exp_avg_sq_row + _col; "
                         "update = grad**2 + eps and the row x col approximation are full-size"),
        OptimRule("sgd", 0, momentum_arg=True, source="torch.optim.SGD: momentum_buffer only if momentum > 0"),
        OptimRule("adagrad", 1, source="torch.optim.Adagrad: state_sum"),
        OptimRule("rmsprop", 1, momentum_arg=True, source="torch.optim.RMSprop: square_avg (+ momentum_buffer)"),
        OptimRule("lion_32bit", 1, source="bitsandbytes Lion: exp_avg only"),
        OptimRule("lion_8bit", 1, quantized=True, source="bitsandbytes Lion8bit"),
        OptimRule("paged_lion_32bit", 1, paged=True, source="bitsandbytes PagedLion"),
        OptimRule("paged_lion_8bit", 1, quantized=True, paged=True, source="bitsandbytes PagedLion8bit"),
    )
}
# bitsandbytes' paged optimizers put a parameter's states in CUDA managed memory (functional.get_paged:
# cudaMallocManaged, outside torch's caching allocator) only from 1e5 elements on; smaller ones get
# torch.zeros_like (bitsandbytes 0.50 optim/optimizer.py, Optimizer8bit.get_state_buffer).
PAGED_MIN_NUMEL = 100_000
# The Trainer default with torch >= 2.8 is adamw_torch_fused (transformers 5.23,
# transformers/training_args.py: default_optim).
OPTIM_ALIASES = {"adamw": "adamw_torch_fused", "adam": "adamw_torch_fused", "adamw_fused": "adamw_torch_fused"}


def optimizer_state_bytes(rule: OptimRule, shape: tuple[int, ...], param_bytes: float, momentum: bool) -> float:
    """Bytes of optimizer state for one parameter tensor of `shape`."""
    numel = 1
    for d in shape:
        numel *= d
    states = rule.state_count(momentum)
    if rule.factored:
        if len(shape) >= 2:
            rows = numel // shape[-1]
            cols = numel // shape[-2]
            return (rows + cols) * param_bytes
        return numel * param_bytes
    if rule.quantized and numel >= BNB_MIN_8BIT_SIZE:
        # 1 byte per value per state + one fp32 absmax per block of 256, per state.
        blocks = -(-numel // BNB_BLOCK)
        return states * (numel + FP32 * blocks)
    if rule.quantized:
        return states * numel * FP32  # bitsandbytes keeps small tensors in 32 bit
    return states * numel * param_bytes


# -- activation functions -------------------------------------------------------------------------
# The full-size tensors (units of the MLP intermediate) an activation function saves for backward,
# beyond its own output (which the next linear saves), by width: "act" is the compute dtype; "up" is
# fp32 under autocast (an op on CUDA autocast's fp32 list, or a result promoted by one; the lists are in
# ATen/autocast_mode.h) and the compute dtype otherwise.
# - gelu / silu / relu (ATen) save one tensor, their input or result.
# - transformers' NewGELUActivation ("gelu_new", GPT-2): 0.5*x*(1+tanh(c*(x+0.044715*pow(x,3)))):
#   pow saves x (pow is on the fp32 list, so an fp32 copy), tanh its output and the final multiply
#   both factors, 0.5*x and (1+tanh); everything after pow is promoted to fp32 (traced, GPT-2 bf16).
# - FastGELUActivation ("gelu_fast"): 0.5*x*(1+tanh(x*c*(1+0.044715*x*x))): x and 0.044715*x (x*x),
#   x*c and the bracket, tanh's output, 0.5*x and (1+tanh).
# - GELUActivation(use_gelu_python) ("gelu_python"): x*0.5*(1+erf(x/sqrt 2)): erf's input, x*0.5, (1+erf).
# - QuickGELUActivation: x*sigmoid(1.702x): sigmoid's output and x.
ACTIVATION_SAVES: dict[str, tuple[str, ...]] = {
    "gelu": ("act",), "gelu_pytorch_tanh": ("act",), "relu": ("act",), "silu": ("act",), "swish": ("act",),
    "gelu_new": ("up", "act", "up", "up"), "gelu_fast": ("act",) * 7, "gelu_python": ("act",) * 3,
    "quick_gelu": ("act",) * 2,
}


def activation_saved_bytes(activation: str, act_bytes: int, autocast: bool) -> list[int]:
    """Bytes per element of each tensor the activation function saves (see ACTIVATION_SAVES)."""
    up = FP32 if autocast else act_bytes
    return [up if w == "up" else act_bytes for w in ACTIVATION_SAVES.get(activation, ("act",))]


# -- CUDA caching allocator -----------------------------------------------------------------------
# c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize 512 (every block rounded up to 512 B),
# kSmallSize 1 MiB (requests <= 1 MiB come from the small pool), kSmallBuffer 2 MiB (small-pool
# segments), kMinLargeAlloc 10 MiB (1-10 MiB requests get a 20 MiB segment, kLargeBuffer),
# kRoundLarge 2 MiB (larger requests are rounded to 2 MiB).
ALLOC_MIN_BLOCK = 512
ALLOC_SMALL_SIZE = 1 << 20
ALLOC_SMALL_BUFFER = 2 << 20
ALLOC_LARGE_BUFFER = 20 << 20
ALLOC_MIN_LARGE_ALLOC = 10 << 20
ALLOC_ROUND_LARGE = 2 << 20


# -- memplan.kernels.linear_cross_entropy (kernels/cross_entropy.py, docs/kernels.md) -------------------
# fp32 bytes of one block of logits: the forward's token chunk, the backward's vocabulary x token blocks
FUSED_LOSS_CHUNK_BYTES = 64 << 20


def tiled_mlp_chunk(hidden: int) -> int:
    """Tokens per chunk of memplan.kernels' tiled MLP: `hidden` tokens, the rule of Arctic Long Sequence
    Training (Bekman et al. 2025: ceil(seqlen / hidden) shards), so a chunk's intermediate tensor is the
    size of one hidden x intermediate weight matrix at any sequence length. The kernel (kernels/mlp.py)
    and the activation model both size their chunks here."""
    return max(1, hidden)


def fused_loss_blocks(tokens: int, hidden: int, vocab: int, chunk_bytes: int = FUSED_LOSS_CHUNK_BYTES,
                      chunk: int | None = None) -> tuple[int, int, int]:
    """(forward token chunk, backward vocabulary block, backward token chunk) of the fused loss: the
    kernel (kernels/cross_entropy.py) and the activation model both size their blocks here."""
    chunk = chunk or fused_loss_chunk(vocab, chunk_bytes)
    vblock = max(1, chunk_bytes // (FP32 * hidden))
    tblock = max(chunk, chunk_bytes // (FP32 * min(vblock, vocab)))
    return max(1, min(chunk, tokens)), min(vblock, vocab), max(1, min(tblock, tokens))


def fused_loss_chunk(vocab: int, chunk_bytes: int = FUSED_LOSS_CHUNK_BYTES) -> int:
    """Tokens per forward chunk of the fused loss: chunk_bytes of fp32 logits."""
    return max(1, chunk_bytes // (FP32 * vocab))
