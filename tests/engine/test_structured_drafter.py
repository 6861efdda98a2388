"""The drafter's grammar masks on the toy vocabulary, with a model proposer over the fake model (which
ignores the grammar): constrained drafts are legal, greedy and sampled (a sampled draft's q is the
masked q it was drawn from), tokens the grammar forces go out as their own chunk with q the point
mass, and a RESET to other tokens leaves the matcher following the new ones."""

from __future__ import annotations

import pytest

from duospec.draft_worker.drafter import Drafter
from duospec.draft_worker.model_proposer import ModelProposer
from duospec.internal.constraint_wire import constraint_to_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.qcodec import DraftProbs
from duospec.structured import Constraint, ConstraintKind, GrammarCompiler
from duospec.structured.backend import allocate_bitmask, allowed_tokens
from structured_support import EOS, TOY_IDS, TOY_TOKENS, FakeRunner, toy_backend

VOCAB = len(TOY_TOKENS)
PROMPT = [TOY_IDS["x"], TOY_IDS["a"], TOY_IDS["c"]]
BRACES = Constraint(ConstraintKind.REGEX, "\\{(a|bc?)*\\}")
COMPILER = GrammarCompiler(toy_backend())


class CountingRunner(FakeRunner):
    forwards = 0

    def _forward(self, chunks, **kwargs):
        self.forwards += 1
        return super()._forward(chunks, **kwargs)


def _drafter(runner=None):
    return Drafter(ModelProposer(runner or FakeRunner()), grammar_compilers=lambda ends: COMPILER)


def _start(drafter, *, constraint=BRACES, sampling=None, lookahead=10, seq_id=1):
    drafter.apply(pb.DraftCommand(
        seq_id=seq_id, kind=pb.DRAFT_COMMAND_KIND_START, tail=PROMPT, draft_until=len(PROMPT) + lookahead,
        committed_len=len(PROMPT), sampling=sampling or pb.Sampling(),
        constraint=constraint_to_proto(constraint, len(PROMPT), [EOS]) if constraint else None))


def _drain(drafter, steps=30):
    chunks = []
    for _ in range(steps):
        if not drafter.has_work():
            break
        chunks += drafter.step()
    return chunks


def _legal_after(tokens, constraint=BRACES):
    matcher = COMPILER.compile(constraint).matcher()
    assert matcher.accept_tokens(tokens) == len(tokens), f"{tokens} leave the grammar"
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    return allowed_tokens(bitmask[0], VOCAB)


def _drafted(drafter, seq_id=1):
    return drafter.sequences[seq_id].tokens[len(PROMPT):]


def test_unmasked_drafts_of_the_fake_model_leave_the_grammar():
    """What the masks are for: without them the same drafter proposes illegal tokens."""
    drafter = _drafter()
    _start(drafter, constraint=None)
    _drain(drafter)
    with pytest.raises(AssertionError, match="leave the grammar"):
        _legal_after(_drafted(drafter))


def test_greedy_drafts_are_legal_and_forced_tokens_cost_no_model_step():
    runner = CountingRunner()
    drafter = _drafter(runner)
    _start(drafter, lookahead=3)
    first = drafter.step()
    # "{" is the only legal first token: its own chunk, marked forced, before the proposer's first token
    assert [list(c.tokens) for c in first][0] == [TOY_IDS["{"]] and first[0].start_pos == len(PROMPT)
    assert first[0].forced and not first[1].forced
    assert first[1].start_pos == len(PROMPT) + 1 and runner.forwards == 1
    chunks = first + _drain(drafter)
    drafted = _drafted(drafter)
    _legal_after(drafted)
    forced = [c for c in chunks if c.forced]
    for chunk in forced:  # each forced token was the only legal one after what came before it
        for i, token in enumerate(chunk.tokens):
            assert _legal_after(drafted[: chunk.start_pos - len(PROMPT) + i]) == [token]
    # the lookahead (3) counts the model's drafts: the forced ones push the bound out by as many
    n_forced = sum(len(c.tokens) for c in forced)
    assert n_forced == drafter.grammars.forced_tokens >= 1
    assert len(drafted) == 3 + n_forced and runner.forwards == 3  # one forward per model draft


