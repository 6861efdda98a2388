"""What goes to the target for each chosen sequence: its verify item (drafts, a token tree, the bonus
policy, logprobs) and, for a long prompt, a prefill chunk within the batch's prompt budget.

`VerifyBatchBuilder` takes the chosen sequences and the budget and gives back the items and the
sequences deferred to a later round. What it asks of the scheduler's adaptive state (the draft limit,
the lookup length, whether a sequence may verify without drafts) comes in as three callables.
"""

from __future__ import annotations

from typing import Callable

from duospec.coordinator.api import SpeculationMode
from duospec.coordinator.scheduling.draft_commands import max_hedges
from duospec.coordinator.scheduling.kv_budget import cache_salt
from duospec.coordinator.scheduling.sequence import Sequence
from duospec.internal.constraint_wire import constraint_to_proto
from duospec.internal.sampling_wire import sampling_to_proto
from duospec.internal.v1 import pearl_pb2 as pb

MIN_PREFILL_CHUNK = 16  # a smaller leftover of a batch's prompt budget waits for the next round
# A prefill chunk also carries this many prompt tokens past its budget: the target feeds them only as
# far as its prefix cache holds them (VerifyItem.max_compute), so a cached prompt takes a round, not one
# per budget's worth; bounded, so a long uncached prompt does not travel whole with every chunk.
CACHE_PROBE_TOKENS = 4096


