"""Per-sequence state in the coordinator: the one place that knows a sequence's committed tokens,
its epoch, the drafts in flight and how much of each worker's KV cache is valid.

The transitions here are pure bookkeeping (no I/O); the scheduler turns their outcomes into
messages. Positions: committed[i] sits at position i. Drafts come in two groups:

    committed ... | verify_tokens (sent to the target, awaiting the verdict) | drafts (arrived since)

Beside them (`spec`, coordinator/scheduling/speculation.py): the speculation cache — hedges, the drafter's
continuations of hypothetical verdicts, keyed by (position, token), "the target puts token at
position" (draft_worker/hedges.py) — the token tree in flight, and the empty rounds' state.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from duospec.coordinator.scheduling.adaptive import AcceptanceTracker
from duospec.coordinator.api import FinishReason, GenerationRequest, SpecStats, SpeculationMode
from duospec.coordinator.scheduling.policies import SpeculationPolicy
from duospec.coordinator.scheduling.speculation import BranchTaken, Hedge, SpeculationState


class DraftAction(enum.Enum):
    """What the drafter must be told after a verdict."""

    NONE = "none"  # nothing: the sequence finished, or the drafter is not used
    ADVANCE = "advance"  # the committed prefix grew; the drafter's speculation still stands
    ABORT = "abort"  # rejection (or an unguessed bonus): new epoch, roll back, continue from the fix
    ADOPT = "adopt"  # the path went into a hedge's branch: new epoch, the drafter goes on on that branch


@dataclass(frozen=True)
class VerdictOutcome:
    """What a verdict did to a sequence (Sequence.apply_verdict)."""

    kept: tuple[int, ...]  # the tokens committed (cut at a stop token or the length limit)
    action: DraftAction
    branch: BranchTaken | None = None  # ADOPT: the branch, and what of its hedge is left to draft on
    drafted: int = 0  # the drafter's tokens the verdict judged (its main chain)
    looked_up: int = 0  # the looked-up tokens an empty round verified (coordinator/scheduling/lookup.py)

    @property
    def new_epoch(self) -> bool:
        """The drafter's line is wrong past the verdict: it must roll back, not just go on."""
        return self.action in (DraftAction.ABORT, DraftAction.ADOPT)


