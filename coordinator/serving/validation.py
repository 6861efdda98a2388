"""Turns a public `GenerateRequest` into a `GenerationRequest`, or a RequestError naming the field.

Everything a user can get wrong is caught here and reported as INVALID_ARGUMENT (NOT_FOUND for an
unknown model) with the proto field path, so nothing user-caused reaches the coordinator as INTERNAL.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, replace
from typing import Any

from duospec.coordinator.api import GenerationRequest, ModelInfo, SpeculationMode
from duospec.coordinator.config import ServerSettings
from duospec.sampling import SamplingParams
from duospec.structured.constraint import Constraint, ConstraintError, ConstraintKind
from duospec.v1 import generation_pb2 as pb

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "user", "assistant")

_MODES = {
    pb.SPECULATION_MODE_PEARL: SpeculationMode.PEARL,
    pb.SPECULATION_MODE_VANILLA: SpeculationMode.VANILLA,
    pb.SPECULATION_MODE_OFF: SpeculationMode.OFF,
}


class RequestError(Exception):
    """A user error; `code` is the gRPC status name, the message names the field and the fix."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field  # the GenerateRequest field path (e.g. "sampling.temperature"), when one is at fault


def invalid(field: str, problem: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", f"{field}: {problem}", field)


@dataclass(frozen=True)
class ValidatedRequest:
    request: GenerationRequest  # tenant fields still default: filled in after admission
    stop_strings: tuple[str, ...]
    client_request_id: str  # echoed back to the client


def resolve_model(model: str, models: dict[str, ModelInfo], default_model: str, usable: list[str]) -> ModelInfo:
    """`usable`: the served models the caller may use, the only ones the error names."""
    name = model or default_model
    info = models.get(name)
    if info is None:
        raise RequestError("NOT_FOUND", f"model: {name!r} is not served here; available to you: "
                           f"{', '.join(usable) or 'none'}", "model")
    return info


def max_prompt_chars(info: ModelInfo, tokenizer: Any) -> int | None:
    """The most characters a prompt that fits the model's context can have, so that a longer one is
    refused before the tokenizer spends time on it. No token covers more characters than the longest
    vocabulary entry (byte-level entries have a character per byte, sentencepiece ones their own), so
    a text past context x longest needs more tokens than fit. None when the tokenizer has no vocabulary
    to measure."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    longest = max((len(token) for token in get_vocab()), default=1)
    return info.max_context * max(1, longest)


def validate_request(
    req: pb.GenerateRequest,
    info: ModelInfo,
    tokenizer: Any,
    settings: ServerSettings,
    default_mode: SpeculationMode,
    internal_request_id: str,
    *,
    max_prompt_chars: int | None = None,
    token_allowance: int | None = None,
) -> ValidatedRequest:
    """`max_prompt_chars`: the bound `max_prompt_chars()` worked out for the model (None: none);
    `token_allowance`: the most tokens the tenant may have in one request
    (TenantLimits.tokens_one_request_may_take; None: no limit), which bounds the default
    max_new_tokens so that a request leaving it unset is not refused for it."""
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid("request_id", f"{len(req.request_id)} characters; use at most {MAX_REQUEST_ID_CHARS}")
    if not (req.request_id.isascii() and req.request_id.isprintable()):
        # It goes into log lines and the ledger: no control characters, no line breaks.
        raise invalid("request_id", "use printable ASCII characters only (no control characters or line breaks)")
    prompt_ids = _prompt_token_ids(req, info, tokenizer, max_prompt_chars)
    max_new = _max_new_tokens(req.stopping, len(prompt_ids), info, settings, token_allowance)
    stops = _stop_strings(req.stopping)
    stop_ids = _stop_token_ids(req.stopping, info)
    mode, max_draft = _speculation(req.speculation, info, default_mode)
    cache = req.speculation.cache if req.speculation.HasField("cache") else None
    tree = req.speculation.tree if req.speculation.HasField("tree") else None
    request = GenerationRequest(
        request_id=internal_request_id,
        prompt_token_ids=tuple(prompt_ids),
        max_new_tokens=max_new,
        sampling=_sampling(req.sampling),
        mode=mode,
        max_draft_tokens=max_draft,
        speculation_cache=cache,
        speculation_tree=tree,
        stop_token_ids=frozenset(stop_ids),
        ignore_eos=req.stopping.ignore_eos,
        model=info.name,
        logprobs=_logprobs(req),
        constraint=_constraint(req),
    )
    return ValidatedRequest(request, stops, req.request_id or internal_request_id)


def with_tenant(v: ValidatedRequest, tenant: str, weight: float) -> GenerationRequest:
    return replace(v.request, tenant=tenant, priority_weight=weight)


def _prompt_token_ids(req: pb.GenerateRequest, info: ModelInfo, tokenizer: Any, max_chars: int | None) -> list[int]:
    which = req.WhichOneof("input")
    if which is None:
        raise invalid("prompt", "empty; set one of prompt, prompt_token_ids or messages")
    if which == "prompt":
        if not req.prompt:
            raise invalid("prompt", "empty; send at least one character")
        _check_prompt_chars("prompt", len(req.prompt), max_chars, info)
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=True))
    elif which == "prompt_token_ids":
        ids = list(req.prompt_token_ids.ids)
        if not ids:
            raise invalid("prompt_token_ids.ids", "empty; send at least one token id")
        if len(ids) >= info.max_context:  # before looking at each id
            raise _no_room(len(ids), info)
        for i, tok in enumerate(ids):
            if tok >= info.vocab_size:
                raise invalid(f"prompt_token_ids.ids[{i}]", f"{tok} is not below the vocabulary size {info.vocab_size}")
    else:
        _check_prompt_chars("messages", sum(len(m.content) for m in req.messages.messages), max_chars, info)
        ids = _chat_token_ids(req.messages, info, tokenizer)
    if not ids:
        raise invalid(which, "tokenizes to no tokens; send more text")
    return ids


def _check_prompt_chars(field: str, n_chars: int, max_chars: int | None, info: ModelInfo) -> None:
    if max_chars is not None and n_chars > max_chars:
        raise invalid(field, f"{n_chars} characters cannot fit the model's context of {info.max_context} tokens "
                      f"(at most {max_chars} characters could); shorten the prompt")


def _no_room(n_prompt: int, info: ModelInfo) -> RequestError:
    return invalid("prompt", f"{n_prompt} tokens leave no room in the model's context of {info.max_context}; "
                   "shorten the prompt")


def _chat_token_ids(messages: pb.ChatMessages, info: ModelInfo, tokenizer: Any) -> list[int]:
    if not messages.messages:
        raise invalid("messages.messages", "empty; send at least one message")
    for i, m in enumerate(messages.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"messages.messages[{i}].role", f"{m.role!r}; use one of {', '.join(CHAT_ROLES)}")
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("messages", f"model {info.name!r} has no chat template; send `prompt` text instead")
    turns = [{"role": m.role, "content": m.content} for m in messages.messages]
    tools = _tools(messages.tools_json)
    extra = {}
    from duospec.structured.tools import OPEN, Tool, default_tool_prompt

    template = str(tokenizer.chat_template)
    if tools and "tools" in template and OPEN in template:
        extra["tools"] = tools  # the model's own offer, in the format the parser and the constraints read
    elif tools:  # (a template whose calls take another format, e.g. Llama 3's bare JSON, gets ours too)
        offer = default_tool_prompt([Tool(t["function"]["name"], t["function"].get("parameters") or {},
                                          t["function"].get("description") or "") for t in tools])
        if turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": turns[0]["content"] + "\n\n" + offer}
        else:
            turns.insert(0, {"role": "system", "content": offer})
    variables = _template_kwargs(messages.chat_template_kwargs_json)
    # Render to text first, then encode: the template already contains any BOS it wants.
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **extra, **variables)
    except Exception as exc:  # the template refuses them (e.g. roles that do not alternate)
        raise invalid("messages", f"the model's chat template refused these messages: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


# apply_chat_template's own arguments, and what duospec sets itself: not template variables
_TEMPLATE_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
MAX_TEMPLATE_KWARGS_CHARS = 16384


def _template_kwargs(kwargs_json: str) -> dict:
    """ChatMessages.chat_template_kwargs_json: a JSON object of variables for the chat template."""
    if not kwargs_json:
        return {}
    field = "messages.chat_template_kwargs_json"
    if len(kwargs_json) > MAX_TEMPLATE_KWARGS_CHARS:
        raise invalid(field, f"{len(kwargs_json)} characters; send at most {MAX_TEMPLATE_KWARGS_CHARS}")
    try:
        kwargs = json.loads(kwargs_json)
    except json.JSONDecodeError as exc:
        raise invalid(field, f"not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise invalid(field, 'must be a JSON object of template variables, like {"enable_thinking": false}')
    reserved = sorted(_TEMPLATE_RESERVED & set(kwargs))
    if reserved:
        raise invalid(field, f"{reserved[0]!r} is set by the server, not a template variable; remove it")
    return kwargs


def _tools(tools_json: str) -> list[dict]:
    """ChatMessages.tools_json: a JSON list of {"type": "function", "function": {"name", ...}}."""
    if not tools_json:
        return []
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as exc:
        raise invalid("messages.tools_json", f"not valid JSON: {exc}") from None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise invalid("messages.tools_json", 'must be a list of {"type": "function", "function": {"name": ...}}')
    return tools


def _constraint(req: pb.GenerateRequest) -> Constraint | None:
    """The request's constraint as data; whether it compiles is checked by the gateway (off the loop,
    with a time limit), which names the same field."""
    if not req.HasField("constraint"):
        return None
    which = req.constraint.WhichOneof("kind")
    if which is None:
        raise invalid("constraint", "set one of json_schema, json_object, regex or grammar")
    try:
        if which == "json_schema":
            return Constraint.json_schema(req.constraint.json_schema)
        if which == "json_object":
            if not req.constraint.json_object:
                raise ConstraintError("must be true (or leave `constraint` unset)")
            return Constraint(ConstraintKind.JSON_OBJECT)
        kind = ConstraintKind.REGEX if which == "regex" else ConstraintKind.GRAMMAR
        return Constraint(kind, getattr(req.constraint, which))
    except ConstraintError as exc:
        raise invalid(f"constraint.{which}", str(exc)) from None


def constraint_field(req: pb.GenerateRequest) -> str:
    """The field a constraint's compile error names (`constraint.regex`, ...)."""
    return f"constraint.{req.constraint.WhichOneof('kind')}"


