"""Selective activation recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 5) for transformers models.

Only the attention core -- QK^T, scaling/bias/mask, softmax, attention dropout and the product with V -- runs
under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; every other activation (projections,
rotary, norms, MLP) is kept as usual. The core's s x s score / probability / dropout-mask tensors are therefore
not saved for backward; the core is run a second time in backward to rebuild them.

Mechanism. In transformers 5 every supported family computes its attention core through

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
                                                                eager_attention_forward)
    attn_output, attn_weights = attention_interface(self, query, key, value, attention_mask, ...)

so we register two extra implementations with `transformers.AttentionInterface.register`:
``selective_eager`` and ``selective_sdpa`` (plus the same names in `AttentionMaskInterface`, pointing at the
eager / sdpa mask builders, so that the masks the model builds are exactly the ones of the base
implementation), and switch the `_attn_implementation` of every config the model uses (the top config, its
sub-configs, and the deep copies some models keep per stack, e.g. T5's encoder/decoder) to the selective name
of its current implementation. The registered function looks up the base core at call time -- for "eager"
the `eager_attention_forward` of the attention module's own modeling file, for "sdpa" the function the
modeling file's `ALL_ATTENTION_FUNCTIONS` holds -- and runs it inside a non-reentrant checkpoint. Tensors
(query, key, value, mask, T5's position_bias, ...) are passed positionally to `checkpoint`; everything else
(the module, floats, flags) is closed over.

Supported families: `SELECTIVE_FAMILIES`, each verified to route its attention core through the interface.

Details that matter for memory accounting:
- The recomputation runs under the TorchFunctionModes that were active in forward: torch pops a mode
  while it handles `Tensor.backward`, so the whole backward runs without it. memplan's
  cudasim.CudaSemantics re-enters itself for backward (full checkpointing needs that too); other modes
  are re-entered here around the recomputed core. Such a mode sees the core twice (SDPA kernel counts double).
- The checkpoint holds its tensor inputs until backward: Q, K, V (saved by the unpatched core as well), and the
  attention mask / position ids / T5 position bias, which the unpatched model frees after forward; those are
  shared by all layers, so they cost one b x s x s mask (not one per layer). Inputs that are views into a
  larger buffer (GPT-2's query in the fused QKV output) are passed as compact copies.
- The gain is the s x s tensors the core saves: large for eager and the SDPA math kernel; for the flash /
  memory-efficient kernels only the output and log-sum-exp are dropped, and under autocast the checkpoint
  holds the fp32 Q/K/V (e.g. after fp32 rotary) where the core would have saved bf16 casts, so it can cost a
  little memory there.
- GPT-2's `reorder_and_upcast_attn` path (taken only under the literal name "eager") is kept.
- `config.output_attentions = True` is rejected by transformers for any implementation but "eager".
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from memplan.estimator.families import family, model_types

# model_types whose attention modules call the core through ALL_ATTENTION_FUNCTIONS (families.Family.selective)
SELECTIVE_FAMILIES: frozenset[str] = frozenset(model_types(lambda f: f.selective))

BASE_IMPLEMENTATIONS = ("eager", "sdpa")
PREFIX = "selective_"
_STATE_ATTR = "_memplan_selective_state"
_MISSING = object()


# -- the wrapped attention core -----------------------------------------------------------------------------------
def _modeling_module(module: torch.nn.Module):
    """The modeling file that defines the attention module's class (or the first base class that has one)."""
    for cls in type(module).__mro__:
        mod = sys.modules.get(cls.__module__)
        if mod is not None and hasattr(mod, "eager_attention_forward"):
            return mod
    return sys.modules.get(type(module).__module__)


def _gpt2_upcast_core(module, query, key, value, attention_mask, *args, **kwargs):
    return module._upcast_and_reordered_attn(query, key, value, attention_mask)


def resolve_core(base: str, module: torch.nn.Module) -> Callable:
    """The attention core the model would call for implementation `base` (the function being checkpointed)."""
    mod = _modeling_module(module)
    eager = getattr(mod, "eager_attention_forward", None)
    if base == "eager":
        # GPT-2 takes its `_upcast_and_reordered_attn` instead of eager_attention_forward when the config asks
        # for it, but only under the literal name "eager"; keep that behaviour.
        if getattr(module, "reorder_and_upcast_attn", False) and hasattr(module, "_upcast_and_reordered_attn"):
            return _gpt2_upcast_core
        if eager is None:
            raise ValueError(f"selective recomputation: {type(module).__name__} has no eager_attention_forward")
        return eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    interface = getattr(mod, "ALL_ATTENTION_FUNCTIONS", ALL_ATTENTION_FUNCTIONS)
    return interface.get_interface(base, eager)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _function_modes() -> list:
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


@contextlib.contextmanager
def _reentered(modes: list):
    """Re-enter the TorchFunctionModes that were active in forward but are not now. A mode that handles
    `Tensor.backward` runs the whole backward -- and so the recomputation -- with itself popped off the stack;
    without this the recomputed core would skip the mode (e.g. its autocast casts) and differ from forward."""
    active = {id(m) for m in _function_modes()}
    with contextlib.ExitStack() as stack:
        for m in modes:
            if id(m) not in active:
                stack.enter_context(m)
        yield


