"""Model-free drafting: continue the sequence the way its own text, or its tenant's, continued before.

For each drafting sequence the proposer takes the longest suffix (at most `max_ngram` tokens, at
least `min_ngram`) that occurred earlier — in the sequence itself (prompt + verified output), or in
the recent finished sequences of the *same tenant* — and proposes the token that most often followed
it (ties: the latest). It then repeats on the extended sequence, up to the step's budget: one step
proposes a whole chain. With no match it proposes nothing and says so (EXHAUSTED), so the target
goes on without waiting; the next verified token may produce a match.

Two indexes (draft_worker/suffix_trie.py): one per sequence over every token it holds (the RESET of
an abort removes the rejected ones again), and one per tenant pool over the verified text of its
recent finished sequences, bounded to `pool_tokens` positions (oldest sequences evicted first) and to
`max_pools` tenants (least recently used evicted). A pool is keyed by the tenant the coordinator
names in START; another tenant's text is never consulted.

Timing independence: the sequence's own index always mirrors exactly the tokens before the position
being proposed, so a proposal (and "no proposal": EXHAUSTED) is a function of the sequence's prefix
alone, however the steps and commands interleave (for sampled requests ties between equally frequent
continuations go to the lowest token id: an abort's rollback restores counts exactly but not
recency). That is what lets the coordinator sample a bonus
token after an exhausted chunk without making seeded output depend on timing. The tenant pool
changes as other requests finish, so sampled requests do not consult it (greedy output is the
target's whatever is proposed).

Exactness with sampling: the proposal x is deterministic, so its q is the point mass at x. The verify
rule then accepts x with probability min(1, p(x)/1) = p(x) and on rejection samples from
norm(max(0, p - q)) = p without x, renormalised; x comes out with probability p(x) and any y != x with
(1 - p(x)) * p(y) / (1 - p(x)) = p(y). The output is distributed as p, as for any q.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from duospec.draft_worker.proposer import DraftMethod, DraftState, NgramOptions, Proposal, Proposer
from duospec.draft_worker.suffix_trie import SuffixTrie, most_frequent
from duospec.qcodec import DraftProbs


@dataclass
class _SeqIndex:
    trie: SuffixTrie
    indexed: int = 0  # tokens[:indexed] are in the trie


@dataclass
class _Pool:
    """One tenant's recent verified text."""

    trie: SuffixTrie
    entries: OrderedDict = field(default_factory=OrderedDict)  # seq_id -> tokens, oldest first
    tokens: int = 0


class NgramProposer(Proposer):
    method = DraftMethod.NGRAM

    def __init__(self, options: NgramOptions):
        self.options = options
        self.pools: OrderedDict[str, _Pool] = OrderedDict()  # least recently used first
        self.proposals = 0
        self.matched = 0

    # -- lifecycle --------------------------------------------------------------------------------
    def open(self, seq: DraftState) -> None:
        seq.proposer_state = _SeqIndex(SuffixTrie(self.options.max_ngram))

    def rewind(self, seq: DraftState, length: int) -> None:
        index: _SeqIndex = seq.proposer_state
        for pos in range(index.indexed - 1, length - 1, -1):
            index.trie.remove(seq.tokens, pos)
        index.indexed = min(index.indexed, length)

    def _sync(self, seq: DraftState) -> _SeqIndex:
        index: _SeqIndex = seq.proposer_state
        index.trie.extend(seq.tokens, index.indexed)
        index.indexed = len(seq.tokens)
        return index

    def close(self, seq: DraftState) -> None:
        index: _SeqIndex | None = seq.proposer_state
        seq.proposer_state = None
        if index is None or not seq.pool or self.options.pool != "tenant":
            return
        self._add_to_pool(seq.pool, seq.seq_id, seq.tokens[: seq.committed_len])

    def _add_to_pool(self, key: str, entry_id: int, tokens: list[int]) -> None:
        tokens = tokens[-self.options.pool_tokens :]  # one long text alone never exceeds the bound
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = _Pool(SuffixTrie(self.options.max_ngram))
            while len(self.pools) > self.options.max_pools:
                self.pools.popitem(last=False)
        self.pools.move_to_end(key)
        pool.trie.extend(tokens)
        pool.entries[entry_id] = tokens
        pool.tokens += len(tokens)
        while pool.tokens > self.options.pool_tokens:
            _, old = pool.entries.popitem(last=False)
            for pos in range(1, len(old)):
                pool.trie.remove(old, pos)
            pool.tokens -= len(old)

    # -- proposing --------------------------------------------------------------------------------
    def propose(self, seqs: list[DraftState], budgets: list[int]) -> list[Proposal]:
        return [self._propose_one(seq, min(budget, self.options.max_proposal)) for seq, budget in zip(seqs, budgets)]

    def _propose_one(self, seq: DraftState, budget: int) -> Proposal:
        index = self._sync(seq)
        use_pool = seq.pool and self.options.pool == "tenant" and seq.sampling.greedy
        pool = self.pools.get(seq.pool) if use_pool else None
        context = seq.tokens[-self.options.max_ngram :]  # a copy of the tail: only that is matched
        tokens: list[int] = []
        while len(tokens) < budget:
            token = self._next_token(context, index.trie, pool.trie if pool is not None else None,
                                     by_recency=seq.sampling.greedy)
            if token is None:
                break
            tokens.append(token)
            context.append(token)
            index.trie.add(context, len(context) - 1)  # the next proposal sees this one, as a later step would
            index.indexed += 1
        self.proposals += 1
        self.matched += bool(tokens)
        probs = [] if seq.sampling.greedy else [DraftProbs([t], [1.0]) for t in tokens]  # q = point mass
        # Fewer than the budget means the match ran out: nothing more until the sequence changes.
        return Proposal(tokens, probs, exhausted=len(tokens) < budget)

    def _next_token(self, context: list[int], own: SuffixTrie, pool: SuffixTrie | None,
                    by_recency: bool) -> int | None:
        min_n = self.options.min_ngram
        depth, table = own.longest_match(context, min_n)
        if pool is not None:
            pool_depth, pool_table = pool.longest_match(context, min_n)
            if pool_depth > depth:  # the longer context predicts better; the sequence's own wins ties
                depth, table = pool_depth, pool_table
        return most_frequent(table, by_recency=by_recency) if depth else None

    def stats(self) -> dict:
        return {
            "proposals": self.proposals,
            "match_rate": self.matched / self.proposals if self.proposals else 0.0,
            "pools": len(self.pools),
            "pool_tokens": sum(p.tokens for p in self.pools.values()),
        }
