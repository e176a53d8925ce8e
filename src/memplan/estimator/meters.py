"""From the allocated bytes at the peak to the three meters (docs/estimator.md): reserved is the
persistent tensors' segments, the segments of the activation tensors alive at the peak, the
fragmentation of the activation churn and cuBLAS's workspace; device used adds the CUDA context.
Numbers or numpy arrays (a table of candidates), one formula."""

from __future__ import annotations

import numpy as np

from memplan.estimator.allocation import as_int
from memplan.inputs.profiles import GPUProfile

# cuBLAS workspace, allocated through the caching allocator: 4096 KiB * 2 + 16 KiB * 8 before Hopper,
# 32 MiB on sm90+ (PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize).
CUBLAS_WORKSPACE = {False: 4096 * 1024 * 2 + 16 * 1024 * 8, True: 32 << 20}
# Fragmentation of the activation churn: blocks freed in backward are re-split for gradients and the
# lazily created optimizer state, so the next forward cannot reuse all of them (docs/estimator.md).
ACTIVATION_FRAGMENTATION = 0.10


def gpu_workspace(gpu: GPUProfile) -> int:
    return CUBLAS_WORKSPACE[gpu.compute_capability >= (9, 0)]


def meters(gpu: GPUProfile, tensors, persistent_segments, activation_segments, churn):
    """(allocated, reserved, device used). tensors: the bytes allocated at the peak, workspace aside;
    churn: the activation and transient bytes alive then (their blocks fragment)."""
    ws = gpu_workspace(gpu)
    allocated = tensors + ws
    reserved = persistent_segments + activation_segments + as_int(ACTIVATION_FRAGMENTATION * churn) + ws
    reserved = as_int(np.maximum(reserved, allocated))
    return allocated, reserved, reserved + gpu.cuda_context_bytes