def test_a_sequence_whose_grammar_ended_drafts_no_further():
    """Past the grammar's end token nothing can be accepted: the drafter stops there (an EXHAUSTED
    chunk) instead of drafting to its bound."""
    drafter = _drafter()
    _start(drafter, lookahead=30)
    chunks = _drain(drafter)
    drafted = _drafted(drafter)
    assert drafted[-1] == EOS and EOS not in drafted[:-1] and len(drafted) < 30
    assert chunks[-1].outlook == pb.DRAFT_OUTLOOK_EXHAUSTED and not drafter.has_work()
    _legal_after(drafted[:-1])


def test_sampled_drafts_send_the_masked_q_they_were_drawn_from():
    drafter = _drafter()
    _start(drafter, sampling=pb.Sampling(temperature=1.0, seed=11))
    chunks = _drain(drafter)
    drafted = _drafted(drafter)
    _legal_after(drafted)
    for chunk in chunks:
        for i, (token, raw) in enumerate(zip(chunk.tokens, chunk.draft_probs)):
            q = DraftProbs.from_bytes(raw)
            support = set(int(t) for t in q.token_ids)
            before = drafted[: chunk.start_pos - len(PROMPT) + i]
            assert token in support and support <= set(_legal_after(before))
    assert any(len(c.draft_probs) == len(c.tokens) for c in chunks)


def test_a_reset_to_other_tokens_is_followed():
    drafter = _drafter()
    _start(drafter)
    _drain(drafter)
    # the target committed "{", "b", then corrected with "c": abort, roll back, go on from there
    tail = [TOY_IDS["{"], TOY_IDS["b"], TOY_IDS["c"]]
    drafter.apply(pb.DraftCommand(seq_id=1, epoch=1, kind=pb.DRAFT_COMMAND_KIND_RESET, start_pos=len(PROMPT),
                                  tail=tail, draft_until=len(PROMPT) + 9, committed_len=len(PROMPT) + 3))
    _drain(drafter)
    drafted = _drafted(drafter)
    assert drafted[:3] == tail and len(drafted) == 9
    _legal_after(drafted)


def test_greedy_proposals_of_any_proposer_are_cut_before_an_illegal_token():
    from duospec.draft_worker.proposer import DraftMethod, Proposal, Proposer

    class Fixed(Proposer):
        method = DraftMethod.NGRAM

        def propose(self, seqs, budgets):
            return [Proposal([TOY_IDS["a"], TOY_IDS["b"], TOY_IDS["x"], TOY_IDS["a"]], exhausted=True) for _ in seqs]

    drafter = Drafter(Fixed(), grammar_compilers=lambda ends: COMPILER)
    _start(drafter, constraint=Constraint(ConstraintKind.REGEX, "[ab]+"))  # nothing forced at the start
    chunks = drafter.step()
    assert [list(c.tokens) for c in chunks] == [[TOY_IDS["a"], TOY_IDS["b"]]]
    assert drafter.grammars.cut_tokens == 2


def test_a_draft_vocabulary_without_a_legal_token_drafts_unmasked():
    """A drafter whose logits are -inf outside a draft vocabulary (EAGLE-3) that holds no legal token
    drafts that position unmasked instead of failing; sampled too (q from the raw logits)."""
    import torch

    class NarrowRunner(FakeRunner):
        def _forward(self, chunks, **kwargs):
            out = super()._forward(chunks, **kwargs)
            narrow = lambda rows: torch.where(torch.arange(VOCAB) == TOY_IDS["x"], rows, float("-inf"))  # noqa: E731
            return narrow(out) if torch.is_tensor(out) else [narrow(rows) for rows in out]

    for sampling in (pb.Sampling(), pb.Sampling(temperature=1.0, seed=4)):
        drafter = _drafter(NarrowRunner())
        _start(drafter, constraint=Constraint(ConstraintKind.REGEX, "[ab]+"), sampling=sampling, lookahead=3)
        chunks = _drain(drafter)
        drafted = _drafted(drafter)
        if sampling.temperature:  # sampled drafts are never cut: the illegal "x" goes to the target
            assert drafted and set(drafted) == {TOY_IDS["x"]}
        else:  # greedy: cut before it, nothing to send
            assert drafted == [] and chunks and all(c.outlook == pb.DRAFT_OUTLOOK_EXHAUSTED for c in chunks)