class VerifyBatchBuilder:
    def __init__(self, max_context: int, prefix_cache: str, *, draft_limit: Callable[[Sequence], int],
                 lookup_length: Callable[[Sequence], int], may_verify_without_drafts: Callable[[Sequence], bool]):
        self._max_context = max_context
        self._prefix_cache = prefix_cache
        self._draft_limit = draft_limit  # most drafts to verify for a sequence now
        self._lookup_length = lookup_length  # most looked-up tokens an empty round verifies
        self._may_verify_without_drafts = may_verify_without_drafts  # an empty round may go now

    def build(self, chosen: list[Sequence], budget: int) -> tuple[list[pb.VerifyItem], list[Sequence]]:
        """One item per chosen sequence, and the sequences deferred. Prompt tokens over the whole batch
        stay within `budget`: a sequence whose prefill does not fit is deferred to the next round."""
        items, deferred = [], []
        for seq in chosen:
            pending = len(seq.committed) - seq.target_len  # 1 while decoding; more to (re-)prefill
            if pending > 1 and budget < min(pending, MIN_PREFILL_CHUNK) and items:
                deferred.append(seq)
                continue
            items.append(self._verify_item(seq, context_limit=max(1, budget) if pending > 1 else pending))
            budget -= item_rows(items[-1]) - len(items[-1].draft_tokens) if pending > 1 else 0
        return items, deferred

    def _verify_item(self, seq: Sequence, context_limit: int) -> pb.VerifyItem:
        if len(seq.committed) - seq.target_len > context_limit:  # a prefill chunk: no draft, no token
            seq.take_verify_chunk(0)
            # where the chunk ends unless the target's prefix cache feeds more (Verdict.context_fed)
            seq.verify_context_end = seq.target_len + context_limit
            return pb.VerifyItem(seq_id=seq.seq_id, epoch=seq.epoch, start_pos=seq.target_len,
                                 context=seq.committed[seq.target_len: seq.verify_context_end + CACHE_PROBE_TOKENS],
                                 max_compute=context_limit,
                                 sampling=sampling_to_proto(seq.request.sampling), bonus=pb.BONUS_POLICY_SKIP,
                                 features=wants_features(seq), cache_salt=self._item_salt(seq),
                                 constraint=_item_constraint(seq))
        seq.verify_context_end = None
        # the cap counts the drafter's own drafts: grammar-forced ones ride along (Sequence.verify_span)
        k = seq.verify_span(self._draft_limit(seq)) if seq.uses_draft else 0
        # Past an exhausted chunk no draft will come: the bonus is the only way on. Which positions
        # those are depends on the sequence's tokens alone (draft_worker/proposer.py), not on timing.
        drafting = seq.uses_draft and not (seq.draft_exhausted and k == len(seq.drafts))
        bonus = pb.BONUS_POLICY_SKIP if self._prefill_only(seq, k) else seq.policy.bonus(seq.greedy, drafting)
        tokens, probs = seq.take_verify_chunk(k)
        # an empty round (Scheduler._may_verify_without_drafts): its bonus keeps the drafter's epoch
        spec = seq.spec
        spec.start_round(empty=not tokens and self._may_verify_without_drafts(seq))
        if spec.empty_round and seq.policy.lookup and bonus != pb.BONUS_POLICY_SKIP:
            # (not in a prompt's prefill round, which leaves the next token to the drafter's first
            # draft). A head drafter gets the features of what the round commits like any verdict's:
            # its rows re-read them, or a RESET brings it to the committed tokens.
            tokens = spec.look_up(seq.committed, self._lookup_length(seq))
        parents: list[int] = []
        # A tree's nodes sit at their depth's position but take one KV row each after the main chain:
        # near the end of the context only as many branch nodes as rows are left.
        kv_room = self._max_context - len(seq.committed) - len(tokens)
        if tokens and not spec.empty_round and seq.greedy and seq.policy.tree_nodes and max_hedges(seq) \
                and kv_room > 0:
            tokens, parents = seq.add_branches(min(seq.policy.tree_nodes, kv_room))  # hedges ride along as a tree
        return pb.VerifyItem(
            seq_id=seq.seq_id,
            epoch=seq.epoch,
            start_pos=seq.target_len,
            context=seq.committed[seq.target_len :],
            draft_tokens=tokens,
            draft_probs=probs if not seq.greedy else [],
            sampling=sampling_to_proto(seq.request.sampling),
            bonus=bonus,
            draft_parents=parents,
            logprobs=seq.request.logprobs is not None,
            top_logprobs=seq.request.logprobs or 0,
            features=wants_features(seq),
            cache_salt=self._item_salt(seq),
            constraint=_item_constraint(seq),
        )

    def _item_salt(self, seq: Sequence) -> str:
        """The prefix-cache salt, on the item that opens the sequence on the target (start_pos 0)."""
        return cache_salt(self._prefix_cache, seq.request.tenant) if seq.target_len == 0 else ""

    def _prefill_only(self, seq: Sequence, k: int) -> bool:
        """A pearl sequence whose prompt goes to the target before any draft exists: prefill without
        taking a token, so the drafter's first token is pre-verified as usual (and its work is kept).
        A head drafter (EAGLE, Medusa) needs the prompt's hidden states first, in vanilla too."""
        return (
            k == 0
            and seq.uses_draft
            and (seq.policy.mode is SpeculationMode.PEARL or seq.needs_features)
            and self._draft_limit(seq) > 0
            and seq.target_len < len(seq.committed) - 1
        )


def _item_constraint(seq: Sequence) -> pb.GrammarConstraint | None:
    """The constraint, on every item that (re)opens a constrained sequence on the target (start_pos 0:
    its first item, or a re-prefill after the target lost it); the target keeps the matcher after."""
    constraint = seq.request.constraint
    if constraint is None or seq.target_len != 0:
        return None
    return constraint_to_proto(constraint, seq.request.output_start, seq.eos_token_ids)


def wants_features(seq: Sequence) -> bool:
    """Whether the target returns the hidden states of `seq`'s tokens, for its head drafter."""
    # also while target-only by the guard: the drafter stays current for when speculation resumes
    return seq.needs_features and seq.draft_started and seq.draft_alive


def fed_to(seq: Sequence, verdict: pb.Verdict) -> None:
    """A prefill chunk the target fed past its budget from its prefix cache ends where it says."""
    if verdict.context_fed:
        seq.verify_context_end = seq.target_len + verdict.context_fed


def item_rows(item: pb.VerifyItem) -> int:
    """The target rows an item may cost: its drafts and the context it may compute (a prefill chunk's
    budget, not the cache probe it carries past it)."""
    return min(len(item.context), item.max_compute or len(item.context)) + len(item.draft_tokens)
