"""The one request path behind every front (gRPC `GenerationService`, the OpenAI-compatible HTTP API).

One request, step by step:
  1. `accept` the bearer key (UNAUTHENTICATED) and charge the tenant's requests/min, before the
     front reads or parses the request's body, so a request rejected later still counts;
  2. resolve the model (NOT_FOUND, PERMISSION_DENIED), validate and tokenize off the event loop
     (INVALID_ARGUMENT naming the field) — coordinator/serving/validation.py;
  3. admit against the tenant's quotas and the weighted queue (RESOURCE_EXHAUSTED + retry_after_s)
     and write the request's ledger row (coordinator/tenants/ledger.py);
  4. iterate `coordinator.generate`, turning committed token ids into text deltas, cutting text and
     tokens at stop strings; the first delta carries the usage id a client resumes a broken stream
     with (coordinator/serving/resume.py), the last finish_reason, usage and speculation stats;
  5. on any exit (finish, stop string, client gone, deadline, shutdown, key revoked) close the
     coordinator's generator — that frees the sequence's KV slots — release the admission ticket
     and finish the ledger row with the tokens the client received.
Fronts see `GatewayError` (a gRPC status name, a message that says what to fix, the field when there
is one) and `Delta`s; they only translate. A request refused before admission (steps 1-3, or a body
the front cannot read) is logged and counted per tenant (`refuse`). Logs carry ids, tenant, model,
codes and counts, never prompts, completions, keys or values the client sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

import grpc

from duospec.coordinator.tenants.admission import Admission, AdmissionError
from duospec.coordinator.api import (
    Coordinator, CoordinatorError, FinishEvent, FinishReason, ModelInfo, SpecStats, SpeculationMode, TokenLogprob,
    TokensEvent,
)
from duospec.coordinator.config import ServerSettings
from duospec.coordinator.tenants.ledger import FLUSH_INTERVAL_S, RUNNING, UsageLedger, UsageRecord
from duospec.coordinator.serving.metrics import UNAUTHENTICATED_TENANT, ServerMetrics
from duospec.coordinator.serving.resume import Continuation, continue_request, load_secret, usage_id
from duospec.coordinator.tenants.tenancy import ANONYMOUS, AuthError, Tenant, TenantRegistry, authorize_model
from duospec.coordinator.serving.validation import (
    RequestError, ValidatedRequest, constraint_field, invalid, max_prompt_chars, resolve_model, validate_request,
    with_tenant,
)
from duospec.structured.constraint import ConstraintError
from duospec.v1 import generation_pb2 as pb

log = logging.getLogger("duospec.server")


class GatewayError(Exception):
    """What a front returns to the client: `code` is a gRPC status name (fronts map it to theirs)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s
        self.field = field


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    key_hash: str | None  # None when auth is off


@dataclass(frozen=True)
class Delta:
    """Text and token ids new since the last delta; the last one has `finish_reason` set."""

    request_id: str  # the client's id, or the server's when the client sent none
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0  # last delta only, like the usage figures below
    completion_tokens: int = 0
    stats: SpecStats | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked for them
    usage_id: str = ""  # first delta only: what a client resumes this stream with if it breaks


class Lifecycle:
    """Shared by the fronts and the server: draining flag, hard-stop signal, open stream count."""

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
class _Stream:
    """What one request has produced so far (for usage, ledger and metrics)."""

    id: str  # server-made, unique
    caller: Caller
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
    revoked: asyncio.Event = field(default_factory=asyncio.Event)
    progress_t: float = 0.0  # when the ledger last got this stream's progress (monotonic)
    constrained: bool = False  # the request has a constraint (its acceptance is also counted on its own)
    usage_row: str = ""  # its ledger row: `id`, or the broken stream's that a resumed one continues
    usage_id: str = ""  # the row, signed for this request (coordinator/serving/resume.py)
    resumed_tokens: int = 0  # a resumed stream: the tokens its broken stream delivered (in completion_tokens)

    @property
    def resumed(self) -> bool:
        return self.usage_row != self.id

    @property
    def charged_tokens(self) -> int:
        """What this stream takes from its tenant's tokens per minute: the prompt and the completion; a
        resumed stream only its new tokens (the broken one was charged the prompt and what it delivered)."""
        if self.resumed:
            return self.completion_tokens - self.resumed_tokens
        return self.prompt_tokens + self.completion_tokens

    @property
    def tenant(self) -> Tenant:
        return self.caller.tenant


