"""The model-free drafter: the suffix trie, the n-gram proposer and the drafter protocol around it."""

from __future__ import annotations

import random

import pytest

from duospec.draft_worker.drafter import Drafter
from duospec.draft_worker.ngram_proposer import NgramProposer
from duospec.draft_worker.proposer import DraftState, NgramOptions
from duospec.draft_worker.suffix_trie import SuffixTrie, most_frequent
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.qcodec import DraftProbs
from duospec.sampling import SamplingParams


def _dump(trie: SuffixTrie) -> dict:
    """Every (reversed context, next token) -> count, for comparing two tries."""
    out = {}

    def walk(node, path):
        for token, (count, _) in node.next.items():
            out[(path, token)] = count
        for key, child in node.children.items():
            walk(child, path + (key,))

    walk(trie.root, ())
    return out


# -- suffix trie --------------------------------------------------------------------------------------
def test_longest_suffix_match_wins_over_shorter_ones():
    trie = SuffixTrie(max_n=4)
    #         0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 9, 7, 2, 3, 5, 0]
    trie.extend(tokens)
    # "2 3" was followed by 9 and by 5; "1 2 3" only by 9.
    depth, table = trie.longest_match([4, 1, 2, 3], min_n=1)
    assert depth == 3 and most_frequent(table) == 9
    depth, table = trie.longest_match([4, 7, 2, 3], min_n=1)
    assert depth == 3 and most_frequent(table) == 5
    depth, _ = trie.longest_match([8, 8, 8], min_n=1)
    assert depth == 0


def test_min_n_refuses_short_matches():
    trie = SuffixTrie(max_n=4)
    trie.extend([1, 2, 3, 4])
    assert trie.longest_match([9, 3], min_n=2)[0] == 0
    assert trie.longest_match([9, 3], min_n=1)[0] == 1


def test_continuations_in_frequency_order_then_recency():
    trie = SuffixTrie(max_n=2)
    trie.extend([5, 1, 5, 2, 5, 1, 5, 3])  # after 5: 1 twice, 2 once, 3 once (latest)
    _, table = trie.longest_match([5], min_n=1)
    assert most_frequent(table) == 1
    assert {t: c for t, (c, _) in table.items()} == {1: 2, 2: 1, 3: 1}
    trie.extend([5, 2], start=1)  # now 1 and 2 tie at two; 2 was seen last
    _, table = trie.longest_match([5], min_n=1)
    assert most_frequent(table) == 2


def test_remove_undoes_add_exactly():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(200)]
    full, prefix = SuffixTrie(max_n=5), SuffixTrie(max_n=5)
    full.extend(tokens)
    prefix.extend(tokens[:120])
    for pos in range(len(tokens) - 1, 119, -1):
        full.remove(tokens, pos)
    assert _dump(full) == _dump(prefix)
    assert full.n_indexed == prefix.n_indexed
    for pos in range(119, 0, -1):
        full.remove(tokens, pos)
    assert not full.root.children and full.n_indexed == 0


# -- the proposer ---------------------------------------------------------------------------------------
def _seq(seq_id, tokens, pool="", greedy=True, committed=None):
    sampling = SamplingParams() if greedy else SamplingParams(temperature=1.0, seed=3)
    return DraftState(seq_id=seq_id, epoch=0, sampling=sampling, tokens=list(tokens),
                      committed_len=len(tokens) if committed is None else committed, draft_until=10**6, pool=pool)


def _propose(proposer, seq, budget=8):
    proposal = proposer.propose([seq], [budget])[0]
    seq.tokens.extend(proposal.tokens)  # what the drafter does with it
    return proposal


def test_copies_the_continuation_of_an_earlier_occurrence():
    proposer = NgramProposer(NgramOptions(min_ngram=2, max_ngram=4))
    text = [10, 11, 12, 13, 14, 15, 16, 20, 21, 10, 11, 12]
    seq = _seq(1, text)
    proposer.open(seq)
    proposal = _propose(proposer, seq, budget=4)
    assert proposal.tokens == [13, 14, 15, 16] and not proposal.exhausted
    assert proposal.probs == []  # greedy: no q on the wire


