"""`memplan verify`: build the planned model from its config (random weights, nothing downloaded), run
the planned training step on synthetic batches, and hold the estimate against what was measured.

Devices:
- fake: the full-size model as FakeTensors (no memory; runs anywhere) under CUDA semantics
  (cudasim.CudaSemantics), every storage counted by tracer.LiveTracker; reserved memory from the
  allocator simulation. Two optimizer steps, so the lazily created optimizer state is seen.
- cpu: the same on real CPU tensors (a real run, for models that fit in RAM).
- cuda: a real run on the GPU: torch.cuda.max_memory_allocated / max_memory_reserved and NVML.

The step is HF Trainer's: forward with the loss inside the model (autocast for fp16 / bf16), backward,
gradient clipping to 1.0 (Trainer's max_grad_norm), optimizer step, zero_grad(set_to_none).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Any, Callable

from pydantic import BaseModel

from memplan.errors import UserError
from memplan.estimator.breakdown import MemoryBreakdown, allocator_mode
from memplan.estimator.rules import PRECISIONS
from memplan.inputs.constraints import BOUNDS, bound_problem
from memplan.inputs.hf import quiet
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.workload import Workload
from memplan.verify.infer import run_cuda_infer, run_traced_infer

OOM_EXIT = 3  # `memplan verify` exit code when the real run ran out of GPU memory (docs/verify.md)
TOLERANCE = {"ok": 5.0, "close": 10.0}  # |error| % -> verdict; above: "off"
# The tracer's categories that the estimate folds into another (the batch is counted with activations).
TRACE_CATEGORIES = {"inputs": "activations"}


class PlanOOM(UserError):
    exit_code = OOM_EXIT


class MeterCheck(BaseModel):
    meter: str
    predicted_bytes: int
    measured_bytes: int
    error_pct: float  # (predicted - measured) / measured
    verdict: str
    how: str  # measured / traced / modelled


class VerifyReport(BaseModel):
    device: str
    device_note: str
    model: str
    gpu: str
    workload: Workload
    steps: int
    defaults: list[str] = []  # the defaults memplan chose (the line estimate and suggest print too)
    meters: list[MeterCheck]
    breakdown: dict[str, dict[str, int]]  # category -> {"predicted": .., "measured": ..}
    peak_phase: str
    peak_op: str
    phases: dict[str, int]
    sdpa_kernels: dict[str, int]
    step_time_s: float | None  # training: the median step after the first; serving: the generate call
    tokens_per_s: float | None
    forward_times_s: list[float] = []  # serving: each forward's wall time, the prefill first
    run_seconds: float
    verdict: str  # of peak allocated, the meter every device measures directly
    estimate: MemoryBreakdown
    notes: list[str]


def verdict(err_pct: float) -> str:
    a = abs(err_pct)
    return "ok" if a <= TOLERANCE["ok"] else "close" if a <= TOLERANCE["close"] else "off"


def check(meter: str, predicted: int, measured: int, how: str) -> MeterCheck:
    err = 100.0 * (predicted - measured) / measured if measured else 0.0
    return MeterCheck(meter=meter, predicted_bytes=predicted, measured_bytes=measured, error_pct=round(err, 2),
                      verdict=verdict(err), how=how)


# -- the model and its batches -------------------------------------------------------------------------
def make_batch(model, head: str, b: int, s: int, dtype, device: str) -> dict[str, Any]:
    import torch

    cfg = model.config
    vocab = getattr(cfg, "vocab_size", 2) or 2
    ids = lambda shape: torch.randint(0, vocab, shape, device=device)  # noqa: E731
    labels = lambda n, shape: torch.randint(0, n, shape, device=device)  # noqa: E731
    if head == "image-classification":
        size, ch = cfg.image_size, getattr(cfg, "num_channels", 3)
        return {"pixel_values": torch.randn(b, ch, size, size, device=device, dtype=dtype),
                "labels": labels(cfg.num_labels, (b,))}
    batch = {"input_ids": ids((b, s))}
    if head == "seq2seq-lm":  # DataCollatorForSeq2Seq passes the shifted labels too
        batch["decoder_input_ids"] = ids((b, s))
    if head in ("causal-lm", "masked-lm", "seq2seq-lm"):
        batch["labels"] = ids((b, s))
    elif head == "sequence-classification":
        batch["labels"] = labels(cfg.num_labels, (b,))
    elif head == "token-classification":
        batch["labels"] = labels(cfg.num_labels, (b, s))
    elif head == "question-answering":
        batch["start_positions"], batch["end_positions"] = labels(s, (b,)), labels(s, (b,))
    else:
        raise UserError(f"verify trains the model, and head {head!r} has no loss; pick a head with one "
                        "(causal-lm, sequence-classification, ...)")
    return batch


def prepare_model(model, w: Workload) -> None:
    """Checkpointing and memplan's kernels on the base model, as the training script sets them up (qlora:
    prepare_model_for_kbit_training turns checkpointing on itself)."""
    if w.grad_ckpt == "full" and w.method != "qlora":
        kwargs = {"use_reentrant": False}  # transformers 5's default, and torch's recommendation
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif w.grad_ckpt == "selective":
        from memplan.selective import enable_selective

        try:
            enable_selective(model)
        except ValueError as e:
            raise UserError(f"--grad-ckpt selective: {e}") from None
    if w.kernels or w.tiled_mlp:  # memplan's kernels, as the user's training script applies them
        from memplan.kernels import apply

        apply(model, loss=w.kernels, mlp=w.tiled_mlp)
    model.train()


# -- one training run ----------------------------------------------------------------------------------
def train_steps(model, batch_fn: Callable[[], dict], optimizer, w: Workload, steps: int, *, tracker=None,
                sem=None, autocast=None, on_phase: Callable[[int, str], None] | None = None) -> list[float]:
    """HF Trainer's step, `steps` times (min(grad_accum, 2) micro batches each: the second one already
    sees the accumulated gradients). Returns the wall time of each step."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    micro = min(w.grad_accum, 2)
    times = []

    def phase(step: int, name: str) -> None:
        if tracker is not None:
            tracker.set_phase(name)
        if on_phase:
            on_phase(step, name)

    for step in range(steps):
        t0 = time.perf_counter()
        for _ in range(micro):
            phase(step, "data")
            batch = batch_fn()
            phase(step, "forward")
            if sem is not None:
                sem.cache_enabled = True
            with autocast() if autocast else contextlib.nullcontext():
                loss = model(**batch).loss / w.grad_accum
            if sem is not None:
                sem.cache_enabled = False
                sem.clear_cache()
            del batch
            phase(step, "backward")
            loss.backward()
            del loss
            if tracker is not None:
                tracker.classify([p.grad for p in params if p.grad is not None], "gradients")
        phase(step, "optimizer")
        if sem is not None:
            sem.autocast = False
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if tracker is not None:
            tracker.classify([t for st in optimizer.state.values() for t in st.values()
                              if isinstance(t, torch.Tensor)], "optimizer_states")
        optimizer.zero_grad(set_to_none=w.zero_grad == "set-to-none")
        if sem is not None:
            sem.autocast = sem.dtype is not None
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def autocast_dtype(w: Workload):
    """The autocast dtype of this precision, or None (fp32, bf16-pure)."""
    import torch

    prec = PRECISIONS[w.precision]
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[prec.half] if prec.autocast else None


