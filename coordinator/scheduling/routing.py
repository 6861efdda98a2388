"""How a model's replicas share its requests (models[].routing; coordinator/scheduling/replicas.py
holds the replicas). A policy sees the request and the replicas: their index, whether they serve,
their live requests and the tokens those may still produce."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Protocol, Sequence

from duospec.coordinator.api import GenerationRequest
from duospec.engine.blocks import chained_block_hashes, salt_root


class Routable(Protocol):
    """What a policy reads of a replica (replicas.Replica)."""

    index: int
    live: int
    tokens_left: int

    @property
    def serving(self) -> bool: ...


class RoutingPolicy(Protocol):
    def choose(self, replicas: Sequence[Routable], request: GenerationRequest) -> Routable: ...


class LeastOutstandingWork:
    """The serving replica with the fewest tokens still to produce, then the fewest live requests;
    with none serving, the least loaded of all (whose scheduler answers UNAVAILABLE at once)."""

    def choose(self, replicas: Sequence[Routable], request: GenerationRequest) -> Routable:
        candidates = [r for r in replicas if r.serving] or list(replicas)
        return min(candidates, key=lambda r: (r.tokens_left, r.live, r.index))


ROUTING_POLICIES = ("least_work", "prefix_affinity")  # models[].routing
AFFINITY_BLOCK = 16  # prompt tokens per key, as the workers' KV blocks hold them
AFFINITY_MAX_BLOCKS = 64  # a prompt's first 1,024 tokens decide: a shared system prompt or chat history
AFFINITY_KEYS = 1 << 16  # remembered keys (~6 MB), the least recently routed dropped first
AFFINITY_SLACK_TOKENS = 1024  # outstanding tokens a replica may have above the least loaded and still keep its prefixes
AFFINITY_HOME_BLOCKS = 4  # a prompt nobody routed yet: its first 64 tokens pick its home replica


class PrefixAffinity:
    """Sends a request to the replica that last took a prompt sharing its longest run of leading
    16-token blocks (same tenant) — that replica's prefix cache most likely still holds them — unless
    that replica has more than `slack_tokens` of outstanding work above the least loaded one; then
    the least outstanding work. A prompt that shares nothing this router saw goes to its home replica:
    among those within the slack, the highest rendezvous hash of its first AFFINITY_HOME_BLOCKS blocks'
    key, so every gateway (each with its own memory of where it routed) sends a new shared prefix to
    the same replica. The coordinator does not see the workers' caches: this is a guess from where it
    routed, as SGLang's cache-aware router makes it, and a wrong guess costs only the prefill a cache
    hit would have saved."""

    def __init__(self, slack_tokens: int = AFFINITY_SLACK_TOKENS) -> None:
        self.slack_tokens = slack_tokens
        self._fallback = LeastOutstandingWork()
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # block-chain key -> replica index

    @staticmethod
    def keys(request: GenerationRequest) -> list[bytes]:
        """One key per full leading block: the hash the workers give that block under the tenant's
        salt (duospec/engine/blocks.py), chained over every prompt token up to its end."""
        tokens = request.prompt_token_ids[: AFFINITY_BLOCK * AFFINITY_MAX_BLOCKS]
        return list(chained_block_hashes(salt_root(request.tenant), tokens, AFFINITY_BLOCK))

    def choose(self, replicas: Sequence[Routable], request: GenerationRequest) -> Routable:
        least = self._fallback.choose(replicas, request)
        serving = {r.index: r for r in replicas if r.serving}
        keys = self.keys(request)
        chosen = least
        for key in reversed(keys):  # the longest shared prefix first
            owner = serving.get(self._owner.get(key))
            if owner is not None:
                if owner.tokens_left - least.tokens_left <= self.slack_tokens:
                    chosen = owner
                break
        else:
            if keys:
                chosen = self._home(keys[: AFFINITY_HOME_BLOCKS][-1], serving.values(), least)
        for key in keys:
            self._owner[key] = chosen.index
            self._owner.move_to_end(key)
        while len(self._owner) > AFFINITY_KEYS:
            self._owner.popitem(last=False)
        return chosen


    def _home(self, key: bytes, serving, least: Routable) -> Routable:
        near = [r for r in serving if r.tokens_left - least.tokens_left <= self.slack_tokens]
        return max(near, key=lambda r: hashlib.blake2b(key + r.index.to_bytes(4, "little"), digest_size=8).digest(),
                   default=least)


def routing_policy(name: str) -> RoutingPolicy:
    """models[].routing as a policy."""
    return PrefixAffinity() if name == "prefix_affinity" else LeastOutstandingWork()
