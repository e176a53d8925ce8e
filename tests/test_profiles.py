"""GPU profiles: bundled files validate, names resolve, user files load, `auto` maps NVML facts."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pynvml
import pytest

import memplan.inputs.profiles as prof
from memplan.errors import UserError
from memplan.inputs.profiles import GPUProfile, list_gpus, load_gpu, profile_from_nvml

MIB = 2**20
PROFILE_FILES = sorted(p for p in resources.files("memplan.inputs.profiles").iterdir() if p.name.endswith(".json"))
EXPECTED = {
    "v100-16g", "v100-32g", "t4-16g", "a10g-24g", "l4-24g", "l40s-48g", "a6000-48g",
    "a100-40g", "a100-80g", "h100-80g", "h100-pcie-80g", "h200-141g", "rtx3090-24g", "rtx4090-24g",
}


@pytest.fixture(autouse=True)
def _fresh_cache():
    load_gpu.cache_clear()
    yield
    load_gpu.cache_clear()


def _user_profile(**changes) -> dict:
    data = load_gpu("a100-80g").model_dump(mode="json")
    data.update(name="my-a100", aliases=[], full_name="My A100", nvml_names=[])
    data.update(changes)
    return data


# ------------------------------------------------------------------ bundled files
@pytest.mark.parametrize("entry", PROFILE_FILES, ids=lambda e: e.name)
def test_every_profile_file_validates(entry):
    data = json.loads(entry.read_text(encoding="utf-8"))
    p = GPUProfile.model_validate(data)
    assert entry.name == f"{p.name}.json"
    assert p.sources and p.nvml_names
    assert set(p.tflops) <= set(prof.DTYPES) and "fp32" in p.tflops
    assert 0 < p.cuda_context_bytes < 2 * 2**30


def test_expected_profiles_present_and_sorted():
    names = [p.name for p in list_gpus()]
    assert set(names) == EXPECTED
    assert names == sorted(names)


def test_names_and_aliases_unique_across_profiles():
    seen: dict[str, str] = {}
    for p in list_gpus():
        for key in p.all_names():
            assert key == key.lower()
            assert key not in seen, f"{key} used by {seen.get(key)} and {p.name}"
            seen[key] = p.name


def test_nvml_names_unambiguous():
    """No NVML pattern of one profile is matched by another profile's full NVML name."""
    for p in list_gpus():
        for pat in p.nvml_names:
            owners = {q.name for q in list_gpus() if any(prof._match_len(pat, x) for x in q.nvml_names)}
            assert owners == {p.name}, (pat, owners)


# ------------------------------------------------------------------ resolution
@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("v100", "v100-16g"), ("V100", "v100-16g"), ("a100", "a100-40g"), ("A100-80GB", "a100-80g"),
        ("h100", "h100-80g"), ("H100", "h100-80g"), ("h100-PCIe", "h100-pcie-80g"), ("t4", "t4-16g"),
        ("4090", "rtx4090-24g"), ("RTX3090", "rtx3090-24g"), ("  l4 ", "l4-24g"), ("H200", "h200-141g"),
    ],
)
def test_aliases_resolve_any_case(alias, name):
    assert load_gpu(alias).name == name


def test_every_name_and_alias_resolves_to_its_profile():
    for p in list_gpus():
        for key in p.all_names():
            assert load_gpu(key) is p
            assert load_gpu(key.upper()) is p


def test_unknown_name_did_you_mean():
    with pytest.raises(UserError) as e:
        load_gpu("v10")
    msg = str(e.value)
    assert msg.startswith("unknown GPU 'v10'; did you mean: ")
    assert "v100, v100-16g" in msg and "memplan gpus" in msg
    assert "\n" not in msg


def test_unknown_name_without_suggestion():
    with pytest.raises(UserError, match="unknown GPU 'zzzzzz'"):
        load_gpu("zzzzzz")


# ------------------------------------------------------------------ user files
def test_user_profile_file_loads(tmp_path):
    f = tmp_path / "my.json"
    f.write_text(json.dumps(_user_profile()))
    p = load_gpu(str(f))
    assert p.name == "my-a100" and p.memory_bytes == 81920 * MIB
    assert prof.load_profile_file(f) == p