def build(config, head: str | None, attn: str, device: str, dtype):
    """(model, head): the model of `head` with random weights (seed 0) in `dtype` on `device`; "meta" builds on
    the meta device and materialises empty tensors of the active mode (FakeTensors)."""
    import torch

    from memplan.inputs.hf import build_model
    from memplan.verify import methods

    torch.manual_seed(0)
    # On the GPU the weights are made in their dtype, as from_pretrained loads them: built in fp32 and cast, they
    # leave the fp32 copies' holes in the caching allocator's segments, which the measured step then fills. The
    # H200 lease measured it (benchmarks/results/gpu_lease2/hist_*.pkl.gz, docs/verify.md): Llama-3.2-1B eager
    # serving reserved 4,660 MiB over 2,868 MiB of segments at the start, for 2,389 MiB of weights.
    direct = {"dtype": dtype} if device == "cuda" else {}
    with torch.device(device):
        model, head = build_model(config, head, attn, half_weights=dtype != torch.float32, **direct)
    if device == "meta":
        methods.materialize_meta(model, dtype)
    elif next(model.parameters()).dtype != dtype:
        model.to(dtype)
    return model, head


def setup(config, head: str | None, w: Workload, device: str, spec: ModelSpec | None = None):
    """(model, head, optimizer, input dtype) for the plan, built on `device` with random weights; "meta"
    builds on the meta device and materialises empty tensors of the active mode (FakeTensors). `spec`: the
    model's, as run() resolved it; None reads it off the built model (callers with a config only)."""
    import torch

    from memplan.inputs.hf import spec_from_config
    from memplan.verify import methods
    from memplan.verify.optimizers import build_optimizer

    dtype = methods.load_dtype(w)  # the fine-tuning method's load dtype (docs/finetune.md)
    model, head = build(config, head, w.attn, device, dtype)
    if w.method == "qlora":
        methods.quantise(model, methods.bnb_quantization_config(w))
        methods.prepare_kbit(model, w)
    prepare_model(model, w)
    if spec is None and w.method != "full":  # the method's modules are named by the spec's parameter table
        spec = spec_from_config(model.config, "verify", head=head)
    model = methods.apply_method(model, w, spec)
    # bitsandbytes' own 8-bit optimizers read their quantisation map with .tolist(), which fake tensors
    # refuse (functional.create_dynamic_map): the fake trace steps the replicas, real runs bnb itself
    optimizer = build_optimizer(w.optim, [p for p in model.parameters() if p.requires_grad], momentum=w.momentum,
                                use_bnb=False if device == "meta" else None)
    return model, head, optimizer, dtype


