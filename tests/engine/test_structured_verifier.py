"""The target's grammar masks, through the real Verifier on a deterministic fake model over a toy
vocabulary: whatever the drafter proposes (unmasked, masked, adversarial, random, forced, the
reference itself) and however the rounds are cut (drafts per round, skipped bonuses, a coordinator
that re-sends from an earlier position after an abort), greedy output is token for token the masked
target alone, and the authoritative matcher holds exactly the committed output."""

from __future__ import annotations

import random

import pytest
import torch

from duospec.internal.constraint_wire import constraint_to_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.structured import Constraint, ConstraintKind, GrammarCompiler
from duospec.structured.backend import allocate_bitmask, allowed_tokens
from duospec.target_worker.verifier import Verifier
from structured_support import EOS, TOY_IDS, TOY_TOKENS, FakeRunner, fake_logits, toy_backend

VOCAB = len(TOY_TOKENS)
PROMPT = [TOY_IDS["x"], TOY_IDS["a"], TOY_IDS["c"]]
GRAMMARS = {
    "finite": Constraint(ConstraintKind.REGEX, "(ab|ba|aa)c?"),
    "braces": Constraint(ConstraintKind.REGEX, "\\{(a|bc?)*\\}"),
    "lark": Constraint(ConstraintKind.GRAMMAR, 'start: "{" item* "}"\nitem: "a" | "b" "c" | "x" start'),
}
# The toy vocabulary has no "z": once the target has taken "a" (here the masked argmax) nothing is legal
DEAD_ENDS = {
    "dead_after_one": Constraint(ConstraintKind.REGEX, "(a|b)z"),
    "dead_after_two": Constraint(ConstraintKind.REGEX, "ab?z|b"),
}
COMPILER = GrammarCompiler(toy_backend())


def _verifier(batched: bool = False) -> Verifier:
    """batched: the batched tensor rule (duospec/verify/batch.py, what a GPU runs) instead of the
    reference item by item; both read the same masked logits."""
    return Verifier(FakeRunner(), grammar_compilers=lambda ends: COMPILER, batched=batched)


def _legal(matcher) -> list[int]:
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    return allowed_tokens(bitmask[0], VOCAB)


def _replay(constraint, output):
    matcher = COMPILER.compile(constraint).matcher()
    assert matcher.accept_tokens(output) == len(output), "a committed token is illegal"
    return matcher


def reference(constraint, max_new: int) -> list[int]:
    """Masked target-alone greedy decoding, written independently of the verifier. It stops at a dead
    end (no legal token)."""
    matcher, out = COMPILER.compile(constraint).matcher(), []
    while len(out) < max_new:
        logits = fake_logits(PROMPT + out).clone()
        legal = _legal(matcher)
        if not legal or matcher.is_dead_end():
            break
        masked = torch.full_like(logits, float("-inf"))
        masked[legal] = logits[legal]
        token = int(masked.argmax())
        out.append(token)
        matcher.accept_tokens([token])
        if token == EOS:
            break
    return out


# ---- drafters: (constraint, committed output, k, rng) -> k draft tokens --------------------------------

def unmasked(constraint, output, k, rng):
    """A fake draft model that ignores the grammar: the argmax of other logits."""
    drafts = []
    for _ in range(k):
        drafts.append(int(fake_logits([TOY_IDS["b"], *PROMPT, *output, *drafts]).argmax()))
    return drafts


def masked(constraint, output, k, rng):
    """A drafter that masks its own proposals: always legal, often not the target's choice."""
    matcher, drafts = _replay(constraint, output), []
    for _ in range(k):
        legal = _legal(matcher)
        if not legal or matcher.is_dead_end():  # nothing to propose
            break
        logits = fake_logits([TOY_IDS["b"], *PROMPT, *output, *drafts])
        token = max(legal, key=lambda t: float(logits[t]))
        drafts.append(token)
        matcher.accept_tokens([token])
    return drafts


def adversarial(constraint, output, k, rng):
    """Always an illegal token where one exists (each draft after the first illegal one is anything)."""
    illegal = sorted(set(range(VOCAB)) - set(_legal(_replay(constraint, output))))
    return [rng.choice(illegal or list(range(VOCAB))) for _ in range(k)]


