"""The emitted files as text (render), and writing them (write): checked before the search runs, written
atomically, never over a user's file without `force`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from memplan import __version__
from memplan.emit.accelerate_yaml import accelerate_config
from memplan.emit.common import (ACCELERATE_YAML, BNB_CONFIG, DS_CONFIG, LAUNCH_SH, LORA_CONFIG, PLAN_JSON, TRAIN_PY,
                                 TRAINING_ARGS, uses_deepspeed)
from memplan.emit.ds_config import deepspeed_config
from memplan.emit.finetune import bnb_kwargs, lora_config
from memplan.emit.launch import launch_script, launch_section
from memplan.emit.trainer import training_arguments, training_arguments_py
from memplan.errors import UserError
from memplan.estimator.finetune import uses_adapters
from memplan.inputs.modelspec import ModelSpec

KINDS = ("trainer", "deepspeed", "accelerate")
TRAINING_ARGS_PY = "training_args.py"
# The files each kind may write, whatever the plan turns out to be: the CLI refuses a clash with any of
# them before it searches. The trainer and accelerate files point at ds_config.json under DeepSpeed, so
# it comes with them; train.py's LoRA and quantisation configs with the trainer files; plan.json always.
# launch.sh starts train.py, which only the trainer kind writes (launch.py command), so it is the trainer's.
MAY_WRITE = {"trainer": (TRAINING_ARGS, TRAINING_ARGS_PY, TRAIN_PY, LAUNCH_SH, DS_CONFIG, LORA_CONFIG, BNB_CONFIG),
             "deepspeed": (DS_CONFIG,),
             "accelerate": (ACCELERATE_YAML, DS_CONFIG)}


def sidecar(plan, launch: dict | None = None) -> dict:
    """plan.json: the memplan version, the predicted peak, the plan with its estimate, and `launch`
    (docs/emit.md). `memplan verify --plan` reads it."""
    doc = {"memplan_version": __version__, "predicted_device_used_bytes": plan.estimate.device_used_bytes,
           "predicted_peak_allocated_bytes": plan.estimate.peak_allocated_bytes, "plan": plan.model_dump(mode="json")}
    if launch is not None:
        doc["launch"] = launch
    return doc


def render(plan, spec: ModelSpec, what: tuple[str, ...]) -> dict[str, str]:
    """File name -> text for the requested kinds (trainer, deepspeed, accelerate), plus plan.json, and
    train.py + launch.sh where the HF Trainer can run the plan (with lora_config.json / bnb_config.json
    for LoRA / QLoRA)."""
    import yaml

    out: dict[str, str] = {}
    if "trainer" in what and (plan.pp == 1 or what == ("trainer",)):  # pipelines: said in launch.not_expressed
        kw = training_arguments(plan, spec)
        out[TRAINING_ARGS] = json.dumps(kw, indent=1) + "\n"
        out[TRAINING_ARGS_PY] = training_arguments_py(plan, kw)
        out[TRAIN_PY] = (Path(__file__).parent / "train.py").read_text(encoding="utf-8")
        out |= method_files(plan, spec)
    if "accelerate" in what:
        head = (f"# memplan {__version__}: {plan.estimate.model.name}, predicted peak "
                f"{plan.estimate.device_used_bytes / 2**30:.2f} GiB per GPU; see plan.json\n")
        out[ACCELERATE_YAML] = head + yaml.safe_dump(accelerate_config(plan, spec), sort_keys=False)
    # a DeepSpeed plan's TrainingArguments and accelerate YAML name ds_config.json: it comes with them
    if uses_deepspeed(plan) and ("deepspeed" in what or TRAINING_ARGS in out or ACCELERATE_YAML in out):
        out[DS_CONFIG] = json.dumps(deepspeed_config(plan, spec), indent=1) + "\n"
    launch = launch_section(plan, set(out), spec)
    if launch["command"]:
        out[LAUNCH_SH] = launch_script(launch)
    out[PLAN_JSON] = json.dumps(sidecar(plan, launch), indent=1) + "\n"
    return out


def method_files(plan, spec: ModelSpec) -> dict[str, str]:
    """lora_config.json for LoRA / QLoRA, bnb_config.json for QLoRA (train.py reads them)."""
    out: dict[str, str] = {}
    if uses_adapters(plan.workload.method):
        out[LORA_CONFIG] = json.dumps(lora_config(plan, spec), indent=1) + "\n"
    if plan.workload.method == "qlora":
        out[BNB_CONFIG] = json.dumps(bnb_kwargs(plan.workload), indent=1) + "\n"
    return out


def check_directory(directory: str, names: tuple[str, ...] = (), force: bool = False) -> None:
    """Refuse, before any search, an -o that cannot take the files: empty, not a directory, not writable,
    or holding one of `names` (without force). Creates nothing: the nearest folder that exists is probed,
    so a search that ends with nothing to write leaves no empty directory behind."""
    if directory == "-":
        return
    if not directory.strip():
        raise UserError("-o: empty directory name (use -o . for the working directory, - to print)")
    try:
        _check_existing(Path(directory), directory, names, force)
    except (OSError, ValueError) as e:  # a name no file system takes (too long, a NUL byte)
        raise UserError(f"-o: cannot write there ({getattr(e, 'strerror', None) or e})") from None


def _check_existing(d: Path, directory: str, names: tuple[str, ...], force: bool) -> None:
    if d.exists() and not d.is_dir():
        raise UserError(f"-o {directory}: not a directory")
    clash = [name for name in names if (d / name).exists()]
    if clash and not force:
        raise UserError(f"-o {directory}: {', '.join(clash)} already exist(s); pass --force to overwrite")
    nearest = next(p for p in (d, *d.parents) if p.exists())  # '.' ends a relative path's parents
    if not nearest.is_dir():
        raise UserError(f"-o {directory}: cannot write there ({nearest} is not a directory)")
    try:
        with tempfile.NamedTemporaryFile(dir=nearest, prefix=".memplan-probe-"):
            pass
    except OSError as e:
        raise UserError(f"-o {directory}: cannot write there ({e.strerror or e})") from None


def emit_kinds(emit: str) -> tuple[str, ...]:
    """The kinds `--emit` names (`all`: every kind)."""
    return KINDS if emit == "all" else (emit,)


def emit_names(emit: str) -> tuple[str, ...]:
    """The files `--emit KIND` may write (checked for clashes before the search)."""
    return tuple(dict.fromkeys(n for k in emit_kinds(emit) for n in MAY_WRITE[k])) + (PLAN_JSON,)


def write(files: dict[str, str], directory: str, force: bool = False) -> list[str]:
    """Write each file atomically (a temporary file renamed over the target); refuse to overwrite an
    existing file unless `force`. `directory` '-' prints them to stdout instead."""
    if directory == "-":
        for name, text in files.items():
            print(f"# ---- {name}\n{text}", end="" if text.endswith("\n") else "\n")
        return []
    check_directory(directory, tuple(files), force)
    d = Path(directory)
    written, name = [], directory
    try:
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            target, tmp = d / name, d / f".{name}.memplan-tmp"
            tmp.write_text(text, encoding="utf-8")
            if name.endswith(".sh"):
                tmp.chmod(0o755)
            os.replace(tmp, target)
            written.append(str(target))
    except OSError as e:
        raise UserError(f"-o {directory}: cannot write {name} ({e.strerror or e})") from None
    return written
