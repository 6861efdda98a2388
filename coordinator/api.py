"""The coordinator's Python entry point: what the public API (gRPC server, demo, bench) wraps.

    coordinator = ...  # coordinator.pipeline.PipelineCoordinator (Ray actors) or an in-process one
    async for event in coordinator.generate(request):
        if isinstance(event, TokensEvent): ...   # newly committed token ids (a diff)
        else: ...                                # FinishEvent, always last

Cancelling: stop iterating and close the generator (`await agen.aclose()`), or cancel the task that
iterates it; the sequence's KV slots on both workers are freed.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from duospec.sampling import SamplingParams
from duospec.structured.constraint import Constraint

MAX_DRAFT_TOKENS = 64  # per verify, in any mode: the config, a request, `duospec bench`


class SpeculationMode(enum.Enum):
    PEARL = "pearl"  # draft and target overlap; pre-verify early abort, post-verify speculation
    VANILLA = "vanilla"  # draft γ, then verify, strictly alternating (the baseline)
    OFF = "off"  # target-only autoregressive


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # a stop token id (or, in the API layer, a stop string)
    EOS = "eos"  # the model's end-of-sequence token
    CANCELLED = "cancelled"  # client cancel / deadline / shutdown
    GRAMMAR_DEAD_END = "grammar_dead_end"  # the request's constraint allows no token after the output


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    mode: SpeculationMode | None = None  # None = the model's configured default
    max_draft_tokens: int | None = None  # None = the model's default (γ in vanilla, max verify in pearl)
    speculation_cache: bool | None = None  # pearl's speculation cache; None = the model's default
    speculation_tree: bool | None = None  # hedges verified as a token tree (needs the cache); None = default
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    model: str = ""  # "" = the default model
    tenant: str = "default"
    priority_weight: float = 1.0  # weighted fair share of the target when saturated
    logprobs: int | None = None  # set: each token's log p under the target, with this many (0..20) alternatives
    # set: the output must match it; the target masks p at every step (validated and compiled by the front)
    constraint: Constraint | None = None
    # a resumed request (coordinator/serving/resume.py): the prompt's last this many tokens are output a
    # broken stream already delivered, so the constraint covers them (the matchers consume them first)
    resumed_tokens: int = 0

    @property
    def output_start(self) -> int:
        """The position of the completion's first token, where a constraint starts."""
        return len(self.prompt_token_ids) - self.resumed_tokens

    def continued(self, delivered: tuple[int, ...]) -> GenerationRequest:
        """This request going on after `delivered` (tokens its stream delivered before it broke): the
        prompt extended by them, the rest of max_new_tokens, the same seed — so the same draws at the
        same positions, and the very tokens the unbroken stream would have committed next."""
        delivered = tuple(delivered)
        return dataclasses.replace(self, prompt_token_ids=tuple(self.prompt_token_ids) + delivered,
                                   max_new_tokens=self.max_new_tokens - len(delivered),
                                   resumed_tokens=self.resumed_tokens + len(delivered))

    def ended_by(self, delivered: tuple[int, ...], end_token_ids: frozenset[int]) -> FinishReason | None:
        """How a stream that delivered these tokens had already ended (as the scheduler decides: a stop
        id, an end token unless ignore_eos, max_new_tokens), or None while it goes on."""
        ends = self.stop_token_ids | (frozenset() if self.ignore_eos else end_token_ids)
        if delivered and delivered[-1] in ends:
            return FinishReason.STOP if delivered[-1] in self.stop_token_ids else FinishReason.EOS
        if len(delivered) >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None