def _max_new_tokens(stopping: pb.StoppingCriteria, n_prompt: int, info: ModelInfo, s: ServerSettings,
                    token_allowance: int | None) -> int:
    room = info.max_context - n_prompt
    if room < 1:
        raise _no_room(n_prompt, info)
    requested = stopping.max_new_tokens
    if requested == 0:
        default = min(room, s.default_max_new_tokens or s.max_new_tokens_limit)
        # a prompt past the allowance is refused by admission, which says so
        return max(1, min(default, token_allowance - n_prompt)) if token_allowance else default
    if requested > s.max_new_tokens_limit:
        raise invalid("stopping.max_new_tokens", f"{requested} is above the server limit {s.max_new_tokens_limit}")
    if requested > room:
        raise invalid("stopping.max_new_tokens", f"prompt ({n_prompt} tokens) + {requested} new tokens exceed the "
                      f"model's context of {info.max_context}; ask for at most {room}")
    return requested


def _stop_strings(stopping: pb.StoppingCriteria) -> tuple[str, ...]:
    if len(stopping.stop) > MAX_STOP_STRINGS:
        raise invalid("stopping.stop", f"{len(stopping.stop)} stop strings; send at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(stopping.stop):
        if not s:
            raise invalid(f"stopping.stop[{i}]", "empty string; remove it")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise invalid(f"stopping.stop[{i}]", f"{len(s)} characters; use at most {MAX_STOP_STRING_CHARS}")
    return tuple(stopping.stop)


def _stop_token_ids(stopping: pb.StoppingCriteria, info: ModelInfo) -> list[int]:
    if len(stopping.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid("stopping.stop_token_ids", f"{len(stopping.stop_token_ids)} ids; send at most {MAX_STOP_TOKEN_IDS}")
    for i, tok in enumerate(stopping.stop_token_ids):
        if tok >= info.vocab_size:
            raise invalid(f"stopping.stop_token_ids[{i}]", f"{tok} is not below the vocabulary size {info.vocab_size}")
    return list(stopping.stop_token_ids)


def _logprobs(req: pb.GenerateRequest) -> int | None:
    if not req.HasField("logprobs"):
        return None
    if req.logprobs > MAX_TOP_LOGPROBS:
        raise invalid("logprobs", f"{req.logprobs} alternatives; ask for at most {MAX_TOP_LOGPROBS}")
    return req.logprobs


def _sampling(sp: pb.SamplingParams) -> SamplingParams:
    if not math.isfinite(sp.top_p) or not 0 <= sp.top_p <= 1:
        raise invalid("sampling.top_p", f"{sp.top_p}; use a value in (0, 1] (0 means unset = 1.0)")
    # Unset seed: a fresh random one, so the request is still reproducible from the server's side.
    seed = sp.seed if sp.HasField("seed") else secrets.randbits(63)
    params = SamplingParams(temperature=float(sp.temperature), top_k=int(sp.top_k), top_p=float(sp.top_p or 1.0),
                            seed=int(seed))
    try:
        params.validate()  # the one place the ranges live (duospec/sampling.py)
    except ValueError as exc:
        field, _, problem = str(exc).partition("=")
        raise invalid(field, problem) from None
    return params


def _speculation(sp: pb.SpeculationParams, info: ModelInfo, default_mode: SpeculationMode):
    if sp.mode == pb.SPECULATION_MODE_UNSPECIFIED:
        mode = default_mode if info.has_draft else SpeculationMode.OFF
    elif sp.mode in _MODES:
        mode = _MODES[sp.mode]
    else:
        raise invalid("speculation.mode", f"unknown value {sp.mode}; use PEARL, VANILLA or OFF")
    if mode is not SpeculationMode.OFF and not info.has_draft:
        raise invalid("speculation.mode", f"model {info.name!r} has no drafter; use OFF or leave it unset")
    problem = info.draft_tokens_problem(sp.max_draft_tokens)
    if problem:
        raise invalid("speculation.max_draft_tokens", problem)
    return mode, (sp.max_draft_tokens or None)
