"""The drafter's serving loop and its gRPC service.

`DraftLoop` runs the Drafter on its own thread: it applies commands as soon as they arrive (an abort
lands before the next drafted token), drafts while any sequence is below its lookahead bound, and
emits one DraftChunkBatch per step. It waits (and counts idle time) only when no sequence may draft.
The same loop serves the gRPC stream (DraftServicer) and in-process use (coordinator/scheduling/links.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import grpc

from duospec.draft_worker.drafter import Drafter
from duospec.draft_worker.proposer import DraftDeclined
from duospec.engine import SlotsExhausted
from duospec.internal.constraint_wire import GrammarWorkReport, add_grammar_work
from duospec.internal.kv_wire import kv_usage_to_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.internal.v1 import pearl_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_STOP = object()


class DraftLoop:
    def __init__(self, drafter: Drafter, emit: Callable[[pb.DraftChunkBatch], None]):
        self.drafter = drafter
        self.emit = emit
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._grammar_work = GrammarWorkReport(drafter.grammars.work)
        self._thread = threading.Thread(target=self._run, name="duospec-draft-loop", daemon=True)

    def start(self) -> "DraftLoop":
        self._thread.start()
        return self

    def submit(self, control: pb.DraftControl) -> None:
        """Thread-safe; never blocks."""
        self.inbox.put(control)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self.inbox.put(_STOP)
        self._thread.join(timeout)

    def _apply(self, control, failed: list[int]) -> bool:
        if control is _STOP:
            return False
        for cmd in control.commands:
            try:
                self.drafter.apply(cmd)
            except SlotsExhausted as exc:
                log.warning("draft sequence %d dropped: %s", cmd.seq_id, exc)
                failed.append(cmd.seq_id)
            except DraftDeclined as exc:
                log.debug("draft sequence %d goes target-only: %s", cmd.seq_id, exc)
                failed.append(cmd.seq_id)
            except Exception:  # a bad command drops its sequence, never the loop
                log.exception("draft command for sequence %d failed", cmd.seq_id)
                self.drafter.release(cmd.seq_id)
                failed.append(cmd.seq_id)
        return True

    def _run(self) -> None:
        busy = idle = 0.0
        while True:
            failed: list[int] = []
            # 1. Apply every pending command without waiting; aborts take effect before the next token.
            try:
                while True:
                    if not self._apply(self.inbox.get_nowait(), failed):
                        return
            except queue.Empty:
                pass
            # 2. Draft one token for every sequence below its bound, or wait for a command.
            stepped = self.drafter.has_work()
            if stepped:
                started = time.perf_counter()
                try:
                    chunks = self.drafter.step()
                    failed.extend(self.drafter.dropped)
                    self.drafter.dropped.clear()
                except Exception:  # never let one bad step kill the loop: those sequences go target-only
                    log.exception("draft step failed; dropping the sequences it was drafting")
                    failed.extend(self.drafter.drop_drafting())
                    chunks = []
                busy += time.perf_counter() - started
            else:
                chunks = []
                started = time.perf_counter()
                try:
                    control = self.inbox.get(timeout=0.5)
                except queue.Empty:
                    control = None
                idle += time.perf_counter() - started
                if control is not None and not self._apply(control, failed):
                    return
            # A step with no chunk (a long prompt being read) still reports: the coordinator knows the
            # drafter is alive and busy, not stalled (coordinator/scheduling/recovery.py).
            if chunks or failed or stepped:
                self.busy_s += busy
                self.idle_s += idle
                self.emit(pb.DraftChunkBatch(chunks=chunks, busy_seconds=busy, idle_seconds=idle, failed_seq_ids=failed,
                                             kv=kv_usage_to_proto(self.drafter.proposer.cache_stats()),
                                             grammar=self._grammar_work.take()))
                busy = idle = 0.0


MESSAGE_BUDGET_BYTES = 8 << 20  # a merged message stays well under the streams' 64 MB limit


def merge_batches(batches: list[pb.DraftChunkBatch],
                  budget_bytes: int = MESSAGE_BUDGET_BYTES) -> list[pb.DraftChunkBatch]:
    """Coalesces batches that queued up while the stream was busy into as few messages as fit in
    `budget_bytes` each: consecutive chunks of a sequence's main line (or of one of its hedges) in the
    same epoch become one multi-token chunk whose outlook is its last part's. Chunks keep their order;
    a line split across two messages continues where it stopped."""
    if len(batches) == 1 and batches[0].ByteSize() <= budget_bytes:
        return [batches[0]]
    merged = pb.DraftChunkBatch()
    out, size = [merged], 0
    last: dict[tuple, pb.DraftChunk] = {}  # (seq_id, hedge key or None) -> its latest merged chunk
    for batch in batches:
        merged.busy_seconds += batch.busy_seconds
        merged.idle_seconds += batch.idle_seconds
        merged.failed_seq_ids.extend(batch.failed_seq_ids)
        if batch.HasField("grammar"):
            add_grammar_work(merged.grammar, batch.grammar)
        if batch.HasField("kv"):  # the latest state of the pool
            merged.kv.CopyFrom(batch.kv)
        for chunk in batch.chunks:
            chunk_size = chunk.ByteSize()
            if size and size + chunk_size > budget_bytes:  # full: what follows goes in the next message
                merged = pb.DraftChunkBatch()
                out.append(merged)
                size, last = 0, {}
            size += chunk_size
            line = (chunk.seq_id, (chunk.hedge.pos, chunk.hedge.token) if chunk.HasField("hedge") else None)
            prev = last.get(line)
            if (
                prev is not None
                and prev.epoch == chunk.epoch
                and prev.start_pos + len(prev.tokens) == chunk.start_pos
                and (not chunk.tokens or not prev.tokens or (bool(prev.draft_probs) == bool(chunk.draft_probs)
                                                             and bool(prev.alternatives) == bool(chunk.alternatives)))
            ):
                prev.tokens.extend(chunk.tokens)
                prev.draft_probs.extend(chunk.draft_probs)
                prev.alternatives.extend(chunk.alternatives)
                prev.outlook = chunk.outlook  # what follows the merged chunk is what follows its last part
            else:
                merged.chunks.append(chunk)
                last[line] = merged.chunks[-1]
    return out


def drain(first, inbox: queue.SimpleQueue) -> tuple[list, bool]:
    """`first` plus whatever else is already queued; True if the end marker was among them."""
    items = [first]
    while True:
        try:
            item = inbox.get_nowait()
        except queue.Empty:
            return items, False
        if item is _STOP:
            return items, True
        items.append(item)


class DraftServicer(pb_grpc.DraftServiceServicer):
    """One coordinator stream at a time; a new stream releases the previous one's sequences."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self._lock = threading.Lock()
        self._loop: DraftLoop | None = None

    def Draft(self, request_iterator, context):
        out: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self._loop is not None:
                self._loop.stop()
                if self._loop.alive:  # its thread is stuck in a step: two loops must never share the drafter
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the drafter is still inside a step; retry later")
            self.drafter.release_all()
            loop = self._loop = DraftLoop(self.drafter, out.put).start()

        def read_commands():
            try:
                for control in request_iterator:
                    loop.submit(control)
            except Exception:  # the client went away
                pass
            out.put(_STOP)

        threading.Thread(target=read_commands, name="duospec-draft-reader", daemon=True).start()
        try:
            while True:
                batch = out.get()
                if batch is _STOP:
                    return
                batches, ended = drain(batch, out)
                yield from merge_batches(batches)
                if ended:
                    return
        finally:
            loop.stop()
            with self._lock:
                if self._loop is loop:
                    self._loop = None
                    self.drafter.release_all()
