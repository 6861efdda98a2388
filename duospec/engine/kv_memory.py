"""How many KV blocks a runner's pool gets, and a clear start-up error when that cannot work.

The pool is sized by memory, not by sequences x context:

    kv_cache_memory_bytes   given: exactly that many bytes of blocks (models[].kv_cache_memory_bytes)
    gpu_memory_utilization  on CUDA, when no byte count is given: the process may use that fraction of
                            the device's memory in all (vLLM's meaning); the blocks get what the
                            weights and everything already allocated leave of it
    neither                 as many positions as ``max_slots`` sequences of ``max_context`` (the
                            footprint of one slot per sequence, so an engine loaded without a memory
                            setting holds at least what it always did)

Whatever the source, the pool must hold one request at ``max_context`` (else no such request could
ever run) and fit in free memory.
"""

from __future__ import annotations

import os
import pathlib

import torch

from duospec.engine.errors import CheckpointError

__all__ = ["DEFAULT_BLOCK_SIZE", "check_kv_fits", "pool_blocks"]

# Positions per block: small enough that a sequence wastes little in its last block and a shared
# prefix is found at a fine grain, large enough that block tables stay short (vLLM's default too).
DEFAULT_BLOCK_SIZE = 16


def pool_blocks(*, block_bytes: int, block_size: int, max_slots: int, max_context: int, device: torch.device,
                kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float | None = None) -> int:
    """The number of blocks of ``block_bytes`` each (all layers' keys and values of ``block_size``
    positions) the pool gets; CheckpointError when that is too few or does not fit."""
    per_request = -(-max_context // block_size)
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes < 1:
            raise CheckpointError(f"kv_cache_memory_bytes={kv_cache_memory_bytes}: must be >= 1")
        blocks, source = kv_cache_memory_bytes // block_bytes, f"kv_cache_memory_bytes={kv_cache_memory_bytes:,}"
    elif device.type == "cuda" and gpu_memory_utilization is not None:
        if not 0 < gpu_memory_utilization <= 1:
            raise CheckpointError(f"gpu_memory_utilization={gpu_memory_utilization}: must be in (0, 1]")
        free, total = torch.cuda.mem_get_info(device)
        budget = int(gpu_memory_utilization * total) - (total - free)
        blocks = max(0, budget) // block_bytes
        source = (f"gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.1f} GiB with "
                  f"{(total - free) / 2**30:.1f} GiB already in use")
    else:
        blocks, source = max_slots * per_request, f"{max_slots} sequences x {max_context} positions"
    if blocks < per_request:
        raise CheckpointError(
            f"the KV cache ({source}) holds {blocks} blocks of {block_size} positions, but one request of "
            f"max_model_len={max_context} needs {per_request} ({per_request * block_bytes / 2**20:.1f} MiB); raise "
            f"models[].kv_cache_memory_bytes (or gpu_memory_utilization) or lower models[].max_model_len")
    check_kv_fits(blocks * block_bytes, device, source)
    return blocks


def check_kv_fits(kv_bytes: int, device: torch.device, what: str) -> None:
    """A clear start-up error when a KV pool of `kv_bytes` cannot fit in free memory."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = available_memory_bytes()
        if free is None:  # not a POSIX system: nothing to check against
            return
    if kv_bytes > 0.9 * free:
        raise CheckpointError(
            f"the KV cache ({what}) needs {kv_bytes / 2**30:.1f} GiB but {free / 2**30:.1f} GiB is free on {device}; "
            f"set models[].kv_cache_memory_bytes lower (or lower models[].max_model_len or the number of sequences)"
        )


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """Host memory a new allocation can have: Linux's MemAvailable, i.e. free memory plus the page cache
    the kernel drops on demand (a machine that just read large checkpoints or a training cache has
    little *free* memory and plenty available); elsewhere the free pages; None when unknown."""
    try:
        for line in pathlib.Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
