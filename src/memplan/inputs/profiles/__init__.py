"""GPU profiles: one JSON file per GPU in this folder, plus the loader.

``load_gpu(name)`` accepts a profile name (``h100-80g``), an alias (``h100``), any case,
``auto`` (read the local GPU with NVML) or the path of a user's JSON profile file.
See docs/gpus.md for where every number comes from.

This module is on the CLI's fast path: it must not import torch, and pynvml is imported
only when ``auto`` is asked for.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from memplan.errors import UserError

__all__ = [
    "DTYPES",
    "GPUProfile",
    "HostRAM",
    "list_gpus",
    "load_gpu",
    "load_profile_file",
    "profile_from_nvml",
    "read_host_ram",
    "read_nvml",
]

#: Keys allowed in ``GPUProfile.tflops``.
DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")

MIB = 2**20
_SLUG = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class HostRAM(BaseModel):
    """The host RAM a GPU usually comes with: what offload to the CPU (DeepSpeed) may pin. Either per GPU,
    from a stated typical host (a cloud instance, a DGX), or per node, read from this machine (``auto``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    per_gpu_bytes: int | None = Field(None, gt=0)
    """The host's RAM divided by its GPUs (a node of n GPUs: n times this)."""
    per_node_bytes: int | None = Field(None, gt=0)
    """The whole RAM of this machine, whatever --gpus says (``--gpu auto``)."""
    host: str
    """The host the figure comes from, said in memplan's defaults line."""
    source: str
    """Where the figure is published, or how it was read."""

    @model_validator(mode="after")
    def _one(self) -> HostRAM:
        if (self.per_gpu_bytes is None) == (self.per_node_bytes is None):
            raise ValueError("give per_gpu_bytes or per_node_bytes")
        return self

    def per_node(self, gpus: int) -> int:
        """Bytes of host RAM on a node of `gpus` GPUs."""
        return self.per_node_bytes if self.per_node_bytes is not None else self.per_gpu_bytes * gpus


class GPUProfile(BaseModel):
    """Facts about one GPU model that the planner needs. All sizes in bytes, speeds in SI units."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """Canonical profile name, lowercase, e.g. ``v100-16g``."""
    full_name: str
    """Marketing name, e.g. ``NVIDIA Tesla V100-SXM2-16GB``."""
    aliases: list[str] = []
    """Other names that select this profile (lowercase), e.g. ``v100``."""
    memory_bytes: int
    """Total memory as the driver reports it: NVML ``nvmlDeviceGetMemoryInfo().total``
    (= nvidia-smi "Total" MiB * 2**20)."""
    compute_capability: tuple[int, int]
    bf16: bool
    """Hardware bf16 tensor-core support (sm80+)."""
    fp8: bool
    """FP8 tensor cores (sm89 / sm90+)."""
    flash_attention: bool
    """FlashAttention-2 supports this GPU (sm80+: Ampere, Ada, Hopper)."""
    tflops: dict[str, float]
    """Dense (no sparsity) peak TFLOP/s per dtype; fp16/bf16/tf32/fp8/int8 are tensor-core
    figures with fp32 accumulation, fp32 is the CUDA-core (non-tensor) figure."""
    memory_bandwidth_gbs: float
    """Peak memory bandwidth, GB/s."""
    nvlink_gbs: float | None
    """Total NVLink bandwidth per GPU, GB/s bidirectional as NVIDIA quotes it; None = no NVLink."""
    pcie_gbs: float
    """Host link, nominal GB/s per direction (PCIe 3.0 x16 = 16, 4.0 = 32, 5.0 = 64)."""
    cuda_context_bytes: int = Field(ge=0)
    """NVML "used" on an otherwise idle GPU right after ``torch.ones((1, 1)).to("cuda")``:
    the process's CUDA context and loaded kernels, plus (R510+ drivers) the driver-reserved
    memory that NVML counts as used. cuBLAS/cuDNN/NCCL workspaces are not included."""
    nvml_names: list[str]
    """Names matched, case-insensitively, against the end of NVML's device name at a word
    boundary (``H100 80GB HBM3`` matches ``NVIDIA H100 80GB HBM3``)."""
    sources: list[str]
    """Where each fact comes from (datasheet / whitepaper titles and URLs)."""
    notes: str = ""
    host_ram: HostRAM | None = None
    """The typical host's RAM (docs/gpus.md); None: not known, host RAM is checked only with --cpu-mem."""

    # ----------------------------------------------------------------- validation
    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _SLUG.match(v):
            raise ValueError("must be lowercase letters, digits, '.', '_' or '-'")
        return v

    @field_validator("aliases")
    @classmethod
    def _check_aliases(cls, v: list[str]) -> list[str]:
        for a in v:
            if not _SLUG.match(a):
                raise ValueError(f"alias {a!r} must be lowercase letters, digits, '.', '_' or '-'")
        if len(set(v)) != len(v):
            raise ValueError("duplicate alias")
        return v

    @field_validator("memory_bytes")
    @classmethod
    def _check_memory(cls, v: int) -> int:
        if v < 256 * MIB:
            raise ValueError("must be the total memory in bytes (at least 256 MiB)")
        if v > 2**44:  # 16 TiB: the byte counts of the --json documents stay below 2**63 (docs/contract.md)
            raise ValueError(f"{v:,} bytes is over memplan's bound of 16 TiB per GPU (the largest, B300, has 288 GB)")
        return v

    @field_validator("compute_capability")
    @classmethod
    def _check_cc(cls, v: tuple[int, int]) -> tuple[int, int]:
        if v[0] < 1 or v[1] < 0:
            raise ValueError("must be [major, minor], e.g. [8, 0]")
        return v

    @field_validator("tflops")
    @classmethod
    def _check_tflops(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("needs at least one dtype")
        for k, x in v.items():
            if k not in DTYPES:
                raise ValueError(f"unknown dtype {k!r} (allowed: {', '.join(DTYPES)})")
            if not x > 0:
                raise ValueError(f"{k} must be > 0")
        return v

    @field_validator("memory_bandwidth_gbs", "pcie_gbs")
    @classmethod
    def _check_positive(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("must be > 0")
        return v

    @field_validator("nvlink_gbs")
    @classmethod
    def _check_nvlink(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError("must be > 0, or null when the GPU has no NVLink")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> GPUProfile:
        if self.cuda_context_bytes >= self.memory_bytes:
            raise ValueError("cuda_context_bytes must be smaller than memory_bytes")
        for flag in ("bf16", "fp8"):
            has = flag in self.tflops
            if getattr(self, flag) and not has:
                raise ValueError(f"{flag} is true but tflops has no {flag!r} entry")
            if has and not getattr(self, flag):
                raise ValueError(f"tflops has a {flag!r} entry but {flag} is false")
        return self

    # ----------------------------------------------------------------- helpers
    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30

    def all_names(self) -> list[str]:
        """The profile name and its aliases."""
        return [self.name, *self.aliases]


# --------------------------------------------------------------------------- loading
def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _validation_message(origin: str, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = str(first.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    msg = msg[:1].lower() + msg[1:]
    where = f"{loc}: " if loc else ""
    return _one_line(f"{origin}: invalid GPU profile: {where}{msg}")


def _parse(origin: str, text: str) -> GPUProfile:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{origin}: invalid GPU profile: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict):
        raise UserError(f"{origin}: invalid GPU profile: expected a JSON object")
    try:
        return GPUProfile.model_validate(data)
    except ValidationError as e:
        raise UserError(_validation_message(origin, e)) from None


def load_profile_file(path: str | os.PathLike[str]) -> GPUProfile:
    """Load and validate a user's JSON profile file; UserError (one line) when it is not valid."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such GPU profile file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(_one_line(f"{path}: cannot read GPU profile: {e}")) from None
    return _parse(str(path), text)


@functools.lru_cache(maxsize=None)
def _registry() -> tuple[dict[str, GPUProfile], dict[str, str]]:
    """Bundled profiles by name, and every lowercase name/alias -> profile name."""
    profiles: dict[str, GPUProfile] = {}
    index: dict[str, str] = {}
    folder = resources.files(__name__)
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        prof = _parse(f"memplan/inputs/profiles/{entry.name}", entry.read_text(encoding="utf-8"))
        if prof.name in profiles:
            raise RuntimeError(f"duplicate bundled GPU profile name {prof.name!r}")
        profiles[prof.name] = prof
        for key in prof.all_names():
            if key in index:
                raise RuntimeError(f"GPU name {key!r} is used by both {index[key]} and {prof.name}")
            index[key] = prof.name
    return profiles, index


def list_gpus() -> list[GPUProfile]:
    """All bundled profiles, sorted by name."""
    profiles, _ = _registry()
    return [profiles[n] for n in sorted(profiles)]


def _suggest(query: str) -> list[str]:
    profiles, index = _registry()
    out: list[str] = []

    def add(key: str) -> None:
        if key not in out:
            out.append(key)

    for key in difflib.get_close_matches(query, list(index), n=4, cutoff=0.6):
        add(key)
        add(index[key])
    if len(query) >= 2:
        for name in sorted(profiles):
            if name.startswith(query):
                add(name)
    return out[:6]


def _looks_like_path(name: str) -> bool:
    from memplan.inputs.catalog import existing_path  # a name no file system accepts is not a path

    path = existing_path(name)
    return name.lower().endswith(".json") or "/" in name or os.sep in name or (path is not None and path.is_file())


@functools.lru_cache(maxsize=64)
def load_gpu(name: str) -> GPUProfile:
    """Resolve a GPU: profile name or alias (any case), ``auto``, or a path to a JSON profile."""
    raw = (name or "").strip()
    if not raw:
        raise UserError("empty GPU name (memplan gpus lists them)")
    key = raw.lower()
    if key == "auto":
        nvml_name, total, cc = read_nvml()
        prof = profile_from_nvml(nvml_name, total, cc)
        host = read_host_ram()  # the GPU in this machine runs with this machine's RAM
        return prof if host is None else prof.model_copy(update={"host_ram": host})
    profiles, index = _registry()
    if key in index:
        return profiles[index[key]]
    if _looks_like_path(raw):
        return load_profile_file(raw)
    hint = _suggest(key)
    if hint:
        raise UserError(f"unknown GPU {raw!r}; did you mean: {', '.join(hint)}? (memplan gpus lists them)")
    raise UserError(f"unknown GPU {raw!r} (memplan gpus lists them; or pass a JSON profile file)")


# --------------------------------------------------------------------------- auto
def _norm(s: str) -> str:
    return " ".join(s.lower().split())


def _match_len(nvml_name: str, pattern: str) -> int:
    """Length of ``pattern`` if the NVML name ends with it at a word boundary, else 0."""
    n, p = _norm(nvml_name), _norm(pattern)
    if not p or not n.endswith(p):
        return 0
    before = n[: len(n) - len(p)]
    if before and before[-1].isalnum():
        return 0
    return len(p)


#: Generic lower-bound speed profiles for GPUs that match nothing (see profile_from_nvml).
_LOWER_BOUND_BF16 = "a10g-24g"
_LOWER_BOUND_NO_BF16 = "t4-16g"


def profile_from_nvml(
    nvml_name: str,
    total_bytes: int,
    compute_capability: tuple[int, int] | None = None,
) -> GPUProfile:
    """Map what NVML reports about a GPU to a profile (the logic behind ``--gpu auto``).

    A profile matches when the NVML name ends with one of its ``nvml_names`` at a word boundary;
    among matches the one with the closest memory wins. The matched profile is returned with
    ``memory_bytes`` set to what this machine's driver reports. A GPU that matches nothing gets a
    profile built from NVML with conservative defaults, said in ``notes``.
    """
    nvml_name = " ".join(str(nvml_name).split())
    total_bytes = int(total_bytes)
    profiles = list_gpus()

    best: tuple[int, int, GPUProfile] | None = None  # (memory distance, -match length, profile)
    for prof in profiles:
        length = max((_match_len(nvml_name, pat) for pat in prof.nvml_names), default=0)
        if length:
            cand = (abs(prof.memory_bytes - total_bytes), -length, prof)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is not None:
        prof = best[2]
        if prof.memory_bytes == total_bytes:
            return prof
        note = (
            f"memory_bytes is what NVML reports on this machine ({total_bytes} B = "
            f"{total_bytes / MIB:.0f} MiB); the bundled profile says {prof.memory_bytes} B."
        )
        return prof.model_copy(update={"memory_bytes": total_bytes, "notes": _join(prof.notes, note)})

    return _unknown_profile(nvml_name, total_bytes, compute_capability, profiles)


def _join(a: str, b: str) -> str:
    return f"{a} {b}".strip() if a else b


def _unknown_profile(
    nvml_name: str,
    total_bytes: int,
    compute_capability: tuple[int, int] | None,
    profiles: list[GPUProfile],
) -> GPUProfile:
    cc_known = compute_capability is not None
    cc = tuple(compute_capability) if cc_known else (7, 0)
    bf16 = cc >= (8, 0)
    fp8 = cc >= (8, 9)
    flash = (8, 0) <= cc < (10, 0)

    same_cc = [p for p in profiles if p.compute_capability == cc]
    if same_cc:
        base = min(same_cc, key=_headline_tflops)
        speed_from = f"the slowest bundled profile with the same compute capability ({base.name})"
    else:
        by_name = {p.name: p for p in profiles}
        base = by_name[_LOWER_BOUND_BF16 if bf16 else _LOWER_BOUND_NO_BF16]
        speed_from = f"a lower-bound profile ({base.name})"

    tflops = {k: v for k, v in base.tflops.items() if (k != "bf16" or bf16) and (k != "fp8" or fp8)}
    half = tflops.get("bf16") or tflops.get("fp16") or tflops["fp32"]
    if bf16 and "bf16" not in tflops:
        tflops["bf16"] = half
    if fp8 and "fp8" not in tflops:
        tflops["fp8"] = tflops.get("bf16", half)  # no FP8 speed-up assumed

    context = max(p.cuda_context_bytes for p in profiles)
    slug = re.sub(r"[^a-z0-9]+", "-", nvml_name.lower()).strip("-") or "gpu"
    cc_text = f"{cc[0]}.{cc[1]}" if cc_known else "unknown (assumed 7.0)"
    notes = (
        f"Not a bundled profile: built from NVML (name {nvml_name!r}, total memory {total_bytes} B, "
        f"compute capability {cc_text}). Conservative defaults: speeds and memory bandwidth from "
        f"{speed_from}, no NVLink assumed, CUDA context set to the largest bundled value. "
        "Write a profile file for accurate plans (docs/gpus.md)."
    )
    return base.model_copy(
        update={
            "name": f"auto-{slug}",
            "full_name": nvml_name or "unknown NVIDIA GPU",
            "aliases": [],
            "memory_bytes": total_bytes,
            "compute_capability": cc,
            "bf16": bf16,
            "fp8": fp8,
            "flash_attention": flash,
            "tflops": tflops,
            "nvlink_gbs": None,
            "cuda_context_bytes": min(context, total_bytes // 2),
            "nvml_names": [nvml_name],
            "sources": ["NVML on this machine", *base.sources],
            "notes": notes,
        }
    )


def _headline_tflops(p: GPUProfile) -> float:
    return p.tflops.get("bf16") or p.tflops.get("fp16") or p.tflops["fp32"]


def read_host_ram() -> HostRAM | None:
    """This machine's physical memory (the kernel's MemTotal, as sysconf reports it), or None where the
    platform does not say (psutil is not a dependency)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    if total <= 0:
        return None
    return HostRAM(per_node_bytes=total, host="this machine",
                   source="os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') (the kernel's MemTotal)")


def read_nvml() -> tuple[str, int, tuple[int, int] | None]:
    """Name, total memory (bytes) and compute capability of the first visible NVIDIA GPU.

    "First visible" honours CUDA_VISIBLE_DEVICES (an index or a GPU UUID) like CUDA does.
    Raises UserError when there is no driver or no GPU.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        raise UserError("--gpu auto: no NVIDIA GPU found (CUDA_VISIBLE_DEVICES is empty)")
    try:
        import pynvml
    except ImportError:
        raise UserError("--gpu auto: no NVIDIA GPU found (NVML: nvidia-ml-py is not installed)") from None

    def fail(err: object) -> UserError:
        return UserError(_one_line(f"--gpu auto: no NVIDIA GPU found (NVML: {err})"))

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise fail(e) from None
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            raise fail("no devices")
        first = visible.split(",")[0].strip() if visible else "0"
        if first.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        name = pynvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        try:
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            cc: tuple[int, int] | None = (int(major), int(minor))
        except pynvml.NVMLError:
            cc = None
    except pynvml.NVMLError as e:
        raise fail(e) from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down is best effort
            pass
    return str(name), total, cc
