"""The proposer interface: the one thing a drafting method implements.

The drafter (draft_worker/drafter.py) owns the PEARL side of the protocol for every sequence — epochs,
the lookahead bound, rollback on RESET, chunks on the wire, failure handling — and asks a `Proposer`
only this: *given what each of these sequences holds, which tokens come next?* Each drafting method
is one file behind this contract (in the spirit of transformers' candidate generators):

    model_proposer.py   a small draft model, or the target's own first K layers (one token per step)
    ngram_proposer.py   model-free: the longest suffix match in the sequence's own text and in the
                        same tenant's recent text (many tokens per step, no accelerator)
    eagle_proposer.py   an EAGLE head on the target's hidden states (one token per step, runs ahead
                        on its own predicted features)
    medusa_proposer.py  Medusa heads on the target's hidden state (several tokens at once, then waits
                        for the next verdict)

Contract, per step (`propose`), for each sequence that may draft:

    seq.tokens[:seq.committed_len]   verified tokens (prompt + committed)
    seq.tokens[seq.committed_len:]   this drafter's earlier proposals not yet verified
    budget                           how many more positions it may fill (>= 1)

and it returns a `Proposal` of 1..budget tokens (with their q when sampling), or no tokens and
``exhausted=True`` when it has nothing to offer until the sequence changes (the coordinator then
verifies what it has instead of waiting). The drafter appends the tokens to ``seq.tokens``.

What a proposer proposes at a position (and whether it proposes anything) must depend only on
``seq.tokens`` before it and the request's seeded sampling — never on how steps and commands happened
to interleave. The coordinator relies on it for sampled requests: after an exhausted chunk it takes
the target's bonus token, and that must happen at the same positions in every run.

Lifecycle: `open` when a sequence starts (allocate a KV slot), `rewind` when a RESET replaces
``tokens[length:]`` (drop cached state past it), `observe` when more of the sequence is verified
(learn: the n-gram index grows), `close` when it is released (free the slot; give the verified text to
the tenant's pool).

Features (head drafters, `DraftMethod.reads_features`): the target's hidden states of verified
positions arrive in FEATURES commands and the drafter keeps them in ``seq.features``; a proposer that
cannot propose before some arrive answers ``Proposal(waiting=True)`` and is asked again after the
next FEATURES command for that sequence.

Hedges (the speculation cache, docs/design.md#beyond-one-chain; draft_worker/hedges.py): a proposer that can `branch`
gives a hypothetical sequence — the parent's tokens before a position, then another token there —
state of its own that starts from what the parent holds (a model copies the KV prefix), and names in
`Proposal.alternatives` its next-best tokens at each position (the likeliest corrections). A branch
is then proposed for like any sequence, in the same batch; what it proposes is what a RESET to that
outcome would propose, so the contract above holds for hedges too. Where this is going: a tree
proposal is a `Proposal` with a parent index per token (a chain is parents ``[-1, 0, 1, ...]``).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from duospec.settings import REQUIRED, setting

if TYPE_CHECKING:  # this module is read by the config loader: no torch at import time
    from duospec.qcodec import DraftProbs
    from duospec.sampling import SamplingParams


class DraftMethod(str, enum.Enum):
    """How draft tokens are made (`models[].draft.method` in the serve config)."""

    MODEL = "model"  # a separate small checkpoint with the target's tokenizer
    LAYERS = "layers"  # the target's first K layers + its final norm and LM head (self-speculation)
    NGRAM = "ngram"  # model-free: suffix matches in the sequence's and the tenant's recent text
    EAGLE = "eagle"  # an EAGLE head (duospec train-heads) on the target's hidden states
    EAGLE3 = "eagle3"  # an EAGLE-3 head (duospec train-heads, or a published one) on three target layers
    MEDUSA = "medusa"  # Medusa heads (duospec train-heads) on the target's hidden states

    @property
    def needs_model(self) -> bool:
        """Whether the draft worker holds a ModelRunner (and so asks for an accelerator)."""
        return self in (DraftMethod.MODEL, DraftMethod.LAYERS, DraftMethod.EAGLE, DraftMethod.EAGLE3)

    @property
    def reads_features(self) -> bool:
        """Drafts from the target's hidden states (the target sends them with each verdict)."""
        return self in (DraftMethod.EAGLE, DraftMethod.EAGLE3, DraftMethod.MEDUSA)

    @property
    def loads_path(self) -> bool:
        """Loads a checkpoint or head directory named by the spec's (required) `path`."""
        return self in (DraftMethod.MODEL, DraftMethod.EAGLE, DraftMethod.EAGLE3, DraftMethod.MEDUSA)