def test_user_file_missing_field_one_line_error(tmp_path):
    data = _user_profile()
    del data["memory_bytes"]
    f = tmp_path / "my.json"
    f.write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        load_gpu(str(f))
    msg = str(e.value)
    assert msg == f"{f}: invalid GPU profile: memory_bytes: field required"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"memory_bytes": "lots"}, "memory_bytes"),
        ({"memory_bytes": 2**80}, "memory_bytes"),  # the --json byte counts had passed 2**63
        ({"tflops": {"fp64": 10.0}}, "tflops"),
        ({"compute_capability": [8]}, "compute_capability"),
        ({"bf16": False}, "bf16"),  # bf16 false but tflops has a bf16 entry
        ({"surprise": 1}, "surprise"),
        ({"nvlink_gbs": -1}, "nvlink_gbs"),
    ],
)
def test_user_file_invalid_field_one_line_error(tmp_path, changes, field):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(_user_profile(**changes)))
    with pytest.raises(UserError) as e:
        load_gpu(str(f))
    msg = str(e.value)
    assert msg.startswith(f"{f}: invalid GPU profile: ")
    assert field in msg
    assert "\n" not in msg


def test_user_file_not_json_and_missing(tmp_path):
    f = tmp_path / "broken.json"
    f.write_text("{not json")
    with pytest.raises(UserError, match="broken.json: invalid GPU profile: not valid JSON"):
        load_gpu(str(f))
    f.write_text("[1, 2]")
    with pytest.raises(UserError, match="expected a JSON object"):
        load_gpu(str(f))
    with pytest.raises(UserError, match="no such GPU profile file"):
        load_gpu(str(tmp_path / "nope.json"))


# ------------------------------------------------------------------ auto mapping
@pytest.mark.parametrize(
    ("nvml_name", "total", "cc", "name"),
    [
        ("Tesla V100-SXM2-16GB", 16945512448, (7, 0), "v100-16g"),
        ("Tesla V100-SXM2-16GB", 16384 * MIB, (7, 0), "v100-16g"),  # R510+ driver total
        ("Tesla V100-SXM2-32GB", 32768 * MIB, (7, 0), "v100-32g"),
        ("NVIDIA A100-SXM4-80GB", 81920 * MIB, (8, 0), "a100-80g"),
        ("NVIDIA A100-SXM4-40GB", 40536 * MIB, (8, 0), "a100-40g"),  # R470 driver total
        ("NVIDIA H100 80GB HBM3", 85520809984, (9, 0), "h100-80g"),
        ("NVIDIA H100 PCIe", 81559 * MIB, (9, 0), "h100-pcie-80g"),
        ("NVIDIA H200", 143771 * MIB, (9, 0), "h200-141g"),
        ("NVIDIA GeForce RTX 4090", 24564 * MIB, (8, 9), "rtx4090-24g"),
        ("NVIDIA GeForce RTX 3090", 24576 * MIB, (8, 6), "rtx3090-24g"),
        ("GeForce RTX 3090", 24268 * MIB, (8, 6), "rtx3090-24g"),
        ("Tesla T4", 15360 * MIB, (7, 5), "t4-16g"),
        ("NVIDIA A10G", 23028 * MIB, (8, 6), "a10g-24g"),
        ("NVIDIA L4", 23034 * MIB, (8, 9), "l4-24g"),
        ("NVIDIA L40S", 46068 * MIB, (8, 9), "l40s-48g"),
        ("NVIDIA RTX A6000", 49140 * MIB, (8, 6), "a6000-48g"),
    ],
)
def test_auto_mapping(nvml_name, total, cc, name):
    p = profile_from_nvml(nvml_name, total, cc)
    assert p.name == name
    assert p.memory_bytes == total  # what this machine's driver says


def test_auto_mapping_keeps_bundled_object_when_memory_matches():
    assert profile_from_nvml("NVIDIA H100 80GB HBM3", 81559 * MIB, (9, 0)) is load_gpu("h100-80g")