def run_traced(config, head: str | None, w: Workload, sm: tuple[int, int], device: str, steps: int,
               on_phase=None, spec: ModelSpec | None = None) -> dict[str, Any]:
    """fake / cpu: the step under CudaSemantics with every storage tracked."""
    from memplan.verify.cudasim import CudaSemantics
    from memplan.verify.tracer import LiveTracker

    import torch

    from memplan.verify.methods import check_device, cuda_bnb_paths, load_dtype, quant_state_tensors

    fake = device == "fake"
    check_device(w, device)
    if fake and _is_moe(config) and load_dtype(w) != torch.bfloat16:
        raise UserError("--device fake traces MoE models with bf16-pure weights only: with fp32 weights "
                        "transformers routes tokens with data-dependent shapes (nonzero), which fake tensors "
                        "cannot run; use --precision bf16-pure, or --device cpu / cuda")
    mode = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    t0 = time.perf_counter()
    with mode:
        model, head, optimizer, dtype = setup(config, head, w, "meta" if fake else "cpu", spec)
        sem = CudaSemantics(autocast_dtype(w), sm, fake=fake, force_kernel="flash" if w.attn == "flash" else None)
        tracker = LiveTracker()
        # qlora: bitsandbytes' CUDA matmul paths on the CPU (methods.cuda_bnb_paths)
        with tracker, cuda_bnb_paths() if w.method == "qlora" else contextlib.nullcontext():
            tracker.register(list(model.parameters()) + list(model.buffers()) + quant_state_tensors(model), "weights")
            with sem:
                times = train_steps(model, lambda: make_batch(model, head, w.micro_batch, w.seq_len, dtype, "cpu"),
                                    optimizer, w, steps, tracker=tracker, sem=sem, on_phase=on_phase)
        summary = tracker.summarize()
        model = optimizer = None
    gc.collect()
    return {"summary": summary, "times": times, "kernels": dict(sem.kernels), "seconds": time.perf_counter() - t0}


