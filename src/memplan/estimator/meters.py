"""From the allocated bytes at the peak to the three meters (docs/estimator.md): reserved is the
persistent tensors' segments, the segments of the activation tensors alive at the peak, the
fragmentation of the activation churn and cuBLAS's workspace; device used adds the CUDA context.
Both allocator modes: the default one, and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, whose
pools each grow one segment by mapping pages at its end (estimator/allocator.py). Numbers or numpy arrays
(a table of candidates), one formula."""

from __future__ import annotations

import numpy as np

from typing import NamedTuple

from memplan.estimator.allocation import as_int
from memplan.estimator.rules import ALLOC_LARGE_BUFFER, ALLOC_SMALL_BUFFER
from memplan.inputs.profiles import GPUProfile

# cuBLAS workspace, allocated through the caching allocator: 4096 KiB * 2 + 16 KiB * 8 before Hopper,
# 32 MiB on sm90+ (PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize).
CUBLAS_WORKSPACE = {False: 4096 * 1024 * 2 + 16 * 1024 * 8, True: 32 << 20}
# One workspace per cuBLAS handle and stream: PyTorch gives each thread its own handle (CublasHandlePool.cpp's
# thread_local PoolWindow) and keeps a workspace per (handle, stream) (cublas_handle_stream_to_workspace). A training
# step's backward runs on autograd's device thread (torch/csrc/autograd/engine.cpp), a second handle, so training
# holds two. Measured on the H200 (benchmarks/results/gpu_lease3/): the allocator's record of two training runs has
# two 32 MiB blocks that live to the end; 37 of the third lease's 38 training runs read 30-39 MiB more peak allocated
# than the estimate with one (RoBERTa fp16 on the default allocator 97 MiB), and the three leases' 30 serving runs
# within 11 MiB of one.
CUBLAS_HANDLES = {"train": 2, "infer": 1}
# Fragmentation of the activation churn: blocks freed in backward are re-split for gradients and the
# lazily created optimizer state, so the next forward cannot reuse all of them (docs/estimator.md).
ACTIVATION_FRAGMENTATION = 0.10
# Expandable segments: a freed block anywhere in the one large segment can be split for any smaller request and
# merges with its neighbours, so what stays mapped beyond the live bytes is the holes best fit leaves, not the
# per-segment rounding. memplan charges this share of the default mode's excess over allocated. Against the
# allocator simulation of the accuracy suite's 152 training traces (python benchmarks/accuracy/expandable_share.py)
# 0.8 is a median 10.4 % off and below in 30 cases (to -20 %), 1.0 below in 17 (there the default mode's own
# excess is under), 0.5 below in 57 (the results of fafea02). Real runs reserve more than the simulation
# (docs/estimator.md), and suggest keeps plans that fit only with expandable segments on this figure, so the
# conservative share.
EXPANDABLE_SHARE = 0.8


class Meters(NamedTuple):
    allocated: object  # int or int64 array, as the inputs
    reserved: object  # the default allocator
    device_used: object
    reserved_expandable: object  # under expandable_segments:True
    device_used_expandable: object

    def mode(self, expandable: bool) -> tuple:
        """(reserved, device used) under one allocator mode."""
        return (self.reserved_expandable, self.device_used_expandable) if expandable else (
            self.reserved, self.device_used)

    def report(self, at: tuple = ()) -> dict[str, dict[str, int]]:
        """The report's meters by allocator mode (MemoryBreakdown.by_allocator), of cell `at` of a table's arrays."""
        reserved, used, reserved_x, used_x = (int(np.asarray(v)[at]) for v in (
            self.reserved, self.device_used, self.reserved_expandable, self.device_used_expandable))
        return {"default": {"peak_reserved_bytes": reserved, "device_used_bytes": used},
                "expandable_segments": {"peak_reserved_bytes": reserved_x, "device_used_bytes": used_x}}


def gpu_workspace(gpu: GPUProfile, task: str) -> int:
    """cuBLAS's workspaces during a step of `task` (train / infer)."""
    return CUBLAS_HANDLES[task] * CUBLAS_WORKSPACE[gpu.compute_capability >= (9, 0)]


def meters(gpu: GPUProfile, task: str, tensors, persistent_segments, activation_segments, churn) -> Meters:
    """The meters in both allocator modes. tensors: the bytes allocated at the peak, workspace aside;
    churn: the activation and transient bytes alive then (their blocks fragment). Expandable segments:
    expandable_reserved."""
    ws = gpu_workspace(gpu, task)
    allocated = tensors + ws
    reserved = persistent_segments + activation_segments + as_int(ACTIVATION_FRAGMENTATION * churn) + ws
    reserved = as_int(np.maximum(reserved, allocated))
    expandable = expandable_reserved(allocated, reserved)
    ctx = gpu.cuda_context_bytes
    return Meters(allocated, reserved, reserved + ctx, expandable, expandable + ctx)


def expandable_reserved(allocated, reserved, share: float = EXPANDABLE_SHARE):
    """Reserved under expandable segments: the live bytes and `share` of the default mode's excess over them,
    mapped in the large pool's 20 MiB pages, plus the small pool's 2 MiB page."""
    mapped = as_int(allocated + share * (reserved - allocated))
    return -(-mapped // ALLOC_LARGE_BUFFER) * ALLOC_LARGE_BUFFER + ALLOC_SMALL_BUFFER