POOL_SCOPES = ("tenant", "sequence")
MAX_TENSOR_PARALLEL = 64  # ranks of one worker: GPUs of one node


@dataclass(frozen=True)
class NgramOptions:
    """`models[].draft` options of the n-gram drafter (read by coordinator/config.py)."""

    min_ngram: int = setting(2, "ngram: the shortest context that may predict (shorter matches are mostly "
                             "noise); at most max_ngram", lo=1, hi=64)
    max_ngram: int = setting(8, "ngram: the longest context matched", lo=1, hi=64)
    max_proposal: int = setting(16, "ngram: tokens proposed per step (the lookahead bound also applies)",
                                lo=1, hi=256)
    pool: str = setting("tenant", "ngram: tenant = also match the tenant's recent sequences; sequence = its own "
                        "text only", choices=POOL_SCOPES)
    # A trie costs ~2.7 KB per indexed token at max_ngram 8 (measured on stdlib code), so the defaults
    # hold at most ~16 x 43 MB.
    pool_tokens: int = setting(16_000, "ngram: tokens per tenant pool; the oldest sequences are evicted past it",
                               lo=1, hi=1 << 30)
    max_pools: int = setting(16, "ngram: tenants with a pool; the least recently used is evicted past it",
                             lo=1, hi=1 << 20)


@dataclass(frozen=True)
class DraftSpec:
    """What drafts for a model: `models[].draft` in the serve config, typed."""

    method: DraftMethod = setting(
        REQUIRED, "model: a small checkpoint with the target's tokenizer; layers: the target's first K "
        "layers; ngram: suffix matches in the text, no checkpoint; eagle / eagle3 / medusa: a head from "
        "`duospec train-heads` (eagle3 also in the published EAGLE-3 layout)", choices=[m.value for m in DraftMethod])
    path: str | None = setting(
        None, "model, eagle, eagle3, medusa: the checkpoint's or head's directory (required); layers: a fine-tuned "
        "shallow draft (optional)")
    layers: int | None = setting(None, "layers: K, the target's first K layers (required; fewer than it has)",
                                 lo=1, hi=1 << 16)
    ngram: NgramOptions = field(default_factory=NgramOptions)  # the ngram keys, declared on NgramOptions
    kv_cache_memory_bytes: int | None = setting(
        None, "model, layers, eagle, eagle3: the draft worker's own KV memory in bytes; absent = the model's setting",
        lo=1 << 10, hi=1 << 50)
    tensor_parallel_size: int = setting(
        1, "model: the draft's tensor-parallel group size, ranks on one node", lo=1, hi=MAX_TENSOR_PARALLEL)
    context_lookup: bool = setting(
        True, "model, layers, eagle, eagle3: where the draft model (or head) is unsure (top probability < 0.5) "
        "and the text's last two tokens occurred earlier in the sequence's verified text, a greedy request drafts "
        "what followed them there instead (draft_worker/context_lookup.py)")
    stop_confidence: float | None = setting(
        None, "model, layers, eagle, eagle3: a greedy request's chain of drafts ends after a token the draft model "
        "(or head) gave less than this probability, until the target's verdict (0: drafts run to the lookahead "
        "bound); absent = 0.4 for a drafter on the CPU (it shares cores with the target: drafting what is likely "
        "wasted slows the verify), 0 on an accelerator", lo=0.0, hi=1.0)
    float16_products: bool = setting(
        True, "model, layers: on a CPU, the draft model's matrix products run in float16 wherever that measured "
        "faster at load (half the bytes to read: a one-row step of the SmolLM2 draft 4.4 -> 3.1 ms); false keeps "
        "them in float32. Only drafts are computed so, never the target's verify: output is the same either way")

    def checkpoint(self, target_path: str) -> str | None:
        """The checkpoint the draft worker loads (None: no model); a head's directory for eagle/medusa."""
        if self.method.loads_path:
            return self.path
        if self.method is DraftMethod.LAYERS:
            return self.path or target_path
        return None

    def feature_layers(self, target_path: str) -> tuple[int, ...]:
        """The target layers whose inputs the drafter reads (EAGLE-3); () for the final hidden states."""
        if self.method is not DraftMethod.EAGLE3:
            return ()
        from duospec.engine.eagle3 import head_feature_layers

        return head_feature_layers(self.path, target_path)

    def describe(self) -> str:
        if self.method is DraftMethod.LAYERS:
            return f"layers:{self.layers}" + (f" ({self.path})" if self.path else "")
        if self.method.loads_path:
            return f"{self.method.value} ({self.path})"
        return f"ngram ({self.ngram.min_ngram}-{self.ngram.max_ngram}, pool {self.ngram.pool})"