def _is_moe(config) -> bool:
    """A MoE model whose fp32 routing has data-dependent shapes: not Llama 4's, which runs every token through
    every expert (families.Family.moe_all_experts)."""
    from memplan.estimator.families import family
    from memplan.inputs.hf import is_moe_config

    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return is_moe_config(config) and not family(model_type).moe_all_experts


def fresh_peaks() -> None:
    """Release what building the model left cached and restart the peak meters, so that they measure the step:
    a model quantised after it is built (QLoRA, int4 / int8 serving) first held its half weights."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_cuda(config, head: str | None, w: Workload, steps: int, on_phase=None,
             spec: ModelSpec | None = None) -> dict[str, Any]:
    """A real run on the GPU. Peak memory counts every step (the first creates the optimizer state);
    the time is the median of the steps after the first."""
    import torch

    torch.cuda.empty_cache()
    model = optimizer = None
    try:
        model, head, optimizer, dtype = setup(config, head, w, "cuda", spec)
        fresh_peaks()  # QLoRA: the half weights bitsandbytes quantised are gone; measure the step
        half = autocast_dtype(w)
        autocast = (lambda: torch.autocast("cuda", dtype=half)) if half is not None else None
        kernel_ctx = contextlib.nullcontext()
        if w.attn == "flash":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kernel_ctx = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
        with kernel_ctx:
            times = train_steps(model, lambda: make_batch(model, head, w.micro_batch, w.seq_len, dtype, "cuda"),
                                optimizer, w, steps + 1, autocast=autocast, on_phase=on_phase)
        out = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
               "device_used": nvml_used(), "times": times[1:]}
    except torch.cuda.OutOfMemoryError as e:
        allocated = torch.cuda.memory_allocated()
        model = optimizer = None
        gc.collect()
        torch.cuda.empty_cache()
        first = str(e).splitlines()[0][:200]
        raise PlanOOM(f"CUDA out of memory in the planned step ({allocated / 2**30:.2f} GiB allocated when it "
                      f"failed): {first}") from None
    model = optimizer = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


def nvml_used() -> int:
    import pynvml
    import torch

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
    finally:
        pynvml.nvmlShutdown()


def compare(est: MemoryBreakdown, device: str, run: dict[str, Any], w: Workload, steps: int, cuda_context: int,
            device_note: str) -> VerifyReport:
    notes: list[str] = []
    ws = est.breakdown.get("workspace", 0)
    tokens = w.micro_batch * w.seq_len * min(w.grad_accum, 2)  # a training step's
    if w.task == "infer":  # the generate call's new tokens, or the scoring forward's: the estimate's count
        from memplan.search.cost import serving_tokens

        tokens = serving_tokens(w)
    if device == "cuda":
        meters = [check("peak_allocated", est.peak_allocated_bytes, run["allocated"], "measured"),
                  check("peak_reserved", est.peak_reserved_bytes, run["reserved"], "measured"),
                  check("device_used", est.device_used_bytes, run["device_used"], "measured (NVML)")]
        breakdown: dict[str, dict[str, int]] = {}
        peak_phase, peak_op, phases, kernels = est.peak_phase, "", {}, {}
        times = run["times"]
    else:
        s = run["summary"]
        measured: dict[str, int] = {}
        for k, v in s.breakdown.items():
            key = TRACE_CATEGORIES.get(k, k)
            measured[key] = measured.get(key, 0) + v
        keys = [k for k in est.breakdown if k not in ("workspace", "allocator_overhead", "cuda_context")]
        breakdown = {k: {"predicted": est.breakdown.get(k, 0), "measured": measured.get(k, 0)}
                     for k in dict.fromkeys(keys + list(measured))}
        meters = _traced_meters(est, s, w, ws, cuda_context)
        notes.append("peak_allocated compares tensor bytes: the estimate's cuBLAS workspaces "
                     f"({ws / 2**20:.0f} MiB) are not tensors and are left out of both sides")
        peak_phase, peak_op, phases, kernels = s.peak_phase, s.peak_op, s.phases, run["kernels"]
        times = run["times"] if device == "cpu" else []
        if device == "cpu" and kernels.get("flash", 0) + kernels.get("efficient", 0):
            notes.append("cpu: fused CPU attention kernel stands in for CUDA's (same saved tensors; "
                         "attention dropout is not applied on the CPU)")
    # serving's step is the estimate's: one generate call (its forwards' sum); training's the median step
    step = (sum(times) if w.task == "infer" else sorted(times)[len(times) // 2]) if times else None
    return VerifyReport(
        device=device, device_note=device_note, model=est.model.name, gpu=est.gpu, workload=w, steps=steps,
        meters=meters, breakdown=breakdown, peak_phase=peak_phase, peak_op=peak_op, phases=phases,
        sdpa_kernels=kernels, step_time_s=round(step, 4) if step else None,
        forward_times_s=[round(t, 5) for t in times] if w.task == "infer" else [],
        tokens_per_s=round(tokens / step, 1) if step else None, run_seconds=round(run.get("seconds", sum(times)), 2),
        verdict=meters[0].verdict, estimate=est, notes=notes)


def _traced_meters(est: MemoryBreakdown, s, w: Workload, ws: int, cuda_context: int) -> list:
    """fake / cpu: the estimate's meters against the traced step, reserved against its allocator simulation (the
    workspace its own segment): the workload's allocator mode gives the meters, the other one a row, and where the
    estimate's reserved is the replay, the segment arithmetic's figures are rows too."""
    predicted_tensors = est.peak_allocated_bytes - ws  # the tracer sees tensors, not the cuBLAS workspace
    simulated = {"default": s.peak_reserved, "expandable_segments": s.peak_reserved_expandable}
    own, other = allocator_mode(w.expandable_segments), allocator_mode(not w.expandable_segments)
    reserved = simulated[own] + ws
    # the traced step's simulation has room: against it, the estimate's high-water mark where the estimate held
    # the replay to the usable memory (estimator/step.py _with_replay)
    highs = {m: v.get("roomy_reserved_bytes", v["peak_reserved_bytes"]) for m, v in est.by_allocator.items()}
    roomy = highs.get(own, est.peak_reserved_bytes)
    meters = [check("peak_allocated", predicted_tensors, s.peak_allocated, "traced tensors"),
              check("peak_reserved", roomy, reserved,
                    "modelled: allocator simulation (expandable segments) of the traced allocations"
                    if w.expandable_segments else
                    "modelled: allocator simulation of the traced allocations + cuBLAS workspace"),
              check("device_used", est.device_used_bytes - est.peak_reserved_bytes + roomy, reserved + cuda_context,
                    "modelled: simulated reserved + the profile's CUDA context")]
    if est.by_allocator:
        meters.append(check(f"peak_reserved ({other})", highs[other], simulated[other] + ws,
                            f"modelled: allocator simulation under {other} + cuBLAS workspace"))
    for mode, sim in simulated.items():
        arithmetic = est.by_allocator.get(mode, {}).get("arithmetic_reserved_bytes")
        if arithmetic is not None:  # the meters above are the replay; this is the search's fast figure
            meters.append(check(f"arithmetic_reserved ({mode})", arithmetic, sim + ws,
                                "the segment arithmetic suggest's search ranks with, same simulation"))
    return meters


# -- the command ---------------------------------------------------------------------------------------
class _Progress:
    """A transient progress line on stderr, shown only once the run has taken more than a second."""

    def __init__(self, steps: int, label: str, enabled: bool):
        self.t0, self.steps, self.label, self.enabled = time.perf_counter(), steps, label, enabled
        self.bar = self.task = None

    def __call__(self, step: int, phase: str) -> None:
        if not self.enabled:
            return
        if self.bar is None and time.perf_counter() - self.t0 > 1.0:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("")
        if self.bar is not None:
            self.bar.update(self.task, description=f"{self.label}: step {step + 1}/{self.steps}, {phase}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def read_plan(path: str, index: int) -> tuple[str, str, dict[str, Any]]:
    """(model, gpu, workload fields) from a file `memplan suggest --json` wrote (or one of its plans), or
    the plan.json of `memplan suggest --emit`."""
    import json
    from pathlib import Path

    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--plan: cannot read {path!r}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"--plan: {path!r} is not JSON; expected what `memplan suggest --json` writes") from None
    plan = None
    if isinstance(doc, dict) and isinstance(doc.get("plans"), list):
        if not doc["plans"]:
            raise UserError(f"--plan: {path!r} has no plans (nothing fitted when it was made)")
        if not 0 <= index < len(doc["plans"]):
            raise UserError(f"--plan-index {index}: {path!r} has {len(doc['plans'])} plans")
        plan = doc["plans"][index]
    elif isinstance(doc, dict) and isinstance(doc.get("plan"), dict):  # the plan.json `suggest --emit` writes
        plan = doc["plan"]
    elif isinstance(doc, dict) and "micro_batch" in doc:
        plan = doc
    est = plan.get("estimate") if isinstance(plan, dict) else None
    if not isinstance(est, dict) or not isinstance(est.get("workload"), dict) or "model" not in est:
        raise UserError(f"--plan: {path!r} is not a memplan plan; expected what `memplan suggest --json` or "
                        "`--emit` writes")
    model = est["model"].get("hf_id") or est["model"].get("name")
    return model, est.get("gpu", ""), dict(est["workload"])


def alloc_conf(env) -> str:
    """The allocator settings torch reads: PYTORCH_ALLOC_CONF, else its older alias PYTORCH_CUDA_ALLOC_CONF
    (c10/core/AllocatorConfig.cpp, AcceleratorAllocatorConfig::instance; pytorch/pytorch PR 167659)."""
    return env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF", "")


def check_allocator_mode(expandable: bool, conf: str) -> None:
    """A real run measures the allocator this process runs, which its allocator settings (`conf`: alloc_conf)
    fix before CUDA starts: the plan's mode (--expandable-segments) must be that one, or the meters compare two
    allocators."""
    running = "expandable_segments:true" in conf.replace(" ", "").lower()
    if expandable != running:
        raise UserError("--device cuda: the plan's allocator mode is " + (
            "expandable segments, but this process runs the default allocator (start it with "
            "PYTORCH_ALLOC_CONF=expandable_segments:True)" if expandable else
            "the default, but PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF set expandable segments (add "
            "--expandable-segments, or unset them)"))


def _run_on(device: str, config, head: str | None, w: Workload, steps: int, sm: tuple[int, int], spec: ModelSpec,
            bar) -> dict[str, Any]:
    """The planned step on `device`: a serving step or training steps, real on the GPU, traced otherwise."""
    if w.task == "infer":
        return run_cuda_infer(config, head, w) if device == "cuda" else \
            run_traced_infer(config, head, w, sm, device, on_phase=bar)
    if device == "cuda":
        return run_cuda(config, head, w, steps, on_phase=bar, spec=spec)
    return run_traced(config, head, w, sm, device, steps, on_phase=bar, spec=spec)


def _fits_host(allocated: int, device: str) -> None:
    """--device cpu holds the step's tensors in host memory: refused up front where the estimate's peak allocated
    passes what this machine has available (/proc/meminfo MemAvailable; not checked where there is none), before
    the kernel's out-of-memory killer ends the run without a word."""
    if device != "cpu":
        return
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return
    if allocated > free:
        raise UserError(f"--device cpu: the step allocates about {allocated / 2**30:,.1f} GiB, more than the "
                        f"{free / 2**30:,.1f} GiB this machine has available; --device fake traces it without memory")


