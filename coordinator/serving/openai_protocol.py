"""OpenAI-compatible request and response shapes, translated to and from `duospec.v1` messages.

Pure functions, no I/O: coordinator/serving/http_server.py wires them to the gateway. A request body becomes
a `GenerateRequest`, so the HTTP API is validated by the same code as gRPC (coordinator/serving/validation.py);
its errors name the gRPC field path, and `field_name()` turns that back into the JSON field the user
sent (`sampling.temperature` -> `temperature`).

Defaults follow OpenAI's API, not duospec's gRPC one: `temperature` 1.0 (send 0 for greedy),
`top_p` 1.0, `n` 1 (up to MAX_CHOICES). `max_tokens` unset = the room left in the context (OpenAI's and vLLM's rule), up to
the server's max_new_tokens_limit and the tenant's max_tokens_per_request.
Structured output (`response_format`, `tools`, `tool_choice`): coordinator/serving/openai_tools.py.
Log-probabilities (`logprobs: N` for completions; `logprobs: true, top_logprobs: N` for chat, N <= 20)
are the target's, the same in every speculation mode (greedy: its log-softmax; sampled: log p after
temperature, top-k and top-p).
duospec's speculation options ride in an extension object, `speculation: {mode, max_draft_tokens,
cache, tree}` (`extra_body=` in the `openai` client); the usage object carries the speculation stats
as `usage.speculation`.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from duospec.coordinator.api import FinishReason, ModelInfo, SpecStats
from duospec.coordinator.serving import openai_tools
from duospec.coordinator.serving.gateway import GatewayError
from duospec.v1 import generation_pb2 as pb

_MODES = {"pearl": pb.SPECULATION_MODE_PEARL, "vanilla": pb.SPECULATION_MODE_VANILLA, "off": pb.SPECULATION_MODE_OFF}
_FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.EOS: "stop",
           FinishReason.CANCELLED: "abort",  # abort: the server ended it (shutdown), as vLLM says
           # OpenAI has no word for it: a value of its own, so that nobody takes the text for complete
           FinishReason.GRAMMAR_DEAD_END: "grammar_dead_end"}
# Accepted and ignored: they change nothing about what is generated.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# OpenAI's and vLLM's sampling knobs that duospec does not have: accepted at the value that changes
# nothing (what clients send by default), refused at any other.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0,
            "skip_special_tokens": True, "include_stop_str_in_output": False}
_CHAT_NEUTRAL = {"add_generation_prompt": True}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n",
           "stream", "stream_options", "logprobs", "ignore_eos", "speculation", "logit_bias",
           *_NEUTRAL, *openai_tools.OUTPUT_FIELDS}
COMPLETION_FIELDS = (_COMMON - {"response_format"}) | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "chat_template_kwargs", *_CHAT_NEUTRAL}

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "FAILED_PRECONDITION": 400, "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499,
    "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "UNIMPLEMENTED": 501,
}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable", 504: "timeout"}


def bad(field: str, problem: str) -> GatewayError:
    return GatewayError("INVALID_ARGUMENT", f"{field}: {problem}", field=field)


class BodyTooLarge(GatewayError):
    """A request body past server.max_request_body_bytes: HTTP 413 (RESOURCE_EXHAUSTED, as gRPC says of
    a message past its limit, in metrics and logs; not 429, which would invite a retry)."""

    http_status = 413
    http_code = "request_too_large"

    def __init__(self, limit: int):
        super().__init__("RESOURCE_EXHAUSTED", f"the request body is larger than the server's limit of {limit} "
                         "bytes (server.max_request_body_bytes); send a shorter prompt")


# ---- requests --------------------------------------------------------------------------------------

def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"null")
    except RecursionError:  # the decoder's nesting limit: a 500 if it got out
        raise GatewayError("INVALID_ARGUMENT", "the request body nests JSON arrays or objects too deeply; "
                           "send an OpenAI request object") from None
    except (ValueError, UnicodeDecodeError) as exc:  # (incl. integers past Python's 4300 digits)
        raise GatewayError("INVALID_ARGUMENT", f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise GatewayError("INVALID_ARGUMENT", "the request body must be a JSON object")
    return body


def completion_request(body: dict, request_id: str = "") -> pb.GenerateRequest:
    """`POST /v1/completions` body -> GenerateRequest (prompt as text or a list of token ids)."""
    _reject_unknown(body, COMPLETION_FIELDS)
    if body.get("echo"):
        raise bad("echo", "not supported; leave it false")
    if body.get("suffix"):
        raise bad("suffix", "not supported; leave it unset")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of", "only 1 is supported")
    req = _common(body, request_id, max_tokens_field="max_tokens")
    if body.get("logprobs") is not None:  # completions: the number of alternatives per token
        req.logprobs = _integer(body, "logprobs", 0, minimum=0)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt = _text(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        req.prompt_token_ids.ids.extend(_token_ids(prompt, "prompt"))
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"a batch of {len(prompt)} prompts; send one prompt per request")
    else:
        raise bad("prompt", "required: a string, or a list of token ids")
    openai_tools.apply_output_constraint(body, req, chat=False)
    return req


def chat_request(body: dict, request_id: str = "") -> pb.GenerateRequest:
    """`POST /v1/chat/completions` body -> GenerateRequest (rendered with the model's chat template)."""
    _reject_unknown(body, CHAT_FIELDS)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad("max_completion_tokens", "send max_completion_tokens or max_tokens, not both")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    req = _common(body, request_id, max_tokens_field=field)
    wants = _boolean(body, "logprobs") if body.get("logprobs") is not None else False
    if body.get("top_logprobs") is not None:
        if not wants:
            raise bad("top_logprobs", "needs logprobs: true")
        req.logprobs = _integer(body, "top_logprobs", 0, minimum=0)
    elif wants:
        req.logprobs = 0
    _neutral(body, _CHAT_NEUTRAL)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "required: a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if not isinstance(role, str):
            raise bad(f"messages[{i}].role", "must be a string: system, user or assistant")
        field = f"messages[{i}].content"
        if role == "tool" or (role == "assistant" and m.get("tool_calls")):  # an agent's earlier turns
            content = _content_text(m["content"], field) if m.get("content") is not None else ""
            role, content = openai_tools.tool_turn(m["role"], content, m.get("tool_calls"), f"messages[{i}]")
            if m["role"] == "tool" and i and messages[i - 1].get("role") == "tool":
                # results of one turn's parallel calls: one user turn, as templates that alternate roles want
                previous = req.messages.messages[-1]
                previous.content += "\n" + _text(content, field)
                continue
        else:
            content = _content_text(m.get("content"), field)
        req.messages.messages.add(role=_text(role, f"messages[{i}].role"), content=_text(content, field))
    variables = body.get("chat_template_kwargs")
    if variables is not None:  # vLLM's extension: variables for the chat template ({"enable_thinking": false})
        if not isinstance(variables, dict):
            raise bad("chat_template_kwargs", 'must be an object of template variables, like {"enable_thinking": false}')
        req.messages.chat_template_kwargs_json = json.dumps(variables)
    openai_tools.apply_output_constraint(body, req, chat=True)
    openai_tools.apply_tools(openai_tools.tool_request(body), body, req)
    return req


def _content_text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{field}[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(field, "must be a string or a list of text parts")


def _common(body: dict, request_id: str, *, max_tokens_field: str) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    req.model = model or ""
    _neutral(body, _NEUTRAL)
    if body.get("logit_bias"):
        raise bad("logit_bias", "not supported; leave it unset")
    temperature = _number(body, "temperature", 1.0)
    req.sampling.temperature = temperature
    top_p = _number(body, "top_p", 1.0)
    if not 0 <= top_p <= 1:
        raise bad("top_p", f"{top_p}; use a value in [0, 1]")
    if top_p == 0 and temperature >= 0:  # in OpenAI's range: a nucleus of the likeliest token alone, greedy
        req.sampling.temperature, top_p = 0.0, 1.0
    req.sampling.top_p = top_p
    req.sampling.top_k = _integer(body, "top_k", 0, minimum=0)  # vLLM's extension; -1 also means off
    if body.get("seed") is not None:  # OpenAI's and vLLM's seeds are signed 64-bit: a negative one as its bits
        req.sampling.seed = _integer(body, "seed", 0, minimum=-(1 << 63), end=1 << 64) % (1 << 64)
    max_tokens = body.get(max_tokens_field)
    if max_tokens is not None:
        if not _is_int(max_tokens) or not 1 <= max_tokens < _UINT32_END:
            raise bad(max_tokens_field, f"{max_tokens!r}; use a positive integer")
        req.stopping.max_new_tokens = max_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("stop", "must be a string or a list of strings")
        req.stopping.stop.extend(_text(s, f"stop[{i}]") for i, s in enumerate(stop))
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        req.stopping.stop_token_ids.extend(_token_ids(stop_ids, "stop_token_ids"))
    if body.get("ignore_eos") is not None:
        req.stopping.ignore_eos = _boolean(body, "ignore_eos")
    _speculation(body.get("speculation"), req.speculation)
    return req


def _neutral(body: dict, knobs: dict) -> None:
    for name, value in knobs.items():
        given = body.get(name)
        if given is not None and (given != value or isinstance(given, bool) != isinstance(value, bool)):
            raise bad(name, f"{given!r}: not supported; leave it unset or {json.dumps(value)}")


def _speculation(raw: Any, out: pb.SpeculationParams) -> None:
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise bad("speculation", "must be an object: {mode, max_draft_tokens, cache, tree}")
    unknown = sorted(set(raw) - {"mode", "max_draft_tokens", "cache", "tree"})
    if unknown:
        raise bad(f"speculation.{unknown[0]}", "unknown field; use mode, max_draft_tokens, cache or tree")
    mode = raw.get("mode")
    if mode is not None:
        if not isinstance(mode, str) or mode not in _MODES:
            raise bad("speculation.mode", f"{mode!r}; use one of {', '.join(_MODES)}")
        out.mode = _MODES[mode]
    if raw.get("max_draft_tokens") is not None:
        out.max_draft_tokens = _integer(raw, "max_draft_tokens", 0, minimum=0, prefix="speculation.")
    for name in ("cache", "tree"):
        if raw.get(name) is not None:
            setattr(out, name, _boolean(raw, name, prefix="speculation."))


def _reject_unknown(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed - _IGNORED - {"stream"})
    if unknown:
        raise bad(unknown[0], "unknown field for this endpoint")


MAX_CHOICES = 128


def choice_count(body: dict) -> int:
    """`n`: how many choices to generate for the prompt (each a request of its own to the gateway, so
    each is admitted as a stream, charged its tokens and recorded in the ledger; the call counts once
    against requests per minute, as OpenAI counts it)."""
    return _integer(body, "n", 1, minimum=1, end=MAX_CHOICES + 1)


def choice_requests(req: pb.GenerateRequest, n: int) -> list[pb.GenerateRequest]:
    """The requests of `n` choices. A seeded request's choice i draws with seed + i: the choices differ
    and each repeats; unseeded ones draw independently; greedy ones are the same text n times."""
    if n == 1:
        return [req]
    out = []
    for i in range(n):
        choice = pb.GenerateRequest()
        choice.CopyFrom(req)
        if req.sampling.HasField("seed"):
            choice.sampling.seed = (req.sampling.seed + i) % (1 << 64)
        out.append(choice)
    return out


def stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = _boolean(body, "stream") if body.get("stream") is not None else False
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "only allowed with stream: true")
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object like {\"include_usage\": true}")
    return stream, bool(options.get("include_usage", False))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"{v!r}; use a number")
    try:
        number = float(v)
    except OverflowError:  # an integer past a float's range (JSON allows any number of digits)
        raise bad(name, "an integer too large for a number; use a number") from None
    if not math.isfinite(number):
        raise bad(name, f"{v!r}; use a number")
    return number