def test_no_match_is_an_exhausted_empty_proposal_and_a_short_match_too():
    proposer = NgramProposer(NgramOptions(min_ngram=2, max_ngram=4))
    seq = _seq(1, [1, 2, 3, 4, 5])
    proposer.open(seq)
    proposal = _propose(proposer, seq)
    assert proposal.tokens == [] and proposal.exhausted
    seq = _seq(2, [1, 2, 3, 7, 8, 1, 2])  # "1 2" -> 3, "2 3" -> 7, "3 7" -> 8, "7 8" -> 1, then repeats
    proposer.open(seq)
    proposal = _propose(proposer, seq, budget=3)
    assert proposal.tokens == [3, 7, 8] and not proposal.exhausted


def test_sampled_proposals_carry_a_point_mass_q():
    proposer = NgramProposer(NgramOptions())
    seq = _seq(1, [4, 5, 6, 7, 4, 5], greedy=False)
    proposer.open(seq)
    proposal = _propose(proposer, seq, budget=2)
    assert proposal.tokens == [6, 7]
    assert proposal.probs == [DraftProbs([6], [1.0]), DraftProbs([7], [1.0])]
    assert float(proposal.probs[0].dense(10)[6]) == 1.0


def test_a_proposal_depends_on_the_prefix_only_not_on_how_steps_split():
    """One step of 6 tokens or six steps of one, with rewinds in between: the same tokens."""
    rng = random.Random(1)
    text = [rng.randrange(5) for _ in range(60)]
    one = NgramProposer(NgramOptions(min_ngram=1, max_ngram=4))
    seq_a = _seq(1, text)
    one.open(seq_a)
    together = _propose(one, seq_a, budget=6).tokens
    many = NgramProposer(NgramOptions(min_ngram=1, max_ngram=4))
    seq_b = _seq(2, text)
    many.open(seq_b)
    _propose(many, seq_b, budget=3)
    many.rewind(seq_b, len(text) + 1)  # an abort after the first draft ...
    del seq_b.tokens[len(text) + 1:]
    while len(seq_b.tokens) < len(text) + 6:  # ... and the rest one token at a time
        _propose(many, seq_b, budget=1)
    assert seq_b.tokens[len(text):] == together


def test_tenant_pool_is_used_and_never_crosses_tenants():
    proposer = NgramProposer(NgramOptions(min_ngram=2, max_ngram=4, pool="tenant"))
    secret = [50, 51, 52, 53, 54, 55, 56]
    done = _seq(1, secret, pool="alice")
    proposer.open(done)
    proposer.close(done)  # its verified text goes to alice's pool
    for tenant, want in (("alice", [53, 54, 55]), ("bob", [])):
        seq = _seq(2, [9, 50, 51, 52], pool=tenant)
        proposer.open(seq)
        assert _propose(proposer, seq, budget=3).tokens == want, tenant
        proposer.close(seq)
    # Unverified drafts never reach the pool: only tokens[:committed_len].
    drafted = _seq(3, [60, 61, 62, 63, 64], pool="carol", committed=3)
    proposer.open(drafted)
    proposer.close(drafted)
    seq = _seq(4, [1, 61, 62], pool="carol")
    proposer.open(seq)
    assert _propose(proposer, seq, budget=2).tokens == []


def test_sequence_scope_and_sampled_requests_skip_the_pool():
    for options, greedy in ((NgramOptions(pool="sequence"), True), (NgramOptions(pool="tenant"), False)):
        proposer = NgramProposer(options)
        done = _seq(1, [50, 51, 52, 53], pool="alice")
        proposer.open(done)
        proposer.close(done)
        seq = _seq(2, [9, 50, 51], pool="alice", greedy=greedy)
        proposer.open(seq)
        assert _propose(proposer, seq).tokens == []


def test_pool_size_is_bounded_by_evicting_the_oldest_sequences():
    proposer = NgramProposer(NgramOptions(min_ngram=2, max_ngram=3, pool_tokens=25, max_pools=2))
    for i in range(10):
        seq = _seq(i, [100 + i, 200 + i, 300 + i, 400 + i, 500 + i, 600 + i, 700 + i, 800 + i, 900 + i, 1000 + i],
                   pool="alice")
        proposer.open(seq)
        proposer.close(seq)
        pool = proposer.pools["alice"]
        assert pool.tokens <= 25 and pool.trie.n_indexed <= 25
    assert list(pool.entries) == [8, 9]  # the two newest survive
    old = _seq(20, [1, 100, 200], pool="alice")
    proposer.open(old)
    assert _propose(proposer, old).tokens == []  # evicted text is gone from the trie too
    new = _seq(21, [1, 109, 209], pool="alice")
    proposer.open(new)
    assert _propose(proposer, new, budget=2).tokens == [309, 409]
    for tenant in ("bob", "carol"):  # a third tenant evicts the least recently used pool
        seq = _seq(30, [1, 2, 3], pool=tenant)
        proposer.open(seq)
        proposer.close(seq)
    assert set(proposer.pools) == {"bob", "carol"}


