"""A sequence's speculation around its main line of drafts (coordinator/scheduling/sequence.py keeps the line
itself: committed tokens, epoch, the drafts in flight): the speculation cache, the token tree riding
in the in-flight verify, the empty round in flight with its looked-up tokens, and what the drafter
has not yet been seen to hold of the tokens such rounds decided (docs/design.md#beyond-one-chain,
docs/design.md#adapting-to-what-pays).

Pure bookkeeping, like Sequence: positions are absolute (committed[i] sits at position i), and the
methods that need the committed length are given it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duospec.coordinator.scheduling.lookup import TextLookup

Key = tuple[int, int]  # (position, token): "the target puts token at position" (draft_worker/hedges.py)
Hedge = tuple[list[int], list[bytes]]  # the drafter's tokens after a key, and their q


@dataclass(frozen=True)
class BranchTaken:
    """A verdict's path went into the branch of hedge `key`: the drafter adopts that branch, and the
    hedge's tokens past the verdict (`drafts`, `probs`) are the next round's drafts."""

    key: Key
    drafts: list[int]
    probs: list[bytes]


@dataclass
class SpeculationState:
    # key -> the hedge drafted after it: this epoch's speculation cache
    hedges: dict[Key, Hedge] = field(default_factory=dict)
    alternatives: dict[int, int] = field(default_factory=dict)  # pos -> the drafter's next-best token there
    # The in-flight verify's token tree past its main chain: node tokens, their parents (indices into
    # main chain + branches; -1 = the context), and for each branch root node its hedge key
    branch_tokens: list[int] = field(default_factory=list)
    branch_parents: list[int] = field(default_factory=list)
    branch_keys: dict[int, Key] = field(default_factory=dict)
    # How many of the sequence's drafts, from the front, a hedge drafted (a cache hit's continuation,
    # or what is left of a taken branch's), and how many of the in-flight chunk: for
    # stats.hedge_tokens_kept
    hedge_drafts: int = 0
    verify_from_hedge: int = 0
    # (epoch, when) a rejection restarted the drafter with nothing cached, until that epoch's first draft
    # arrives: the restart time patience weighs (Patience.first_draft_s)
    restarted: tuple[int, float] | None = None
    # the in-flight item is an empty round: no draft, sent rather than idle for the restarted drafter
    empty_round: bool = False
    # ... and these tokens, found in the sequence's own text, ride in it as drafts (coordinator/scheduling/lookup.py)
    lookup_tokens: list[int] = field(default_factory=list)
    lookup: TextLookup = field(default_factory=TextLookup)
    # The first committed position an empty round decided that the drafter has not yet been seen to
    # hold (its chunk for it has not come, or came short): what it holds there is its own guess, so it
    # is told only the positions before as verified (verified_len).
    unconfirmed_from: int | None = None

    # -- the cache --------------------------------------------------------------------------------
    def add_hedge(self, committed_len: int, pos: int, token: int, start_pos: int, tokens, probs) -> bool:
        """Appends a hedge chunk; False if its key is decided or it does not continue what the cache
        holds for the key."""
        held, held_probs = self.hedges.get((pos, token), ([], []))
        if pos < committed_len or start_pos != pos + 1 + len(held):
            return False
        self.hedges[(pos, token)] = (held + list(tokens), held_probs + list(probs))
        return True

    def hit(self, key: Key) -> Hedge | None:
        """The cached continuation after `key`, or None on a miss."""
        hit = self.hedges.get(key)
        return hit if hit is not None and hit[0] else None

    def add_alternatives(self, start_pos: int, alternatives) -> None:
        self.alternatives.update((start_pos + i, a) for i, a in enumerate(alternatives) if a >= 0)

    def decided(self, committed_len: int) -> None:
        """Hedges and alternatives at committed positions can no longer be hit."""
        if self.hedges:
            self.hedges = {key: hedge for key, hedge in self.hedges.items() if key[0] >= committed_len}
        self.alternatives = {pos: a for pos, a in self.alternatives.items() if pos >= committed_len}

    def parted_at(self, pos: int) -> None:
        """The drafter's line parts from the decided tokens after `pos`: only the hedges it drafted on
        the prefix before stand."""
        self.hedges = {key: hedge for key, hedge in self.hedges.items() if key[0] <= pos}

    def clear_cache(self) -> None:
        self.hedges, self.alternatives = {}, {}

    def new_epoch(self) -> None:
        """A RESET: nothing cached, drafted or decided before stands; it carries the committed tokens."""
        self.unconfirmed_from = None
        self.clear_cache()
        self.hedge_drafts, self.verify_from_hedge = 0, 0
        self.clear_branches()

    # -- the token tree of the in-flight verify -----------------------------------------------------
    def add_branches(self, chain: list[int], first: int, remaining: int,
                     max_nodes: int) -> tuple[list[int], list[int]]:
        """Hangs this epoch's hedges off `chain`, the main chain just taken for verification from
        position `first` (a token tree): a hedge at the position of main-chain draft i (or the bonus
        position after the last) becomes a sibling of that draft, its continuation a chain below it;
        at most `max_nodes` nodes, nearest positions first, none past the `remaining` positions the
        request may still commit. Returns the tree's tokens and parents (no parents: no branch
        fitted, a chain)."""
        self.clear_branches()
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
            if not 0 <= offset <= len(chain) or offset >= remaining or (
                    offset < len(chain) and chain[offset] == token) or len(self.branch_tokens) >= max_nodes:
                continue
            node = len(chain) + len(self.branch_tokens)
            self.branch_keys[node] = (pos, token)
            self.branch_tokens.append(token)
            self.branch_parents.append(offset - 1)
            roots.append((node, offset, tokens))
        for node, offset, tokens in roots:
            room = min(max_nodes - len(self.branch_tokens), remaining - offset - 1)
            for i, token in enumerate(tokens[: max(0, room)]):
                self.branch_parents.append(node if i == 0 else len(chain) + len(self.branch_tokens) - 1)
                self.branch_tokens.append(token)
        if not self.branch_tokens:
            return list(chain), []
        return chain + self.branch_tokens, [*range(-1, len(chain) - 1), *self.branch_parents]

    def tree_outcome(self, chain: list[int], path) -> tuple[list[int], Key | None, int]:
        """A verdict's accepted tokens from its path through the in-flight tree (`chain` its main
        chain), the hedge key of the branch it went into (None: it stayed on the main chain) and how
        many of that branch's nodes it accepted."""
        tokens = chain + self.branch_tokens
        accepted = [tokens[i] for i in path]
        for depth, node in enumerate(path):
            if node in self.branch_keys:
                return accepted, self.branch_keys[node], len(path) - depth
        return accepted, None, 0

    def branch_rest(self, key: Key, branch_accepted: int, next_token: int | None) -> Hedge:
        """After a path into hedge `key`'s branch: the hedge's tokens past the verdict's next token when
        the hedge guessed that token too (the next round's drafts), else none."""
        hedge = self.hedges.get(key)
        rest = hedge[0][branch_accepted - 1:] if hedge else []
        if next_token is None or rest[:1] != [next_token]:
            return [], []
        return rest[1:], hedge[1][branch_accepted:]

    def clear_branches(self) -> int:
        """Drops the in-flight tree; returns how many branch nodes it had."""
        n = len(self.branch_tokens)
        self.branch_tokens, self.branch_parents, self.branch_keys = [], [], {}
        return n

    # -- the hedge-drafted share of the drafts --------------------------------------------------------
    def chunk_taken(self, k: int) -> None:
        """The first `k` drafts went into the in-flight chunk."""
        self.verify_from_hedge = min(k, self.hedge_drafts)
        self.hedge_drafts -= self.verify_from_hedge

    def chunk_forgotten(self, back_in_front: bool) -> None:
        """The in-flight chunk's verdict will not come; `back_in_front`: its tokens went back in front
        of the drafts."""
        if back_in_front:
            self.hedge_drafts += self.verify_from_hedge
        self.verify_from_hedge = 0

    def drafts_adopted(self, n: int) -> None:
        """A new epoch's drafts are `n` tokens of a hedge."""
        self.hedge_drafts = n

    def drafts_decided(self, n: int) -> None:
        """The first `n` drafts were decided (committed as drafted) and leave the drafts."""
        self.hedge_drafts = max(0, self.hedge_drafts - n)

    def drafts_dropped(self) -> None:
        self.hedge_drafts = 0

    def chunk_verified(self) -> int:
        """The in-flight chunk got its verdict: how many of its tokens a hedge drafted."""
        n, self.verify_from_hedge = self.verify_from_hedge, 0
        return n

    # -- the drafter's restart ----------------------------------------------------------------------
    def drafter_restarted(self, epoch: int, at: float) -> None:
        """A rejection restarted the drafter with nothing cached at `at`: its first draft of `epoch` is timed."""
        self.restarted = (epoch, at)

    def first_draft(self, epoch: int) -> float | None:
        """A chunk with drafts of `epoch` arrived: when the drafter restarted for that epoch (timed once),
        or None."""
        if self.restarted is None or epoch != self.restarted[0]:
            return None
        at, self.restarted = self.restarted[1], None
        return at

    # -- empty rounds -----------------------------------------------------------------------------
    def start_round(self, empty: bool) -> None:
        """The in-flight item is an empty round (`empty`) or carries drafts."""
        self.empty_round = empty

    def look_up(self, committed: list[int], k: int) -> list[int]:
        """This empty round's drafts: up to `k` tokens found in the sequence's own text."""
        self.lookup_tokens = self.lookup.propose(committed, k)
        return self.lookup_tokens

    def end_round(self) -> tuple[bool, list[int]]:
        """The in-flight item got its verdict (or never will): whether it was an empty round, and the
        looked-up tokens it verified (an empty round's drafts, not the drafter's)."""
        ended = self.empty_round, self.lookup_tokens
        self.empty_round, self.lookup_tokens = False, []
        return ended

    def unconfirmed(self, pos: int) -> None:
        """An empty round decided positions from `pos` on that the drafter's chunks have not shown it
        to hold (the earliest such position stays)."""
        if self.unconfirmed_from is None:
            self.unconfirmed_from = pos

    def drafter_holds(self, start_pos: int, n: int, committed_len: int) -> None:
        """A current-epoch chunk starting at `start_pos` showed that the drafter holds the committed
        tokens at its first `n` positions (Sequence.decided_prefix)."""
        if self.unconfirmed_from is not None and start_pos <= self.unconfirmed_from < start_pos + n:
            end = start_pos + n
            self.unconfirmed_from = end if end < committed_len else None

    def verified_len(self, committed_len: int) -> int:
        """How much of the committed text the drafter holds as committed: all of it, except after
        empty rounds whose tokens its chunks have not yet confirmed. (Told more, it would count its
        own guess as verified text: an n-gram drafter would teach it to the tenant's pool.)"""
        return committed_len if self.unconfirmed_from is None else self.unconfirmed_from
