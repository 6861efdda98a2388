"""The drafter: per-sequence PEARL state and continuous, batched drafting through a Proposer.

The drafter holds no scheduling policy. Each sequence has a lookahead bound (`draft_until`, an
absolute position) set by the coordinator; every `step()` asks the proposer (draft_worker/proposer.py)
for the next tokens of every sequence below its bound and turns the answers into chunks. A RESET
(abort + rollback) truncates the sequence's tokens and takes effect at the next step. The protocol
is the same whatever proposes the tokens: a model (one token per step), or n-gram matching (several
at once, or nothing: an EXHAUSTED chunk tells the coordinator not to wait). The same step grows the
speculation cache's hedges (draft_worker/hedges.py). A constrained sequence's proposals are masked by
its grammar, and tokens the grammar forces are drafted without asking the proposer
(draft_worker/grammar_masks.py).
"""

from __future__ import annotations

from duospec.draft_worker.grammar_masks import DraftGrammars
from duospec.draft_worker.hedges import HedgeBook, extend, forget_alternatives
from duospec.draft_worker.proposer import DraftState, FeatureStore, Proposer
from duospec.engine.errors import BlocksExhausted, SlotsExhausted
from duospec.internal.features_wire import features_from_proto
from duospec.internal.sampling_wire import sampling_from_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.qcodec import DraftProbs


# Most grammar-forced drafts a sequence holds past its verified prefix, beyond its lookahead (each is
# a target row; a JSON schema's keys and punctuation force runs of 3-10 tokens).
FORCED_AHEAD = 32


