"""Continuing a broken stream: `GenerateRequest.resume` checked and turned into the coordinator's request.

A client whose stream broke (its gateway died, the connection reset) sends the same request again
with `resume = {usage_id, delivered_token_ids}`. The continuation is a coordinator request whose
prompt is the original prompt followed by the delivered tokens, asking for max_new_tokens minus
them, with the same sampling, seed, stopping and constraint. Every draw is keyed by (seed, absolute
position, purpose) (duospec/sampling.py), so it commits exactly the tokens the unbroken run would
have: greedy always, sampled when the request has a seed (docs/design.md, "Exactness"). What else
makes it the same stream:
- text: the gateway's detokenizer and stop matcher read the delivered tokens before the first new one
  (`gateway.text_state`), so the next delta is what the unbroken stream would have sent next, a
  character split across the break and a stop string begun before it included;
- a constraint: `GenerationRequest.resumed_tokens` puts the completion's start before the delivered
  tokens, which the target's (and drafter's) matcher then consumes as the prompt's tail; they are
  checked against the grammar here first;
- usage: prompt_tokens is the original prompt's, completion_tokens counts delivered + new, and the
  row is the broken stream's (`UsageLedger.start` takes it over): the request is charged once.

The usage id binds a row to its request: `<row>.<tag>`, the tag an HMAC-SHA256 (the server's
`resume_secret_file`, 64 bits kept) of the row, the tenant and everything that decides the output:
model, prompt ids, the seed when sampled, temperature, top-k, top-p, max_new_tokens, stop strings and
ids, ignore_eos and the constraint. A resume with any of them changed (another prompt, another seed,
another tenant's key) does not verify: INVALID_ARGUMENT. A client cannot make an id for a request it
was not given one for, so it cannot write into any other row, its own or another tenant's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pathlib
import re
import secrets
from dataclasses import dataclass, replace

from duospec.coordinator.api import FinishReason, ModelInfo
from duospec.coordinator.serving.validation import ValidatedRequest, invalid
from duospec.v1 import generation_pb2 as pb

_USAGE_ID = re.compile(r"([0-9a-f]{32})\.([0-9a-f]{16})")


@dataclass(frozen=True)
class Continuation:
    """A resume that was accepted."""

    row: str  # the broken stream's usage row, which this stream finishes
    # set: the delivered tokens already end the request (an end token, or max_new_tokens of them): the
    # broken stream lacked only its final message, which is all this stream sends (the coordinator is
    # not asked for anything)
    finished: FinishReason | None = None


def usage_id(secret: bytes, row: str, tenant: str, v: ValidatedRequest) -> str:
    """The id a stream's first message carries: its usage row, bound to this tenant and request."""
    return f"{row}.{_tag(secret, row, tenant, v)}"


def continue_request(req: pb.GenerateRequest, v: ValidatedRequest, info: ModelInfo, tenant: str, secret: bytes,
                     grammar=None) -> tuple[ValidatedRequest, Continuation]:
    """The continuation of `v` (the original request validated) after `req.resume`'s delivered tokens,
    or a RequestError naming the `resume` field at fault. `grammar`: the request's compiled constraint."""
    request = v.request
    if not request.sampling.greedy and not req.sampling.HasField("seed"):
        raise invalid("resume", "a sampled request (temperature > 0) without a seed cannot be continued "
                      "exactly; set sampling.seed to make its streams resumable")
    row = _verified_row(req.resume.usage_id, secret, tenant, v)
    delivered = tuple(req.resume.delivered_token_ids)
    field = "resume.delivered_token_ids"
    if len(delivered) > request.max_new_tokens:
        raise invalid(field, f"{len(delivered)} tokens, past the request's max_new_tokens "
                      f"({request.max_new_tokens}): send the tokens this request's stream delivered")
    ends = request.stop_token_ids | (frozenset() if request.ignore_eos else info.end_token_ids)
    for i, token in enumerate(delivered):
        if token >= info.vocab_size:
            raise invalid(f"{field}[{i}]", f"{token} is not below the vocabulary size {info.vocab_size}")
        if token in ends and i < len(delivered) - 1:
            raise invalid(f"{field}[{i}]", f"{token} ends the generation, yet tokens follow it: send the tokens "
                          "this request's stream delivered")
    if grammar is not None and grammar.matcher().accept_tokens(list(delivered)) < len(delivered):
        raise invalid(field, "the constraint does not allow these tokens: send the tokens this request's stream "
                      "delivered")
    # the client's own id, or the one the broken stream echoed (its row's), so every chunk carries one id
    return (replace(v, request=request.continued(delivered), client_request_id=req.request_id or row),
            Continuation(row, request.ended_by(delivered, info.end_token_ids)))


def _verified_row(value: str, secret: bytes, tenant: str, v: ValidatedRequest) -> str:
    match = _USAGE_ID.fullmatch(value)
    if match is None:
        raise invalid("resume.usage_id", "not a usage id: send the usage_id of the broken stream's first message")
    row = match.group(1)
    if not hmac.compare_digest(match.group(2), _tag(secret, row, tenant, v)):
        raise invalid("resume.usage_id", "was not issued for this request: resend the broken stream's request "
                      "unchanged (same prompt, seed, sampling, stopping, model and API key), with its usage_id")
    return row


def _tag(secret: bytes, row: str, tenant: str, v: ValidatedRequest) -> str:
    r, s = v.request, v.request.sampling
    identity = json.dumps([
        row, tenant, r.model, list(r.prompt_token_ids[: r.output_start]),
        None if s.greedy else s.seed,  # a greedy request's seed is the server's random one, and unused
        s.temperature, s.top_k, s.top_p, r.max_new_tokens + r.resumed_tokens, sorted(r.stop_token_ids),
        r.ignore_eos, list(v.stop_strings), None if r.constraint is None else [r.constraint.kind.value,
                                                                                 r.constraint.text],
    ])
    return hmac.new(secret, identity.encode(), hashlib.sha256).hexdigest()[:16]


def load_secret(path: str | None) -> bytes:
    """The key usage ids are signed with: `server.resume_secret_file`'s bytes, or a random one per
    process when none is configured (then only this process can resume its streams)."""
    if path is None:
        return secrets.token_bytes(32)
    try:
        secret = pathlib.Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"server.resume_secret_file: cannot read {path!r} ({exc.strerror})") from None
    if len(secret) < 16:
        raise ValueError(f"server.resume_secret_file {path!r}: {len(secret)} bytes; put at least 16 random bytes "
                         "in it (e.g. `openssl rand -hex 32 > FILE`)")
    return secret