@dataclass
class DraftState:
    """The drafter's state of one sequence. Owned by the Drafter; proposers read it and keep their own
    per-sequence data in `proposer_state`."""

    seq_id: int
    epoch: int
    sampling: SamplingParams
    # [n] every token this drafter knows, by position: verified ones, then its own unverified proposals
    tokens: list[int]
    committed_len: int  # tokens[:committed_len] are verified
    draft_until: int  # draft positions < draft_until only (the coordinator's lookahead bound)
    pool: str = ""  # the tenant's n-gram pool key ("" = none)
    cache_salt: str = ""  # whose KV prefix cache the sequence shares (the tenant, or "" for the whole model)
    exhausted: bool = False  # the proposer has nothing more until the next command
    tokens_drafted: int = 0
    proposer_state: object = None
    max_hedges: int = 0  # hedges this sequence may hold (the coordinator's speculation cache setting)
    # pos -> the proposer's next-best tokens at pos (Proposal.alternatives), for positions it drafted
    alternatives: dict[int, list[int]] = field(default_factory=dict)
    features: FeatureStore | None = None  # head drafters: the target's hidden states (shared with hedges)
    waiting: bool = False  # the proposer waits for features: not asked again before the next FEATURES
    # [1, ceil(V/32)] int32 or None: the grammar's legal next tokens, set by the drafter for one `propose`
    # (draft_worker/grammar_masks.py); a proposer that samples from logits masks them with it first
    grammar_mask: object = None
    # positions of its grammar-forced drafts (ascending; draft_worker/grammar_masks.py): the coordinator
    # does not count them toward the lookahead, so neither does `draft_end`
    forced: list[int] = field(default_factory=list)

    @property
    def next_pos(self) -> int:
        """The position the next drafted token will occupy."""
        return len(self.tokens)

    @property
    def forced_ahead(self) -> int:
        """Forced drafts past the verified prefix."""
        return sum(1 for pos in self.forced if pos >= self.committed_len)

    @property
    def draft_end(self) -> int:
        """Drafting stops before this position: the coordinator's bound, pushed out by the forced drafts
        ahead (they cost the target a row each but no model step, and are certain once their prefix is)."""
        return self.draft_until + self.forced_ahead

    def forget_forced(self, from_pos: int) -> None:
        """The tokens from `from_pos` on were replaced; forced marks below the verified prefix are spent."""
        self.forced = [pos for pos in self.forced if self.committed_len <= pos < from_pos]