@dataclass
class SpecStats:
    drafted_tokens: int = 0  # draft tokens sent to the target for verification
    accepted_tokens: int = 0  # draft tokens the target kept
    target_forwards: int = 0  # verify passes that included this sequence
    pre_verify_aborts: int = 0  # rounds aborted at the first draft token of a chunk
    wasted_draft_tokens: int = 0  # drafted but discarded (after a rejection), incl. never verified
    rejections: int = 0
    committed_tokens: int = 0  # tokens committed by verify forwards (accepted + recovered/bonus)
    cache_lookups: int = 0  # rejections that looked for a hedge in the speculation cache
    cache_hits: int = 0  # ... and found one: the next verify went out without waiting for the drafter
    tree_nodes: int = 0  # branch tokens verified beside the main chain (drafts' runners-up, hedges)
    tree_hits: int = 0  # verdicts whose accepted path went into such a branch
    hedge_tokens_kept: int = 0  # tokens a hedge drafted past its key that the target kept (hit or branch)
    lookup_tokens: int = 0  # tokens found in the sequence's own text, verified in empty rounds
    lookup_accepted: int = 0  # ... and kept
    # Not a speculation count, carried here to every front: prompt tokens the target read from its
    # prefix cache instead of computing them (gRPC usage.cached_prompt_tokens, OpenAI's
    # usage.prompt_tokens_details.cached_tokens)
    cached_prompt_tokens: int = 0
    # accepted_per_pos[i]: how often the draft token at offset i of a verified chunk was accepted
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Committed tokens per target forward (accepted + the recovered/bonus token when there is
        one), counted directly: a prefill-only forward or a declined bonus adds no token."""
        if self.target_forwards == 0:
            return 0.0
        return self.committed_tokens / self.target_forwards

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def plus(self, other: "SpecStats | None") -> "SpecStats":
        """These counts and `other`'s summed (a request's parts served by different schedulers, or the
        choices of one request)."""
        if other is None:
            return self
        out = SpecStats()
        for f in dataclasses.fields(SpecStats):
            x, y = getattr(self, f.name), getattr(other, f.name)
            if isinstance(x, list):
                n = max(len(x), len(y))
                setattr(out, f.name, [(x[i] if i < len(x) else 0) + (y[i] if i < len(y) else 0) for i in range(n)])
            else:
                setattr(out, f.name, x + y)
        return out


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target, and the likeliest tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log p), likeliest first


@dataclass(frozen=True)
class TokensEvent:
    token_ids: tuple[int, ...]  # newly committed tokens, in order
    # The sequence's live stats (updated in place), so a consumer that stops early (a stop string,
    # a client cancel) still has them without waiting for a FinishEvent.
    stats: SpecStats | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the request asked for them


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stats: SpecStats = field(default_factory=SpecStats)


GenerationEvent = TokensEvent | FinishEvent


@dataclass(frozen=True)
class ModelInfo:
    name: str
    target_path: str
    draft_path: str | None  # the draft checkpoint, if the drafter loads one of its own
    vocab_size: int  # tokenizer vocabulary (ids must be < this)
    max_context: int  # prompt + new tokens must fit
    eos_token_id: int | None  # the tokenizer's end-of-sequence token
    draft_method: str | None = None  # "model", "layers", "ngram"; None = no drafter (mode off only)
    # every token that ends a generation (generation_config.json's eos_token_id list, e.g. Llama 3's
    # <|eot_id|> and <|end_of_text|>); () = just eos_token_id
    eos_token_ids: tuple[int, ...] = ()
    draft_node_id: str = ""  # Ray node of the draft actor ("" in-process / no draft)
    target_node_id: str = ""  # Ray node of the target actor
    # live sequences the model's schedulers hold at once (models[].max_num_seqs on each of its
    # replicas): the server's weighted admission queue hands out exactly this many per model, so no
    # request waits elsewhere
    max_num_seqs: int = 16
    # the most drafts per verify a request may ask for (models[].speculation: the larger of
    # max_draft_tokens and gamma); a request above it is refused, naming it
    max_draft_tokens: int = MAX_DRAFT_TOKENS
    # whose cached prompt blocks a request may reuse (models[].prefix_cache; coordinator/scheduling/kv_budget.py)
    prefix_cache: str = "tenant"

    @property
    def has_draft(self) -> bool:
        return self.draft_method is not None

    def draft_tokens_problem(self, n: int) -> str | None:
        """Why a request may not ask for `n` drafts per verify; None when it may. Refused rather than
        clamped: a client that asks for more learns the cap instead of silently getting less."""
        if 0 <= n <= self.max_draft_tokens:
            return None
        return (f"{n} drafts per verify; model {self.name!r} allows at most {self.max_draft_tokens} "
                f"(its speculation.max_draft_tokens / gamma): ask for at most {self.max_draft_tokens}, or leave "
                "it unset (0) for the model's default")

    @property
    def end_token_ids(self) -> frozenset[int]:
        """The ids that finish a generation with FINISH_REASON_EOS (unless the request ignores EOS)."""
        if self.eos_token_ids:
            return frozenset(self.eos_token_ids)
        return frozenset() if self.eos_token_id is None else frozenset({self.eos_token_id})


class Coordinator(Protocol):
    def models(self) -> list[ModelInfo]: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]: ...

    async def stats(self) -> dict: ...  # {"ready": bool, "models": {name: {live_sequences, target, draft}}}

    async def close(self) -> None: ...


class CoordinatorError(Exception):
    """An error with a gRPC-compatible status name, picklable across Ray."""

    code: str = "INTERNAL"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    def __reduce__(self):
        return (type(self), (str(self), self.code))


class InvalidRequest(CoordinatorError):
    code = "INVALID_ARGUMENT"


class ModelNotFound(CoordinatorError):
    code = "NOT_FOUND"


class Overloaded(CoordinatorError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(CoordinatorError):
    code = "UNAVAILABLE"
