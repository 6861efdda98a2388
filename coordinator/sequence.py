"""Per-sequence state in the coordinator: the one place that knows a sequence's committed tokens,
its epoch, the drafts in flight and how much of each worker's KV cache is valid.

The transitions here are pure bookkeeping (no I/O); the scheduler turns their outcomes into
messages. Positions: committed[i] sits at position i. Drafts come in two groups:

    committed ... | verify_tokens (sent to the target, awaiting the verdict) | drafts (arrived since)

plus the speculation cache: hedges, the drafter's continuations of hypothetical verdicts, keyed by
(position, token) — "the target puts token at position" (draft_worker/hedges.py).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from duospec.coordinator.adaptive import AcceptanceTracker
from duospec.coordinator.api import FinishReason, GenerationRequest, SpecStats, SpeculationMode
from duospec.coordinator.lookup import TextLookup
from duospec.coordinator.policies import SpeculationPolicy


@dataclass(frozen=True)
class BranchTaken:
    """A verdict's path went into the branch of hedge `key`: the drafter adopts that branch, and the
    hedge's tokens past the verdict (`drafts`, `probs`) are the next round's drafts."""

    key: tuple[int, int]
    drafts: list[int]
    probs: list[bytes]


class DraftAction(enum.Enum):
    """What the drafter must be told after a verdict."""

    NONE = "none"  # nothing: the drafter is not used
    ADVANCE = "advance"  # the committed prefix grew; the drafter's speculation still stands
    ABORT = "abort"  # rejection (or an unguessed bonus): new epoch, roll back, continue from the fix


@dataclass
class Sequence:
    seq_id: int
    request: GenerationRequest
    policy: SpeculationPolicy
    committed: list[int]  # prompt + generated, all verified
    prompt_len: int
    eos_token_ids: frozenset[int]  # the model's end tokens (ModelInfo.end_token_ids)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stats: SpecStats = field(default_factory=SpecStats)
    epoch: int = 0
    verify_tokens: list[int] | None = None  # drafts in the in-flight verify batch (None: not in one)
    verify_probs: list[bytes] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # drafts that arrived after the in-flight chunk
    draft_probs: list[bytes] = field(default_factory=list)  # [len(drafts)] or empty when greedy
    draft_alive: bool = True  # False: the drafter dropped it or died; go on target-only
    draft_fed_len: int = 0  # the drafter's KV cache holds valid tokens for positions < this
    draft_started: bool = False
    draft_paused: bool = False  # backed off to target-only under load: the drafter is told to stop
    # The drafter said it has nothing more until its next command (DRAFT_OUTLOOK_EXHAUSTED): verify
    # what has arrived instead of waiting for more.
    draft_exhausted: bool = False
    # Its drafter reads the target's hidden states (EAGLE, Medusa): verify items ask for them and each
    # verdict's go to the drafter (a FEATURES command); the prompt goes to the target first.
    needs_features: bool = False
    target_len: int = 0  # the target's KV cache holds committed[:target_len]
    # where the in-flight verify item's context ends: None = all committed tokens; less for a prefill chunk
    verify_context_end: int | None = None
    round_start: int = 0  # position of the first draft of the current round (after start/abort)
    finish_reason: FinishReason | None = None
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    started_at: float = field(default_factory=time.monotonic)
    # (pos, token) -> (tokens at pos + 1 ..., their q): this epoch's hedges
    hedges: dict[tuple[int, int], tuple[list[int], list[bytes]]] = field(default_factory=dict)
    # The in-flight verify's token tree past its main chain (verify_tokens): node tokens, their parents
    # (indices into main chain + branches; -1 = the context), and for each branch root node its hedge key
    branch_tokens: list[int] = field(default_factory=list)
    branch_parents: list[int] = field(default_factory=list)
    branch_keys: dict[int, tuple[int, int]] = field(default_factory=dict)
    alternatives: dict[int, int] = field(default_factory=dict)  # pos -> the drafter's next-best token there
    # How many of `drafts`, from the front, a hedge drafted (a cache hit's continuation, or what is left
    # of a taken branch's), and how many of the in-flight chunk: for stats.hedge_tokens_kept
    hedge_drafts: int = 0
    verify_from_hedge: int = 0
    # (epoch, when) a rejection restarted the drafter with nothing cached, until that epoch's first draft
    # arrives: the restart time patience weighs (Patience.first_draft_s)
    restarted: tuple[int, float] | None = None
    # the in-flight item is an empty round: no draft, sent rather than idle for the restarted drafter
    empty_round: bool = False
    # ... and these tokens, found in the sequence's own text, ride in it as drafts (coordinator/lookup.py)
    lookup_tokens: list[int] = field(default_factory=list)
    lookup: TextLookup = field(default_factory=TextLookup)
    # The first committed position an empty round decided that the drafter has not yet been seen to
    # hold (its chunk for it has not come, or came short): what it holds there is its own guess, so it
    # is told only the positions before as verified (drafter_verified_len).
    unconfirmed_from: int | None = None
    # set (monotonic time): preempted, its KV freed on both workers, until it resumes (coordinator/kv_budget.py)
    preempted_at: float | None = None

    # -- facts ------------------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.request.sampling.greedy

    @property
    def limit(self) -> int:
        """One past the last position this request may commit."""
        return self.prompt_len + self.request.max_new_tokens

    @property
    def remaining(self) -> int:
        return self.limit - len(self.committed)

    @property
    def uses_draft(self) -> bool:
        return self.policy.uses_draft and self.draft_alive

    @property
    def verifying(self) -> bool:
        return self.verify_tokens is not None

    @property
    def next_draft_pos(self) -> int:
        """Where the next draft chunk must start to extend what this sequence holds."""
        return len(self.committed) + len(self.verify_tokens or ()) + len(self.drafts)

    @property
    def prefill_pending(self) -> bool:
        return self.target_len < len(self.committed) - 1 and not self.verifying

    def draft_until(self) -> int:
        if self.draft_paused:
            return len(self.committed)  # nothing to draft: the drafter idles instead of taking CPU/GPU
        return min(len(self.committed) + self.policy.lookahead(), self.limit)

    def pause_drafting(self) -> None:
        """Stop speculating for now. Only the committed prefix of the drafter's cache stays trusted:
        what it drafted past it may not be what the target commits meanwhile."""
        self.draft_paused = True
        self.hedges, self.alternatives = {}, {}
        self.drop_drafts()
        self.draft_fed_len = min(self.draft_fed_len, len(self.committed))

    def stop_ids(self) -> frozenset[int]:
        ids = self.request.stop_token_ids
        if not self.request.ignore_eos:
            ids = ids | self.eos_token_ids
        return ids

    # -- transitions ------------------------------------------------------------------------------
    def add_drafts(self, start_pos: int, tokens, probs, exhausted: bool = False, alternatives=()) -> bool:
        """Appends a draft chunk of the current epoch; False if it does not continue the drafts."""
        if start_pos != self.next_draft_pos:
            return False
        self.drafts.extend(tokens)
        self.draft_probs.extend(probs)
        self.alternatives.update((start_pos + i, a) for i, a in enumerate(alternatives) if a >= 0)
        # Drafting position P needed P-1 fed; an empty (exhausted) chunk at P says the same of P-1,
        # so the next RESET does not resend what the drafter already holds.
        self.draft_fed_len = max(self.draft_fed_len, start_pos + len(tokens) - 1)
        self.draft_exhausted = exhausted
        return True

    def decided_prefix(self, start_pos: int, tokens) -> int | None:
        """How many leading tokens of a current-epoch draft chunk starting at `start_pos` sit at
        positions the target decided on its own while the chunk was on its way (empty rounds after a
        restart, nothing else in flight): 0 for a chunk that continues the drafts, None when one of
        them is not the committed token (the drafter guessed wrong and must start over)."""
        decided = len(self.committed) - start_pos
        if decided <= 0:
            return 0
        if self.verify_tokens or self.drafts:  # not after an empty round: a stray chunk, start over
            return None
        n = min(decided, len(tokens))
        return n if list(tokens[:n]) == self.committed[start_pos:start_pos + n] else None

    def drafter_holds(self, start_pos: int, n: int) -> None:
        """A current-epoch chunk starting at `start_pos` showed that the drafter holds the committed
        tokens at its first `n` positions (decided_prefix)."""
        if self.unconfirmed_from is not None and start_pos <= self.unconfirmed_from < start_pos + n:
            end = start_pos + n
            self.unconfirmed_from = end if end < len(self.committed) else None

    def drafter_verified_len(self) -> int:
        """How much of the committed text the drafter holds as committed: all of it, except after
        empty rounds whose tokens its chunks have not yet confirmed. (Told more, it would count its
        own guess as verified text: an n-gram drafter would teach it to the tenant's pool.)"""
        return len(self.committed) if self.unconfirmed_from is None else self.unconfirmed_from

    def add_hedge(self, pos: int, token: int, start_pos: int, tokens, probs) -> bool:
        """Appends a hedge chunk of the current epoch; False if its key is decided or it does not
        continue what the cache holds for the key."""
        held, held_probs = self.hedges.get((pos, token), ([], []))
        if pos < len(self.committed) or start_pos != pos + 1 + len(held):
            return False
        self.hedges[(pos, token)] = (held + list(tokens), held_probs + list(probs))
        return True

    def take_hedge(self) -> tuple[list[int], list[bytes]] | None:
        """The cached continuation for the verdict just committed (its last token at its position), or
        None on a miss. Called after a rejection, before the new epoch clears the cache."""
        self.stats.cache_lookups += 1
        hit = self.hedges.get((len(self.committed) - 1, self.committed[-1]))
        if hit is None or not hit[0]:
            return None
        self.stats.cache_hits += 1
        return hit

    def add_branches(self, max_nodes: int) -> tuple[list[int], list[int]]:
        """Hangs this epoch's hedges off the main chain just taken for verification (a token tree):
        a hedge at the position of main-chain draft i (or the bonus position after the last) becomes a
        sibling of that draft, its continuation a chain below it; at most `max_nodes` nodes, nearest
        positions first, none past the request's length limit. Returns the tree's tokens and parents
        (no parents: no branch fitted, a chain)."""
        chain = self.verify_tokens or []
        first = len(self.committed)
        self._clear_branches()
        # Every draft's runner-up becomes a sibling leaf (free for the drafter: it comes with the
        # draft's own logits); a hedge for it, where one exists, brings its continuation along.
        candidates = dict(self.hedges)
        for i, token in enumerate(chain):
            alt = self.alternatives.get(first + i)
            if alt is not None and alt != token:
                candidates.setdefault((first + i, alt), ([], []))
        roots = []  # first every candidate's own token (nearest positions first), then continuations
        for (pos, token), (tokens, _) in sorted(candidates.items()):
            offset = pos - first  # the main-chain draft this one replaces (len(chain): the bonus)
            if not 0 <= offset <= len(chain) or offset >= self.remaining or (
                    offset < len(chain) and chain[offset] == token) or len(self.branch_tokens) >= max_nodes:
                continue
            node = len(chain) + len(self.branch_tokens)
            self.branch_keys[node] = (pos, token)
            self.branch_tokens.append(token)
            self.branch_parents.append(offset - 1)
            roots.append((node, offset, tokens))
        for node, offset, tokens in roots:
            room = min(max_nodes - len(self.branch_tokens), self.remaining - offset - 1)
            for i, token in enumerate(tokens[: max(0, room)]):
                self.branch_parents.append(node if i == 0 else len(chain) + len(self.branch_tokens) - 1)
                self.branch_tokens.append(token)
        if not self.branch_tokens:
            return list(chain), []
        return chain + self.branch_tokens, [*range(-1, len(chain) - 1), *self.branch_parents]

    def _tree_outcome(self, path) -> tuple[list[int], tuple[int, int] | None, int]:
        """A verdict's accepted tokens from its path through the in-flight tree, the hedge key of the
        branch it went into (None: it stayed on the main chain) and how many of that branch's nodes
        it accepted."""
        tokens = (self.verify_tokens or []) + self.branch_tokens
        accepted = [tokens[i] for i in path]
        for depth, node in enumerate(path):
            if node in self.branch_keys:
                return accepted, self.branch_keys[node], len(path) - depth
        return accepted, None, 0

    def _branch_rest(self, key, branch_accepted: int, next_token: int | None) -> tuple[list[int], list[bytes]]:
        """After a path into hedge `key`'s branch: the hedge's tokens past the verdict's next token when
        the hedge guessed that token too (the next round's drafts), else none."""
        hedge = self.hedges.get(key)
        rest = hedge[0][branch_accepted - 1:] if hedge else []
        if next_token is None or rest[:1] != [next_token]:
            return [], []
        return rest[1:], hedge[1][branch_accepted:]

    def drop_drafts(self) -> int:
        """Discards the drafts not under verification (the in-flight chunk still gets its verdict)."""
        n = len(self.drafts)
        self.drafts, self.draft_probs = [], []
        self.hedge_drafts = 0
        self.stats.wasted_draft_tokens += n
        return n

    def take_verify_chunk(self, k: int) -> tuple[list[int], list[bytes]]:
        """Moves the first k drafts into the in-flight verify chunk and returns them."""
        tokens, probs = self.drafts[:k], self.draft_probs[:k]
        self.drafts, self.draft_probs = self.drafts[k:], self.draft_probs[k:]
        self.verify_tokens, self.verify_probs = tokens, probs
        self.verify_from_hedge = min(len(tokens), self.hedge_drafts)
        self.hedge_drafts -= self.verify_from_hedge
        self._clear_branches()
        return tokens, probs

    def _clear_branches(self) -> None:
        self.branch_tokens, self.branch_parents, self.branch_keys = [], [], {}

    def forget_verify(self) -> None:
        """The verdict for the in-flight chunk will not come (stale, or the target restarted)."""
        self._clear_branches()
        self.empty_round, self.lookup_tokens = False, []
        if self.verify_tokens is not None:
            # Back in front of the later drafts; they are re-verified (or dropped by an abort).
            self.drafts = self.verify_tokens + self.drafts
            self.draft_probs = self.verify_probs + self.draft_probs
            self.hedge_drafts += self.verify_from_hedge
        self.verify_tokens, self.verify_probs, self.verify_from_hedge = None, [], 0

    def apply_verdict(self, n_accepted: int, next_token: int | None, recovered: bool,
                      path=()) -> tuple[list[int], DraftAction, BranchTaken | None]:
        """Commits the verdict of the in-flight chunk (`recovered`: its next token is a correction;
        `path`: the accepted nodes of a token tree). Returns (tokens kept, what the drafter needs, and
        when the path went into a hedge's branch, which one and what of it is left to draft on).
        Draft statistics count the main chain; tree_nodes the branches."""
        accepted, branch, branch_accepted = self._tree_outcome(path) if path else (None, None, 0)
        taken = None
        if branch is not None:  # the drafter's main line differs from the committed tokens from the branch on
            self.stats.tree_hits += 1
            self.draft_fed_len = min(self.draft_fed_len, branch[0])
            taken = BranchTaken(branch, *self._branch_rest(branch, branch_accepted, next_token))
        else:
            accepted = None
        chunk = self.verify_tokens or []
        empty_round, self.empty_round = self.empty_round, False
        lookup, self.lookup_tokens = self.lookup_tokens, []  # an empty round's drafts, not the drafter's
        rejected = recovered and (branch is not None or n_accepted < len(chunk))
        self.verify_tokens, self.verify_probs = None, []
        k = len(chunk)
        self.stats.tree_nodes += len(self.branch_tokens)
        self._clear_branches()
        new_tokens = ((chunk or lookup)[:n_accepted] if accepted is None else accepted) + (
            [next_token] if next_token is not None else [])
        old_len = len(self.committed)
        # The target keeps what it was fed but the last token (re-fed next round); a prefill chunk
        # fed only committed[:verify_context_end].
        chunk_end = old_len if self.verify_context_end is None else min(self.verify_context_end, old_len)
        self.target_len = chunk_end + len(new_tokens) - 1
        kept = self._commit(new_tokens)
        n_accepted -= branch_accepted  # of the main chain
        # a hedge's own tokens kept: below a taken branch's root (its key), or a hit's continuation here
        from_hedge, self.verify_from_hedge = self.verify_from_hedge, 0
        self.stats.hedge_tokens_kept += min(len(kept), max(0, branch_accepted - 1) + min(n_accepted, from_hedge))
        if lookup:
            self.stats.lookup_tokens += len(lookup)
            self.stats.lookup_accepted += min(n_accepted, len(kept))
            n_accepted = 0  # of the drafter's tokens
        if chunk_end == old_len:  # a prefill chunk is not a round: it commits and drafts nothing
            self._count(k, n_accepted, len(kept), rejected, first_of_round=old_len == self.round_start)
        if self.finish_reason is not None or not self.uses_draft:
            return kept, DraftAction.NONE, None
        if rejected or accepted is not None:  # a path into a branch leaves the main line too
            self.stats.wasted_draft_tokens += (k - n_accepted) + len(self.drafts)
            return kept, DraftAction.ABORT, taken
        if next_token is not None:  # bonus: keep the speculation past it only if the drafter guessed it
            # The tokens decided past the drafter's verified chunk: the bonus, or everything an empty
            # round committed (its lookup tokens and its next token); the drafts that arrived meanwhile
            # start where they do.
            beyond = kept[k:]
            same = next((i for i, (a, b) in enumerate(zip(self.drafts, beyond)) if a != b),
                        min(len(self.drafts), len(beyond)))  # how many of them the drafts guessed
            if same == len(beyond):
                self.drafts, self.draft_probs = self.drafts[same:], self.draft_probs[same:]
                self.hedge_drafts = max(0, self.hedge_drafts - same)
                self._decided()
                return kept, DraftAction.ADVANCE, None
            if empty_round and same == len(self.drafts) and not self.draft_paused:
                # An empty round beat the restarted drafter's chunks: keep the epoch, and check the
                # next chunk against the tokens decided past these drafts when it comes (decided_prefix).
                self.drafts, self.draft_probs, self.hedge_drafts = [], [], 0
                if self.unconfirmed_from is None:
                    self.unconfirmed_from = old_len + same
                self._decided()
                return kept, DraftAction.ADVANCE, None
            # The drafter's line parts from the decided tokens where its drafts do: only what it
            # holds before that stands, in its cache and in the hedges it drafted on that prefix
            # (an empty round may have decided several positions the drafter guessed otherwise).
            parted = old_len + k + same
            self.draft_fed_len = min(self.draft_fed_len, parted)
            self.hedges = {key: hedge for key, hedge in self.hedges.items() if key[0] <= parted}
            self.stats.wasted_draft_tokens += len(self.drafts)
            return kept, DraftAction.ABORT, taken
        self._decided()
        return kept, DraftAction.ADVANCE, None

    def _decided(self) -> None:
        """Hedges and alternatives at committed positions can no longer be hit."""
        if self.hedges:
            self.hedges = {key: hedge for key, hedge in self.hedges.items() if key[0] >= len(self.committed)}
        self.alternatives = {pos: a for pos, a in self.alternatives.items() if pos >= len(self.committed)}

    def start_new_epoch(self) -> int:
        """After an abort: drafts are gone (a verdict still in flight is now stale and will be
        dropped); returns where the drafter's cache stops matching the committed prefix."""
        self.epoch += 1
        self.draft_exhausted = False
        self.unconfirmed_from = None  # the RESET carries the committed tokens
        self.hedges, self.alternatives = {}, {}
        self.drafts, self.draft_probs, self.hedge_drafts = [], [], 0
        self.verify_tokens, self.verify_probs, self.verify_from_hedge = None, [], 0
        self._clear_branches()
        self.draft_fed_len = min(self.draft_fed_len, len(self.committed) - 1)
        self.round_start = len(self.committed)
        return self.draft_fed_len

    def _commit(self, tokens: list[int]) -> list[int]:
        """Appends verified tokens, cut at a stop token or the length limit; sets finish_reason."""
        stop_ids = self.stop_ids()
        kept = []
        for token in tokens[: self.remaining]:
            kept.append(token)
            if token in stop_ids:
                is_eos = token in self.eos_token_ids and token not in self.request.stop_token_ids
                self.finish_reason = FinishReason.EOS if is_eos else FinishReason.STOP
                break
        self.committed.extend(kept)
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = FinishReason.LENGTH
        return kept

    def _count(self, k: int, accepted: int, kept: int, rejected: bool, first_of_round: bool) -> None:
        stats = self.stats
        stats.target_forwards += 1
        stats.drafted_tokens += k
        accepted_kept = min(accepted, kept)  # tokens cut by a stop or the length limit don't count
        stats.accepted_tokens += accepted_kept
        stats.committed_tokens += kept
        if len(stats.accepted_per_pos) < accepted_kept:
            stats.accepted_per_pos.extend([0] * (accepted_kept - len(stats.accepted_per_pos)))
        for i in range(accepted_kept):
            stats.accepted_per_pos[i] += 1
        if k:
            self.acceptance.observe(accepted, int(rejected))
        if rejected:
            stats.rejections += 1
            if accepted == 0 and first_of_round and self.policy.mode is SpeculationMode.PEARL:
                stats.pre_verify_aborts += 1  # the round's first draft token, checked on its own, was wrong