class Gateway:
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
        # The longest prompt text that can fit each model's context, refused before tokenizing.
        self.max_prompt_chars = {name: max_prompt_chars(self.models[name], tok)
                                 for name, tok in tokenizers.items() if name in self.models}
        self._streams: dict[str, _Stream] = {}
        # usage row -> the stream of this gateway that writes it: a resumed stream that lands on the gateway
        # its broken stream is still ending on takes the row over, and the broken one's writes are dropped
        self._row_writers: dict[str, _Stream] = {}
        self._grammars: dict[str, Any] = {}  # model -> its GrammarCompiler, made at the first constraint
        # Gateways of one scaled-out deployment sign with a key they share (coordinator/remote.py), so a
        # stream broken on one resumes on any other; a file configured wins
        shared = getattr(coordinator, "resume_key", None)
        self.resume_secret = shared if shared and not settings.resume_secret_file \
            else load_secret(settings.resume_secret_file)

    # ---- who is calling ----------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Caller:
        """`authorization`: the `Bearer <key>` header/metadata value (None when absent)."""
        if self.registry is None:
            return Caller(ANONYMOUS, None)
        try:
            tenant, key_hash = self.registry.identify(authorization)
        except AuthError as exc:
            raise GatewayError(exc.code, str(exc)) from None
        return Caller(tenant, key_hash)

    async def accept(self, authorization: str | None) -> Caller:
        """The first step of every Generate, before its body is read: the caller, with one request
        charged to its requests/min. Raises GatewayError (counted and logged as refused)."""
        try:
            caller = self.authenticate(authorization)
        except GatewayError as exc:
            raise self.refuse(None, exc) from None
        try:
            await self.admission.charge_request(caller.tenant)
        except AdmissionError as exc:
            raise self.refuse(caller, GatewayError(exc.code, str(exc), exc.retry_after_s)) from None
        return caller

    def refuse(self, caller: Caller | None, exc: GatewayError) -> GatewayError:
        """Counts and logs a request refused before admission (`caller` None: no valid key); returns
        `exc` to raise. The log line names the tenant, the code and the field or the server's reason,
        never the key, the prompt or a value the client sent (those are in INVALID_ARGUMENT and
        NOT_FOUND messages)."""
        tenant = caller.tenant.name if caller is not None else None
        self.metrics.observe_refusal(tenant, exc.code)
        detail = f"field={exc.field}" if exc.code in ("INVALID_ARGUMENT", "NOT_FOUND") else f"reason: {exc}"
        log.info("request refused before admission: tenant=%s code=%s %s", tenant or UNAUTHENTICATED_TENANT,
                 exc.code, detail)
        return exc

    def visible_models(self, caller: Caller) -> list[ModelInfo]:
        return [m for m in self.models.values() if caller.tenant.may_use(m.name)]

    def default_mode(self, m: ModelInfo) -> SpeculationMode:
        return self.default_modes.get(m.name, SpeculationMode.PEARL) if m.has_draft else SpeculationMode.OFF

    def reload_tenants(self, tenants: list[Tenant]) -> int:
        """New keys, limits and weights take effect now; streams of a revoked key end with
        UNAUTHENTICATED. Returns how many streams were ended."""
        if self.registry is None:
            return 0
        self.registry = TenantRegistry(tenants)
        self.admission.set_tenants(tenants)
        ended = 0
        for stream in self._streams.values():
            if stream.caller.key_hash is not None and not self.registry.holds(stream.caller.key_hash,
                                                                             stream.tenant.name):
                stream.revoked.set()
                ended += 1
        return ended

    # ---- one request ---------------------------------------------------------------------------------

    async def generate(self, caller: Caller, request: pb.GenerateRequest) -> AsyncIterator[Delta]:
        """Deltas of one request from a caller `accept` returned; raises GatewayError (before the first
        delta, or mid-stream for a failure of the system). Closing the generator early cancels the
        request."""
        validated, text, finished, ticket, stream = await self._admit(caller, request)
        if caller.key_hash is not None and self.registry is not None and not self.registry.holds(
                caller.key_hash, caller.tenant.name):  # revoked while it was validated or queued
            self.admission.release(ticket, 0)
            raise GatewayError("UNAUTHENTICATED", "the API key of this request was revoked")
        self._streams[stream.id] = stream
        self.lifecycle.stream_opened()
        self._update_queue_gauges()
        self._row_writers[stream.usage_row] = stream
        try:
            if self.ledger is not None:
                await self.ledger.start_async(self._record(stream, "running", RUNNING))
            # aclosing: a consumer that stops at the last delta (or leaves) closes the coordinator's
            # generator now, freeing the sequence before the admission slot goes to the next request.
            async with contextlib.aclosing(self._run(validated, stream, text, finished)) as deltas:
                usage = stream.usage_id
                async for delta in deltas:
                    yield replace(delta, usage_id=usage) if usage else delta
                    usage = ""
        except (asyncio.CancelledError, GeneratorExit):
            if stream.finish_reason is None and stream.status_code == "OK":
                stream.finish_reason, stream.status_code = FinishReason.CANCELLED, "CANCELLED"
            raise
        except GatewayError as exc:
            stream.status_code = exc.code
            raise
        except CoordinatorError as exc:
            stream.status_code = exc.code if exc.code in grpc.StatusCode.__members__ else "INTERNAL"
            log.warning("request %s failed: %s %s", stream.client_request_id, stream.status_code, exc)
            raise GatewayError(stream.status_code, str(exc)) from None
        except Exception:
            stream.status_code = "INTERNAL"
            log.exception("request %s: internal error", stream.client_request_id)
            raise GatewayError("INTERNAL", f"internal error (request {stream.client_request_id}); "
                               "see the server log") from None
        finally:
            del self._streams[stream.id]
            self.admission.release(ticket, stream.charged_tokens)
            self.lifecycle.stream_closed()
            self._update_queue_gauges()
            await self._account(stream)

    async def _admit(self, caller: Caller, request: pb.GenerateRequest):
        tenant = caller.tenant
        try:
            usable = [m.name for m in self.visible_models(caller)]
            info = resolve_model(request.model, self.models, self.default_model, usable)
            authorize_model(tenant, info.name, usable)
            # Tokenizing and templating a long prompt takes milliseconds: not on the event loop.
            validated: ValidatedRequest = await asyncio.to_thread(
                validate_request, request, info, self.tokenizers[info.name], self.settings,
                self.default_modes.get(info.name, SpeculationMode.PEARL), uuid.uuid4().hex,
                max_prompt_chars=self.max_prompt_chars.get(info.name),
                token_allowance=tenant.limits.tokens_one_request_may_take,
            )
            grammar = None
            if validated.request.constraint is not None:
                grammar = await self._check_constraint(info, validated.request.constraint, constraint_field(request))
            row = validated.request.request_id
            signed = usage_id(self.resume_secret, row, tenant.name, validated)
            resume = Continuation(row)
            if request.HasField("resume"):  # a client continues a broken stream of this request
                validated, resume = await asyncio.to_thread(
                    continue_request, request, validated, info, tenant.name, self.resume_secret, grammar)
            text = await asyncio.to_thread(text_state, self.tokenizers[info.name], validated)
            n_prompt = validated.request.output_start
            # a resumed request reserves only what is new: its broken stream paid for the prompt and the delivered
            resent = len(validated.request.prompt_token_ids) if not request.HasField("resume") else 0
            ticket = await self.admission.admit(tenant, resent + validated.request.max_new_tokens, info.name)
        except RequestError as exc:
            raise self.refuse(caller, GatewayError(exc.code, str(exc), field=exc.field)) from None
        except AuthError as exc:
            raise self.refuse(caller, GatewayError(exc.code, str(exc))) from None
        except AdmissionError as exc:
            raise self.refuse(caller, GatewayError(exc.code, str(exc), exc.retry_after_s)) from None
        stream = _Stream(validated.request.request_id, caller, info.name, validated.client_request_id, n_prompt,
                         completion_tokens=validated.request.resumed_tokens,
                         resumed_tokens=validated.request.resumed_tokens,
                         constrained=validated.request.constraint is not None, usage_row=resume.row,
                         usage_id=signed)
        return validated, text, resume.finished, ticket, stream

    async def _check_constraint(self, info: ModelInfo, constraint, field: str):
        """Compile the constraint for the model's tokenizer (cached; off the event loop, time-limited),
        so that a bad one is a 400 naming `field` before it is admitted; the target compiles it again
        where its matcher lives. Returns the grammar."""
        compiler = self._grammars.get(info.name)
        if compiler is None:
            compiler = self._grammars[info.name] = await asyncio.to_thread(self._new_compiler, info)
        started = time.monotonic()
        try:
            return await compiler.compile_async(constraint)
        except ConstraintError as exc:
            raise RequestError("INVALID_ARGUMENT", f"{field}: {exc}", field) from None
        finally:
            self.metrics.observe_grammar_compile(info.name, time.monotonic() - started)

    def _new_compiler(self, info: ModelInfo):
        from duospec.structured.llguidance_backend import LLGuidanceBackend
        from duospec.structured.manager import GrammarCompiler

        try:
            backend = LLGuidanceBackend.from_tokenizer(self.tokenizers[info.name], info.end_token_ids,
                                                       key=info.target_path)
        except ConstraintError as exc:
            raise RequestError("INVALID_ARGUMENT", f"constraint: model {info.name!r}: {exc}", "constraint") from None
        return GrammarCompiler(backend, timeout_s=self.settings.grammar_compile_timeout_s)

    async def _run(self, v: ValidatedRequest, stream: _Stream, text_state,
                   finished: FinishReason | None) -> AsyncIterator[Delta]:
        detok, stopper = text_state
        if finished is not None:  # a resumed stream whose tokens were all delivered: only its end was lost
            stream.finish_reason = finished
            yield self._final(stream, self._closing_text(stream, detok, stopper), ())
            return
        request = with_tenant(v, stream.tenant.name, stream.tenant.priority_weight)
        events = self.coordinator.generate(request)
        interrupts = [asyncio.ensure_future(self.lifecycle.hard_stop.wait()),
                      asyncio.ensure_future(stream.revoked.wait())]
        try:
            while True:
                event = await _next_event(events, interrupts)
                if event is _END:
                    raise CoordinatorError("the coordinator ended the stream without a finish event", "INTERNAL")
                if event is _INTERRUPTED:
                    if stream.revoked.is_set():
                        raise GatewayError("UNAUTHENTICATED", "the API key of this stream was revoked")
                    stream.finish_reason = FinishReason.CANCELLED  # the server's grace period ended
                    yield self._final(stream, stopper.flush(), ())
                    return
                if isinstance(event, TokensEvent):
                    stream.stats = event.stats or stream.stats  # live: right even if we stop early
                    text, sent, hit = _cut_at_stop(detok, stopper, event.token_ids)
                    logprobs = event.logprobs[: len(sent)]
                    self._observe_tokens(stream, len(sent))
                    if hit:
                        stream.finish_reason = FinishReason.STOP
                        yield self._final(stream, text, sent, logprobs)
                        return
                    self._ledger_progress(stream)
                    yield Delta(stream.client_request_id, text, sent, logprobs=logprobs)
                elif isinstance(event, FinishEvent):
                    stream.finish_reason, stream.stats = event.finish_reason, event.stats
                    stream.completion_tokens = request.resumed_tokens + event.completion_tokens
                    yield self._final(stream, self._closing_text(stream, detok, stopper), ())
                    return
        finally:
            for waiter in interrupts:
                waiter.cancel()
            await events.aclose()  # frees the sequence's KV slots when we stopped early

    @staticmethod
    def _closing_text(stream: _Stream, detok, stopper: StopStringMatcher) -> str:
        """The text held back until the end (an unfinished character, a possible stop string's start)."""
        text, hit = stopper.feed(detok.flush())
        if hit:  # the stop string completed only in the detokenizer's last held text
            stream.finish_reason = FinishReason.STOP
        return text if hit else text + stopper.flush()

    def _final(self, stream: _Stream, text: str, token_ids, logprobs=()) -> Delta:
        return Delta(stream.client_request_id, text, tuple(token_ids), stream.finish_reason, stream.prompt_tokens,
                     stream.completion_tokens, stream.stats, tuple(logprobs))

    def _observe_tokens(self, stream: _Stream, n: int) -> None:
        now = time.monotonic()
        if stream.last_token_t is None:
            self.metrics.observe_first_token(stream.tenant.name, now - stream.t0)
            if n > 1:
                self.metrics.observe_tokens(stream.tenant.name, n - 1, 0.0)
        else:
            self.metrics.observe_tokens(stream.tenant.name, n, now - stream.last_token_t)
        stream.last_token_t = now
        stream.completion_tokens += n

    def _update_queue_gauges(self) -> None:
        self.metrics.set_admission(self.admission.running, self.admission.waiting)

    # ---- accounting --------------------------------------------------------------------------------

    def _record(self, stream: _Stream, finish: str, status: str) -> UsageRecord:
        s = stream.stats
        return UsageRecord(
            id=stream.usage_row, request_id=stream.client_request_id, tenant=stream.tenant.name, model=stream.model,
            prompt_tokens=stream.prompt_tokens, completion_tokens=stream.completion_tokens,
            drafted=s.drafted_tokens, accepted=s.accepted_tokens, target_forwards=s.target_forwards,
            mean_accepted_length=s.mean_accepted_length, finish_reason=finish, status_code=status,
            started_at=stream.started_at, finished_at=time.time(),
        )

    def _ledger_progress(self, stream: _Stream) -> None:
        """In memory, flushed each second; a record at most every quarter of that, not per token event."""
        now = time.monotonic()
        if self.ledger is not None and now - stream.progress_t >= FLUSH_INTERVAL_S / 4 \
                and self._row_writers.get(stream.usage_row) is stream:
            stream.progress_t = now
            self.ledger.progress(self._record(stream, "running", RUNNING))

    async def _account(self, stream: _Stream) -> None:
        tenant = stream.tenant.name
        if stream.status_code == "OK" or stream.finish_reason is FinishReason.CANCELLED:
            reason = stream.finish_reason or FinishReason.CANCELLED
            self.metrics.observe_finish(tenant, reason, stream.prompt_tokens, stream.completion_tokens, stream.stats,
                                        time.monotonic() - stream.t0, constrained=stream.constrained)
            finish = reason.value
        else:
            self.metrics.observe_failure(tenant, stream.status_code)
            finish = stream.status_code
        log.info("request %s tenant=%s model=%s prompt_tokens=%d completion_tokens=%d finish=%s",
                 stream.client_request_id, tenant, stream.model, stream.prompt_tokens, stream.completion_tokens,
                 finish)
        if self._row_writers.get(stream.usage_row) is not stream:
            log.info("request %s: its usage row %s was resumed by a later stream of this gateway, which writes it",
                     stream.client_request_id, stream.usage_row)
            return
        del self._row_writers[stream.usage_row]
        if self.ledger is not None:  # (a failed write is logged and counted by the ledger, never raised)
            await self.ledger.finish_async(self._record(stream, finish, stream.status_code))


