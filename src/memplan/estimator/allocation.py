"""PyTorch's caching allocator as arithmetic: what a tensor charges to memory_allocated, and the
segments a set of tensors reserves (c10/cuda/CUDACachingAllocator.cpp; constants in rules.py).

One implementation for a number and for numpy arrays of byte counts: the search evaluates whole
tables of candidates, a single estimate is a one-cell table.
"""

from __future__ import annotations

import numpy as np

from memplan.estimator.rules import (
    ALLOC_LARGE_BUFFER, ALLOC_MIN_BLOCK, ALLOC_MIN_LARGE_ALLOC, ALLOC_ROUND_LARGE, ALLOC_SMALL_BUFFER, ALLOC_SMALL_SIZE,
)


def as_int(x):
    """Truncated to an integer: an int for a number, an int64 array for an array (as int() truncates)."""
    return x.astype(np.int64) if isinstance(x, np.ndarray) else int(x)


def round_block(nbytes):
    """Bytes the allocator charges to memory_allocated for one tensor: its size rounded up to 512 B
    (kMinBlockSize). A number gives an int, an array an int64 array; byte counts are never negative."""
    n = as_int(nbytes)
    return -(-n // ALLOC_MIN_BLOCK) * ALLOC_MIN_BLOCK


def _pools(n, count):
    """(small, mid, large) of `count` tensors of `n` rounded bytes each, before the pools are packed: small ones
    (<= 1 MiB) by their bytes, which share 2 MiB segments; 1-10 MiB ones by the share of 20 MiB segments they fill
    (count / how many fit in one); larger ones by their segments, one each rounded to 2 MiB (kSmallBuffer,
    kLargeBuffer, kMinLargeAlloc, kRoundLarge). Numbers or arrays: only arithmetic, no branches."""
    small_m = (n > 0) & (n <= ALLOC_SMALL_SIZE)
    mid_m = (n > ALLOC_SMALL_SIZE) & (n < ALLOC_MIN_LARGE_ALLOC)
    large_m = n >= ALLOC_MIN_LARGE_ALLOC
    per_seg = ALLOC_LARGE_BUFFER // (n * mid_m + (1 - mid_m))  # 1 where not a mid-size tensor
    return (small_m * n * count, mid_m * count / per_seg,
            large_m * (-(-n // ALLOC_ROUND_LARGE)) * ALLOC_ROUND_LARGE * count)


def _packed(small, mid, large):
    """Reserved bytes of the pools: the small pool's bytes in 2 MiB segments; the 1-10 MiB tensors of every size
    in as many 20 MiB segments as their shares add up to (best fit puts a tensor in any segment's free tail, so
    tensors of different sizes share segments: each size's count is rounded only with the rest, where rounding
    per size charged a tiny model's weights, gradients and each optimizer state a segment apiece, 2-3x the
    simulation); the large ones as they are."""
    mid_segments = as_int(-(-(mid - 1e-9) // 1))  # the shares' sum rounded up (1e-9: thirds that add up to one)
    return -(-small // ALLOC_SMALL_BUFFER) * ALLOC_SMALL_BUFFER + mid_segments * ALLOC_LARGE_BUFFER + large


def segments(nbytes: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Reserved bytes of tensors allocated fresh, over the last axis: `count` tensors of `nbytes` each."""
    n = round_block(np.asarray(nbytes, dtype=np.float64))
    return _packed(*(part.sum(axis=-1) for part in _pools(n, np.asarray(count, dtype=np.int64))))


def allocated_of(tensors: list[tuple[float, int]]) -> int:
    """Allocated bytes of a list of (bytes, count) tensors, each rounded as the allocator rounds it."""
    return sum(round_block(nbytes) * int(count) for nbytes, count in tensors)


def segments_of(tensors: list[tuple[float, int]]) -> int:
    """`segments` of one list of (bytes, count) tensors (the same pools, summed in Python: the lists are
    short and built once per cached stage)."""
    parts = [_pools(round_block(nbytes), int(count)) for nbytes, count in tensors]
    return int(_packed(*(sum(p[i] for p in parts) for i in range(3))))


def round_segment(nbytes: float) -> int:
    """Bytes of the cudaMalloc'd segment a lone tensor of this size reserves when no cached block fits
    (get_allocation_size)."""
    n = round_block(nbytes)
    if n <= ALLOC_SMALL_SIZE:
        return ALLOC_SMALL_BUFFER
    if n < ALLOC_MIN_LARGE_ALLOC:
        return ALLOC_LARGE_BUFFER
    return -(-n // ALLOC_ROUND_LARGE) * ALLOC_ROUND_LARGE
