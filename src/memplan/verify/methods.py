"""The fine-tuning method applied to the built model as a user's training script applies it (docs/finetune.md).

- lora: the base loaded in the precision's half type (fp32 under --precision fp32), then
  `peft.get_peft_model(model, LoraConfig(...))` (adapters up-cast to fp32: autocast_adapter_dtype=True).
- qlora: the base's linear layers converted and quantised by bitsandbytes as transformers'
  `from_pretrained(quantization_config=BitsAndBytesConfig(...))` does it (its HfQuantizer replaces the
  modules, and its quantise op, integrations/bitsandbytes.py Bnb4bitQuantize / Bnb8bitQuantize, quantises
  each weight), then
  `peft.prepare_model_for_kbit_training` and get_peft_model.
- freeze: the model as in full fine-tuning; requires_grad as the emitted train.py sets it from plan.json's
  launch.freeze (emit/finetune.py freeze_section: the modules estimator/finetune.py freeze_trains trains, the
  last K blocks of the stack next to the head, the head, the final norm, the tied embedding, modules_to_save).

Sources: peft 0.21.2 (mapping_func.py get_peft_model, utils/other.py prepare_model_for_kbit_training),
transformers 5.23 (quantizers/quantizer_bnb_4bit.py, integrations/bitsandbytes.py), bitsandbytes 0.50.2
(nn/modules.py Params4bit / Int8Params, functional.py quantize_4bit, autograd/_functions.py matmul).

FakeTensors (verify --device fake): lora and freeze run (PEFT's adapters are made on the meta device and
become FakeTensors after, see add_adapters). qlora does not: bitsandbytes' ops have fake kernels
(bitsandbytes/_ops.py register_fake) and quantising a FakeTensor works, but a Params4bit / Int8Params is a
Tensor._make_subclass parameter, which cannot wrap a FakeTensor: around fake data it reports the meta device
and the first matmul fails on mixed devices; and LLM.int8's training matmul (MatMul8bitLt) splits outlier
columns whose count depends on the data. qlora runs on --device cpu (real tensors, small models).
"""

from __future__ import annotations

import contextlib

import torch

from memplan.errors import UserError
from memplan.emit.finetune import bnb_kwargs, freeze_section, lora_kwargs
from memplan.emit.train import mark_trainable
from memplan.estimator import finetune
from memplan.estimator.rules import DTYPE_NAMES
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.workload import Workload

def load_dtype(w: Workload) -> torch.dtype:
    """The dtype the model is built in (estimator/finetune.py load_dtype)."""
    return getattr(torch, DTYPE_NAMES[finetune.load_dtype(w)])


def check_device(w: Workload, device: str) -> None:
    if device == "fake" and w.method == "qlora":
        raise UserError("--device fake cannot run --method qlora (bitsandbytes' quantised weights cannot hold fake "
                        "tensors); use --device cpu with a small model, or cuda")


def bnb_quantization_config(w: Workload):
    """The transformers.BitsAndBytesConfig the emitted bnb_config.json holds for this workload."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**bnb_kwargs(w))


def suspend_fake():
    """Leave the fake mode (if any): PEFT's adapters are made outside it, on the meta device (add_adapters)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def quantise(model, config) -> None:
    """transformers' bitsandbytes loading on a built model, for a BitsAndBytesConfig (bnb_quantization_config:
    QLoRA's; verify/infer.py serving_quantization_config: serving's): the quantizer replaces nn.Linear / Conv1D
    (outside get_keys_to_not_convert) by bnb modules, its own quantise op (get_quantize_ops: Bnb4bitQuantize /
    Bnb8bitQuantize, which transpose a Conv1D weight) quantises each weight as from_pretrained does, and the
    quantizer marks the model (is_loaded_in_4bit / 8bit)."""
    import bitsandbytes as bnb
    from transformers.quantizers.auto import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    floats = {name: (m.weight, m.bias) for name, m in model.named_modules()
              if type(m) is torch.nn.Linear or type(m).__name__ == "Conv1D"}
    quantizer.preprocess_model(model, device_map={"": "cpu"})
    op = quantizer.get_quantize_ops()
    for name, module in model.named_modules():
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            weight, bias = floats[name]
            key = f"{name}.weight"
            module.weight = op.convert({key: weight.detach()}, model=model, full_layer_name=key)[key]
            if bias is not None:
                module.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        if isinstance(module, bnb.nn.Linear4bit):
            # the CPU run stands in for a CUDA one: on a CPU with AVX512-BF16, bitsandbytes 0.50's first no-grad
            # forward repacks each 4-bit weight into a new storage for its CPU kernel (nn/modules.py
            # Linear4bit.forward, _convert_weight_packed_for_cpu), which CUDA never does; the tracker then
            # counted Mixtral-small's packed weights (1.3 MiB) as freed, on such a machine only
            module.support_avx512bf16_for_cpu = False
    quantizer.postprocess_model(model)


