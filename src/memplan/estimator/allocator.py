"""Pure-Python model of PyTorch's CUDA caching allocator (no torch import).

Follows ``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp with
default settings, on a single stream:

* ``round_size``: requests round up to a multiple of 512 B (kMinBlockSize).
* ``get_pool``: rounded sizes <= 1 MiB (kSmallSize) use the small pool, the
  rest the large pool; a free block is only reused within its own pool.
* ``get_free_block``: best fit, the smallest free block with size >= request,
  ties to the lowest address (``BlockComparatorSize``: stream, size, ptr).
* ``get_allocation_size``: a miss cudaMallocs a new segment of 2 MiB
  (kSmallBuffer) for small requests, 20 MiB (kLargeBuffer) for requests
  < 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge).
* ``should_split``: the small pool splits when >= 512 B would remain, the large
  pool only when > 1 MiB would remain; an unsplit block is handed out whole
  and counts in full towards ``allocated_bytes`` (stats use ``block->size``).
* ``free_block``/``try_merge_blocks``: a freed block merges with free
  neighbours in its segment. Segments are never released, so reserved memory
  only grows.

``expandable=True`` follows ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the same file, torch
2.13; docs/verify.md): one segment per pool whose physical memory is mapped at its end on a miss, only
the shortfall beyond a free block already at the end, in pages of 2 MiB (small pool) and 20 MiB (large
pool, ``large_segment_size_mb``); any block splits when >= 512 B remain; best fit takes any other free
block before the one at the end; nothing is unmapped without ``empty_cache``.

``capacity`` (optional) holds the default allocator to that many reserved bytes, as a GPU of that size does:
a cudaMalloc past it first releases every cached segment that is wholly free and retries
(``release_cached_blocks`` in ``malloc``'s retry chain); past it still, the step runs out of memory (``oom``).
The retry chain's first step, ``release_available_cached_blocks``, releases nothing while ``max_split_size_mb`` is
unset (the default). Under expandable segments a mapping past the capacity is out of memory (their pages'
release is not modelled).

Not modelled: ``roundup_power2_divisions``,
``max_split_size_mb`` (default unlimited, so the oversize-block rules never
fire), ``garbage_collection_threshold``, memory fractions, multiple streams /
``record_stream`` events, CUDA-graph private pools and ``empty_cache`` but for the default allocator's
(``CachingAllocator.empty_cache``). cudaMalloc addresses are modelled
as increasing with each new segment; they only matter for tie-breaking.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional

# The allocator's constants live in estimator/rules.py and its two size rules in estimator/allocation.py
# (the estimator uses them too): kMinBlockSize, kSmallSize; round_size -> round_block;
# get_allocation_size -> round_segment.
from memplan.estimator.rules import ALLOC_LARGE_BUFFER, ALLOC_SMALL_BUFFER
from memplan.estimator.rules import ALLOC_MIN_BLOCK as MIN_BLOCK_SIZE
from memplan.estimator.rules import ALLOC_SMALL_SIZE as SMALL_SIZE
from memplan.estimator.allocation import round_block as round_size
from memplan.estimator.allocation import round_segment as allocation_size

__all__ = ["MIN_BLOCK_SIZE", "SMALL_SIZE", "AllocatorStats", "CachingAllocator", "allocation_size",
           "reserved_for", "round_size", "should_split", "simulate"]


# expandable segments map physical memory in pages of kSmallBuffer (small pool) and large_segment_size_mb
# (default 20 MiB: CUDAAllocatorConfig) in the large pool
EXPANDABLE_PAGE = {True: ALLOC_SMALL_BUFFER, False: ALLOC_LARGE_BUFFER}
EXPANDABLE_BASE = {True: 0, False: 1 << 50}  # the two pools' virtual address ranges


def should_split(block_size: int, size: int, expandable: bool = False) -> bool:
    """``should_split`` (max_split_size unlimited): an expandable block splits whenever a minimum block remains."""
    remaining = block_size - size
    if size <= SMALL_SIZE or expandable:  # the pool is decided by the request size
        return remaining >= MIN_BLOCK_SIZE
    return remaining > SMALL_SIZE


class _Block:
    __slots__ = ("addr", "size", "small", "allocated", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool) -> None:
        self.addr, self.size, self.small = addr, size, small
        self.allocated = False
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


@dataclass
class AllocatorStats:
    peak_allocated: int  # torch.cuda.max_memory_allocated()
    peak_reserved: int  # torch.cuda.max_memory_reserved()
    final_allocated: int  # torch.cuda.memory_allocated() after the last event
    final_reserved: int  # torch.cuda.memory_reserved() after the last event
    segments: int  # cudaMalloc'ed segments at the end
    peak_index: int  # event index where peak_reserved was first reached (-1: never)
    oom: bool = False  # held to a capacity, a cudaMalloc failed even after the cached segments were released


class CachingAllocator:
    """Incremental simulator; ``malloc``/``free`` take caller-chosen int keys.

    Every call (including zero-byte ones) counts as one event for ``peak_index``.
    """

    def __init__(self, expandable: bool = False, capacity: int | None = None) -> None:
        self.expandable = expandable
        self.capacity = capacity  # reserved bytes the device can hold (None: unlimited)
        self.oom = False  # a cudaMalloc past the capacity, cached segments released
        self._end = dict(EXPANDABLE_BASE)  # expandable: each pool's mapped end
        self._last: dict[bool, Optional[_Block]] = {True: None, False: None}  # expandable: the block at the end
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.peak_index = -1
        self.events = 0
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._blocks: dict[int, _Block] = {}  # every block (free or live) by address
        self._live: dict[int, _Block] = {}
        self._zero: set[int] = set()  # zero-byte "allocations" (no allocator call)
        self._segments: list[int] = []  # base address of each segment
        self._next_addr = 0

    def malloc(self, key: int, nbytes: int) -> None:
        index, self.events = self.events, self.events + 1
        if key in self._live or key in self._zero:
            raise ValueError(f"key {key} is already allocated")
        if nbytes < 0:
            raise ValueError(f"negative size {nbytes} for key {key}")
        if nbytes == 0:  # torch never calls the allocator for empty tensors
            self._zero.add(key)
            return
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._take_free(size, small)
        if block is None and self.expandable:  # try_allocate_expandable_block: map the shortfall at the end
            block = self._expand(size, small)
        elif block is None:  # alloc_block: cudaMalloc a new segment
            seg = allocation_size(size)
            if self.capacity is not None and not self.oom and self.reserved + seg > self.capacity:
                self._release_cached()  # cudaMalloc failed: release the cached segments, retry
                self.oom = self.oom or self.reserved + seg > self.capacity
            block = _Block(self._next_addr, seg, small)
            self._next_addr += seg
            self._blocks[block.addr] = block
            self._segments.append(block.addr)
            self.reserved += seg
        if self.reserved > self.peak_reserved:
            self.peak_reserved, self.peak_index = self.reserved, index
        if should_split(block.size, size, self.expandable):  # alloc_found_block
            rest = _Block(block.addr + size, block.size - size, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._blocks[rest.addr] = rest
            self._insert_free(rest)
            if self._last[small] is block:
                self._last[small] = rest
        block.allocated = True
        self._live[key] = block
        self.allocated += block.size  # block->size, not the request
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated

    def free(self, key: int) -> None:
        self.events += 1
        if key in self._zero:
            self._zero.remove(key)
            return
        block = self._live.pop(key, None)
        if block is None:
            raise KeyError(f"key {key} is not allocated")
        block.allocated = False
        self.allocated -= block.size
        for other in (block.prev, block.next):  # free_block -> try_merge_blocks
            if other is None or other.allocated:
                continue
            self._remove_free(other)
            del self._blocks[other.addr]
            if other is block.prev:
                del self._blocks[block.addr]
                block.addr, block.prev = other.addr, other.prev
                if block.prev is not None:
                    block.prev.next = block
                self._blocks[block.addr] = block
            else:
                block.next = other.next
                if block.next is not None:
                    block.next.prev = block
                if self._last[block.small] is other:
                    self._last[block.small] = block
            block.size += other.size
        self._insert_free(block)

    def stats(self) -> AllocatorStats:
        return AllocatorStats(self.peak_allocated, self.peak_reserved, self.allocated,
                              self.reserved, len(self._segments), self.peak_index, self.oom)

    def layout(self) -> list[list[tuple[int, bool]]]:
        """Per segment, in address order: ``(block size, allocated)`` for each block."""
        out = []
        for base in self._segments:
            blocks, b = [], self._blocks[base]
            while b is not None:
                blocks.append((b.size, b.allocated))
                b = b.next
            out.append(blocks)
        return out

    def _take_free(self, size: int, small: bool) -> Optional[_Block]:
        # get_free_block: lower_bound on (size, ptr). The max_split_size checks
        # there never trigger with the default (SIZE_MAX) setting. Expandable: the free block at the end
        # counts as the rest of the segment (huge), so every other fitting block comes first.
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        last = self._last[small]
        if self.expandable and i < len(pool) and last is not None and pool[i][1] == last.addr:
            i = i + 1 if i + 1 < len(pool) else i
        if i == len(pool):
            return None
        return self._blocks[pool.pop(i)[1]]

    def _expand(self, size: int, small: bool) -> _Block:
        """Map pages at the end of the pool's segment for `size` bytes, merged into a free block already there."""
        last = self._last[small]
        tail = last if last is not None and not last.allocated else None
        have = tail.size if tail is not None else 0
        page = EXPANDABLE_PAGE[small]
        grow = -(-(size - have) // page) * page
        self.reserved += grow
        self.oom = self.oom or (self.capacity is not None and self.reserved > self.capacity)
        end = self._end[small]
        self._end[small] = end + grow
        if tail is not None:
            self._remove_free(tail)
            tail.size += grow
            return tail
        block = _Block(end, grow, small)
        block.prev = last
        if last is not None:
            last.next = block
        self._blocks[block.addr] = block
        self._last[small] = block
        return block

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache() for the default allocator: its wholly free segments go back to the device (the
        expandable segments' unmapping is not modelled); the peaks restart from what is now reserved and allocated,
        as after torch.cuda.reset_peak_memory_stats()."""
        self._release_cached()
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def _release_cached(self) -> None:
        """release_cached_blocks: every segment that is one free block (never split, or merged whole again) goes
        back to the device."""
        for base in [b for b in self._segments if self._blocks[b].next is None and not self._blocks[b].allocated]:
            block = self._blocks.pop(base)
            self._remove_free(block)
            self._segments.remove(base)
            self.reserved -= block.size

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr))

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.addr))]


def simulate(events: Iterable[tuple[int, int]], expandable: bool = False,
             capacity: int | None = None) -> AllocatorStats:
    """Replay ``(key, nbytes)`` events: nbytes > 0 allocates (0 is ignored),
    nbytes < 0 (conventionally -1) frees the block allocated for ``key``."""
    alloc = CachingAllocator(expandable, capacity)
    malloc, free = alloc.malloc, alloc.free  # bound once: the replay calls them ~10^4-10^5 times
    for key, nbytes in events:
        if nbytes < 0:
            free(key)
        else:
            malloc(key, nbytes)
    return alloc.stats()


def reserved_for(sizes: list[int]) -> int:
    """Reserved bytes after allocating ``sizes`` once, in order, never freeing."""
    alloc = CachingAllocator()
    for key, nbytes in enumerate(sizes):
        alloc.malloc(key, nbytes)
    return alloc.reserved
