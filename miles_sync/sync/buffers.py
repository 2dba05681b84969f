"""Pack buffers of the sender: bucket-sized byte buffers on the heap, a device, or CPU shared memory.

A live send packs into a `DoubleBuffer` (bucket i into buffer i % 2, reused once bucket i was acknowledged); a
staged export gives every bucket a buffer of its own (`FreshBuffers`), since all of them stay alive until the send.
After each send the sender hands the freed host heap back to the OS (`trim_heap`).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Protocol

import torch

__all__: list[str] = []  # nothing here is imported from outside miles_sync.sync


class BucketBuffers(Protocol):
    """Where bucket `index` of `num_bytes` is packed."""

    def for_bucket(self, index: int, num_bytes: int) -> torch.Tensor: ...


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim() if sys.platform.startswith("linux") else None


def trim_heap() -> None:
    """Hand the free pages of the host heap back to the OS. An export frees many MiB-sized tensors every sync from
    several threads; glibc keeps such memory in per-thread arenas, and the sending rank's RSS then creeps up by a
    few percent over a hundred syncs without any live object leaking (benchmarks/soak.py measured +7.6% without
    this, flat with it). Costs milliseconds, after the send."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def byte_buffer(num_bytes: int, *, device: torch.device, shared: bool) -> torch.Tensor:
    """`shared`: in a CPU shared-memory segment (torch's file_system strategy), so that pickling it for a
    colocated engine passes a handle instead of copying the bytes into a new segment."""
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    if shared:
        buffer.untyped_storage()._share_filename_cpu_()
    return buffer


class DoubleBuffer:
    """Two byte buffers of at most `cap_bytes`, allocated on first use; bucket i packs into buffer i % 2.

    A buffer grows when a bucket does not fit (to at least twice its size, at most the cap), so it settles at the
    largest bucket after a few buckets and a model smaller than the cap never holds the cap. A bucket larger than the
    cap (one oversized unit travels alone) gets a buffer of its own for that bucket only.
    """

    def __init__(self, *, cap_bytes: int, device: torch.device, shared: bool = False) -> None:
        self._cap_bytes = cap_bytes
        self._device = device
        self._shared = shared
        self._slots: list[torch.Tensor | None] = [None, None]

    def for_bucket(self, index: int, num_bytes: int) -> torch.Tensor:
        if num_bytes > self._cap_bytes:
            return byte_buffer(num_bytes, device=self._device, shared=self._shared)
        slot = index % 2
        held = self._slots[slot]
        if held is None or held.numel() < num_bytes:
            size = num_bytes if held is None else min(self._cap_bytes, max(num_bytes, 2 * held.numel()))
            self._slots[slot] = None  # the old buffer is freed before the new one is allocated
            self._slots[slot] = held = byte_buffer(size, device=self._device, shared=self._shared)
        return held


class FreshBuffers:
    """A buffer of its own per bucket: staged buckets all stay alive until they are sent."""

    def __init__(self, *, device: torch.device, shared: bool) -> None:
        self._device = device
        self._shared = shared

    def for_bucket(self, index: int, num_bytes: int) -> torch.Tensor:
        del index
        return byte_buffer(num_bytes, device=self._device, shared=self._shared)