def uniform_random(constraint, output, k, rng):
    return [rng.randrange(VOCAB) for _ in range(k)]


def forced(constraint, output, k, rng):
    """Where the grammar allows one token only, that token (what item 4's drafter sends for free)."""
    matcher, drafts = _replay(constraint, output), []
    for _ in range(k):
        token = matcher.forced_token(VOCAB)
        if matcher.is_dead_end():  # nothing to propose
            break
        token = token if token is not None else rng.choice(_legal(matcher))
        drafts.append(token)
        matcher.accept_tokens([token])
    return drafts


def oracle(constraint, output, k, rng):
    """The reference's own continuation: every draft accepted, bonus tokens on the grammar's edge."""
    want = reference(constraint, len(output) + k)
    return want[len(output):len(output) + k]


DRAFTERS = [unmasked, masked, adversarial, uniform_random, forced, oracle]


def drive(verifier, constraint, drafter, rng, *, max_new: int, max_drafts: int = 4, seq_id: int = 1,
          rewind: bool = True) -> tuple[list[int], list[int], bool]:
    """What the coordinator does for one sequence: items from the committed tokens, verdicts applied.
    max_drafts 0 is mode off; `rewind`: now and then re-send from an earlier position (as after an
    abort whose verdict was dropped), which rolls the target's slot and matcher back. Returns the
    output as a client sees it (cut at max_new or the end token), everything committed, and whether
    the grammar reached a dead end."""
    committed, target_len, batch_id, dead_end = list(PROMPT), 0, 0, False
    while len(committed) - len(PROMPT) < max_new and not dead_end:
        output = committed[len(PROMPT):]
        if EOS in output:
            break
        k = rng.randint(0, max_drafts) if max_drafts else 0
        drafts = drafter(constraint, output, k, rng) if k else []
        bonus = rng.choice([pb.BONUS_POLICY_SAMPLE, pb.BONUS_POLICY_SKIP]) if drafts else pb.BONUS_POLICY_SAMPLE
        item = pb.VerifyItem(seq_id=seq_id, start_pos=target_len, context=committed[target_len:], draft_tokens=drafts,
                             bonus=bonus, constraint=constraint_to_proto(constraint, len(PROMPT), [EOS])
                             if target_len == 0 else None)
        batch_id += 1
        out = verifier.run(pb.VerifyBatch(batch_id=batch_id, items=[item]))
        assert not out.errors, out.errors[0].message
        verdict = out.verdicts[0]
        dead_end = verdict.grammar_dead_end
        assert not dead_end or verdict.kind == pb.NEXT_TOKEN_KIND_NONE  # nothing past a dead end
        committed += drafts[:verdict.n_accepted]
        if verdict.kind != pb.NEXT_TOKEN_KIND_NONE:
            committed.append(verdict.next_token)
        target_len = len(committed) - 1
        if rewind and rng.random() < 0.2 and target_len > len(PROMPT):
            target_len = rng.randint(len(PROMPT), target_len)
    output = committed[len(PROMPT):]
    return (output[: output.index(EOS) + 1] if EOS in output else output[:max_new]), output, dead_end


@pytest.mark.parametrize("name", sorted(GRAMMARS))
@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: d.__name__)
@pytest.mark.parametrize("max_drafts", [0, 1, 4], ids=["off", "one", "four"])
def test_greedy_output_is_the_masked_target_alone(name, drafter, max_drafts):
    constraint, max_new = GRAMMARS[name], 16
    want = reference(constraint, max_new)
    for seed in range(4):
        verifier = _verifier(batched=seed % 2 == 1)
        got, committed, _ = drive(verifier, constraint, drafter, random.Random(seed), max_new=max_new,
                                  max_drafts=max_drafts)
        assert got == want, f"seed {seed}: {got} != masked target alone {want}"
        # the authoritative matcher holds exactly the committed output: no draft it rejected, and in
        # the state a fresh replay of those tokens gives
        assert verifier.grammars.consumed(1) == committed
        assert _legal(verifier.grammars.matcher(1)) == _legal(_replay(constraint, committed))