@pytest.mark.parametrize(
    ("nvml_name", "total", "cc"),
    [
        ("NVIDIA H100 NVL", 95830 * MIB, (9, 0)),
        ("NVIDIA GeForce RTX 4090 D", 24564 * MIB, (8, 9)),
        ("NVIDIA L40", 46068 * MIB, (8, 9)),  # must not match L4 or L40S
        ("NVIDIA GeForce RTX 5090", 32607 * MIB, (12, 0)),
        ("Tesla V100-PCIE-16GB", 16160 * MIB, (7, 0)),
        ("NVIDIA T400 4GB", 4096 * MIB, (7, 5)),
    ],
)
def test_auto_unknown_gpu_built_from_nvml(nvml_name, total, cc):
    p = profile_from_nvml(nvml_name, total, cc)
    assert p.name.startswith("auto-")
    assert p.full_name == nvml_name
    assert p.memory_bytes == total and p.compute_capability == cc
    assert p.nvlink_gbs is None
    assert "Not a bundled profile" in p.notes
    assert p.bf16 == (cc >= (8, 0)) and p.fp8 == (cc >= (8, 9))
    assert ("bf16" in p.tflops) == p.bf16 and ("fp8" in p.tflops) == p.fp8
    assert p.cuda_context_bytes >= max(q.cuda_context_bytes for q in list_gpus()) or p.memory_bytes < 4 * 2**30
    GPUProfile.model_validate(p.model_dump())  # still a valid profile


def test_auto_unknown_same_cc_uses_slowest_matching_arch():
    p = profile_from_nvml("Tesla V100-PCIE-16GB", 16160 * MIB, (7, 0))
    assert p.tflops["fp16"] == 125.0 and not p.flash_attention
    q = profile_from_nvml("NVIDIA GeForce RTX 5090", 32607 * MIB, (12, 0))
    assert q.tflops["bf16"] <= load_gpu("a10g-24g").tflops["bf16"]
    assert not q.flash_attention


class _FakeMem:
    total = 85520809984
    free = used = 0


def test_auto_via_monkeypatched_pynvml(monkeypatch):
    calls = []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: ("handle", i))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: _FakeMem())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCudaComputeCapability", lambda h: (9, 0))
    assert load_gpu("auto").name == "h100-80g"
    assert load_gpu("AUTO").name == "h100-80g"
    assert calls[0] == "init" and "shutdown" in calls


def test_auto_without_driver_is_user_error(monkeypatch):
    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    with pytest.raises(UserError) as e:
        load_gpu("auto")
    msg = str(e.value)
    assert msg.startswith("--gpu auto: no NVIDIA GPU found (NVML: ")
    assert "\n" not in msg


def test_auto_with_empty_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(UserError, match="no NVIDIA GPU found"):
        load_gpu("auto")


# ------------------------------------------------------------------ facts sanity
def test_dtype_support_by_architecture():
    for p in list_gpus():
        cc = p.compute_capability
        assert p.bf16 == (cc >= (8, 0)), p.name
        assert p.flash_attention == (cc >= (8, 0)), p.name
        assert p.fp8 == (cc >= (8, 9)), p.name
    for name in ("v100", "v100-32g", "t4"):
        assert not load_gpu(name).bf16 and not load_gpu(name).flash_attention
    for name in ("a100", "a100-80g", "h100", "h200", "l4", "a10g"):
        assert load_gpu(name).bf16


def test_throughput_and_memory_figures_are_consistent():
    for p in list_gpus():
        # tensor fp16 never slower than CUDA-core fp32; dense figures only: no GPU here reaches 1000 dense
        # bf16 TFLOPS (H100's 1979 is the 2:4-sparse figure)
        assert p.tflops.get("fp16", p.tflops["fp32"]) >= p.tflops["fp32"], p.name
        assert p.tflops.get("bf16", 0) < 1000, p.name
        # the driver's total is close to the size in the name (GiB vs GB, reserved pages)
        assert 0.5 < p.memory_bytes / 2**30 / float(p.name.rsplit("-", 1)[1].rstrip("g")) < 1.1, p.name


def test_profiles_are_frozen():
    with pytest.raises(Exception):
        load_gpu("h100").memory_bytes = 1


def test_profiles_load_without_torch():
    """Loading profiles imports no torch (timings belong in benchmarks/, not in a unit test)."""
    code = ("import sys; import memplan.inputs.profiles as p; p.list_gpus(); p.load_gpu('h100'); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docs_table_lists_every_profile():
    doc = Path(__file__).resolve().parents[1] / "docs" / "gpus.md"
    if not doc.exists():
        pytest.skip("docs/gpus.md not present")
    text = doc.read_text(encoding="utf-8")
    for p in list_gpus():
        assert f"`{p.name}`" in text, p.name