_INTERRUPTED = object()  # sentinel: the server's grace period ended, or the stream's key was revoked
_END = object()  # sentinel: the coordinator's generator is exhausted


def text_state(tokenizer, v: ValidatedRequest):
    """The request's detokenizer and stop matcher. A resumed request's have read the tokens its
    broken stream delivered (its prompt's tail), so its first delta is exactly the text the broken
    stream would have sent next: a character split across the break, or a stop string begun before
    it, come out as they would have (both hold back the same text after the same tokens)."""
    from duospec.detokenizer import IncrementalDetokenizer

    prompt = v.request.prompt_token_ids
    # Text as transformers' decode(skip_special_tokens=True): no <|im_end|> at the end of a chat
    # reply; the token ids still carry everything.
    detok = IncrementalDetokenizer(tokenizer, prompt[: v.request.output_start],
                                   skip_special_tokens=True)
    stopper = StopStringMatcher(v.stop_strings)
    if v.request.resumed_tokens and stopper.feed(detok.push(prompt[v.request.output_start:]))[1]:
        raise invalid("resume.delivered_token_ids", "their text holds a stop string, where the stream ended: "
                      "send the tokens this request's stream delivered")
    return detok, stopper


def _cut_at_stop(detok, stopper: StopStringMatcher, token_ids) -> tuple[str, tuple[int, ...], bool]:
    """(text to send, token ids to send, stop string found). With stop strings the tokens go through
    one at a time, so what is sent (and counted) ends with the token that completed the stop string."""
    if not stopper.stops:
        return detok.push(list(token_ids)), tuple(token_ids), False
    parts = []
    for i, token in enumerate(token_ids):
        text, hit = stopper.feed(detok.push([token]))
        parts.append(text)
        if hit:
            return "".join(parts), tuple(token_ids[: i + 1]), True
    return "".join(parts), tuple(token_ids), False


async def _next_event(events: AsyncIterator, interrupts: list[asyncio.Future]):
    """The coordinator's next event, `_END` when exhausted, or `_INTERRUPTED` if an interrupt came first."""
    nxt = asyncio.ensure_future(_anext_or_end(events))
    try:
        await asyncio.wait({nxt, *interrupts}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel_and_wait(nxt)
        raise
    if nxt.done():
        return nxt.result()
    await _cancel_and_wait(nxt)
    return _INTERRUPTED


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