@pytest.mark.parametrize("name", sorted(DEAD_ENDS))
@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: d.__name__)
@pytest.mark.parametrize("max_drafts", [0, 4], ids=["off", "four"])
def test_a_dead_end_stops_where_the_target_alone_stops_and_says_so(name, drafter, max_drafts):
    """A dead end reached at an item's first position or after an accepted draft: the verdict keeps
    the tokens before it, has no next token and says grammar_dead_end; no error, no token past it."""
    constraint = DEAD_ENDS[name]
    want = reference(constraint, 16)
    assert want and EOS not in want and _replay(constraint, want).is_dead_end()  # the scenario holds
    for seed in range(4):
        verifier = _verifier(batched=seed % 2 == 1)
        got, committed, dead_end = drive(verifier, constraint, drafter, random.Random(seed), max_new=16,
                                         max_drafts=max_drafts)
        assert dead_end and got == committed == want, f"seed {seed}: {got} != masked target alone {want}"
        assert verifier.grammars.consumed(1) == want


def test_a_finished_grammar_allows_only_the_end_token():
    got = reference(GRAMMARS["finite"], 8)
    assert got[-1] == EOS and bytes(b"".join(TOY_TOKENS[t] for t in got[:-1])) in {
        b"ab", b"ba", b"aa", b"abc", b"bac", b"aac"}


def test_an_unconstrained_sequence_in_the_same_batch_is_untouched():
    verifier = _verifier()
    constraint = GRAMMARS["braces"]
    free = pb.VerifyItem(seq_id=2, start_pos=0, context=PROMPT, draft_tokens=[TOY_IDS["x"]])
    bound = pb.VerifyItem(seq_id=1, start_pos=0, context=PROMPT, draft_tokens=[TOY_IDS["x"]],
                          constraint=constraint_to_proto(constraint, len(PROMPT), [EOS]))
    out = verifier.run(pb.VerifyBatch(batch_id=1, items=[bound, free]))
    by_seq = {v.seq_id: v for v in out.verdicts}
    # the free sequence takes the plain argmax, the bound one the masked argmax, in one forward
    assert by_seq[2].n_accepted + 0 == int(fake_logits(PROMPT).argmax() == TOY_IDS["x"])
    assert by_seq[1].n_accepted == 0 and by_seq[1].next_token == TOY_IDS["{"]


def test_a_constraint_the_target_cannot_compile_fails_only_its_own_item():
    verifier = _verifier()
    broken = pb.VerifyItem(seq_id=1, start_pos=0, context=PROMPT, constraint=pb.GrammarConstraint(
        kind=pb.CONSTRAINT_KIND_REGEX, text="(", output_start=len(PROMPT), end_token_ids=[EOS]))
    fine = pb.VerifyItem(seq_id=2, start_pos=0, context=PROMPT)
    out = verifier.run(pb.VerifyBatch(batch_id=1, items=[broken, fine]))
    assert [e.seq_id for e in out.errors] == [1] and out.errors[0].kind == pb.VERIFY_ERROR_KIND_GRAMMAR
    assert [v.seq_id for v in out.verdicts] == [2] and 1 not in verifier.slots


class _GatedBackend:
    """The toy backend whose compile of `slow` waits for `gate`: a grammar that takes as long as a test
    wants to compile (a pathological schema, within the gateway's time limit)."""

    def __init__(self, slow: Constraint):
        import threading

        self.inner, self.slow, self.gate = toy_backend(), slow, threading.Event()
        self.key = self.inner.key

    def compile(self, constraint):
        if constraint == self.slow:
            assert self.gate.wait(30), "the test never opened the gate"
        return self.inner.compile(constraint)


