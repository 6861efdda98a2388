"""`duospec.v1.GenerationService`: authenticate, validate, admit, stream text, account.

One `Generate` call, step by step:
  1. authenticate the bearer key (UNAUTHENTICATED) and resolve the model (NOT_FOUND, PERMISSION_DENIED);
  2. validate and tokenize (INVALID_ARGUMENT naming the field) — coordinator/validation.py;
  3. admit against the tenant's quotas and the server's stream cap (RESOURCE_EXHAUSTED + retry-after-s);
  4. iterate `coordinator.generate`, turning committed token ids into text deltas, cutting at stop
     strings; the last message carries finish_reason, usage and speculation stats;
  5. on any exit (finish, stop string, client cancel/deadline, shutdown) close the coordinator's
     generator — that frees the sequence's KV slots — release the admission ticket, write the ledger.
Logs carry ids, tenant, model and counts, never prompts, completions or keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc

from coordinator.admission import Admission, AdmissionError
from coordinator.api import (
    Coordinator, CoordinatorError, FinishEvent, FinishReason, ModelInfo, SpecStats, SpeculationMode, TokensEvent,
)
from coordinator.config import ServerSettings
from coordinator.ledger import UsageLedger, UsageRecord
from coordinator.metrics import ServerMetrics
from coordinator.tenancy import ANONYMOUS, AuthError, Tenant, TenantRegistry, authorize_model
from coordinator.validation import RequestError, ValidatedRequest, resolve_model, validate_request, with_tenant
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("duospec.server")

_FINISH_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
_MODE_TO_PB = {
    SpeculationMode.PEARL: pb.SPECULATION_MODE_PEARL,
    SpeculationMode.VANILLA: pb.SPECULATION_MODE_VANILLA,
    SpeculationMode.OFF: pb.SPECULATION_MODE_OFF,
}
_SHUTDOWN = object()  # sentinel: the server's grace period ended while this stream was running
_END = object()  # sentinel: the coordinator's generator is exhausted


class Lifecycle:
    """Shared by the servicer and the server: draining flag, hard-stop signal, open stream count."""

    def __init__(self) -> None:
        self.draining = False
        self.hard_stop = asyncio.Event()
        self.active_streams = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def stream_opened(self) -> None:
        self.active_streams += 1
        self.idle.clear()

    def stream_closed(self) -> None:
        self.active_streams -= 1
        if self.active_streams == 0:
            self.idle.set()


class StopStringMatcher:
    """Cuts streamed text before the first stop string, holding back only text that could start one.

    The held tail is the longest suffix of the pending text that is a proper prefix of some stop
    string; anything before it is safe to send because no stop string can begin there.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to send now, whether a stop string was found)."""
        if not self.stops:
            return text, False
        pending = self._held + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return pending[: min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(pending)), keep, -1):
                if pending.endswith(s[:k]):
                    keep = k
                    break
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


@dataclass
class _StreamState:
    """What one Generate call has produced so far (for usage, ledger and metrics)."""

    tenant: Tenant
    model: str
    client_request_id: str
    prompt_tokens: int
    started_at: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)
    last_token_t: float | None = None
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    status_code: str = "OK"


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(
        self,
        coordinator: Coordinator,
        settings: ServerSettings,
        tokenizers: dict[str, Any],
        *,
        registry: TenantRegistry | None,
        admission: Admission,
        lifecycle: Lifecycle,
        metrics: ServerMetrics,
        ledger: UsageLedger | None = None,
        default_modes: dict[str, SpeculationMode] | None = None,
    ):
        self.coordinator = coordinator
        self.settings = settings
        self.tokenizers = tokenizers
        self.registry = registry
        self.admission = admission
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.ledger = ledger
        self.default_modes = default_modes or {}
        self.models: dict[str, ModelInfo] = {m.name: m for m in coordinator.models()}
        self.default_model = next(iter(self.models))

    # ---- RPCs -------------------------------------------------------------------------------------

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        try:
            tenant = self._authenticate(context)
        except AuthError as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        cards = [self._card(m, reveal=tenant.admin) for m in self.models.values() if tenant.may_use(m.name)]
        return pb.ListModelsResponse(models=cards)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            tenant = self._authenticate(context)
            info = resolve_model(request.model, self.models, self.default_model)
            authorize_model(tenant, info.name)
            validated = validate_request(
                request, info, self.tokenizers[info.name], self.settings,
                self.default_modes.get(info.name, SpeculationMode.PEARL), uuid.uuid4().hex,
            )
            ticket = await self.admission.admit(tenant, len(validated.request.prompt_token_ids)
                                                + validated.request.max_new_tokens, info.name)
        except (AuthError, RequestError) as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        except AdmissionError as exc:
            # grpc.aio rejects trailing_metadata=None (TypeError → UNKNOWN), so "no hint" is an empty tuple.
            trailer = (("retry-after-s", f"{exc.retry_after_s:.3f}"),) if exc.retry_after_s else ()
            await context.abort(grpc.StatusCode[exc.code], str(exc), trailer)
        state = _StreamState(tenant, info.name, validated.client_request_id, len(validated.request.prompt_token_ids))
        self.lifecycle.stream_opened()
        self._update_queue_gauges()
        try:
            await self._run_stream(validated, state, context)
        except asyncio.CancelledError:
            state.finish_reason, state.status_code = FinishReason.CANCELLED, "CANCELLED"
            raise
        except CoordinatorError as exc:
            state.status_code = exc.code if exc.code in grpc.StatusCode.__members__ else "INTERNAL"
            log.warning("request %s failed: %s %s", state.client_request_id, state.status_code, exc)
            await context.abort(grpc.StatusCode[state.status_code], str(exc))
        except Exception:
            if state.status_code == "OK":
                state.status_code = "INTERNAL"
                log.exception("request %s: internal error", state.client_request_id)
                await context.abort(grpc.StatusCode.INTERNAL,
                                    f"internal error (request {state.client_request_id}); see the server log")
            raise
        finally:
            self.admission.release(ticket, state.prompt_tokens + state.completion_tokens)
            self.lifecycle.stream_closed()
            self._update_queue_gauges()
            await self._account(state)

    # ---- streaming --------------------------------------------------------------------------------

    async def _run_stream(self, v: ValidatedRequest, state: _StreamState, context) -> None:
        from duospec.detokenizer import IncrementalDetokenizer

        request = with_tenant(v, state.tenant.name, state.tenant.priority_weight)
        # Text as transformers' decode(skip_special_tokens=True): no <|im_end|> at the end of a chat
        # reply; the token ids still carry everything.
        detok = IncrementalDetokenizer(self.tokenizers[state.model], list(request.prompt_token_ids),
                                       skip_special_tokens=True)
        stopper = StopStringMatcher(v.stop_strings)
        events = self.coordinator.generate(request)
        stop_waiter = asyncio.ensure_future(self.lifecycle.hard_stop.wait())
        try:
            while True:
                event = await _next_event(events, stop_waiter)
                if event is _END:
                    raise CoordinatorError("the coordinator ended the stream without a finish event", "INTERNAL")
                if event is _SHUTDOWN:
                    state.finish_reason = FinishReason.CANCELLED
                    await context.write(self._final(state, stopper.flush(), ()))
                    return
                if isinstance(event, TokensEvent):
                    state.stats = event.stats or state.stats  # live: right even if we stop early
                    self._observe_tokens(state, len(event.token_ids))
                    text, hit = stopper.feed(detok.push(list(event.token_ids)))
                    if hit:
                        state.finish_reason = FinishReason.STOP
                        await context.write(self._final(state, text, event.token_ids))
                        return
                    await context.write(pb.GenerateResponse(request_id=state.client_request_id, text=text,
                                                            token_ids=event.token_ids))
                elif isinstance(event, FinishEvent):
                    state.finish_reason, state.stats = event.finish_reason, event.stats
                    state.completion_tokens = event.completion_tokens
                    text, hit = stopper.feed(detok.flush())
                    await context.write(self._final(state, text if hit else text + stopper.flush(), ()))
                    return
        finally:
            stop_waiter.cancel()
            await events.aclose()  # frees the sequence's KV slots when we stopped early

    def _observe_tokens(self, state: _StreamState, n: int) -> None:
        now = time.monotonic()
        if state.last_token_t is None:
            self.metrics.observe_first_token(state.tenant.name, now - state.t0)
            if n > 1:
                self.metrics.observe_tokens(state.tenant.name, n - 1, 0.0)
        else:
            self.metrics.observe_tokens(state.tenant.name, n, now - state.last_token_t)
        state.last_token_t = now
        state.completion_tokens += n

    def _final(self, state: _StreamState, text: str, token_ids) -> pb.GenerateResponse:
        s = state.stats
        return pb.GenerateResponse(
            request_id=state.client_request_id,
            text=text,
            token_ids=token_ids,
            finish_reason=_FINISH_TO_PB[state.finish_reason],
            usage=pb.Usage(prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens),
            stats=pb.SpeculationStats(
                drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens,
                target_forwards=s.target_forwards, mean_accepted_length=s.mean_accepted_length,
                pre_verify_aborts=s.pre_verify_aborts, wasted_draft_tokens=s.wasted_draft_tokens,
                cache_lookups=s.cache_lookups, cache_hits=s.cache_hits, tree_nodes=s.tree_nodes,
                tree_hits=s.tree_hits,
            ),
        )

    # ---- helpers ----------------------------------------------------------------------------------

    def _authenticate(self, context) -> Tenant:
        if self.registry is None:
            return ANONYMOUS
        authorization = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                authorization = value
        return self.registry.authenticate(authorization)

    def _card(self, m: ModelInfo, *, reveal: bool) -> pb.ModelCard:
        """What a tenant may know of a model; checkpoint paths and Ray node ids only for an admin."""
        mode = self.default_modes.get(m.name, SpeculationMode.PEARL) if m.has_draft else SpeculationMode.OFF
        card = pb.ModelCard(name=m.name, vocab_size=m.vocab_size, max_context=m.max_context,
                            default_mode=_MODE_TO_PB[mode], draft_method=m.draft_method or "")
        if reveal:
            card.target, card.draft = m.target_path, m.draft_path or ""
            card.target_node_id, card.draft_node_id = m.target_node_id, m.draft_node_id
        return card

    def _update_queue_gauges(self) -> None:
        self.metrics.streams_running.set(self.admission.running)
        self.metrics.streams_waiting.set(self.admission.waiting)

    async def _account(self, state: _StreamState) -> None:
        finished_at = time.time()
        tenant = state.tenant.name
        if state.status_code == "OK" or state.finish_reason is FinishReason.CANCELLED:
            reason = state.finish_reason or FinishReason.CANCELLED
            self.metrics.observe_finish(tenant, reason, state.prompt_tokens, state.completion_tokens, state.stats,
                                        time.monotonic() - state.t0)
            finish = reason.value
        else:
            self.metrics.observe_failure(tenant, state.status_code)
            finish = state.status_code
        log.info("request %s tenant=%s model=%s prompt_tokens=%d completion_tokens=%d finish=%s",
                 state.client_request_id, tenant, state.model, state.prompt_tokens, state.completion_tokens, finish)
        if self.ledger is None:
            return
        s = state.stats
        record = UsageRecord(
            request_id=state.client_request_id, tenant=tenant, model=state.model,
            prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens,
            drafted=s.drafted_tokens, accepted=s.accepted_tokens, target_forwards=s.target_forwards,
            mean_accepted_length=s.mean_accepted_length, finish_reason=finish, status_code=state.status_code,
            started_at=state.started_at, finished_at=finished_at,
        )
        try:
            await self.ledger.record_async(record)
        except Exception:  # the client already has its answer; losing a row must not turn it into an error
            log.exception("request %s: could not write the usage ledger", state.client_request_id)


async def _next_event(events: AsyncIterator, stop_waiter: asyncio.Future):
    """The coordinator's next event, `_END` when exhausted, or `_SHUTDOWN` if the hard stop came first."""
    nxt = asyncio.ensure_future(_anext_or_end(events))
    try:
        await asyncio.wait({nxt, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel_and_wait(nxt)
        raise
    if nxt.done():
        return nxt.result()
    await _cancel_and_wait(nxt)
    return _SHUTDOWN


async def _anext_or_end(events: AsyncIterator):
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return _END


async def _cancel_and_wait(task: asyncio.Future) -> None:
    # The generator must not be running when we aclose() it, so wait for the cancel to land.
    task.cancel()
    try:
        await task
    except BaseException:
        pass
