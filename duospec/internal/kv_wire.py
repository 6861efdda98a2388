"""A worker's KV pool and prefix-cache counters on the internal wire (pearl.proto `KVUsage`): each
verdict batch and draft chunk batch carries them, so the coordinator reports both workers' pools
without asking the actors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from duospec.internal.v1 import pearl_pb2 as pb

if TYPE_CHECKING:  # the coordinator reads these messages without the engine
    from duospec.engine.blocks import CacheStats


def kv_usage_to_proto(stats: CacheStats | None) -> pb.KVUsage | None:
    if stats is None:
        return None
    return pb.KVUsage(num_blocks=stats.num_blocks, free_blocks=stats.free_blocks,
                      prefix_cache_queries=stats.queries, prefix_cache_hits=stats.hits, block_size=stats.block_size)


def kv_usage_report(kv: pb.KVUsage | None) -> dict:
    """The counters as a stats dict (kv_cache_usage: the fraction of blocks sequences hold); {} when unset."""
    if kv is None or not kv.num_blocks:
        return {}
    return {"kv_cache_usage": 1.0 - kv.free_blocks / kv.num_blocks, "kv_blocks": kv.num_blocks,
            "prefix_cache_queries": kv.prefix_cache_queries, "prefix_cache_hits": kv.prefix_cache_hits}