def test_a_grammar_still_compiling_stalls_none_of_the_other_sequences_in_its_batch():
    """Its item is left unanswered and untouched (the coordinator sends it again), the others are
    verified as usual, round after round; once compiled it is verified like any other."""
    constraint = GRAMMARS["braces"]
    backend = _GatedBackend(constraint)
    compiler = GrammarCompiler(backend)
    verifier = Verifier(FakeRunner(), grammar_compilers=lambda ends: compiler)
    slow = pb.VerifyItem(seq_id=1, start_pos=0, context=PROMPT, draft_tokens=[TOY_IDS["{"]],
                         constraint=constraint_to_proto(constraint, len(PROMPT), [EOS]))
    free, committed = pb.VerifyItem(seq_id=2, start_pos=0, context=PROMPT), list(PROMPT)
    for batch_id in range(1, 4):  # three rounds while the grammar compiles: the free sequence goes on
        out = verifier.run(pb.VerifyBatch(batch_id=batch_id, items=[slow, free]))
        assert not out.errors and [v.seq_id for v in out.verdicts] == [2]
        committed.append(out.verdicts[0].next_token)
        free = pb.VerifyItem(seq_id=2, start_pos=len(committed) - 1, context=committed[-1:])
        assert 1 not in verifier.slots and 1 not in verifier.grammars  # nothing of it changed
    assert committed[len(PROMPT):] == [int(fake_logits(committed[:i]).argmax())
                                       for i in range(len(PROMPT), len(committed))]
    backend.gate.set()
    answered = []
    for batch_id in range(4, 400):  # resent until its compile is done (the pool's thread finishes it)
        answered = verifier.run(pb.VerifyBatch(batch_id=batch_id, items=[slow])).verdicts
        if answered:
            break
    assert answered and answered[0].n_accepted == 1  # "{" is the grammar's only first token
    assert verifier.grammars.consumed(1) == [TOY_IDS["{"], answered[0].next_token]


def test_a_grammar_that_fails_to_compile_in_the_background_ends_only_its_own_sequence():
    bad = Constraint(ConstraintKind.REGEX, "(")
    backend = _GatedBackend(bad)
    verifier = Verifier(FakeRunner(), grammar_compilers=lambda ends: GrammarCompiler(backend))
    item = pb.VerifyItem(seq_id=1, start_pos=0, context=PROMPT, constraint=pb.GrammarConstraint(
        kind=pb.CONSTRAINT_KIND_REGEX, text="(", output_start=len(PROMPT), end_token_ids=[EOS]))
    assert not verifier.run(pb.VerifyBatch(batch_id=1, items=[item])).errors  # still compiling
    backend.gate.set()
    for batch_id in range(2, 400):
        out = verifier.run(pb.VerifyBatch(batch_id=batch_id, items=[item, pb.VerifyItem(seq_id=2, start_pos=0,
                                                                                         context=PROMPT)]))
        assert [v.seq_id for v in out.verdicts] == [2]
        verifier.release(2)
        if out.errors:
            break
    assert [e.seq_id for e in out.errors] == [1] and out.errors[0].kind == pb.VERIFY_ERROR_KIND_GRAMMAR


@pytest.mark.parametrize("batched", [False, True], ids=["reference", "batched"])
def test_a_sampled_sequence_commits_only_legal_tokens(batched):
    verifier = _verifier(batched)
    constraint = GRAMMARS["lark"]
    rng, committed, target_len = random.Random(5), list(PROMPT), 0
    for batch_id in range(1, 30):
        output = committed[len(PROMPT):]
        if EOS in output:
            break
        item = pb.VerifyItem(seq_id=1, start_pos=target_len, context=committed[target_len:],
                             draft_tokens=[rng.randrange(VOCAB)], sampling=pb.Sampling(temperature=1.0, seed=batch_id),
                             draft_probs=[_point_mass_q(VOCAB)],
                             constraint=constraint_to_proto(constraint, len(PROMPT), [EOS]) if target_len == 0 else None)
        verdict = verifier.run(pb.VerifyBatch(batch_id=batch_id, items=[item])).verdicts[0]
        committed += list(item.draft_tokens[:verdict.n_accepted]) + (
            [verdict.next_token] if verdict.kind != pb.NEXT_TOKEN_KIND_NONE else [])
        target_len = len(committed) - 1
    _replay(constraint, committed[len(PROMPT):])  # raises if any committed token is illegal


def _point_mass_q(vocab):
    """A uniform q over the toy vocabulary as the wire carries it."""
    from duospec.qcodec import DraftProbs

    return DraftProbs.from_probs(torch.full((vocab,), 1.0 / vocab)).to_bytes()


