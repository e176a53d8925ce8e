"""`memplan` command line: thin over memplan.api. Every command takes --json; user errors exit 2 with
one line on stderr."""

from __future__ import annotations

import functools
import json
import math
import sys

import click

from memplan import __version__
from memplan.errors import UserError
from memplan.inputs import defaults
from memplan.inputs.workload import METHOD_KNOBS, Workload

MODEL_HELP = "catalog name (bert-large), hub id, or path to a config.json / model folder"
GPU_HELP = "GPU profile name (v100-16g), alias (a100), 'auto', or a profile JSON file"
PRECISION_HELP = ("; ".join(f"{p}: {what}" for p, what in defaults.PRECISION_HELP.items())
                  + " [default: train bf16 (fp16 without bf16 support), infer bf16-pure (fp16-pure)]")


def _emit_json(doc) -> None:
    click.echo(doc.model_dump_json(indent=1) if hasattr(doc, "model_dump_json") else json.dumps(doc, indent=1))


def _momentum(optim_args: str | None) -> float:
    """HF TrainingArguments.optim_args style: 'momentum=0.9,nesterov=True'; memplan reads momentum."""
    if not optim_args:
        return 0.0
    seen: dict[str, str] = {}
    for item in optim_args.split(","):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not key or not eq:
            raise UserError(f"--optim-args: {item!r} is not key=value")
        if key in seen:
            raise UserError(f"--optim-args names {key} twice")
        seen[key] = value
    if "momentum" not in seen:
        return 0.0
    try:
        return float(seen["momentum"])
    except ValueError:
        raise UserError(f"--optim-args: momentum must be a number, got {seen['momentum']!r}") from None


def common_options(f, required: bool = True):
    for opt in reversed([
        click.option("--model", "-m", required=required, help=MODEL_HELP),
        click.option("--gpu", "-g", required=required, help=GPU_HELP),
        click.option("--task", type=click.Choice(["train", "infer"]), default="train", show_default=True),
        click.option("--seq-len", type=int, help="tokens per sequence [default: model maximum, capped at "
                     + " / ".join(f"{cap} ({arch}s)" for arch, cap in defaults.SEQ_CAP.items()) + "]"),
        click.option("--optim", help=f"HF TrainingArguments optim name or 'adamw' [default: {defaults.OPTIM}]"),
        click.option("--optim-args", help="optimizer arguments, e.g. 'momentum=0.9' for sgd"),
        click.option("--attn", help="eager, sdpa, flash, memplan (memplan.kernels' tiled attention; transformers "
                     "attn_implementation names accepted) [default: sdpa where the model has it, else eager; "
                     "suggest: searched]"),
        click.option("--head", help="model head: causal-lm, sequence-classification, seq2seq-lm, "
                     "image-classification, masked-lm, token-classification, question-answering, base"),
        click.option("--zero-grad", type=click.Choice(["set-to-none", "zeros"]), default="set-to-none",
                     show_default=True, help="zeros: gradients stay allocated between steps (torch 1.x)"),
        click.option("--headroom", type=float, default=0.05, show_default=True,
                     help="fraction of GPU memory to keep free"),
        click.option("--trust-remote-code", is_flag=True, help="allow custom modelling code from the hub"),
        click.option("--kernels", is_flag=True, default=None, help="train with memplan's fused linear + cross-entropy "
                     "(memplan.kernels.apply(model)): no b x s x vocab logits [default: off; suggest says what "
                     "it would gain]"),
        click.option("--tiled-mlp", is_flag=True, default=None, help="train with memplan's tiled MLP "
                     "(memplan.kernels.apply(model, mlp=True)): each layer keeps only its MLP input"),
        click.option("--expandable-segments/--no-expandable-segments", default=None,
                     help="run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (reserved grows by pages, not "
                     "segments) [default: off; suggest turns it on for a plan that fits only with it]"),
        click.option("--json", "as_json", is_flag=True, help="print one JSON document"),
    ]):
        f = opt(f)
    return f