_UINT32_END = 1 << 32


def _integer(body: dict, name: str, default: int, *, minimum: int, prefix: str = "", end: int = _UINT32_END) -> int:
    v = body.get(name)
    if v is None:
        return default
    if name == "top_k" and v == -1:
        return 0
    if not _is_int(v) or v < minimum or v >= end:
        raise bad(prefix + name, f"{v!r}; use an integer in [{minimum}, {end})")
    return v


def _text(v: str, field: str) -> str:
    """A string the wire can carry (UTF-8: no lone surrogates)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(field, "is not valid Unicode text (a lone surrogate); send UTF-8 text") from None
    return v


def _token_ids(v: Any, field: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t < _UINT32_END for t in v):
        raise bad(field, "must be a list of token ids (integers >= 0)")
    return v


def _boolean(body: dict, name: str, prefix: str = "") -> bool:
    v = body.get(name)
    if not isinstance(v, bool):
        raise bad(prefix + name, f"{v!r}; use true or false")
    return v


_FIELD_NAMES = [  # gRPC field path (validation.py) -> the JSON field the user sent
    (re.compile(r"^sampling\.(temperature|top_p|top_k|seed)$"), r"\1"),
    (re.compile(r"^stopping\.max_new_tokens$"), "max_tokens"),
    (re.compile(r"^stopping\.(stop|stop_token_ids)(\[\d+\])?$"), r"\1\2"),
    (re.compile(r"^prompt_token_ids\.ids(\[\d+\])?$"), r"prompt\1"),
    (re.compile(r"^messages\.messages(\[\d+\])?(\.role|\.content)?$"), r"messages\1\2"),
    (re.compile(r"^messages$"), "messages"),
    (re.compile(r"^messages\.chat_template_kwargs_json$"), "chat_template_kwargs"),
]


def field_name(grpc_field: str, *, chat: bool, max_tokens_field: str = "max_tokens",
               constraint_field: str | None = None) -> str:
    """`constraint_field`: the JSON field the request's constraint came from (openai_tools.constraint_field)."""
    if constraint_field and grpc_field.startswith("constraint"):
        return constraint_field
    for pattern, repl in _FIELD_NAMES:
        if pattern.match(grpc_field):
            name = pattern.sub(repl, grpc_field)
            return max_tokens_field if name == "max_tokens" else name
    if grpc_field == "prompt" and chat:
        return "messages"
    return grpc_field


