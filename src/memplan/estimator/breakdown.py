"""What an estimate reports: the bytes per category at the peak moment and the three meters
(docs/estimator.md): peak allocated (torch.cuda.max_memory_allocated), peak reserved
(max_memory_reserved) and device used (nvidia-smi: reserved + the CUDA context)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pydantic import BaseModel, ConfigDict

from memplan.estimator.finetune import Tuning, tuned_params
from memplan.inputs.modelspec import ModelSpec, category_totals
from memplan.inputs.profiles import GPUProfile
from memplan.inputs.workload import Workload

if TYPE_CHECKING:
    from memplan.search.cost import Throughput

# weights: the base model (without its quantisation constants); adapter_weights: LoRA adapters and the
# trained copies of modules_to_save; quant_constants: bitsandbytes' absmax / code / scales;
# paged_optimizer_states: CUDA managed memory, outside allocated and reserved (like cuda_context)
BREAKDOWN_KEYS = ("weights", "adapter_weights", "quant_constants", "autocast_cache", "gradients", "optimizer_states",
                  "paged_optimizer_states", "optimizer_temporaries", "comm_buffers", "gathered_params", "activations",
                  "transient", "kv_cache", "workspace", "allocator_overhead", "cuda_context")


class ModelInfo(BaseModel):
    name: str
    hf_id: str | None
    model_type: str
    head: str
    params_total: int
    params_trainable: int
    params_by_category: dict[str, int]


class MemoryBreakdown(BaseModel):
    """Bytes per category at the peak moment, and the three meters (docs/contract.md)."""

    model_config = ConfigDict(frozen=True)

    model: ModelInfo
    gpu: str
    workload: Workload
    breakdown: dict[str, int]
    peak_phase: str
    phases: dict[str, int]  # peak allocated bytes of each moment of the step
    activations_per_layer: dict[str, int]  # saved bytes per layer by term (one micro batch)
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_used_bytes: int
    capacity_bytes: int
    usable_bytes: int  # capacity minus the headroom
    headroom_bytes: int  # usable - device used (negative: does not fit)
    fits: bool
    notes: list[str]
    # Per GPU: every byte above is one GPU's (the worst pipeline stage's). Host RAM that offload pins,
    # for all the GPUs of one node (docs/parallel.md).
    cpu_ram_per_node_bytes: int = 0
    params_per_gpu: int = 0  # parameters one GPU holds before ZeRO partitioning (after TP / PP)
    # the host RAM per node the estimate was held to (--cpu-mem or the default, memplan.inputs.defaults;
    # None: not checked) and whether what offload pins fits it (`fits` needs both)
    host_ram_limit_bytes: int | None = None
    host_ram_fits: bool = True
    defaults: list[str] = []  # the defaults memplan chose for what was left out (the defaults line)
    # The speed model's prediction for this configuration (search/cost.py, docs/cost-model.md), the numbers
    # suggest ranks plans by: one optimizer step (a forward of the micro batch when serving), over all GPUs
    step_time_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    # reserved and device used under each allocator mode ("default", "expandable_segments": PYTORCH_CUDA_ALLOC_CONF
    # =expandable_segments:True); the meters above are the workload's own mode's
    by_allocator: dict[str, dict[str, int]] = {}
    # how reserved (and device used) was predicted: "replay", the allocator simulation of the step's allocations
    # in order (one GPU training a whole replica, or serving; then each mode also has `arithmetic_reserved_bytes`),
    # or "segment arithmetic", the fast figure the search ranks with (docs/estimator.md, "Reserved and device used")
    reserved_from: str = "segment arithmetic"


class Peak(NamedTuple):
    """The estimate before it is named as a report."""

    parts: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    notes: list[str]
    per_layer: dict[str, int]
    allocated: int
    reserved: int
    device_used: int
    cpu_per_gpu: int
    params_per_gpu: int
    saved_activations: int  # bytes written in forward and read in backward (the cost model's traffic)
    state_bytes: int  # weights + gradients + optimizer states (the optimizer step's traffic)
    rates: Throughput | None = None  # the speed model's prediction for this configuration
    by_allocator: dict[str, dict[str, int]] = {}  # meters.Meters.report
    reserved_from: str = "segment arithmetic"  # or "replay": how reserved was predicted (MemoryBreakdown)


def allocator_mode(expandable: bool) -> str:
    """The key of an allocator mode in `by_allocator` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or not)."""
    return "expandable_segments" if expandable else "default"


def usable_bytes(gpu: GPUProfile, headroom: float) -> int:
    """The GPU's memory less the headroom the workload keeps free: what device used must fit."""
    return int(gpu.memory_bytes * (1 - headroom))


def report(spec: ModelSpec, gpu: GPUProfile, w: Workload, p: Peak) -> MemoryBreakdown:
    usable = usable_bytes(gpu, w.headroom)
    # a method's table in training (the model's own for full fine-tuning); inference precisions (int8, int4)
    # are no training precision a Tuning can read
    table = tuned_params(spec, Tuning.of(w)) if w.task == "train" else spec.params
    info = ModelInfo(name=spec.name, hf_id=spec.hf_id, model_type=spec.model_type, head=spec.head,
                     params_total=sum(g.total for g in table),
                     params_trainable=sum(g.total for g in table if g.trainable),
                     params_by_category=category_totals(table))
    breakdown = {k: int(p.parts.get(k, 0)) for k in BREAKDOWN_KEYS}
    fits = p.device_used <= usable
    expandable = p.by_allocator.get("expandable_segments", {}).get("device_used_bytes")
    notes = p.notes
    if not fits and not w.expandable_segments and expandable is not None and expandable <= usable:
        notes = notes + [f"fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: {expandable / 2**30:.2f} GiB "
                         "device used, as the allocator no longer rounds each segment (--expandable-segments)"]
    return MemoryBreakdown(
        model=info, gpu=gpu.name, workload=w, breakdown=breakdown, peak_phase=p.peak_phase,
        phases={k: int(v) for k, v in p.phases.items()}, activations_per_layer=p.per_layer,
        peak_allocated_bytes=p.allocated, peak_reserved_bytes=p.reserved, device_used_bytes=p.device_used,
        capacity_bytes=gpu.memory_bytes, usable_bytes=usable, headroom_bytes=usable - p.device_used,
        fits=fits, notes=notes, cpu_ram_per_node_bytes=p.cpu_per_gpu * w.gpus,
        params_per_gpu=p.params_per_gpu, by_allocator=p.by_allocator, reserved_from=p.reserved_from,
        **({} if p.rates is None else dict(step_time_s=p.rates.step_seconds, samples_per_s=p.rates.samples_per_s,
                                           tokens_per_s=p.rates.tokens_per_s, mfu=p.rates.mfu)),
    )


def with_host_limit(e: MemoryBreakdown, limit: int | None) -> MemoryBreakdown:
    """The estimate held to `limit` bytes of host RAM per node: host RAM is a limit like the GPU's, so a
    plan whose offload pins more does not fit."""
    if limit is None:
        return e
    ok = e.cpu_ram_per_node_bytes <= limit
    notes = e.notes if ok else e.notes + [
        f"offload pins {e.cpu_ram_per_node_bytes / 2**30:,.0f} GiB of host RAM per node; the node has "
        f"{limit / 2**30:,.0f} GiB (--cpu-mem)"]
    return e.model_copy(update={"host_ram_limit_bytes": limit, "host_ram_fits": ok, "fits": e.fits and ok,
                                "notes": notes})