def method_options(search: bool):
    """The fine-tuning method's options (docs/finetune.md), passed on as one `tuning` dict of the
    Workload fields the user set."""
    many = (", a comma list, or 'any' (full, lora, qlora; freeze too with --trainable-layers) [default: full; "
            "suggest says what LoRA / QLoRA allow]")
    opts = [
        click.option("--method", help="full, lora, qlora, freeze" + (many if search else " [default: full]")),
        click.option("--lora-r", type=int, help="LoRA rank (peft.LoraConfig r) [default: 8]"),
        click.option("--lora-alpha", type=float, help="LoRA alpha [default: 8]"),
        click.option("--lora-dropout", type=float, help="LoRA dropout [default: 0]"),
        click.option("--lora-targets", help="comma-separated module names (e.g. q_proj,v_proj) or all-linear "
                     "[default: PEFT's default for the model type]"),
        click.option("--modules-to-save", help="modules trained in full beside the adapters (e.g. lm_head); "
                     "with freeze, trained too"),
        click.option("--quant", type=click.Choice(["nf4", "fp4", "int8"]), help="qlora's base format [default: nf4]"),
        click.option("--double-quant/--no-double-quant", default=None, help="bnb_4bit_use_double_quant [default: on]"),
        click.option("--compute-dtype", type=click.Choice(["auto", "fp32", "fp16", "bf16"]),
                     help="bnb_4bit_compute_dtype [default: auto, the precision's half type]"),
        click.option("--quant-storage", type=click.Choice(["uint8", "fp16", "bf16", "fp32"]),
                     help="bnb_4bit_quant_storage [default: uint8]"),
        click.option("--trainable-layers", type=int, help="freeze: train the last K blocks and the head"),
    ]

    def deco(f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            given = {k: kwargs.pop(k) for k in ("method",) + METHOD_KNOBS}
            return f(*args, tuning={k: v for k, v in given.items() if v is not None}, **kwargs)
        for opt in reversed(opts):
            wrapper = opt(wrapper)
        return wrapper
    return deco


def generation_options(plan: bool = False):
    """Serving's generate options (`--task infer`), one definition for estimate, suggest and verify. plan: verify's,
    which default to the plan's (--plan) and so have no default of their own."""
    defaults = {k: Workload.model_fields[k].default for k in ("max_new_tokens", "beams", "kv_cache")}
    given = (lambda k: {}) if plan else (lambda k: {"default": defaults[k], "show_default": True})
    said = (lambda k: f" [default: {defaults[k]}]") if plan else (lambda k: "")
    opts = [
        click.option("--max-new-tokens", type=int, **given("max_new_tokens"),
                     help="infer: tokens each sequence generates (one greedy generate call; 0: one scoring forward)"
                     + said("max_new_tokens")),
        click.option("--beams", type=int, **given("beams"), help="infer: sequences per prompt" + said("beams")),
        click.option("--kv-cache", type=click.Choice(["dynamic", "static"]), **given("kv_cache"),
                     help="infer: generate's cache (static: StaticCache, allocated for the whole length up front)"
                     + said("kv_cache")),
    ]

    def deco(f):
        for o in reversed(opts):
            f = o(f)
        return f
    return deco


def _parallel_options(search: bool):
    """Multi-GPU options; `suggest` takes lists or 'any' where `estimate` takes one value."""
    many = " (one, a comma list, or 'any') [default: any]" if search else ""

    def deco(f):
        opts = [
            click.option("--gpus", type=int, default=1, show_default=True, help="GPUs per node"),
            click.option("--nodes", type=int, default=1, show_default=True),
            click.option("--zero", help="DeepSpeed ZeRO stage 0-3 (0: torch DDP)" + (
                many.replace("any]", "any; naming --fsdp alone leaves ZeRO at 0; on one GPU, ZeRO 1-3 only "
                             "where the plain Trainer does not fit]") or " [default: 0]")),
            click.option("--fsdp", help="PyTorch FSDP (accelerate) instead of DeepSpeed: none, full-shard, "
                         "shard-grad-op, hybrid-shard" + (many.replace("any]", "any over several GPUs; naming "
                                                                       "--zero alone leaves FSDP off]")
                                                          or " [default: none]")),
            click.option("--offload", help="DeepSpeed offload to CPU: none, optimizer, all (+ parameters, ZeRO-3)"
                         + (many or " [default: none]")),
            click.option("--tp", help="tensor-parallel degree, inside a node" + (many or " [default: 1]")),
            click.option("--pp", help="pipeline stages" + (many or " [default: 1]")),
            click.option("--sp", help="sequence parallel with TP: on, off" + (many or " [default: off]")),
            click.option("--vpp", help="virtual stages per GPU (interleaved 1F1B)" + (many or " [default: 1]")),
            click.option("--cpu-mem", type=float, help="host RAM per node in GiB, which offload must fit [default: "
                         "this machine's with --gpu auto, else the GPU profile's typical host, docs/gpus.md]"),
        ]
        if search:  # only the ranking's cost model reads the network
            opts.append(click.option("--net-gbs", type=float, help="inter-node GB/s per GPU [default: by GPU "
                                     "generation, docs/cost-model.md]"))
        for opt in reversed(opts):
            f = opt(f)
        return f
    return deco


def _one_int(value, name: str, default: int) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"--{name}: expected a number, got {value!r}") from None