def _compact(tensors: list) -> list:
    """Copies of the inputs that would keep a much larger buffer alive through the checkpoint.

    The checkpoint holds its inputs until backward. GPT-2's query is a view into the fused (b, s, 3h) QKV
    output; holding the view would hold the whole buffer, where the unpatched core keeps a compact copy (the
    one its matmul makes). Only inputs that require grad (per-layer activations) are compacted: a shared
    mask viewing a larger buffer stays shared instead of being copied once per layer."""
    from torch.multiprocessing.reductions import StorageWeakRef

    used: dict = {}
    for t in tensors:
        key = StorageWeakRef(t.untyped_storage())
        used[key] = used.get(key, 0) + t.numel() * t.element_size()
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        if t.requires_grad and storage.nbytes() > used[StorageWeakRef(storage)]:
            t = t.clone(memory_format=torch.contiguous_format)
        out.append(t)
    return out


def _make_selective(base: str) -> Callable:
    def selective_attention(module, *args, **kwargs):
        core = resolve_core(base, module)
        arg_tensors = [a for a in args if _is_tensor(a)]
        kw_tensors = {k: v for k, v in kwargs.items() if _is_tensor(v)}
        tensors = arg_tensors + list(kw_tensors.values())
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return core(module, *args, **kwargs)  # nothing is saved for backward: no need to checkpoint
        arg_slots = [i for i, a in enumerate(args) if _is_tensor(a)]
        kw_names = list(kw_tensors)
        n_args = len(arg_slots)
        modes = _function_modes()  # forward's; the recomputation runs under them too
        # The recompute closure lives until backward: it must not hold the original tensors (a view
        # would keep its whole base alive, e.g. GPT-2's fused QKV output behind the compacted query).
        rest_args = [None if _is_tensor(a) else a for a in args]
        rest_kwargs = {k: v for k, v in kwargs.items() if k not in kw_tensors}
        compact = _compact(tensors)
        del args, kwargs, arg_tensors, kw_tensors, tensors

        def run(*ts):
            call_args = list(rest_args)
            for i, t in zip(arg_slots, ts[:n_args]):
                call_args[i] = t
            call_kwargs = dict(rest_kwargs)
            call_kwargs.update(zip(kw_names, ts[n_args:]))
            with _reentered(modes):
                return core(module, *call_args, **call_kwargs)

        # looked up at call time (not imported by name) so that tests and tools can observe it
        return torch.utils.checkpoint.checkpoint(run, *compact, use_reentrant=False)

    selective_attention.__name__ = selective_attention.__qualname__ = f"selective_{base}_attention_forward"
    selective_attention.base = base
    return selective_attention


SELECTIVE_FUNCTIONS: dict[str, Callable] = {PREFIX + b: _make_selective(b) for b in BASE_IMPLEMENTATIONS}


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for name, fn in SELECTIVE_FUNCTIONS.items():
        if AttentionInterface._global_mapping.get(name) is not fn:
            AttentionInterface.register(name, fn)
        if name not in AttentionMaskInterface._global_mapping:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[fn.base])


# -- switching a model ------------------------------------------------------------------------------------------
def _configs(model: torch.nn.Module) -> list:
    """Every distinct config the model's modules read `_attn_implementation` from, parents before sub-configs."""
    seen: dict[int, Any] = {}

    def add(cfg) -> None:
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
            return
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", None) or {}:
            add(getattr(cfg, key, None))

    add(getattr(model, "config", None))
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            add(cfg)
    return list(seen.values())


def _set_impl(cfg, value) -> None:
    # The internal slot: the public setter also rewrites every sub-config, which may use another implementation.
    if "_attn_implementation_internal" in vars(cfg) or value is _MISSING:
        if value is _MISSING:
            vars(cfg).pop("_attn_implementation_internal", None)
        else:
            cfg._attn_implementation_internal = value
    else:
        cfg._attn_implementation = value


def is_selective(model: torch.nn.Module) -> bool:
    return getattr(model, _STATE_ATTR, None) is not None


def enable_selective(model: torch.nn.Module) -> None:
    """Recompute the attention core of `model` in backward (Megatron's selective activation recomputation).

    Raises ValueError for model families not in SELECTIVE_FAMILIES and for attention implementations other
    than eager and sdpa. Idempotent; undo with `disable_selective`."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if not family(model_type).selective:
        raise ValueError(f"selective recomputation does not support model_type {model_type!r}; "
                         f"supported: {', '.join(sorted(SELECTIVE_FAMILIES))}")
    if is_selective(model):
        return
    configs = _configs(model)
    plan = []
    for c in configs:
        impl = c._attn_implementation
        if impl is not None and impl.startswith(PREFIX):
            continue  # shared with a model that is already selective
        if impl not in BASE_IMPLEMENTATIONS:
            raise ValueError(f"selective recomputation supports attn_implementation {BASE_IMPLEMENTATIONS}, "
                             f"not {impl!r} ({type(c).__name__})")
        plan.append((c, vars(c).get("_attn_implementation_internal", _MISSING), PREFIX + impl))
    _register()
    for c, _, new in plan:
        _set_impl(c, new)
    setattr(model, _STATE_ATTR, [(c, old) for c, old, _ in plan])


def disable_selective(model: torch.nn.Module) -> None:
    """Restore the attention implementation(s) `enable_selective` replaced. No-op if not enabled."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    for c, old in reversed(state):
        _set_impl(c, old)
    delattr(model, _STATE_ATTR)
