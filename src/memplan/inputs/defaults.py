"""Every default memplan chooses for what the user leaves out, in one place, with why; and the defaults
line that says them. estimate, suggest, verify and the Python API all read this module, so the same
question gets the same defaults, and `choose` says the ones it picked out loud (docs/contract.md).

What the line says: the values memplan derives for the fields a command has in common (sequence length,
precision, optimizer, memplan's kernels, host RAM; verify's GPU). Knobs suggest searches (micro batch,
checkpointing, attention, parallelism) are in its `searched` list instead; plain option defaults that
--help prints (micro batch 1, headroom 0.05, ...) are not repeated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.profiles import GPUProfile

GIB = 2**30
TASK = "train"
# transformers 5.23 TrainingArguments.optim: "adamw_torch_fused" with torch >= 2.8 (training_args.py,
# default_optim); what the HF Trainer runs when the script names none
OPTIM = "adamw_torch_fused"
# memplan's fused loss and tiled MLP need memplan.kernels.apply(model) in the training script: off unless
# asked (--kernels / --tiled-mlp), so a plan is what the user's script runs as written; suggest says what
# they would gain (an alternative) when they would help
KERNELS = False
TILED_MLP = False
# suggest: sequences per optimizer step when --batch-size is not given; a common fine-tuning batch
# (e.g. the HF run_clm examples' 8 per device x 4 GPUs), divisible by every power-of-two world up to 32
GLOBAL_BATCH = 32
# the longest sequence taken from the model when --seq-len is not given: the model's maximum, capped
# (a decoder's 128k context would plan a run almost nobody trains; BERT-style encoders train at 512)
SEQ_CAP = {"decoder": 2048, "encoder": 512, "encoder-decoder": 512}
# verify without --gpu and without a GPU in the machine: the profile whose attention kernels (sm80:
# FlashAttention-2 and the efficient kernel) and CUDA context the fake / cpu trace assumes; the A100 80GB
# is the most common training GPU of the bundled profiles' clouds (docs/gpus.md)
VERIFY_GPU = "a100-80g"
# why verify's GPU is the one it is, by device, when --gpu is not given
VERIFY_GPU_WHY = {"cuda": "the GPU in this machine",
                  "other": "the profile the trace assumes: its attention kernels and CUDA context; --gpu to change"}

# what each precision means (--help, docs/contract.md)
PRECISION_HELP = {
    "fp32": "fp32 weights and compute",
    "fp16": "fp16 autocast over fp32 weights, HF Trainer fp16=True",
    "bf16": "bf16 autocast over fp32 weights, HF Trainer bf16=True",
    "bf16-pure": "bf16 weights, gradients and states, model.to(torch.bfloat16)",
    "fp16-pure": "fp16 weights, from_pretrained(dtype=torch.float16); inference",
    "int8": "bitsandbytes LLM.int8 weights; inference",
    "int4": "bitsandbytes NF4 weights; inference",
}
# the half weights at inference: no gradients or states to speak of
SERVING_HALF = {"bf16-pure": "bf16 weights, from_pretrained(dtype=torch.bfloat16)",
                "fp16-pure": "fp16 weights, from_pretrained(dtype=torch.float16)"}


def seq_len(spec: ModelSpec, task: str, new_tokens: int = 0) -> int:
    """A vision model's patches (+ CLS); otherwise the model's maximum, capped (SEQ_CAP), leaving `new_tokens`
    generated tokens room in a learned position table (_room)."""
    if spec.arch == "vision":
        return spec.seq_positions
    cap = SEQ_CAP.get(spec.arch, SEQ_CAP["encoder"])
    seq = min(spec.max_position or cap, cap)
    room = _room(spec, seq, new_tokens)
    return room[0] if room else seq


def precision(gpu: GPUProfile, task: str) -> str:
    """Training: the best mixed precision the GPU runs (bf16 autocast on sm80+, else fp16), what the HF
    Trainer runs with bf16=True / fp16=True. Inference: the half weights from_pretrained(dtype=...)
    loads (bf16-pure / fp16-pure): autocast over fp32 weights would hold 6 bytes per parameter."""
    half = "bf16" if gpu.bf16 else "fp16"
    return f"{half}-pure" if task == "infer" else half


def attn(supported: list[str]) -> str:
    """transformers' own default attn_implementation: sdpa where the model has it, else eager."""
    return "sdpa" if "sdpa" in supported else "eager"


def host_ram(gpu: GPUProfile, gpus: int) -> int | None:
    """Host RAM per node of `gpus` GPUs: this machine's (--gpu auto) or the profile's typical host's;
    None where the profile states none."""
    return None if gpu.host_ram is None else gpu.host_ram.per_node(gpus)