def test_a_reset_that_keeps_an_illegal_token_drafts_unmasked_until_a_reset_removes_it():
    """A RESET's tail may keep a hedge's drafts, and hedges draft unmasked: past an illegal token the
    sequence drafts unmasked (the target corrects it); once a RESET removes it, masks come back."""
    drafter = _drafter()
    _start(drafter)
    _drain(drafter)
    t = TOY_IDS
    drafter.apply(pb.DraftCommand(seq_id=1, epoch=1, kind=pb.DRAFT_COMMAND_KIND_RESET, start_pos=len(PROMPT),
                                  tail=[t["{"], t["x"]], draft_until=len(PROMPT) + 6, committed_len=len(PROMPT) + 1))
    _drain(drafter)
    assert len(_drafted(drafter)) == 6 and drafter.grammars.unmasked_steps > 0
    drafter.apply(pb.DraftCommand(seq_id=1, epoch=2, kind=pb.DRAFT_COMMAND_KIND_RESET, start_pos=len(PROMPT) + 1,
                                  tail=[t["a"]], draft_until=len(PROMPT) + 10, committed_len=len(PROMPT) + 2))
    _drain(drafter)
    drafted = _drafted(drafter)
    assert drafted[:2] == [t["{"], t["a"]] and drafted[-1] == EOS  # masked again, to the grammar's end
    _legal_after(drafted[:-1])


def test_hedges_of_the_speculation_cache_draft_legal_tokens_too():
    drafter = _drafter()
    drafter.apply(pb.DraftCommand(
        seq_id=1, kind=pb.DRAFT_COMMAND_KIND_START, tail=PROMPT, draft_until=len(PROMPT) + 8,
        committed_len=len(PROMPT), max_hedges=4, constraint=constraint_to_proto(BRACES, len(PROMPT), [EOS])))
    chunks = _drain(drafter)
    hedges = list(drafter.hedges._hedges.get(1, {}).values())
    assert hedges and any(c.HasField("hedge") and c.tokens for c in chunks)
    for hedge in hedges:  # key tokens are masked runners-up, and what the hedge drafted after them is masked
        _legal_after(hedge.tokens[len(PROMPT):])


def test_a_grammar_still_compiling_drafts_unmasked_meanwhile_then_masked():
    """A constraint that compiles slowly holds up no draft: the sequence drafts unmasked meanwhile, and
    once compiled its matcher follows what was drafted and masks from there (or, where an unmasked
    draft left the grammar, waits for the RESET that removes it, as any illegal token)."""
    import threading

    gate = threading.Event()

    class Gated:
        inner = toy_backend()
        key = inner.key

        def compile(self, constraint):
            assert gate.wait(30)
            return self.inner.compile(constraint)

    compiler = GrammarCompiler(Gated())
    drafter = Drafter(ModelProposer(FakeRunner()), grammar_compilers=lambda ends: compiler)
    _start(drafter, lookahead=4)
    _drain(drafter)
    assert len(_drafted(drafter)) == 4 and drafter.grammars.forced_tokens == 0  # drafted, unmasked
    with pytest.raises(AssertionError, match="leave the grammar"):
        _legal_after(_drafted(drafter))  # the fake model's own choice: illegal here
    gate.set()
    compiler.prepare(BRACES, wait_s=30)  # the compile is done
    drafter.apply(pb.DraftCommand(seq_id=1, epoch=1, kind=pb.DRAFT_COMMAND_KIND_RESET, start_pos=len(PROMPT),
                                  tail=[], draft_until=len(PROMPT) + 4, committed_len=len(PROMPT)))
    _drain(drafter)
    assert drafter.grammars.forced_tokens >= 1  # "{" forced: the matcher is open now
    _legal_after(_drafted(drafter))
