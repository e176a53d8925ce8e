"""Which dtype autocast casts matmul inputs to, for kernels that cast their inputs once, outside their
tiles (inside, autocast would cast every tile's operands again).

Besides torch.autocast, a TorchFunctionMode that emulates CUDA autocast says so with an
`emulated_autocast_dtype` attribute: memplan.verify.cudasim does, because a CPU-only torch cannot enter CUDA
autocast, and `memplan verify --device fake|cpu` must see the kernels cast as they would on the GPU.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in effect for `device_type`, or None."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    for mode in torch.overrides._get_current_function_mode_stack():
        dtype = getattr(mode, "emulated_autocast_dtype", None)
        if dtype is not None:
            return dtype
    return None


def cast_once(device_type: str, *tensors):
    """(the tensors cast to the autocast dtype, a context with autocast off for the kernel's tiles): a
    kernel casts its inputs once, outside, where autocast would cast every tile's operands again (and a
    gradient flows back through the cast). Without autocast: the tensors as they are, a null context.
    None stays None (an optional input)."""
    dtype = autocast_dtype(device_type)
    if dtype is None:
        return tensors, nullcontext()
    off = torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) else nullcontext()
    return tuple(None if t is None else t.to(dtype) for t in tensors), off