def _parallel_work(gpus, nodes, zero, fsdp, offload, tp, pp, sp, vpp) -> dict:
    if sp not in (None, "on", "off"):
        raise UserError(f"--sp: expected on or off, got {sp!r}")
    # an empty --fsdp / --offload is refused by the Workload's choices, not read as none
    return dict(gpus=gpus, nodes=nodes, zero=_one_int(zero, "zero", 0), fsdp="none" if fsdp is None else fsdp,
                offload="none" if offload is None else offload, tp=_one_int(tp, "tp", 1), pp=_one_int(pp, "pp", 1),
                sp=sp == "on", vpp=_one_int(vpp, "vpp", 1))


def _cpu_mem(gib: float | None) -> int | None:
    """--cpu-mem GiB as bytes, inside constraints.BOUNDS["cpu_mem"] (NaN and infinities refused)."""
    from memplan.inputs.constraints import BOUNDS

    if gib is None:
        return None
    b = BOUNDS["cpu_mem"]
    if not math.isfinite(gib):
        raise UserError(f"--cpu-mem: must be a finite number, got {gib}")
    if not b.low <= gib * 2**30 <= b.high:  # said in the option's unit, GiB
        raise UserError(f"--cpu-mem {gib:,} GiB: reads {b.low / 2**20:,.0f} MiB to {b.high / 2**30:,.0f} GiB of "
                        f"host RAM per node ({b.why})")
    return int(gib * 2**30)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="memplan")
def cli() -> None:
    """Plan GPU memory for training and serving Hugging Face models."""


@cli.command()
@common_options
@click.option("--micro-batch", "-b", type=int, default=1, show_default=True, help="sequences per GPU per step")
@click.option("--grad-accum", type=int, default=1, show_default=True)
@click.option("--precision", help=PRECISION_HELP)
@click.option("--grad-ckpt", type=click.Choice(["none", "selective", "full"]), default="none", show_default=True)
@generation_options()
@_parallel_options(search=False)
@method_options(search=False)
def estimate(model, gpu, task, seq_len, optim, optim_args, attn, head, zero_grad, headroom, trust_remote_code,
             kernels, tiled_mlp, expandable_segments, as_json, micro_batch, grad_accum, precision, grad_ckpt, max_new_tokens, beams, kv_cache,
             gpus, nodes,
             zero, fsdp,
             offload, tp, pp, sp, vpp, cpu_mem, tuning) -> None:
    """Predict the memory of one configuration: breakdown and the three meters."""
    from memplan import api

    est = api.estimate(model, gpu, head=head, trust_remote_code=trust_remote_code, cpu_mem=_cpu_mem(cpu_mem), simulate=True,
                       task=task, micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum,
                       precision=precision, optim=optim, momentum=_momentum(optim_args), grad_ckpt=grad_ckpt,
                       attn=attn, max_new_tokens=max_new_tokens, beams=beams, kv_cache=kv_cache, zero_grad=zero_grad,
                       headroom=headroom, kernels=kernels, tiled_mlp=tiled_mlp,
                       expandable_segments=bool(expandable_segments),
                       **_parallel_work(gpus, nodes, zero, fsdp, offload, tp, pp, sp, vpp), **tuning)
    if as_json:
        _emit_json(est)
    else:
        from memplan.cli.report import print_estimate

        print_estimate(est)