class FeatureStore:
    """The target's hidden states of one sequence's verified positions, rows [0, known) contiguous
    (stored fp16, as they travel; a hedge's copy keeps only the rows from `base` on)."""

    def __init__(self):
        self.rows = None  # torch [capacity, hidden] float16; row j holds position base + j
        self.base = 0
        self.known = 0
        self.broken = False  # a gap arrived (e.g. the drafter restarted mid-sequence): never complete

    def write(self, start: int, rows) -> None:
        import torch

        if start > self.known:
            self.broken = True
            return
        if start < self.base:  # rows this copy does not keep (a hedge's tail: nothing reads them)
            rows, start = rows[self.base - start:], self.base
        end = start + rows.shape[0]
        if end <= start:
            return
        have = 0 if self.rows is None else self.rows.shape[0]
        if have < end - self.base:
            grown = torch.zeros(max(end - self.base, 2 * have, 64), rows.shape[1], dtype=torch.float16)
            if self.rows is not None:
                grown[: self.known - self.base] = self.rows[: self.known - self.base]
            self.rows = grown
        self.rows[start - self.base: end - self.base] = rows
        self.known = max(self.known, end)

    def row(self, pos: int):
        """[hidden] float32 of position `pos` (< known, >= base)."""
        if not self.base <= pos < self.known:
            raise IndexError(f"feature of position {pos} not held (rows {self.base}..{self.known - 1})")
        return self.rows[pos - self.base].float()

    def rows_between(self, start: int, end: int):
        """[end - start, hidden] float32 of positions start .. end - 1 (all held)."""
        if not self.base <= start <= end <= self.known:
            raise IndexError(f"features of positions {start}..{end - 1} not held (rows {self.base}..{self.known - 1})")
        return self.rows[start - self.base: end - self.base].float()

    def truncate(self, length: int) -> None:
        self.known = max(min(self.known, length), self.base)

    def tail(self, start: int, length: int) -> FeatureStore:
        """A copy holding rows [start, length) (what a hedge branching at `length` can still read)."""
        copy = FeatureStore()
        start, length = max(start, self.base), min(length, self.known)
        copy.base = copy.known = start
        if length > start:
            copy.write(start, self.rows[start - self.base: length - self.base].clone())
        return copy


class DraftDeclined(Exception):
    """A proposer does not draft this sequence (e.g. a method without a sampling rule for it); the
    sequence goes on target-only."""


@dataclass
class Proposal:
    # [n] proposed tokens at positions seq.next_pos, seq.next_pos + 1, ...
    tokens: list[int] = field(default_factory=list)
    # [n] the q each token was drawn from; empty when greedy
    probs: list[DraftProbs] = field(default_factory=list)
    # True: nothing more until the sequence changes (a RESET or ADVANCE); required when tokens is empty
    exhausted: bool = False
    # [n] per token, the proposer's next-best tokens at its position, best first (hedge keys); may be empty
    alternatives: list[list[int]] = field(default_factory=list)
    # True (with no tokens): the proposer is still reading a long prompt, a chunk per step; ask again
    prefilling: bool = False
    # True (with no tokens): nothing until the target's features for more positions arrive
    waiting: bool = False


class Proposer(abc.ABC):
    """A drafting method. Methods are called from the drafter's one thread, never concurrently."""

    method: DraftMethod
    # Positions a sequence may reach (the draft model's context); None = no limit of its own.
    max_context: int | None = None

    def open(self, seq: DraftState) -> None:
        """A new sequence (its prompt is in `seq.tokens`). Raises SlotsExhausted when it cannot hold
        one more; the drafter then drops that sequence (it goes on target-only)."""

    def rewind(self, seq: DraftState, length: int) -> None:
        """`seq.tokens[length:]` is about to be replaced (an abort); forget what was built on it."""

    def observe(self, seq: DraftState) -> None:
        """`seq.committed_len` grew: more of the sequence is verified."""

    def close(self, seq: DraftState) -> None:
        """The sequence is finished or cancelled."""

    def branch(self, parent: DraftState, child: DraftState) -> bool:
        """Give `child` (a hedge: ``child.tokens`` is ``parent.tokens[:pos] + [token]``) state of its own,
        starting from what `parent` holds before ``pos``; `close` frees it. False when this method has no
        branches (no hedges) or no room for one now (it must never take what a new sequence needs)."""
        return False

    @abc.abstractmethod
    def propose(self, seqs: list[DraftState], budgets: list[int]) -> list[Proposal]:
        """One proposal per sequence (same order); `budgets[i] >= 1` caps `len(proposal.tokens)`."""

    def stats(self) -> dict:
        return {}

    def cache_stats(self):
        """Its KV pool's counters (a duospec.engine.blocks.CacheStats), None without a paged KV cache."""
        return None
