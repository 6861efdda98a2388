"""Errors raised by the engine. Both are ordinary exceptions with picklable string messages, so they
cross Ray actor boundaries unchanged."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint (or a load option) cannot be used. The message names the path, the problem and
    the fix."""


class SlotsExhausted(RuntimeError):
    """Every KV-cache slot of a runner is in use; free one or load the model with more ``max_slots``."""


class BlocksExhausted(SlotsExhausted):
    """The KV pool has no free block for a forward's new positions; nothing was changed. Free a
    sequence (or preempt one) and retry, or give the model more KV memory."""