@dataclass
class Sequence:
    seq_id: int
    request: GenerationRequest
    policy: SpeculationPolicy
    committed: list[int]  # prompt + generated, all verified
    eos_token_ids: frozenset[int]  # the model's end tokens (ModelInfo.end_token_ids)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stats: SpecStats = field(default_factory=SpecStats)
    epoch: int = 0
    verify_tokens: list[int] | None = None  # drafts in the in-flight verify batch (None: not in one)
    verify_probs: list[bytes] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # drafts that arrived after the in-flight chunk
    draft_probs: list[bytes] = field(default_factory=list)  # [len(drafts)] or empty when greedy
    # positions of drafts the drafter marked grammar-forced (DraftChunk.forced): free, and certain once
    # their prefix is accepted, so they count neither toward the draft cap nor toward acceptance
    forced: set[int] = field(default_factory=set)
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
    # position of the first draft of the current round: the prompt's end, then where the last abort left
    round_start: int = field(init=False)
    finish_reason: FinishReason | None = None
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    started_at: float = field(default_factory=time.monotonic)
    spec: SpeculationState = field(default_factory=SpeculationState)  # hedges, tree, empty rounds
    # set (monotonic time): preempted, its KV freed on both workers, until it resumes (coordinator/scheduling/kv_budget.py)
    preempted_at: float | None = None

    def __post_init__(self) -> None:
        self.round_start = self.prompt_len

    # -- facts ------------------------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

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

    def _forced_in(self, start: int, n: int) -> int:
        return sum(1 for pos in range(start, start + n) if pos in self.forced) if self.forced else 0

    @property
    def free_drafts(self) -> int:
        """How many of the drafts waiting for verification are grammar-forced."""
        return self._forced_in(self.next_draft_pos - len(self.drafts), len(self.drafts))

    def verify_span(self, cap: int) -> int:
        """How many drafts a verify takes under a cap of `cap` drafts: forced drafts ride along free,
        the ones after the last counted draft included (within the length limit)."""
        end = max(0, min(len(self.drafts), self.remaining))
        if cap <= 0 or not self.forced:
            return min(max(cap, 0), end)
        start, counted = self.next_draft_pos - len(self.drafts), 0
        for n in range(end):
            if start + n not in self.forced:
                if counted == cap:
                    return n
                counted += 1
        return end

    def _keep_forced(self, below: float = float("inf")) -> None:
        """Drops the forced marks of committed positions and of positions from `below` on (drafts gone)."""
        if self.forced:
            self.forced = {pos for pos in self.forced if len(self.committed) <= pos < below}

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
        self.spec.clear_cache()
        self.drop_drafts()
        self.draft_fed_len = min(self.draft_fed_len, len(self.committed))

    def stop_ids(self) -> frozenset[int]:
        ids = self.request.stop_token_ids
        if not self.request.ignore_eos:
            ids = ids | self.eos_token_ids
        return ids

    # -- transitions ------------------------------------------------------------------------------
    def add_drafts(self, start_pos: int, tokens, probs, exhausted: bool = False, alternatives=(),
                   forced: bool = False) -> bool:
        """Appends a draft chunk of the current epoch; False if it does not continue the drafts."""
        if start_pos != self.next_draft_pos:
            return False
        if forced:
            self.forced.update(range(start_pos, start_pos + len(tokens)))
        self.drafts.extend(tokens)
        self.draft_probs.extend(probs)
        self.spec.add_alternatives(start_pos, alternatives)
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
        self.spec.drafter_holds(start_pos, n, len(self.committed))

    def drafter_verified_len(self) -> int:
        """How much of the committed text the drafter holds as committed (SpeculationState.verified_len)."""
        return self.spec.verified_len(len(self.committed))

    def add_hedge(self, pos: int, token: int, start_pos: int, tokens, probs) -> bool:
        """Appends a hedge chunk of the current epoch; False if its key is decided or it does not
        continue what the cache holds for the key."""
        return self.spec.add_hedge(len(self.committed), pos, token, start_pos, tokens, probs)

    def take_hedge(self) -> Hedge | None:
        """The cached continuation for the verdict just committed (its last token at its position), or
        None on a miss. Called after a rejection, before the new epoch clears the cache."""
        self.stats.cache_lookups += 1
        hit = self.spec.hit((len(self.committed) - 1, self.committed[-1]))
        if hit is None:
            return None
        self.stats.cache_hits += 1
        return hit

    def add_branches(self, max_nodes: int) -> tuple[list[int], list[int]]:
        """Hangs this epoch's hedges off the main chain just taken for verification, as a token tree
        of at most `max_nodes` branch nodes (SpeculationState.add_branches): its tokens and parents."""
        return self.spec.add_branches(self.verify_tokens or [], len(self.committed), self.remaining, max_nodes)

    def drop_drafts(self) -> int:
        """Discards the drafts not under verification (the in-flight chunk still gets its verdict)."""
        n = len(self.drafts)
        self.drafts, self.draft_probs = [], []
        self._keep_forced(below=self.next_draft_pos)
        self.spec.drafts_dropped()
        self.stats.wasted_draft_tokens += n
        return n

    def take_verify_chunk(self, k: int) -> tuple[list[int], list[bytes]]:
        """Moves the first k drafts into the in-flight verify chunk and returns them."""
        tokens, probs = self.drafts[:k], self.draft_probs[:k]
        self.drafts, self.draft_probs = self.drafts[k:], self.draft_probs[k:]
        self.verify_tokens, self.verify_probs = tokens, probs
        self.spec.chunk_taken(len(tokens))
        self.spec.clear_branches()
        return tokens, probs

    def adopt_hedge(self, hedge: Hedge) -> list[int]:
        """Right after a new epoch: a hedge's tokens (within the length limit) are its drafts, fed on the
        drafter's branch already. Returns them."""
        n = min(len(hedge[0]), self.remaining)
        self.forced.clear()  # a hedge's tokens are never forced ones
        self.drafts, self.draft_probs = list(hedge[0][:n]), list(hedge[1][:n])
        self.spec.drafts_adopted(n)
        self.draft_fed_len = len(self.committed) - 1 + n  # what the branch has fed
        return self.drafts

    def forget_verify(self) -> None:
        """The verdict for the in-flight chunk will not come (stale, or the target restarted)."""
        self.spec.clear_branches()
        self.spec.end_round()
        if self.verify_tokens is not None:
            # Back in front of the later drafts; they are re-verified (or dropped by an abort).
            self.drafts = self.verify_tokens + self.drafts
            self.draft_probs = self.verify_probs + self.draft_probs
        self.spec.chunk_forgotten(back_in_front=self.verify_tokens is not None)
        self.verify_tokens, self.verify_probs = None, []

    def apply_verdict(self, n_accepted: int, next_token: int | None, recovered: bool, path=()) -> VerdictOutcome:
        """Commits the verdict of the in-flight chunk (`recovered`: its next token is a correction;
        `path`: the accepted nodes of a token tree) and says what the drafter needs: nothing, an
        ADVANCE, an ABORT, or to ADOPT the hedge's branch the path went into. Draft statistics count
        the main chain; tree_nodes the branches."""
        spec = self.spec
        chunk = self.verify_tokens or []
        accepted, branch, branch_accepted = spec.tree_outcome(chunk, path) if path else (None, None, 0)
        taken = None
        if branch is not None:  # the drafter's main line differs from the committed tokens from the branch on
            self.stats.tree_hits += 1
            self.draft_fed_len = min(self.draft_fed_len, branch[0])
            taken = BranchTaken(branch, *spec.branch_rest(branch, branch_accepted, next_token))
        else:
            accepted = None
        empty_round, lookup = spec.end_round()  # an empty round's drafts, not the drafter's
        rejected = recovered and (branch is not None or n_accepted < len(chunk))
        self.verify_tokens, self.verify_probs = None, []
        k = len(chunk)
        self.stats.tree_nodes += spec.clear_branches()
        new_tokens = ((chunk or lookup)[:n_accepted] if accepted is None else accepted) + (
            [next_token] if next_token is not None else [])
        old_len = len(self.committed)
        # The target keeps what it was fed but the last token (re-fed next round); a prefill chunk
        # fed only committed[:verify_context_end].
        chunk_end = old_len if self.verify_context_end is None else min(self.verify_context_end, old_len)
        self.target_len = chunk_end + len(new_tokens) - 1
        free, free_accepted = self._forced_in(old_len, k), self._forced_in(old_len, min(n_accepted, k))
        kept = self._commit(new_tokens)
        self._keep_forced()
        n_accepted -= branch_accepted  # of the main chain
        # a hedge's own tokens kept: below a taken branch's root (its key), or a hit's continuation here
        from_hedge = spec.chunk_verified()
        self.stats.hedge_tokens_kept += min(len(kept), max(0, branch_accepted - 1) + min(n_accepted, from_hedge))
        if lookup:
            self.stats.lookup_tokens += len(lookup)
            self.stats.lookup_accepted += min(n_accepted, len(kept))
            n_accepted = 0  # of the drafter's tokens
        if chunk_end == old_len:  # a prefill chunk is not a round: it commits and drafts nothing
            self._count(k, n_accepted, len(kept), rejected, first_of_round=old_len == self.round_start,
                        free=free, free_accepted=min(free_accepted, n_accepted))

        def outcome(action: DraftAction, branch_taken: BranchTaken | None = None) -> VerdictOutcome:
            return VerdictOutcome(tuple(kept), action, branch_taken, drafted=k, looked_up=len(lookup))

        if self.finish_reason is not None or not self.uses_draft:
            return outcome(DraftAction.NONE)
        if rejected or taken is not None:  # a path into a branch leaves the main line too
            self.stats.wasted_draft_tokens += (k - n_accepted) + len(self.drafts)
            return outcome(DraftAction.ABORT) if taken is None else outcome(DraftAction.ADOPT, taken)
        if next_token is not None:  # bonus: keep the speculation past it only if the drafter guessed it
            # The tokens decided past the drafter's verified chunk: the bonus, or everything an empty
            # round committed (its lookup tokens and its next token); the drafts that arrived meanwhile
            # start where they do.
            beyond = kept[k:]
            same = next((i for i, (a, b) in enumerate(zip(self.drafts, beyond)) if a != b),
                        min(len(self.drafts), len(beyond)))  # how many of them the drafts guessed
            if same == len(beyond):
                self.drafts, self.draft_probs = self.drafts[same:], self.draft_probs[same:]
                spec.drafts_decided(same)
                spec.decided(len(self.committed))
                return outcome(DraftAction.ADVANCE)
            if empty_round and same == len(self.drafts) and not self.draft_paused:
                # An empty round beat the restarted drafter's chunks: keep the epoch, and check the
                # next chunk against the tokens decided past these drafts when it comes (decided_prefix).
                self.drafts, self.draft_probs = [], []
                self.forced.clear()
                spec.drafts_dropped()
                spec.unconfirmed(old_len + same)
                spec.decided(len(self.committed))
                return outcome(DraftAction.ADVANCE)
            # The drafter's line parts from the decided tokens where its drafts do: only what it
            # holds before that stands, in its cache and in the hedges it drafted on that prefix
            # (an empty round may have decided several positions the drafter guessed otherwise).
            parted = old_len + k + same
            self.draft_fed_len = min(self.draft_fed_len, parted)
            spec.parted_at(parted)
            self.stats.wasted_draft_tokens += len(self.drafts)
            return outcome(DraftAction.ABORT)
        spec.decided(len(self.committed))
        return outcome(DraftAction.ADVANCE)

    def start_new_epoch(self) -> int:
        """After an abort: drafts are gone (a verdict still in flight is now stale and will be
        dropped); returns where the drafter's cache stops matching the committed prefix."""
        self.epoch += 1
        self.draft_exhausted = False
        self.spec.new_epoch()
        self.drafts, self.draft_probs = [], []
        self.forced.clear()
        self.verify_tokens, self.verify_probs = None, []
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

    def _count(self, k: int, accepted: int, kept: int, rejected: bool, first_of_round: bool,
               free: int = 0, free_accepted: int = 0) -> None:
        """Counts a round that verified k drafts (`free` of them grammar-forced: `free_accepted`
        accepted). The acceptance estimate, which sizes the drafts to come, counts the drafter's own."""
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
        if k > free:
            self.acceptance.observe(accepted - free_accepted, int(rejected))
        if rejected:
            stats.rejections += 1
            if accepted == 0 and first_of_round and self.policy.mode is SpeculationMode.PEARL:
                stats.pre_verify_aborts += 1  # the round's first draft token, checked on its own, was wrong