def peft_lora_config(w: Workload, spec: ModelSpec):
    """The peft.LoraConfig of the emitted lora_config.json, but for the targets: none named, PEFT applies its
    own default for the model type, as in a script that names none (emit.finetune.lora_kwargs)."""
    from peft import LoraConfig

    return LoraConfig(**lora_kwargs(w, spec, resolve_default=False))


def add_adapters(model, w: Workload, spec: ModelSpec):
    """get_peft_model on the (prepared) base; the PeftModel trains."""
    from peft import get_peft_model

    fake = is_fake(next(model.parameters()))
    try:
        # FakeTensors: PEFT moves each new adapter with Module.to, which swaps a FakeTensor parameter
        # (torch.utils.swap_tensors) and fails on the fake mode's weak references to it; the adapters are
        # made on the meta device instead and become FakeTensors afterwards (materialize_meta)
        with suspend_fake() if fake else contextlib.nullcontext(), torch.device("meta") if fake else contextlib.nullcontext():
            model = get_peft_model(model, peft_lora_config(w, spec))
    except ValueError as e:
        raise UserError(f"--method {w.method}: PEFT cannot add LoRA adapters: {str(e).splitlines()[0]}") from None
    if fake:
        materialize_meta(model)
    return model


def is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import is_fake as fake_check

    return fake_check(t)


def materialize_meta(model, dtype: torch.dtype | None = None) -> None:
    """Meta parameters and buffers -> empty CPU tensors of the active mode (FakeTensors under FakeTensorMode),
    tied ones kept tied; floating ones in `dtype` (None: each keeps its own). Module.to_empty cannot swap
    meta for fake tensors."""
    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in done:
                    kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    new = torch.empty_like(t, device="cpu", dtype=kind)
                    done[id(t)] = torch.nn.Parameter(new, t.requires_grad) if table is mod._parameters else new
                table[name] = done[id(t)]


def prepare_kbit(model, w: Workload) -> None:
    from peft import prepare_model_for_kbit_training

    prepare_model_for_kbit_training(model, use_gradient_checkpointing=w.grad_ckpt == "full",
                                    gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_method(model, w: Workload, spec: ModelSpec):
    """The method on a built base model (its checkpointing already on, but for qlora where
    prepare_model_for_kbit_training turns it on); returns the model that trains. `spec`: the model's."""
    if w.method == "freeze":  # as the emitted train.py does it, from the plan.json section emit writes
        mark_trainable(model, freeze_section(w, spec))
    if not finetune.uses_adapters(w.method):
        return model
    return add_adapters(model, w, spec)


def quant_state_tensors(model) -> list[torch.Tensor]:
    """Every tensor bitsandbytes keeps beside a quantised weight: a Params4bit's QuantState (absmax, code,
    offset, the nested state2's absmax and code) and an Int8Params' SCB, with Linear8bitLt's MatmulLtState."""
    found: list[torch.Tensor] = []

    def collect(obj) -> None:
        if obj is None:
            return
        for v in vars(obj).values():
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif type(v).__name__ == "QuantState":
                collect(v)

    for p in model.parameters():
        collect(getattr(p, "quant_state", None))
        found += [t for t in (getattr(p, "SCB", None), getattr(p, "CB", None)) if isinstance(t, torch.Tensor)]
    for m in model.modules():
        state = getattr(m, "state", None)
        if type(state).__name__ == "MatmulLtState":
            collect(state)
    return found


@contextlib.contextmanager
def cuda_bnb_paths():
    """bitsandbytes' CUDA training path on CPU tensors: autograd/_functions.py `matmul` sends a training
    step on CPU tensors to MatMul8bitFp (dequantise, then a float matmul), on CUDA to MatMul8bitLt (int8
    matmul of the activations, outlier columns in half) - a different set of saved tensors."""
    import importlib

    import bitsandbytes as bnb

    bnb_autograd = importlib.import_module("bitsandbytes.autograd._functions")

    def cuda_matmul(A, B, out=None, state=None, threshold=0.0, bias=None):
        state = state or bnb_autograd.MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return bnb_autograd.MatMul8bitLt.apply(A, B, out, bias, state)

    saved = bnb.matmul
    bnb.matmul = cuda_matmul
    try:
        yield
    finally:
        bnb.matmul = saved