def _host_text(gpu: GPUProfile, gpus: int) -> str:
    h = gpu.host_ram
    if h is None:
        return f"host RAM not checked ({gpu.name}'s profile states no host; give --cpu-mem)"
    if h.per_node_bytes is not None:
        return f"host RAM {h.per_node_bytes / GIB:,.0f} GiB per node ({h.host})"
    return (f"host RAM {h.per_node(gpus) / GIB:,.0f} GiB per node ({h.per_gpu_bytes / GIB:,.0f} GiB per GPU "
            f"x {gpus}, as on {h.host}; --cpu-mem to change)")


class Default(NamedTuple):
    """One default: the field it fills, the tasks it applies to, its value, and how the line says it."""

    field: str
    tasks: tuple[str, ...]
    value: Callable[[ModelSpec, GPUProfile, str, int], Any]
    said: Callable[[Any, ModelSpec, GPUProfile, str, int], str]


def _seq_why(spec: ModelSpec) -> str:
    return ("image patches + CLS" if spec.arch == "vision" else
            f"model maximum, capped at {SEQ_CAP.get(spec.arch, SEQ_CAP['encoder'])}")


TABLE = (
    Default("seq_len", ("train", "infer"), lambda m, g, t, n: seq_len(m, t),
            lambda v, m, g, t, n: f"seq-len {v} ({_seq_why(m)})"),
    Default("precision", ("train", "infer"), lambda m, g, t, n: precision(g, t),
            lambda v, m, g, t, n: f"precision {v} (the best {g.name} runs: "
                                  f"{(SERVING_HALF if t == 'infer' else {}).get(v, PRECISION_HELP[v])})"),
    Default("optim", ("train",), lambda m, g, t, n: OPTIM,
            lambda v, m, g, t, n: f"optimizer {v} (HF Trainer's default)"),
    Default("kernels", ("train",), lambda m, g, t, n: KERNELS,
            lambda v, m, g, t, n: "memplan kernels off (transformers' own modules; --kernels, --tiled-mlp)"),
    Default("tiled_mlp", ("train",), lambda m, g, t, n: TILED_MLP, lambda v, m, g, t, n: ""),
    Default("cpu_mem", ("train",), lambda m, g, t, n: host_ram(g, n), lambda v, m, g, t, n: _host_text(g, n)),
)


class Chosen(NamedTuple):
    values: dict[str, Any]  # the fields the user left out, filled in
    said: list[str]  # the defaults line, item by item


def choose(spec: ModelSpec, gpu: GPUProfile, given: Mapping[str, Any], *, gpus: int = 1) -> Chosen:
    """The defaults for the fields of TABLE that `given` leaves out (absent or None), and their line."""
    task = given.get("task") or TASK
    values: dict[str, Any] = {}
    said = []
    for d in TABLE:
        if task in d.tasks and given.get(d.field) is None:
            values[d.field] = d.value(spec, gpu, task, gpus)
            said.append(d.said(values[d.field], spec, gpu, task, gpus))
            if d.field == "seq_len" and (room := _room(spec, seq_len(spec, task), given.get("max_new_tokens") or 0)):
                values["seq_len"], said[-1] = room
    return Chosen(values, [s for s in said if s])


def _room(spec: ModelSpec, seq: int, new_tokens: int) -> tuple[int, str] | None:
    """The default prompt shortened to leave the generated tokens room in a learned position table (GPT-2's 1,024
    rows: the prompt and the new tokens index it), with its line; None where it has room."""
    if not (new_tokens and spec.position == "learned" and spec.max_position
            and seq + new_tokens > spec.max_position > new_tokens):
        return None
    fit = spec.max_position - new_tokens
    return fit, f"seq-len {fit} ({spec.max_position:,} learned positions less --max-new-tokens {new_tokens:,})"


def verify_gpu(device: str) -> tuple[str, str]:
    """verify without --gpu: (the GPU name load_gpu takes, the defaults line's item)."""
    name = "auto" if device == "cuda" else VERIFY_GPU
    return name, f"gpu {name} ({VERIFY_GPU_WHY['cuda' if device == 'cuda' else 'other']})"


def precision_notes(w: Any) -> list[str]:
    """What an autocast precision means at inference, where the half weights are the common case."""
    if w.task != "infer" or w.precision not in ("fp16", "bf16"):
        return []
    return [f"--precision {w.precision} at inference is autocast over fp32 weights (4 bytes per parameter "
            f"plus the half copies); {w.precision}-pure holds the half weights from_pretrained(dtype=...) loads"]


def line(said: list[str]) -> str:
    """The one defaults line every command prints."""
    return "defaults: " + "; ".join(said)