def as_http_error(exc: GatewayError, *, chat: bool = False, max_tokens_field: str = "max_tokens",
                  constraint_field: str | None = None):
    """(status, body, headers) in OpenAI's error shape; the message names the JSON field."""
    status = getattr(exc, "http_status", None) or HTTP_STATUS.get(exc.code, 500)
    message, param = str(exc), None
    if exc.field:
        param = field_name(exc.field, chat=chat, max_tokens_field=max_tokens_field, constraint_field=constraint_field)
        prefix = exc.field + ":"
        if message.startswith(prefix):
            message = param + ":" + message[len(prefix):]
    headers = {}
    if exc.retry_after_s:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    body = {"error": {"message": message, "type": _ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": getattr(exc, "http_code", None) or exc.code.lower()}}
    return status, body, headers


# ---- responses -------------------------------------------------------------------------------------

def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH[reason]


def usage(prompt_tokens: int, completion_tokens: int, stats: SpecStats | None) -> dict:
    s = stats or SpecStats()
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
        "speculation": {
            "drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
            "target_forwards": s.target_forwards, "mean_accepted_length": round(s.mean_accepted_length, 4),
            "cache_lookups": s.cache_lookups, "cache_hits": s.cache_hits, "tree_nodes": s.tree_nodes,
            "tree_hits": s.tree_hits, "lookup_tokens": s.lookup_tokens, "lookup_accepted": s.lookup_accepted,
            "hedge_tokens_kept": s.hedge_tokens_kept,
        },
    }


def choices_usage(finals: list) -> dict:
    """The usage of a request's choices (their last deltas): the prompt once, as OpenAI counts it, the
    completions and the speculation stats summed."""
    stats = None
    for final in finals:
        stats = final.stats if stats is None else stats.plus(final.stats)
    if stats is not None and finals[0].stats is not None:  # the prompt's cached part, once too
        stats.cached_prompt_tokens = finals[0].stats.cached_prompt_tokens
    return usage(finals[0].prompt_tokens, sum(f.completion_tokens for f in finals), stats)


def completion_object(rid: str, model: str, created: int, text: str, finish: str | None, *, index: int = 0,
                      token_ids: tuple[int, ...] = (), logprobs: dict | None = None) -> dict:
    """A completion or one of its stream chunks (same shape); `token_ids` is duospec's extension."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs,
                         "token_ids": list(token_ids)}]}


def completion_logprobs(tokenizer, logprobs, text_offset: int) -> dict:
    """The completions API's shape: parallel lists, `text_offset` counted from the completion's start."""
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(text_offset)
        tokens.append(tokenizer.decode([lp.token_id]))
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [_by_text(tokenizer, lp.top) for lp in logprobs],
            "text_offset": offsets}


def _by_text(tokenizer, top) -> dict:
    """{token text: log p}; ids that decode to the same text keep the likeliest one's value."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(tokenizer.decode([token_id]), logprob)
    return out


def chat_logprobs(tokenizer, logprobs) -> dict:
    """The chat API's shape: one entry per token, with its bytes and top alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}


def chat_object(rid: str, model: str, created: int, text: str | None, finish: str | None, *,
                chunk: bool, index: int = 0, first: bool = False, token_ids: tuple[int, ...] = (),
                logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    """A chat completion, or (`chunk`) one of its stream chunks; `token_ids` is duospec's extension."""
    if chunk:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs,
                  "token_ids": list(token_ids)}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": index, "message": {"role": "assistant", "content": text,
                                                 **({"tool_calls": tool_calls} if tool_calls else {})},
                         "finish_reason": finish, "logprobs": logprobs, "token_ids": list(token_ids)}]}


def usage_chunk(rid: str, model: str, created: int, *, chat: bool, usage_body: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_body}


def model_list(models: list[ModelInfo]) -> dict:
    created = int(time.time())
    return {"object": "list", "data": [
        {"id": m.name, "object": "model", "created": created, "owned_by": "duospec", "max_model_len": m.max_context}
        for m in models
    ]}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