class Drafter:
    """Draft state for every live sequence; `apply` commands, then `step` to draft."""

    def __init__(self, proposer: Proposer, *, tokenizer_path: str | None = None, grammar_compilers=None):
        """`tokenizer_path`: the target's checkpoint, whose tokenizer compiles constraints (None: constrained
        sequences draft unmasked); `grammar_compilers`: (end token ids) -> GrammarCompiler instead (tests)."""
        self.proposer = proposer
        self.grammars = DraftGrammars(tokenizer_path, grammar_compilers)
        self.sequences: dict[int, DraftState] = {}
        self.hedges = HedgeBook(proposer)
        self.steps = 0
        self.tokens_drafted = 0
        self.dropped: list[int] = []  # sequences a step released for want of KV blocks (target-only now)

    # -- commands -------------------------------------------------------------------------------
    def apply(self, cmd: pb.DraftCommand) -> None:
        kind = cmd.kind
        if kind == pb.DRAFT_COMMAND_KIND_START:
            self._start(cmd)
        elif kind == pb.DRAFT_COMMAND_KIND_RESET:
            seq = self.sequences.get(cmd.seq_id)
            if seq is None:  # e.g. the drafter restarted: the coordinator sees no chunks and goes on
                return
            if cmd.start_pos > len(seq.tokens):
                raise ValueError(
                    f"sequence {cmd.seq_id}: RESET to position {cmd.start_pos} but only {len(seq.tokens)} are known"
                )
            self._reset(seq, cmd)
        elif kind == pb.DRAFT_COMMAND_KIND_ADVANCE:
            seq = self.sequences.get(cmd.seq_id)
            if seq is not None and cmd.epoch == seq.epoch:
                seq.draft_until = cmd.draft_until
                seq.exhausted = False
                seq.max_hedges = cmd.max_hedges
                self._verified(seq, cmd.committed_len)
        elif kind == pb.DRAFT_COMMAND_KIND_RELEASE:
            self.release(cmd.seq_id)
        elif kind == pb.DRAFT_COMMAND_KIND_FEATURES:
            seq = self.sequences.get(cmd.seq_id)
            if seq is not None and seq.features is not None:  # verified positions: true in every epoch
                seq.features.write(*features_from_proto(cmd.features))
                seq.waiting = False
        else:
            raise ValueError(f"unknown draft command kind {kind}")

    def _reset(self, seq: DraftState, cmd: pb.DraftCommand) -> None:
        """Abort + rollback to `tail` from `start_pos`; with `adopt`, the hedge the verdict hit becomes
        the main line when this drafter holds it with the tokens the coordinator kept."""
        tokens = seq.tokens[: cmd.start_pos] + list(cmd.tail)
        changed_from = min(cmd.start_pos, cmd.adopt.pos) if cmd.HasField("adopt") else cmd.start_pos
        self.grammars.changed(seq.seq_id, changed_from)
        seq.forget_forced(changed_from)
        hedge = self.hedges.take(seq.seq_id, (cmd.adopt.pos, cmd.adopt.token)) if cmd.HasField("adopt") else None
        self.hedges.drop(seq.seq_id)
        shared = _common_prefix(hedge.tokens, tokens) if hedge is not None else 0
        adopted = hedge is not None and shared > cmd.adopt.pos  # it agrees through the hedge's own token
        if adopted:
            self.hedges.adopted += 1
            # Swap states: the sequence continues on the branch's KV; the old main line's is freed.
            seq.proposer_state, hedge.proposer_state = hedge.proposer_state, seq.proposer_state
            self.proposer.close(hedge)
            seq.tokens, seq.alternatives = hedge.tokens, hedge.alternatives
            # Where the branch and the new tokens part is re-fed; at least the last token is fed
            # again, as a RESET's tail always holds one: its logits draft the next position.
            shared = min(shared, len(tokens) - 1)
            self.proposer.rewind(seq, shared)
        else:
            if hedge is not None:
                self.proposer.close(hedge)
            self.proposer.rewind(seq, cmd.start_pos)
        del seq.tokens[cmd.start_pos:]
        seq.tokens.extend(tokens[cmd.start_pos:])
        forget_alternatives(seq, from_pos=shared if adopted else cmd.start_pos)
        seq.epoch = cmd.epoch
        seq.draft_until = cmd.draft_until
        seq.exhausted = False
        seq.max_hedges = cmd.max_hedges
        self._verified(seq, cmd.committed_len or len(seq.tokens))

    def _start(self, cmd: pb.DraftCommand) -> None:
        if cmd.seq_id in self.sequences:
            self.release(cmd.seq_id)
        if not cmd.tail or cmd.start_pos != 0:
            raise ValueError(f"sequence {cmd.seq_id}: START needs the whole prompt (start_pos 0, >= 1 token)")
        seq = DraftState(
            seq_id=cmd.seq_id,
            epoch=cmd.epoch,
            sampling=sampling_from_proto(cmd.sampling),
            tokens=list(cmd.tail),
            committed_len=min(cmd.committed_len or len(cmd.tail), len(cmd.tail)),
            draft_until=cmd.draft_until,
            pool=cmd.pool,
            cache_salt=cmd.cache_salt,
            max_hedges=cmd.max_hedges,
            features=FeatureStore() if self.proposer.method.reads_features else None,
        )
        try:
            self.proposer.open(seq)
        except SlotsExhausted:  # hedges never keep a sequence out: evict them and try once more
            if not self.hedges.live():
                raise  # the loop reports the sequence as failed (it goes on target-only)
            self.hedges.drop_all()
            self.proposer.open(seq)
        self.sequences[cmd.seq_id] = seq
        if cmd.HasField("constraint"):
            self.grammars.open(seq, cmd.constraint)

    def _verified(self, seq: DraftState, committed_len: int) -> None:
        # Only what this drafter holds can be verified text; an old coordinator sends 0 (unknown).
        committed_len = min(committed_len, len(seq.tokens))
        if committed_len > seq.committed_len:
            seq.committed_len = committed_len
            seq.forget_forced(len(seq.tokens))
            self.proposer.observe(seq)
            self.hedges.decided(seq)
            forget_alternatives(seq, below=committed_len)

    def release(self, seq_id: int) -> None:
        self.grammars.release(seq_id)
        self.hedges.drop(seq_id)
        seq = self.sequences.pop(seq_id, None)
        if seq is not None:
            self.proposer.close(seq)

    def drop_drafting(self) -> list[int]:
        """Releases every sequence that was about to draft (after a failed step); returns their ids."""
        ids = [seq_id for seq_id, seq in self.sequences.items() if self._may_draft(seq)]
        self.hedges.drop_all()  # hedges are only ever an optimisation
        for seq_id in ids:
            self.release(seq_id)
        return ids

    def release_all(self) -> None:
        for seq_id in list(self.sequences):
            self.release(seq_id)

    # -- drafting -------------------------------------------------------------------------------
    @staticmethod
    def _may_draft(seq: DraftState) -> bool:
        return not seq.exhausted and not seq.waiting and seq.next_pos < seq.draft_end

    @classmethod
    def _may_hedge(cls, seq: DraftState) -> bool:
        """Hedges grow once the main line is half its lookahead ahead (about the chunk under
        verification and the next one's first token): drafts past that are used only if the whole
        chunk is accepted, a hedge for its first positions about as often, and each costs a row."""
        lead = seq.next_pos - seq.committed_len
        return not cls._may_draft(seq) or 2 * lead >= seq.draft_end - seq.committed_len

    def has_work(self) -> bool:
        return any(self._may_draft(seq) for seq in self.sequences.values()) or self.hedges.has_work(
            seq for seq in self.sequences.values() if self._may_hedge(seq))

    def step(self) -> list[pb.DraftChunk]:
        """Proposes for every sequence below its bound and every growing hedge, in one batch; returns
        one chunk per such sequence (and per hedge that got tokens)."""
        active = [seq for seq in self.sequences.values() if self._may_draft(seq)]
        chunks = []
        limit = self.proposer.max_context
        at_end = [seq for seq in active if limit is not None and seq.next_pos >= limit]
        for seq in at_end:  # the end of the draft model's context: nothing more, never an error
            seq.exhausted = True
            chunks.append(self._chunk(seq, seq.next_pos, [], [], exhausted=True))
        active = [seq for seq in active if not seq.exhausted]
        chunks += self._draft_forced(active, limit)  # sets each constrained sequence's grammar_mask
        active = [seq for seq in active if not seq.exhausted]
        ends = [seq.draft_end if limit is None else min(seq.draft_end, limit) for seq in active]
        budgets = [end - seq.next_pos for seq, end in zip(active, ends)]
        active, budgets = [s for s, b in zip(active, budgets) if b > 0], [b for b in budgets if b > 0]
        hedging = self.hedges.growing([seq for seq in self.sequences.values() if self._may_hedge(seq)])
        for _, hedge, _ in hedging:  # (a hedge copied its parent's fields, its mask included: replaced)
            hedge.grammar_mask = self.grammars.hedge_mask(hedge)
        try:
            if not active and not hedging:
                return chunks
            proposals = self._propose_within_pool(active, budgets, hedging)
        finally:
            for seq in [*self.sequences.values(), *(hedge for _, hedge, _ in hedging)]:
                seq.grammar_mask = None  # for this step only
        for seq, budget, proposal in zip(active, budgets, proposals):
            if proposal.prefilling:  # still reading its prompt: nothing to send, more work next step
                continue
            if proposal.waiting:  # asked again once the target's features for more positions arrive
                seq.waiting = True
                continue
            tokens = proposal.tokens[:budget]
            if seq.sampling.greedy:  # a greedy draft past an illegal token is rejected there anyway
                tokens = tokens[: self.grammars.legal_prefix(seq, tokens)]
            start = seq.next_pos
            extend(seq, tokens, proposal.alternatives)
            seq.tokens_drafted += len(tokens)
            self.tokens_drafted += len(tokens)
            seq.exhausted = proposal.exhausted or not tokens
            chunks.append(self._chunk(seq, start, tokens, proposal.probs[: len(tokens)], seq.exhausted))
        for (key, hedge, budget), proposal in zip(hedging, proposals[len(active):]):
            start = hedge.next_pos
            if tokens := self.hedges.grew(hedge, proposal, budget):
                chunks.append(self._chunk(hedge, start, tokens, proposal.probs[: len(tokens)], False, hedge=key))
        self.steps += 1
        return chunks

    def _draft_forced(self, active: list[DraftState], limit: int | None) -> list[pb.DraftChunk]:
        """Tokens the grammar forces, drafted at no model cost (q: the point mass) and marked so: they
        push the sequence's `draft_end` out by as many, so the proposer's budget stays what it was. At
        most FORCED_AHEAD past the verified prefix (a grammar may force a long string, and each
        costs the target a row), and never past the proposer's context `limit`. Each sequence's
        `grammar_mask` is then the mask its proposer drafts the next token with; a sequence whose
        grammar has ended (an end token drafted) is exhausted: nothing after it could be accepted."""
        chunks = []
        for seq in active:
            room = FORCED_AHEAD - seq.forced_ahead
            if limit is not None:
                room = min(room, limit - seq.next_pos)
            forced, seq.grammar_mask = self.grammars.forced(seq, max(room, 0))
            seq.exhausted = self.grammars.ended(seq)
            if not forced and not seq.exhausted:
                continue
            start = seq.next_pos
            extend(seq, forced, [])
            seq.forced.extend(range(start, start + len(forced)))
            seq.tokens_drafted += len(forced)
            self.tokens_drafted += len(forced)
            probs = [] if seq.sampling.greedy else [DraftProbs([t], [1.0]) for t in forced]
            chunks.append(self._chunk(seq, start, forced, probs, seq.exhausted, forced=bool(forced)))
        return chunks

    def _propose_within_pool(self, active: list[DraftState], budgets: list[int], hedging: list) -> list:
        """The proposer's answers for `active` and then the hedges. When the KV pool cannot hold the
        step, the hedges go first, then the newest sequences (released; `dropped` names them), until
        the rest fits; the lists shrink in place."""
        while active or hedging:
            try:
                return self.proposer.propose(active + [h for _, h, _ in hedging],
                                             budgets + [budget for _, _, budget in hedging])
            except BlocksExhausted:  # raised before anything changed
                if hedging:
                    self.hedges.drop_all()
                    hedging.clear()
                    continue
                victim = active.pop()
                budgets.pop()
                self.release(victim.seq_id)
                self.dropped.append(victim.seq_id)
        return []

    @staticmethod
    def _chunk(seq: DraftState, start: int, tokens, probs, exhausted: bool, hedge=None,
               forced: bool = False) -> pb.DraftChunk:
        alternatives = [seq.alternatives.get(start + i, (-1,))[0] for i in range(len(tokens))]
        return pb.DraftChunk(
            alternatives=alternatives if hedge is None and any(a >= 0 for a in alternatives) else [],
            seq_id=seq.seq_id,
            epoch=seq.epoch,
            start_pos=start,
            tokens=tokens,
            draft_probs=[q.to_bytes() for q in probs],
            outlook=pb.DRAFT_OUTLOOK_EXHAUSTED if exhausted else pb.DRAFT_OUTLOOK_MORE,
            hedge=pb.HedgeKey(pos=hedge[0], token=hedge[1]) if hedge is not None else None,
            forced=forced,
        )

    def stats(self) -> dict:
        return {
            "method": self.proposer.method.value,
            "live_sequences": len(self.sequences),
            "steps": self.steps,
            "tokens_drafted": self.tokens_drafted,
            **self.hedges.stats(),
            **self.grammars.stats(),
            **self.proposer.stats(),
        }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
