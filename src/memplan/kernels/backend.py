"""Which implementation of a kernel runs: `backend="auto" | "triton" | "torch"`, one rule for every kernel.

- auto: the Triton kernels for real CUDA tensors of fp32, fp16 or bf16 when triton imports (and the
  kernel takes the shape); the tiled PyTorch path otherwise: CPU, fake tensors (memplan's tracer: a launch
  needs real memory), fp64 (a test's exact reference; the kernels compute in fp32);
- triton: forced, on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
  before the kernel module is first imported); a clear ValueError otherwise;
- torch: the tiled PyTorch path.
The Triton modules are imported on first use only: triton may be missing (it is Linux-only).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
from torch._subclasses.fake_tensor import is_fake

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """kernels/<name>.py (a Triton kernel module), or None where triton does not import."""
    try:
        return importlib.import_module(f"memplan.kernels.{name}")
    except ImportError:
        return None


def pick(backend: str, tensors, module: str, fits: bool = True) -> ModuleType | None:
    """The Triton kernel module (kernels/<module>.py) if `backend` picks Triton for these tensors, else None.
    fits: whether the kernel takes these inputs at all (head dim, one dtype); forced Triton checks its own."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "torch":
        return None
    ts = [t for t in tensors if t is not None]
    real_cuda = all(t.is_cuda and not is_fake(t) for t in ts)
    if backend == "auto":
        if not (real_cuda and fits and all(t.dtype in TRITON_DTYPES for t in ts)):
            return None
        return triton_module(module)
    mod = triton_module(module)
    if mod is None:
        raise ValueError("backend='triton' needs triton, which does not import here")
    if not real_cuda and not (mod.INTERPRETED and all(t.device.type == "cpu" for t in ts)):
        raise ValueError(f"backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
                         f"memplan.kernels.{module} is first imported (Triton's interpreter)")
    if any(t.dtype not in TRITON_DTYPES for t in ts):
        raise ValueError(f"backend='triton' takes fp32, fp16 or bf16 tensors of one dtype, not "
                         f"{sorted({str(t.dtype) for t in ts})}")
    return mod