def test_tree_rows_get_the_mask_of_their_own_path():
    """A token tree's row 1 + i is the mask after the path to node i (what the target alone would see
    there); a node with an illegal token, and everything under it, leaves its row unmasked (never read),
    and the matcher ends where it started."""
    from duospec.structured import SequenceGrammars

    constraint = GRAMMARS["braces"]
    grammars = SequenceGrammars()
    grammars.open(1, COMPILER.compile(constraint), output_start=len(PROMPT))
    t = TOY_IDS
    #        0: {     1: a (under 0)  2: x (under 0, illegal)  3: b (under 0)  4: c (under 3)  5: a (under 2)
    tokens = [t["{"], t["a"], t["x"], t["b"], t["c"], t["a"]]
    parents = [-1, 0, 0, 0, 3, 2]
    masks = grammars.prepare(1, 0, PROMPT, tokens, parents)
    rows = [allowed_tokens(masks.bitmask[r], VOCAB) for r in range(len(tokens) + 1)]
    paths = {0: [0], 1: [0, 1], 3: [0, 3], 4: [0, 3, 4]}
    assert rows[0] == _legal(_replay(constraint, []))
    for node, path in paths.items():
        assert rows[1 + node] == _legal(_replay(constraint, [tokens[i] for i in path])), node
    assert rows[1 + 2] == rows[1 + 5] == list(range(VOCAB))  # under an illegal token: all allowed
    assert grammars.consumed(1) == [] and _legal(grammars.matcher(1)) == rows[0]


def test_grammar_costs_are_counted():
    verifier = _verifier()
    drive(verifier, GRAMMARS["braces"], masked, random.Random(0), max_new=6)
    stats = verifier.grammar_stats()
    assert stats["grammar_sequences"] == 1 and stats["grammar_compiles"] >= 1 and stats["grammar_compile_seconds"] > 0
    assert stats["grammar_mask_rows"] >= 6 and stats["grammar_mask_seconds"] > 0


def test_a_sequence_whose_tokens_leave_its_grammar_ends_alone():
    """A committed token the grammar forbids (a coordinator out of step) ends that sequence with a
    GRAMMAR error after the batch's forward; the other sequence in the batch gets its verdict."""
    verifier = _verifier()
    constraint = GRAMMARS["braces"]
    opened = pb.VerifyItem(seq_id=1, start_pos=0, context=PROMPT,
                           constraint=constraint_to_proto(constraint, len(PROMPT), [EOS]))
    verifier.run(pb.VerifyBatch(batch_id=1, items=[opened]))
    bad = pb.VerifyItem(seq_id=1, start_pos=len(PROMPT) - 1, context=[PROMPT[-1], TOY_IDS["x"]])
    fine = pb.VerifyItem(seq_id=2, start_pos=0, context=PROMPT, draft_tokens=[TOY_IDS["a"]])
    out = verifier.run(pb.VerifyBatch(batch_id=2, items=[bad, fine]))
    assert [(e.seq_id, e.kind) for e in out.errors] == [(1, pb.VERIFY_ERROR_KIND_GRAMMAR)]
    assert "not legal" in out.errors[0].message and [v.seq_id for v in out.verdicts] == [2]
    assert 1 not in verifier.slots and 1 not in verifier.grammars


def test_a_rollback_the_library_refuses_falls_back_to_replaying_the_committed_tokens(monkeypatch):
    from duospec.structured import SequenceGrammars
    from duospec.structured.llguidance_backend import LLGuidanceMatcher

    constraint = GRAMMARS["braces"]
    grammars = SequenceGrammars()
    grammars.open(1, COMPILER.compile(constraint), output_start=len(PROMPT))
    t = TOY_IDS
    committed = [t["{"], t["b"], t["c"], t["a"]]
    grammars.prepare(1, 0, PROMPT + committed, [])
    real = LLGuidanceMatcher.rollback

    def refuse(self, n):
        if n:
            raise RuntimeError("history too short")
        real(self, n)

    monkeypatch.setattr(LLGuidanceMatcher, "rollback", refuse)
    # the coordinator re-sends from after "{b" with another token: roll back two, consume the new one
    masks = grammars.prepare(1, len(PROMPT) + 2, [t["a"]], [])
    assert grammars.replays == 1 and grammars.consumed(1) == [t["{"], t["b"], t["a"]]
    assert allowed_tokens(masks.bitmask[0], VOCAB) == _legal(_replay(constraint, [t["{"], t["b"], t["a"]]))