# -- the drafter protocol around it ---------------------------------------------------------------------
def _cmd(kind, seq_id=1, **kw):
    return pb.DraftCommand(seq_id=seq_id, kind=kind, **kw)


def test_drafter_emits_exhausted_chunks_and_starts_again_after_a_reset():
    drafter = Drafter(NgramProposer(NgramOptions(min_ngram=2, max_ngram=4)))
    prompt = [1, 2, 3, 4, 1, 2]
    drafter.apply(_cmd(pb.DRAFT_COMMAND_KIND_START, tail=prompt, draft_until=12, committed_len=6, pool="t"))
    (chunk,) = drafter.step()
    assert chunk.start_pos == 6 and list(chunk.tokens) == [3, 4, 1, 2, 3, 4]
    assert chunk.outlook == pb.DRAFT_OUTLOOK_MORE  # cut by the lookahead bound, not by the match
    assert not drafter.has_work()
    # The target rejected position 7 (4 -> 9): roll back and feed the correction.
    drafter.apply(_cmd(pb.DRAFT_COMMAND_KIND_RESET, epoch=1, start_pos=7, tail=[9], draft_until=16, committed_len=8))
    (chunk,) = drafter.step()
    assert chunk.epoch == 1 and chunk.start_pos == 8 and list(chunk.tokens) == []
    assert chunk.outlook == pb.DRAFT_OUTLOOK_EXHAUSTED  # "3 9" never occurred: nothing to propose
    assert not drafter.has_work()  # no busy loop while exhausted
    drafter.apply(_cmd(pb.DRAFT_COMMAND_KIND_ADVANCE, epoch=1, draft_until=17, committed_len=8))
    assert drafter.has_work()  # a command may bring a match: it tries again


def test_drafter_stops_at_the_draft_context_without_failing():
    class TinyContext(NgramProposer):
        max_context = 8

    drafter = Drafter(TinyContext(NgramOptions(min_ngram=1, max_ngram=2)))
    drafter.apply(_cmd(pb.DRAFT_COMMAND_KIND_START, tail=[1, 2, 1, 2, 1, 2], draft_until=20, committed_len=6))
    (chunk,) = drafter.step()
    assert list(chunk.tokens) == [1, 2]  # positions 6, 7; the context ends at 8
    (chunk,) = drafter.step()
    assert chunk.start_pos == 8 and not chunk.tokens and chunk.outlook == pb.DRAFT_OUTLOOK_EXHAUSTED


@pytest.mark.parametrize("bad", [dict(start_pos=3), dict(tail=[])])
def test_start_without_the_whole_prompt_is_refused(bad):
    drafter = Drafter(NgramProposer(NgramOptions()))
    cmd = dict(tail=[1, 2, 3], draft_until=9)
    cmd.update(bad)
    with pytest.raises(ValueError, match="START needs the whole prompt"):
        drafter.apply(_cmd(pb.DRAFT_COMMAND_KIND_START, **cmd))


def test_sampled_proposals_after_an_abort_do_not_depend_on_how_far_the_drafter_had_run():
    """Rolling back restores the trie's counts but not recency, so sampled requests break ties by
    token id: the same prefix gives the same proposal whether 6 or 1 tokens were drafted and rolled back."""
    prompt = [40, 41, 42, 31, 32, 35, 5, 30, 31, 32, 33, 6, 40, 41]
    sampled = SamplingParams(temperature=1.0, seed=7)
    from duospec.internal.sampling_wire import sampling_to_proto

    def run(first_until):
        drafter = Drafter(NgramProposer(NgramOptions(min_ngram=2, max_ngram=3)))
        drafter.apply(_cmd(pb.DRAFT_COMMAND_KIND_START, tail=prompt, draft_until=first_until,
                           committed_len=len(prompt), sampling=sampling_to_proto(sampled)))
        drafter.step()
        drafter.apply(_cmd(pb.DRAFT_COMMAND_KIND_RESET, epoch=1, start_pos=len(prompt), tail=[36, 37, 31, 32],
                           draft_until=len(prompt) + 5, committed_len=len(prompt) + 4))
        (chunk,) = drafter.step()
        return list(chunk.tokens)

    assert run(len(prompt) + 6) == run(len(prompt) + 1)
