"""`duospec.v1.GenerationService`: the gRPC front of coordinator/serving/gateway.py.

It reads the `authorization` metadata, hands the request to the gateway, and writes each delta as a
`GenerateResponse` (the last carries finish_reason, usage and speculation stats). A GatewayError
becomes the status of the same name with its message (and a `retry-after-s` trailer when the client
should retry later). A client that cancels or passes its deadline closes the gateway's generator,
which frees the sequence and finishes its ledger row; so does one that stops reading for the server's
send_timeout_s (its stream then ends CANCELLED, after the messages it has not read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from duospec.coordinator.api import FinishReason, ModelInfo, SpeculationMode
from duospec.coordinator.serving.gateway import Delta, Gateway, GatewayError
from duospec.coordinator.scheduling.replicas import ReplicaState
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("duospec.server")
_FINISH_TO_PB = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.GRAMMAR_DEAD_END: pb.FINISH_REASON_GRAMMAR_DEAD_END,
}
_REPLICA_STATE_TO_PB = {
    ReplicaState.SERVING: pb.REPLICA_STATE_SERVING,
    ReplicaState.DEGRADED: pb.REPLICA_STATE_DEGRADED,
    ReplicaState.DOWN: pb.REPLICA_STATE_DOWN,
}
_MODE_TO_PB = {
    SpeculationMode.PEARL: pb.SPECULATION_MODE_PEARL,
    SpeculationMode.VANILLA: pb.SPECULATION_MODE_VANILLA,
    SpeculationMode.OFF: pb.SPECULATION_MODE_OFF,
}


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        try:
            caller = self.gateway.authenticate(_authorization(context))
        except GatewayError as exc:
            await _abort(context, exc)
        cards = [self._card(m, reveal=caller.tenant.admin) for m in self.gateway.visible_models(caller)]
        return pb.ListModelsResponse(models=cards)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            caller = await self.gateway.accept(_authorization(context))
            timeout = self.gateway.settings.send_timeout_s
            async with contextlib.aclosing(self.gateway.generate(caller, request)) as deltas:
                async for delta in deltas:
                    if not await _sent(context, _response(delta), timeout):
                        break
                else:
                    return
            # The client stopped reading: its request is closed now, as a cancelled one (KV slots and
            # admission ticket free); the status waits behind the messages it has not read.
            log.warning("request %s: its client read nothing for %.0f s; the stream is ended", delta.request_id,
                        timeout)
            raise GatewayError("CANCELLED", f"the client read nothing for {timeout:.0f} s (server.send_timeout_s); "
                                            "the stream was ended to free its slot")
        except GatewayError as exc:
            await _abort(context, exc)

    def _card(self, m: ModelInfo, *, reveal: bool) -> pb.ModelCard:
        """What a tenant may know of a model; checkpoint paths and Ray node ids only for an admin."""
        card = pb.ModelCard(name=m.name, vocab_size=m.vocab_size, max_context=m.max_context,
                            default_mode=_MODE_TO_PB[self.gateway.default_mode(m)], draft_method=m.draft_method or "")
        if reveal:
            card.target, card.draft = m.target_path, m.draft_path or ""
            card.target_node_id, card.draft_node_id = m.target_node_id, m.draft_node_id
            # a coordinator of replicas says how each is (coordinator/scheduling/replicas.py); a test double may not
            replica_status = getattr(self.gateway.coordinator, "replica_status", None)
            for r in replica_status(m.name) if replica_status is not None else ():
                card.replicas.add(index=r.index, state=_REPLICA_STATE_TO_PB[r.state], live_sequences=r.live_sequences,
                                  outstanding_tokens=r.outstanding_tokens, target_restarts=r.target_restarts,
                                  draft_restarts=r.draft_restarts, target_node_id=r.target_node_id,
                                  draft_node_id=r.draft_node_id)
        return card


async def _sent(context, response: pb.GenerateResponse, timeout_s: float) -> bool:
    """Writes `response`; False if the client leaves it unread (flow control full) for `timeout_s`."""
    try:
        await asyncio.wait_for(context.write(response), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def _authorization(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return None


async def _abort(context, exc: GatewayError) -> None:
    # grpc.aio rejects trailing_metadata=None (TypeError → UNKNOWN), so "no hint" is an empty tuple.
    trailer = (("retry-after-s", f"{exc.retry_after_s:.3f}"),) if exc.retry_after_s else ()
    await context.abort(grpc.StatusCode[exc.code], str(exc), trailer)


def _response(delta: Delta) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=delta.request_id, text=delta.text, token_ids=delta.token_ids,
                                   usage_id=delta.usage_id)
    for lp in delta.logprobs:
        response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                              top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    if delta.finish_reason is None:
        return response
    s = delta.stats
    response.finish_reason = _FINISH_TO_PB[delta.finish_reason]
    response.usage.CopyFrom(pb.Usage(prompt_tokens=delta.prompt_tokens, completion_tokens=delta.completion_tokens,
                                     # a resumed stream's prompt includes its delivered tokens: not the user's
                                     cached_prompt_tokens=min(s.cached_prompt_tokens, delta.prompt_tokens)))
    # every public count under its SpecStats name (a new one needs only the proto field)
    response.stats.CopyFrom(pb.SpeculationStats(
        **{field.name: getattr(s, field.name) for field in pb.SpeculationStats.DESCRIPTOR.fields}))
    return response
