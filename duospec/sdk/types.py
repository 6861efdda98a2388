"""SDK result types and the translation between them and the `duospec.v1` proto messages.

Enum values cross into Python as plain lower-case strings: finish reasons `"length"`, `"stop"`,
`"eos"`, `"cancelled"`; speculation modes `"pearl"`, `"vanilla"`, `"off"`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Sequence

from duospec.sdk.errors import InvalidArgument
from duospec.v1 import generation_pb2 as pb

MODES = ("pearl", "vanilla", "off")
_UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # of the prompt tokens, those the server read from its prefix cache


@dataclass(frozen=True)
class SpeculationStats:
    # Each field is named as its SpeculationStats proto field (chunk_from_proto copies them by name).
    drafted_tokens: int  # draft tokens the target verified
    accepted_tokens: int  # draft tokens the target kept
    target_forwards: int  # verify passes that included this request
    mean_accepted_length: float  # committed tokens per target forward (accepted + 1)
    pre_verify_aborts: int  # rounds aborted at the first draft token
    wasted_draft_tokens: int  # drafted but discarded
    cache_lookups: int = 0  # rejections that looked for a hedge in the speculation cache
    cache_hits: int = 0  # ... and found one (the next verify did not wait for the drafter)
    tree_nodes: int = 0  # branch tokens verified beside the main chain (drafts' runners-up, hedges)
    tree_hits: int = 0  # verify passes whose accepted path went into a branch
    lookup_tokens: int = 0  # tokens found in the request's own text, verified in rounds without a draft
    lookup_accepted: int = 0  # ... and kept
    hedge_tokens_kept: int = 0  # tokens a hedge drafted past its key that the target kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target, and the likeliest tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log p), likeliest first


@dataclass(frozen=True)
class GenerationChunk:
    """One streamed delta. finish_reason, usage and stats are set on the last chunk only."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    stats: SpeculationStats | None = None
    request_id: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when generate(logprobs=N) asked


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage | None
    stats: SpeculationStats | None
    request_id: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ReplicaStatus:
    """One of a model's draft/target pairs, as an admin sees it."""

    index: int
    state: str  # "serving", "degraded" (target-only: its drafter is down), "down" (its target is)
    live_sequences: int
    outstanding_tokens: int  # what its live requests may still produce
    target_restarts: int
    draft_restarts: int
    target_node_id: str  # Ray nodes; "" in-process
    draft_node_id: str


@dataclass(frozen=True)
class ModelCard:
    name: str
    target: str
    draft: str  # "" when the model has no draft (only mode "off")
    vocab_size: int
    max_context: int
    default_mode: str
    target_node_id: str
    draft_node_id: str
    draft_method: str = ""  # "model", "layers", "ngram"; "" = no drafter
    replicas: tuple[ReplicaStatus, ...] = ()  # admins only: each of the model's pairs


def _enum_name(enum_type, value: int, prefix: str) -> str:
    """`FINISH_REASON_LENGTH` -> `"length"`; values newer than this SDK become `"unknown_<n>"`."""
    try:
        return enum_type.Name(value).removeprefix(prefix).lower()
    except ValueError:
        return f"unknown_{value}"


def _check_count(field: str, value: Any, maximum: int = _UINT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise InvalidArgument(
            "INVALID_ARGUMENT", f"{field} must be an integer in [0, {maximum}], got {value!r}"
        )
    return value


def _check_float(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument("INVALID_ARGUMENT", f"{field} must be a finite number, got {value!r}")
    return float(value)


def _chat_messages(messages: Iterable[Any]) -> pb.ChatMessages:
    """Accepts dicts `{"role", "content"}`, `(role, content)` pairs or objects with those attributes."""
    out = pb.ChatMessages()
    for index, message in enumerate(messages):
        if isinstance(message, Mapping):
            role, content = message.get("role"), message.get("content")
        elif isinstance(message, (tuple, list)) and len(message) == 2:
            role, content = message
        else:
            role, content = getattr(message, "role", None), getattr(message, "content", None)
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidArgument(
                "INVALID_ARGUMENT",
                f"messages[{index}] must have string 'role' and 'content' "
                '(e.g. {"role": "user", "content": "..."}), got ' + repr(message)[:80],
            )
        out.messages.add(role=role, content=content)
    return out


def _set_input(request: pb.GenerateRequest, prompt, prompt_token_ids, messages) -> None:
    given = [name for name, value in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids),
                                      ("messages", messages)) if value is not None]
    if len(given) != 1:
        raise InvalidArgument(
            "INVALID_ARGUMENT",
            "pass exactly one of prompt, prompt_token_ids= or messages=, got "
            + (", ".join(given) if given else "none"),
        )
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidArgument("INVALID_ARGUMENT", f"prompt must be a str, got {type(prompt).__name__}")
        request.prompt = prompt
    elif prompt_token_ids is not None:
        ids = [_check_count(f"prompt_token_ids[{i}]", t) for i, t in enumerate(prompt_token_ids)]
        request.prompt_token_ids.ids.extend(ids)
    else:
        request.messages.CopyFrom(_chat_messages(messages))


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Iterable[Any] | None = None,
    model: str = "",
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    mode: str | None = None,
    max_draft_tokens: int = 0,
    request_id: str = "",
    speculation_cache: bool | None = None,
    speculation_tree: bool | None = None,
    logprobs: int | None = None,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    grammar: str | None = None,
) -> pb.GenerateRequest:
    """The wire request. Only checks what the proto cannot carry; the server validates the rest.
    At most one of `json_schema` (a dict, or its JSON text), `regex` and `grammar` (Lark) constrains
    the output."""
    request = pb.GenerateRequest(model=model, request_id=request_id)
    _set_input(request, prompt, prompt_token_ids, messages)
    request.sampling.temperature = _check_float("temperature", temperature)
    request.sampling.top_k = _check_count("top_k", top_k)
    request.sampling.top_p = _check_float("top_p", top_p)
    if seed is not None:
        request.sampling.seed = _check_count("seed", seed, 2**64 - 1)
    if isinstance(stop, str):
        stop = (stop,)  # a lone string is one stop string, not a list of characters
    request.stopping.stop.extend(stop)
    request.stopping.max_new_tokens = _check_count("max_new_tokens", max_new_tokens or 0)
    request.stopping.stop_token_ids.extend(
        _check_count(f"stop_token_ids[{i}]", t) for i, t in enumerate(stop_token_ids)
    )
    request.stopping.ignore_eos = bool(ignore_eos)
    request.speculation.mode = _mode_to_proto(mode)
    request.speculation.max_draft_tokens = _check_count("max_draft_tokens", max_draft_tokens)
    if speculation_cache is not None:
        request.speculation.cache = bool(speculation_cache)
    if speculation_tree is not None:
        request.speculation.tree = bool(speculation_tree)
    if logprobs is not None:
        request.logprobs = _check_count("logprobs", logprobs)
    _set_constraint(request, json_schema, regex, grammar)
    return request