def _check_inputs(gpu: str | None, plan_file: str | None, plan_index: int | None, steps: int) -> None:
    """verify's own options, refused as the constraints table refuses a workload's (one line each)."""
    if plan_file is not None and not plan_file.strip():
        raise UserError("--plan: empty file name")
    if plan_index is not None and plan_file is None:
        raise UserError("--plan-index picks a plan of --plan FILE; there is no --plan")
    if gpu is not None and not gpu.strip():
        raise UserError("empty GPU name (memplan gpus lists them)")
    least = BOUNDS["steps"].low
    if steps < least:  # compare like with like: the estimate is the steady state
        raise UserError(f"--steps {steps}: verify compares the steady state, which the second step reaches (the "
                        f"first creates the optimizer state); use --steps {least:,} or more")
    if problem := bound_problem("steps", steps):
        raise UserError(f"--steps {problem}")


def run(*, model: str | None, gpu: str | None, head: str | None = None, trust_remote_code: bool = False,
        plan_file: str | None = None, plan_index: int | None = None, device: str = "auto", steps: int = 2,
        progress: bool = False, **given: Any) -> VerifyReport:
    """Resolve the plan, run it on `device`, compare with the estimate (the API behind `memplan verify`)."""
    from memplan import api
    from memplan.inputs import defaults
    from memplan.inputs.catalog import resolve_config

    work: dict[str, Any] = {}
    _check_inputs(gpu, plan_file, plan_index, steps)
    if plan_file:
        p_model, p_gpu, work = read_plan(plan_file, plan_index or 0)
        model, gpu = model or p_model, gpu or p_gpu
    if not model:
        raise UserError("verify needs --model (or --plan FILE)")
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "fake"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible to torch (use --device fake or cpu)")
    said = []
    if not gpu:  # the GPU in hand, or the profile whose attention kernels and context the trace assumes
        gpu, item = defaults.verify_gpu(device)
        said.append(item)
    work.update({k: v for k, v in given.items() if v is not None})
    spec, prof = api.resolve_spec(model, head, trust_remote_code), api.resolve_gpu(gpu)
    est = api.estimate(spec, prof, simulate=True, **work)
    w = est.workload
    if w.world > 1 or w.zero or w.fsdp != "none":
        raise UserError("verify runs the single-GPU Trainer step; multi-GPU plans (data / tensor / pipeline "
                        "parallel, ZeRO, FSDP) are not verified yet")
    if device == "cuda":
        check_allocator_mode(w.expandable_segments, alloc_conf(os.environ))
    config, head = resolve_config(model, head, trust_remote_code)
    note = {"cuda": f"real run on {torch.cuda.get_device_name() if device == 'cuda' else ''}",
            "cpu": "real run on the CPU with CUDA memory semantics (memplan.verify.cudasim), tensors counted",
            "fake": "full-size model under FakeTensorMode with CUDA semantics; no memory used"}[device]
    _fits_host(est.peak_allocated_bytes, device)
    bar = _Progress(steps, f"verify ({device})", progress)
    try:
        t0 = time.perf_counter()
        bar(0, "building the model")
        with quiet():  # transformers' warnings about the built model, on a run that succeeds
            result = _run_on(device, config, head, w, steps, prof.compute_capability, spec, bar)
        result.setdefault("seconds", time.perf_counter() - t0)
    except RuntimeError as e:  # torch's CPU allocator (DefaultCPUAllocator: can't allocate memory)
        if device != "cpu" or "can't allocate memory" not in str(e):
            raise
        raise UserError("--device cpu: the run needed more host memory than this machine could give; --device fake "
                        "traces it without memory") from None
    finally:
        bar.close()
    report = compare(est, device, result, w, steps, prof.cuda_context_bytes, note)
    return report.model_copy(update={"defaults": said + est.defaults})