@cli.command()
@common_options
@click.option("--batch-size", type=int, help=f"global batch in sequences [default: {defaults.GLOBAL_BATCH}]")
@click.option("--precision", help="one, a comma list, or 'any'; " + PRECISION_HELP)
@click.option("--grad-ckpt", help="none, selective, full, a comma list, or 'any' [default: any]")
@generation_options()
@click.option("--top", type=int, default=5, show_default=True, help="how many plans to show")
@click.option("--objective", type=click.Choice(["throughput", "min-gpus", "headroom"]), default="throughput",
              show_default=True, help="rank by speed, by the fewest GPUs that fit, or by free memory")
@_parallel_options(search=True)
@click.option("--emit", type=click.Choice(["trainer", "deepspeed", "accelerate", "all"]),
              help="write the first plan's launch files: TrainingArguments (JSON + .py), ds_config.json, "
              "accelerate_config.yaml, plan.json (with the launch section), train.py and launch.sh")
@click.option("-o", "--out", "out_dir", help="directory for --emit [default: .]; '-' prints")
@click.option("--force", is_flag=True, help="overwrite files that already exist")
@method_options(search=True)
def suggest(model, gpu, task, seq_len, optim, optim_args, attn, head, zero_grad, headroom, trust_remote_code,
            kernels, tiled_mlp, expandable_segments, as_json, batch_size, precision, grad_ckpt, max_new_tokens, beams,
            kv_cache, top, objective, gpus, nodes, zero, fsdp, offload, tp, pp, sp,
            vpp, cpu_mem, net_gbs, emit, out_dir, force, tuning) -> None:
    """Search the layout over the GPUs (TP, PP, DP, ZeRO / FSDP, offload), micro batch, accumulation,
    checkpointing and attention (precision and optimizer when you list them or say 'any'); rank what fits."""
    from memplan import api

    if not emit and (out_dir is not None or force):
        raise UserError("-o and --force go with --emit (which files to write)")
    out_dir = "." if out_dir is None else out_dir
    if emit:  # what cannot be written is refused before the search runs and prints
        from memplan import emit as emit_files

        if task != "train":
            raise UserError("--emit writes training configs; --task infer has none")
        if as_json and out_dir == "-":
            raise UserError("--emit -o - and --json both print to stdout; write the files to a directory")
        emit_files.check_directory(out_dir, emit_files.emit_names(emit), force)
    if emit == "deepspeed":  # a DeepSpeed file is asked for: plan with DeepSpeed
        zero = zero or "1,2,3"
        fsdp = fsdp or "none"
    s = api.suggest(model, gpu, head=head, trust_remote_code=trust_remote_code, task=task, seq_len=seq_len,
                    global_batch=batch_size, precision=precision, optim=optim, grad_ckpt=grad_ckpt, attn=attn,
                    max_new_tokens=max_new_tokens, beams=beams, kv_cache=kv_cache, momentum=_momentum(optim_args),
                    headroom=headroom, zero_grad=zero_grad, top=top,
                    objective=objective, gpus=gpus, nodes=nodes, zero=zero, fsdp=fsdp, offload=offload, tp=tp, pp=pp, sp=sp,
                    vpp=vpp, cpu_mem=_cpu_mem(cpu_mem), net_gbs=net_gbs, kernels=kernels, tiled_mlp=tiled_mlp,
                    expandable_segments=expandable_segments, **tuning)
    if as_json:
        _emit_json(s)
    else:
        from memplan.cli.report import print_suggestion

        print_suggestion(s)
    if emit:
        if not s.plans:
            raise UserError("nothing fits: no plan to emit")
        written = s.plans[0].write(out_dir, emit_files.emit_kinds(emit), force=force, spec=api.resolve_spec(model, head, trust_remote_code))
        if written and not as_json:
            click.echo("wrote " + ", ".join(written))


@cli.command()
@functools.partial(common_options, required=False)
@click.option("--micro-batch", "-b", type=int, help="sequences per GPU per step [default: 1]")
@click.option("--grad-accum", type=int, help="[default: 1]")
@click.option("--precision", help=PRECISION_HELP)
@click.option("--grad-ckpt", type=click.Choice(["none", "selective", "full"]), help="[default: none]")
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False), help="a plan: the plan.json that "
              "--emit wrote, or `suggest --json` output (its first plan, or --plan-index); options given here "
              "override the plan's")
