"""The documents `suggest` returns: a Plan (its Workload, estimate and speed), Alternatives, the Suggestion.

A Plan holds its Workload; its JSON keeps the flat keys launchers read (micro_batch, zero_stage, ...),
computed from that workload, in the order they always had."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from memplan.estimator.breakdown import MemoryBreakdown
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.workload import Workload

# FSDP's sharding strategy with the same partitioning, for accelerate users (PyTorch FSDP docs:
# FULL_SHARD ~ ZeRO-3, SHARD_GRAD_OP ~ ZeRO-2, HYBRID_SHARD = FULL_SHARD inside a node, replicas across)
FSDP_EQUIVALENT = {0: "NO_SHARD", 1: "SHARD_GRAD_OP", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
# The keys of a plan's JSON, in order (`suggest --json`, plan.json; `verify --plan` reads them)
PLAN_KEYS = ("micro_batch", "grad_accum", "global_batch", "dp", "tp", "pp", "zero_stage", "precision", "optim",
             "grad_ckpt", "attn", "seq_len", "samples_per_s", "tokens_per_s", "mfu", "estimate", "sp", "vpp", "offload",
             "gpus", "nodes", "fsdp", "kernels", "tiled_mlp", "fsdp_equivalent", "step_seconds", "step_terms",
             "host_ram_per_node_bytes", "method", "expandable_segments")


def _shown(field: str) -> property:
    return property(lambda plan: getattr(plan.workload, field), doc=f"the workload's {field}")


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True)

    workload: Workload = Field(exclude=True)  # in the JSON as the flat keys below (and as estimate.workload)
    samples_per_s: float
    tokens_per_s: float
    mfu: float
    estimate: MemoryBreakdown
    step_seconds: float = 0.0
    step_terms: dict[str, float] = {}  # seconds per step by cost term (docs/cost-model.md)

    @model_serializer(mode="wrap")
    def _flat(self, handler) -> dict:
        doc = handler(self)
        return {k: doc[k] if k in doc else getattr(self, k) for k in PLAN_KEYS}

    # the workload's knobs under the plan's JSON names
    micro_batch = _shown("micro_batch")
    grad_accum = _shown("grad_accum")
    global_batch = _shown("global_batch")
    dp = _shown("dp")
    tp = _shown("tp")
    pp = _shown("pp")
    zero_stage = _shown("zero")
    precision = _shown("precision")
    optim = _shown("optim")
    grad_ckpt = _shown("grad_ckpt")
    attn = _shown("attn")
    seq_len = _shown("seq_len")
    sp = _shown("sp")
    vpp = _shown("vpp")
    offload = _shown("offload")
    gpus = _shown("gpus")
    nodes = _shown("nodes")
    fsdp = _shown("fsdp")
    kernels = _shown("kernels")
    tiled_mlp = _shown("tiled_mlp")
    method = _shown("method")  # its knobs (rank, targets, quantisation) are in estimate.workload
    expandable_segments = _shown("expandable_segments")  # launch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

    @property
    def host_ram_per_node_bytes(self) -> int:
        """Host RAM that the plan's offload pins on each node (0 without offload)."""
        return self.estimate.cpu_ram_per_node_bytes

    @property
    def fsdp_equivalent(self) -> str | None:
        """For a multi-GPU ZeRO / DDP plan: the FSDP sharding strategy that partitions alike."""
        w = self.workload
        data_parallel_only = w.task == "train" and w.world > 1 and w.tp == w.pp == 1 and w.fsdp == "none"
        return FSDP_EQUIVALENT[w.zero] if data_parallel_only else None

    # -- the files to launch (memplan.emit) ------------------------------------------------------------
    def _spec(self, spec: ModelSpec | None) -> ModelSpec:
        from memplan.inputs.catalog import resolve_model

        return spec or resolve_model(self.estimate.model.hf_id or self.estimate.model.name)

    def training_arguments(self, spec: ModelSpec | None = None) -> dict:
        """Keyword arguments for transformers.TrainingArguments."""
        from memplan import emit

        return emit.training_arguments(self, self._spec(spec))

    def deepspeed_config(self, spec: ModelSpec | None = None) -> dict:
        """The ds_config.json contents (DeepSpeed plans)."""
        from memplan import emit

        return emit.deepspeed_config(self, self._spec(spec))

    def accelerate_config(self, spec: ModelSpec | None = None) -> dict:
        """The accelerate config YAML contents, as a dict."""
        from memplan import emit

        return emit.accelerate_config(self, self._spec(spec))

    def write(self, directory: str, what: tuple[str, ...] = ("trainer", "deepspeed", "accelerate"),
              force: bool = False, spec: ModelSpec | None = None) -> list[str]:
        """Write the files (atomically; an existing file only with force); return their paths."""
        from memplan import emit

        return emit.write(emit.render(self, self._spec(spec), what), directory, force)


class Alternative(BaseModel):
    change: str
    gain: str
    plan: Plan


class Suggestion(BaseModel):
    model: str
    gpu: str
    task: str
    seq_len: int
    global_batch: int
    global_batch_default: bool = False  # memplan chose it (memplan.inputs.defaults.GLOBAL_BATCH)
    gpus: int = 1
    nodes: int = 1
    objective: str = "throughput"
    defaults: list[str]  # the defaults memplan chose, said out loud (the line estimate and verify print too)
    # the host RAM per node a plan may pin (--cpu-mem or the default; None: not checked, or inference)
    host_ram_limit_bytes: int | None = None
    searched: dict[str, list[str]]
    candidates: int  # evaluated: every setting of every knob, its memory estimated and its step time modelled
    search_seconds: float = 0.0
    plans: list[Plan]
    # fitting plans no other plan beats on both memory and speed, least memory first: the 12 with the least
    # memory of the front (pareto_size says how many it has)
    pareto: list[Plan] = []
    pareto_size: int = 0
    why: list[str] = []  # for the first plan: what each alternative would cost
    alternatives: list[Alternative]
    notes: list[str]
