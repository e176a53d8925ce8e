"""`memplan verify --task infer`: the planned serving step on the real transformers model, measured.

The step is what `model.generate(do_sample=False)` runs, written out so that it also runs on FakeTensors
(generate's stopping check reads a tensor's value, which a fake tensor does not have): one prefill forward
of the b * beams prompts through a DynamicCache, keeping the logits of the last position only
(`logits_to_keep=1`, as generate asks for: transformers 5.23 generation/utils.py _prefill), their fp32 copy
(generate's `logits[:, -1, :].to(dtype=torch.float32)`), the argmax token, then max_new_tokens - 1
decode forwards of one token each. Without max_new_tokens it is one forward over the prompts with every
position's logits (scoring). Beams: the cache and the logits are those of b * beams sequences; beam
search's per-step cache reordering (index_select per layer) is not run, so its transient is not measured.

Weights: fp32 under autocast for fp16 / bf16 (the cast copies cached for the whole run, as torch.autocast
does for leaves that require grad), half for the -pure formats. int8 / int4: the half model quantised by
transformers' own bitsandbytes quantizer (verify/methods.py quantise) with serving_quantization_config, on
--device cpu (bitsandbytes 0.50 runs there; its quantised weights cannot hold fake tensors) or cuda.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

from memplan.errors import UserError
from memplan.estimator.rules import WEIGHT_FORMATS
from memplan.inputs.workload import Workload


def weight_dtype(w: Workload):
    """The dtype the weights are loaded in, and the autocast dtype (None: no autocast). int8 / int4: the half
    model bitsandbytes then quantises (its other weights stay half: rules.WEIGHT_FORMATS)."""
    import torch

    fmt = WEIGHT_FORMATS[w.precision]
    half = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[fmt.compute]
    if fmt.name.endswith("-pure") or fmt.quantised:
        return half, None
    return torch.float32, half


def serving_quantization_config(w: Workload):
    """The BitsAndBytesConfig of --precision int4 / int8 (rules.WEIGHT_FORMATS): load_in_4bit with NF4 and fp16
    compute, no double quantisation (BitsAndBytesConfig's default); or load_in_8bit (LLM.int8, its default
    threshold 6.0)."""
    import torch
    from transformers import BitsAndBytesConfig

    if w.precision == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16)


def prompts(model, head: str, w: Workload, device: str, dtype) -> dict:
    """The b * beams prompts: token ids, or images for an image classifier."""
    import torch

    cfg, n = model.config, w.micro_batch * w.beams
    if head == "image-classification":
        size = cfg.image_size
        return {"pixel_values": torch.randn(n, getattr(cfg, "num_channels", 3), size, size, device=device, dtype=dtype)}
    return {"input_ids": torch.randint(0, cfg.get_text_config().vocab_size, (n, w.seq_len), device=device)}


def serve(model, inputs: dict, w: Workload, *, tracker=None, autocast=None) -> list[float]:
    """Prefill and greedy decode (or one scoring forward); the wall time of each forward."""
    import torch
    from transformers import DynamicCache, StaticCache

    def phase(name: str) -> None:
        if tracker is not None:
            tracker.set_phase(name)

    times = []
    ctx = autocast() if autocast else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        t0 = time.perf_counter()
        phase("prefill")
        if w.max_new_tokens == 0:
            out = model(**inputs, **({"use_cache": False} if "input_ids" in inputs else {}))
            del out
            return [time.perf_counter() - t0]
        cache = StaticCache(config=model.config, max_cache_len=w.seq_len + w.max_new_tokens) \
            if w.kv_cache == "static" else DynamicCache(config=model.config)
        logits = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1, :].to(dtype=torch.float32).argmax(dim=-1, keepdim=True)
        del logits
        times.append(time.perf_counter() - t0)
        phase("decode")
        for _ in range(w.max_new_tokens - 1):
            t0 = time.perf_counter()
            logits = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            token = logits[:, -1, :].to(dtype=torch.float32).argmax(dim=-1, keepdim=True)
            del logits
            times.append(time.perf_counter() - t0)
        if tracker is not None:
            tracker.classify([t for layer in cache.layers for t in (getattr(layer, "keys", None),
                                                                     getattr(layer, "values", None))
                              if isinstance(t, torch.Tensor)], "kv_cache")
        del cache, token
    return times


def _model(config, head: str | None, w: Workload, device: str, dtype):
    from memplan.verify import methods
    from memplan.verify.run import build

    if head not in (None, "causal-lm") and w.max_new_tokens:
        raise UserError(f"verify --task infer generates with a causal-lm head; head {head!r} has no generate "
                        "(drop --max-new-tokens to verify one scoring forward)")
    if WEIGHT_FORMATS[w.precision].quantised and device == "meta":
        raise UserError(f"--device fake cannot verify --precision {w.precision} (bitsandbytes' quantised weights "
                        "cannot hold fake tensors); use --device cpu with a small model, or cuda")
    model, head = build(config, head, w.attn, device, dtype)
    if WEIGHT_FORMATS[w.precision].quantised:
        methods.quantise(model, serving_quantization_config(w))
    return model.eval(), head


def run_traced_infer(config, head: str | None, w: Workload, sm: tuple[int, int], device: str,
                     on_phase=None) -> dict[str, Any]:
    """fake / cpu: the serving step under CudaSemantics with every storage tracked."""
    import torch

    from memplan.verify.cudasim import CudaSemantics
    from memplan.verify.methods import quant_state_tensors
    from memplan.verify.tracer import LiveTracker

    fake = device == "fake"
    dtype, half = weight_dtype(w)
    mode = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    t0 = time.perf_counter()
    with mode:
        if on_phase:
            on_phase(0, "building the model")
        model, head = _model(config, head, w, "meta" if fake else "cpu", dtype)
        sem = CudaSemantics(half, sm, fake=fake, force_kernel="flash" if w.attn == "flash" else None)
        tracker = LiveTracker()
        with tracker:
            tracker.register(list(model.parameters()) + list(model.buffers()) + quant_state_tensors(model),
                             "weights")
            tracker.set_phase("data")
            inputs = prompts(model, head, w, "cpu", dtype)
            with sem:
                sem.cache_enabled = True  # autocast's weight casts live for the whole no_grad region
                times = serve(model, inputs, w, tracker=tracker)
                sem.cache_enabled = False
                sem.clear_cache()
            del inputs
        summary = tracker.summarize()
        model = None
    gc.collect()
    return {"summary": summary, "times": times, "kernels": dict(sem.kernels), "seconds": time.perf_counter() - t0}


def _warm_up(model, head: str, w: Workload, dtype, autocast) -> None:
    """One forward of a single short prompt before the measured call, so that the prefill's time is not CUDA's
    and cuBLAS's lazy start-up. What it leaves reserved is released (fresh_peaks); cuBLAS's workspace stays, as
    it would after the first matmul of the measured call."""
    import torch

    short = w.model_copy(update=dict(micro_batch=1, beams=1, seq_len=min(w.seq_len, 8), max_new_tokens=0))
    with torch.no_grad(), (autocast() if autocast else contextlib.nullcontext()):
        model(**prompts(model, head, short, "cuda", dtype))
    torch.cuda.synchronize()


def run_cuda_infer(config, head: str | None, w: Workload) -> dict[str, Any]:
    """A real serving step on the GPU: peak allocated / reserved and NVML, the forward times."""
    import torch

    from memplan.verify.run import PlanOOM, fresh_peaks, nvml_used

    dtype, half = weight_dtype(w)
    torch.cuda.empty_cache()
    model = None
    try:
        model, head = _model(config, head, w, "cuda", dtype)
        autocast = (lambda: torch.autocast("cuda", dtype=half)) if half is not None else None
        _warm_up(model, head, w, dtype, autocast)
        fresh_peaks()  # int4 / int8: the half weights bitsandbytes quantised are gone; measure the serving step
        times = serve(model, prompts(model, head, w, "cuda", dtype), w, autocast=autocast)
        torch.cuda.synchronize()
        out = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
               "device_used": nvml_used(), "times": times}
    except torch.cuda.OutOfMemoryError as e:
        model = None
        gc.collect()
        torch.cuda.empty_cache()
        raise PlanOOM(f"CUDA out of memory in the planned serving step: {str(e).splitlines()[0][:200]}") from None
    model = None
    gc.collect()
    torch.cuda.empty_cache()
    return out