@click.option("--plan-index", type=int, default=None, help="which plan of --plan FILE  [default: 0, the best]")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu", "fake"]), default="auto", show_default=True,
              help="cuda: real run on the GPU; cpu: real run on the CPU; fake: full-size trace with no memory; "
              "auto: cuda when there is a GPU, else fake")
@click.option("--steps", type=int, default=2, show_default=True, help="optimizer steps, at least 2: the "
              "estimate is the steady state, which the second step reaches (the first creates the optimizer state)")
@generation_options(plan=True)
@method_options(search=False)
def verify(model, gpu, task, seq_len, optim, optim_args, attn, head, zero_grad, headroom, trust_remote_code, kernels,
           tiled_mlp, expandable_segments, as_json,
           micro_batch, grad_accum, precision, grad_ckpt, plan_file, plan_index, device, steps, max_new_tokens, beams,
           kv_cache, tuning) -> None:
    """Run the planned training step or serving step (random weights, synthetic batches) and compare with the
    estimate.

    Exit codes: 0 ran (see the verdicts), 2 bad input, 3 the real run ran out of GPU memory."""
    from memplan.verify.run import run

    given = dict(task=task, seq_len=seq_len, optim=optim, attn=attn, micro_batch=micro_batch, grad_accum=grad_accum,
                 precision=precision, grad_ckpt=grad_ckpt, zero_grad=zero_grad, headroom=headroom, kernels=kernels,
                 tiled_mlp=tiled_mlp, max_new_tokens=max_new_tokens, beams=beams, kv_cache=kv_cache,
                 expandable_segments=expandable_segments, **tuning)
    if optim_args:
        given["momentum"] = _momentum(optim_args)
    report = run(model=model, gpu=gpu, head=head, trust_remote_code=trust_remote_code, plan_file=plan_file,
                 plan_index=plan_index, device=device, steps=steps, progress=True, **given)
    if as_json:
        _emit_json(report)
    else:
        from memplan.cli.report import print_verify

        print_verify(report)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def gpus(as_json) -> None:
    """List the bundled GPU profiles."""
    from memplan.inputs.profiles import list_gpus

    profiles = list_gpus()
    if as_json:
        _emit_json({"gpus": [p.model_dump(mode="json") for p in profiles]})
        return
    from rich.table import Table

    from memplan.cli.report import console

    t = Table("name", "GPU", "memory (driver)", "sm", "bf16", "flash", "dense TFLOP/s (fp16/bf16)", "aliases")
    for p in profiles:
        half = p.tflops.get("bf16") or p.tflops.get("fp16") or 0
        t.add_row(p.name, p.full_name, f"{p.memory_bytes / 2**30:.1f} GiB", ".".join(map(str, p.compute_capability)),
                  "yes" if p.bf16 else "no", "yes" if p.flash_attention else "no", f"{half:g}", ", ".join(p.aliases))
    console().print(t)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="print one JSON document")
def models(as_json) -> None:
    """List the bundled model catalog (works offline)."""
    from memplan.estimator.families import activation_method, describe
    from memplan.inputs.catalog import list_models

    entries = list_models()
    if as_json:
        _emit_json({"models": [{"name": e.name, "hf_id": e.hf_id, "aliases": e.aliases,
                                "model_type": e.spec.model_type, "family": describe(e.spec),
                                "activations": activation_method(e.spec), "head": e.spec.head,
                                "params_total": e.spec.params_total} for e in entries]})
        return
    from rich.table import Table

    from memplan.cli.report import console

    t = Table("name", "hub id", "type", "family", "activations", "default head", "parameters")
    for e in entries:
        t.add_row(e.name, e.hf_id or "", e.spec.model_type, describe(e.spec), activation_method(e.spec), e.spec.head,
                  f"{e.spec.params_total:,}")
    console().print(t)


def main(argv: list[str] | None = None) -> None:
    """Entry point: click in non-standalone mode so every user error becomes one line and exit 2."""
    try:
        rv = cli.main(args=argv, prog_name="memplan", standalone_mode=False)
        sys.exit(rv if isinstance(rv, int) else 0)
    except UserError as e:
        click.echo(f"memplan: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("memplan: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"memplan: error: {e.format_message()}", err=True)
        sys.exit(2)
    except BrokenPipeError:
        sys.exit(0)