def _set_constraint(request: pb.GenerateRequest, json_schema, regex, grammar) -> None:
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None}
    if len(given) > 1:
        raise InvalidArgument("INVALID_ARGUMENT", f"constrain the output with one of json_schema, regex or grammar, "
                              f"not {' and '.join(given)}")
    if json_schema is not None:
        if not isinstance(json_schema, str):
            import json

            json_schema = json.dumps(json_schema)
        request.constraint.json_schema = json_schema
    elif regex is not None:
        request.constraint.regex = regex
    elif grammar is not None:
        request.constraint.grammar = grammar


def _mode_to_proto(mode: str | None) -> int:
    if mode is None:
        return pb.SPECULATION_MODE_UNSPECIFIED  # the model's configured default
    if mode not in MODES:
        raise InvalidArgument("INVALID_ARGUMENT", f"mode must be one of {', '.join(MODES)} (or None), got {mode!r}")
    return pb.SpeculationMode.Value(f"SPECULATION_MODE_{mode.upper()}")


def chunk_from_proto(response: pb.GenerateResponse) -> GenerationChunk:
    finish = None
    if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        finish = _enum_name(pb.FinishReason, response.finish_reason, "FINISH_REASON_")
    usage = stats = None
    if response.HasField("usage"):
        usage = Usage(response.usage.prompt_tokens, response.usage.completion_tokens,
                      response.usage.cached_prompt_tokens)
    if response.HasField("stats"):
        s = response.stats
        stats = SpeculationStats(**{f.name: getattr(s, f.name) for f in fields(SpeculationStats)})
    return GenerationChunk(
        text=response.text,
        token_ids=tuple(response.token_ids),
        finish_reason=finish,
        usage=usage,
        stats=stats,
        request_id=response.request_id,
        logprobs=tuple(TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                       for lp in response.logprobs),
    )


def model_card_from_proto(card: pb.ModelCard) -> ModelCard:
    return ModelCard(
        name=card.name,
        target=card.target,
        draft=card.draft,
        vocab_size=card.vocab_size,
        max_context=card.max_context,
        default_mode=_enum_name(pb.SpeculationMode, card.default_mode, "SPECULATION_MODE_"),
        target_node_id=card.target_node_id,
        draft_node_id=card.draft_node_id,
        draft_method=card.draft_method,
        replicas=tuple(ReplicaStatus(
            index=r.index, state=_enum_name(pb.ReplicaState, r.state, "REPLICA_STATE_"),
            live_sequences=r.live_sequences, outstanding_tokens=r.outstanding_tokens,
            target_restarts=r.target_restarts, draft_restarts=r.draft_restarts,
            target_node_id=r.target_node_id, draft_node_id=r.draft_node_id) for r in card.replicas),
    )


class ResultBuilder:
    """Concatenates streamed chunks into one GenerationResult."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._last: GenerationChunk | None = None
        self._request_id = ""

    def add(self, chunk: GenerationChunk) -> None:
        self._text.append(chunk.text)
        self._ids.extend(chunk.token_ids)
        self._logprobs.extend(chunk.logprobs)
        self._request_id = self._request_id or chunk.request_id
        self._last = chunk

    def result(self) -> GenerationResult:
        last = self._last
        assert last is not None and last.finish_reason is not None, "streams end with a finish chunk"
        return GenerationResult(
            text="".join(self._text),
            token_ids=tuple(self._ids),
            finish_reason=last.finish_reason,
            usage=last.usage,
            stats=last.stats,
            request_id=self._request_id,
            logprobs=tuple(self._logprobs),
        )
