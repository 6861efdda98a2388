"""The speculation cache (draft_worker/hedges.py): scheduler scenarios with fake links, and the
drafter's hedges on a real tiny model.

Scheduler side: a hit sends the cached continuation to the target in the same event and tells the
drafter to adopt the branch; a stale hedge, a key that never matches and a drafter that dies while
hedges are cached lose and duplicate nothing. Drafter side: hedges grow from the proposer's
alternatives, an adopted branch drafts exactly what a RESET to the same outcome drafts, other RESETs
and decided positions drop hedges, and hedges never keep a new sequence out of a slot.
"""

from __future__ import annotations

import pytest

from duospec.coordinator.api import SpeculationMode
from duospec.coordinator.scheduling.policies import SpeculationPolicy
from duospec.internal.v1 import pearl_pb2 as pb
from test_scheduler import _chunks, _committed_events, _request, _scheduler, _verdict

RESET = pb.DRAFT_COMMAND_KIND_RESET


def _cache_policy(mode=SpeculationMode.PEARL, hedges=4, tree_nodes=0):
    return SpeculationPolicy(mode=mode, max_draft_tokens=4, max_lookahead=8, adaptive=False, hedges=hedges,
                             tree_nodes=tree_nodes)


def _hedge(scheduler, seq, pos, token, start, tokens, epoch=None):
    scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[pb.DraftChunk(
        seq_id=seq.seq_id, epoch=seq.epoch if epoch is None else epoch, start_pos=start, tokens=tokens,
        hedge=pb.HedgeKey(pos=pos, token=token))]))


def _commands(draft, kind):
    return [c for m in draft.sent for c in m.commands if c.kind == kind]


def _prefilled(policy, n=20):
    """A sequence with prompt [1, 2, 3] prefilled and draft [10, 11, 12] under verification (at most
    `n` new tokens)."""
    scheduler, target, draft, _ = _scheduler()
    seq = scheduler._add(_request(n=n), policy)
    _chunks(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # prefill-only round
    for pos, tok in ((4, 11), (5, 12)):
        _chunks(scheduler, seq, pos, [tok])
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 11)  # [10] accepted, bonus 11 = the draft
    assert seq.committed == [1, 2, 3, 10, 11] and list(target.sent[-1].items[0].draft_tokens) == [12]
    return scheduler, target, draft, seq


async def test_a_hit_sends_the_cached_continuation_at_once_and_adopts_the_branch():
    scheduler, target, draft, seq = _prefilled(_cache_policy())
    # While [12] at position 5 is verified the drafter hedges "the target puts 40 at 5" (and 41).
    _hedge(scheduler, seq, 5, 40, 6, [60, 61])
    _hedge(scheduler, seq, 5, 41, 6, [70])
    _hedge(scheduler, seq, 5, 40, 8, [62])  # continues the first hedge
    batches_before = len(target.sent)
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 40)
    assert seq.committed == [1, 2, 3, 10, 11, 40] and seq.epoch == 1
    assert seq.stats.cache_lookups == 1 and seq.stats.cache_hits == 1
    # The next verify went out in the same event, with the hedge's tokens as drafts.
    assert len(target.sent) == batches_before + 1
    item = target.sent[-1].items[0]
    assert (item.epoch, item.start_pos, list(item.context), list(item.draft_tokens)) == (1, 5, [40], [60, 61, 62])
    reset = _commands(draft, RESET)[-1]
    assert (reset.adopt.pos, reset.adopt.token) == (5, 40) and reset.HasField("adopt")
    # The tail holds the hedge too, so a drafter that no longer has the branch still lines up.
    assert list(reset.tail)[-4:] == [40, 60, 61, 62] and reset.committed_len == 6
    # The drafter continues after the hedge: its next main-line chunk starts at 9.
    _chunks(scheduler, seq, 9, [63])
    assert seq.drafts == [63]
    assert seq.stats.hedge_tokens_kept == 0
    _verdict(scheduler, target, seq, 3, pb.NEXT_TOKEN_KIND_BONUS, 63)
    assert seq.committed == [1, 2, 3, 10, 11, 40, 60, 61, 62, 63]
    assert _committed_events(seq) == [10, 11, 40, 60, 61, 62, 63]
    assert seq.stats.hedge_tokens_kept == 3  # the hedge's 60, 61, 62 (its key, 40, was the correction)


async def test_a_hits_tokens_are_counted_as_the_hedges_wherever_they_are_verified():
    scheduler, target, draft, seq = _prefilled(_cache_policy())
    _hedge(scheduler, seq, 5, 40, 6, [60, 61, 62])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 40)  # a hit: [60, 61, 62] goes out
    assert (seq.spec.verify_from_hedge, seq.spec.hedge_drafts) == (3, 0)
    seq.forget_verify()  # e.g. the target restarted: the chunk goes back in front of the drafts
    assert seq.drafts == [60, 61, 62] and (seq.spec.verify_from_hedge, seq.spec.hedge_drafts) == (0, 3)
    _chunks(scheduler, seq, 9, [63])  # the drafter's own next draft, after the adopted branch
    seq.take_verify_chunk(2)
    assert (seq.spec.verify_from_hedge, seq.spec.hedge_drafts) == (2, 1)
    seq.apply_verdict(2, 62, recovered=False)  # 60, 61 accepted; the bonus 62 is the hedge's last draft
    assert seq.stats.hedge_tokens_kept == 2 and seq.drafts == [63]
    assert (seq.spec.verify_from_hedge, seq.spec.hedge_drafts) == (0, 0)  # 63 is the drafter's own
    seq.take_verify_chunk(1)
    seq.apply_verdict(1, 64, recovered=False)
    assert seq.stats.hedge_tokens_kept == 2


async def test_a_miss_takes_the_reset_path():
    scheduler, target, draft, seq = _prefilled(_cache_policy())
    _hedge(scheduler, seq, 5, 40, 6, [60])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 42)  # a key that never matches
    assert seq.stats.cache_lookups == 1 and seq.stats.cache_hits == 0
    reset = _commands(draft, RESET)[-1]
    assert not reset.HasField("adopt") and list(reset.tail)[-1] == 42
    assert seq.drafts == [] and seq.spec.hedges == {}
    # Nothing is verified until the drafter drafts again (target-only sequences aside).
    _chunks(scheduler, seq, 6, [80])
    assert list(target.sent[-1].items[0].draft_tokens) == [80]


async def test_stale_and_decided_hedges_are_never_used():
    scheduler, target, draft, seq = _prefilled(_cache_policy())
    _hedge(scheduler, seq, 5, 40, 6, [60], epoch=seq.epoch + 1)  # another epoch
    _hedge(scheduler, seq, 4, 40, 5, [60])  # position 4 is committed already
    _hedge(scheduler, seq, 5, 41, 9, [70])  # does not start right after its key
    assert seq.spec.hedges == {}
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 40)
    assert seq.stats.cache_hits == 0 and not _commands(draft, RESET)[-1].HasField("adopt")
    # A hedge of the old epoch arriving after the abort is dropped too.
    _hedge(scheduler, seq, 6, 50, 7, [51], epoch=0)
    assert seq.spec.hedges == {}


async def test_an_accepted_chunk_drops_only_the_hedges_it_decided():
    scheduler, target, draft, seq = _prefilled(_cache_policy())
    _chunks(scheduler, seq, 6, [13])
    _chunks(scheduler, seq, 7, [14])
    _hedge(scheduler, seq, 5, 40, 6, [60])
    _hedge(scheduler, seq, 7, 41, 8, [70])
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 13)  # [12] accepted, bonus 13 = the draft
    assert seq.committed == [1, 2, 3, 10, 11, 12, 13]
    assert list(seq.spec.hedges) == [(7, 41)]  # position 5 is decided; 7 (under verification now) is not
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 41)
    assert seq.stats.cache_hits == 1 and list(target.sent[-1].items[0].draft_tokens) == [70]


async def test_a_bonus_the_main_line_did_not_guess_can_hit_the_cache():
    scheduler, target, draft, seq = _prefilled(_cache_policy())
    _chunks(scheduler, seq, 6, [13])
    _chunks(scheduler, seq, 7, [14])  # drafted past the chunk [12]: the main line guessed 13 for position 6
    _hedge(scheduler, seq, 6, 30, 7, [31, 32])  # "the target puts 30 at 6" (the bonus position)
    _hedge(scheduler, seq, 7, 41, 8, [70])  # past the main line's parting point: drawn on a prefix that goes
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 30)  # [12] accepted, bonus 30, not 13
    assert seq.committed == [1, 2, 3, 10, 11, 12, 30] and seq.epoch == 1
    assert seq.stats.cache_lookups == 1 and seq.stats.cache_hits == 1
    item = target.sent[-1].items[0]
    assert (list(item.context), list(item.draft_tokens)) == ([30], [31, 32])
    reset = _commands(draft, RESET)[-1]
    assert (reset.adopt.pos, reset.adopt.token) == (6, 30) and list(reset.tail)[-3:] == [30, 31, 32]
    assert seq.spec.hedges == {}  # the new epoch starts with none


async def test_a_sampled_cache_hit_sends_each_hedge_token_with_its_own_q():
    """The rejection rule needs every draft's q: a hit's drafts carry the q's the hedge chunks brought,
    joined in order across chunks."""
    from duospec.sampling import SamplingParams

    def chunk(pos, tokens, probs, hedge=None):
        scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[pb.DraftChunk(
            seq_id=seq.seq_id, epoch=seq.epoch, start_pos=pos, tokens=tokens, draft_probs=probs,
            hedge=pb.HedgeKey(pos=hedge[0], token=hedge[1]) if hedge else None)]))

    scheduler, target, draft, _ = _scheduler()
    seq = scheduler._add(_request(n=20, sampling=SamplingParams(temperature=1.0, seed=7)), _cache_policy())
    chunk(3, [10], [b"q10"])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # prefill; [10] goes out next
    chunk(4, [11, 12], [b"q11", b"q12"])
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_NONE)  # [10] kept; sampled pearl takes no bonus
    item = target.sent[-1].items[0]
    assert list(item.draft_tokens) == [11, 12] and list(item.draft_probs) == [b"q11", b"q12"]
    chunk(5, [60], [b"h60"], hedge=(4, 40))  # "the target puts 40 at 4", in two chunks
    chunk(6, [61], [b"h61"], hedge=(4, 40))
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 40)
    assert seq.stats.cache_hits == 1
    item = target.sent[-1].items[0]
    assert (list(item.context), list(item.draft_tokens), list(item.draft_probs)) == ([40], [60, 61], [b"h60", b"h61"])


async def test_the_drafter_dying_with_hedges_cached_loses_nothing():
    scheduler, target, draft, seq = _prefilled(_cache_policy())
    _hedge(scheduler, seq, 5, 40, 6, [60, 61])
    scheduler.on_draft_batch(pb.DraftChunkBatch(failed_seq_ids=[seq.seq_id]))
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 40)
    # Target-only from here: the hedge is not used (no drafter to adopt it), nothing is duplicated.
    assert seq.committed == [1, 2, 3, 10, 11, 40] and seq.stats.cache_hits == 0
    item = target.sent[-1].items[0]
    assert list(item.draft_tokens) == [] and list(item.context) == [40]
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 77)
    assert _committed_events(seq) == [10, 11, 40, 77]


@pytest.mark.parametrize("mode,hedges", [(SpeculationMode.VANILLA, 4), (SpeculationMode.PEARL, 0)])
async def test_no_cache_in_vanilla_or_when_turned_off(mode, hedges):
    scheduler, target, draft, _ = _scheduler(mode)
    seq = scheduler._add(_request(n=20), _cache_policy(mode, hedges))
    start = _commands(draft, pb.DRAFT_COMMAND_KIND_START)[-1]
    assert start.max_hedges == 0
    assert seq.policy.max_hedges() == 0


def _tree_setup(tree_nodes=8, cont=(41, 42), n=20):
    """In flight: [14] at position 7 (committed [1, 2, 3, 10, 11, 12, 13]), with hedges "40 at 7"
    (a sibling of 14) and "50 at 8" (the bonus position) riding along as a token tree."""
    scheduler, target, draft, seq = _prefilled(_cache_policy(tree_nodes=tree_nodes), n=n)
    _chunks(scheduler, seq, 6, [13])
    _chunks(scheduler, seq, 7, [14])
    _hedge(scheduler, seq, 7, 40, 8, list(cont))
    _hedge(scheduler, seq, 8, 50, 9, [51])
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 13)
    assert seq.committed == [1, 2, 3, 10, 11, 12, 13]
    return scheduler, target, draft, seq


def _tree_verdict(scheduler, target, seq, path, kind, next_token):
    batch = target.sent[-1]
    scheduler.on_verdict_batch(pb.VerdictBatch(batch_id=batch.batch_id, verdicts=[pb.Verdict(
        seq_id=seq.seq_id, epoch=seq.epoch, n_accepted=len(path), kind=kind, next_token=next_token, path=path)]))


async def test_hedges_ride_along_as_a_tree_and_a_path_into_one_is_adopted():
    scheduler, target, draft, seq = _tree_setup()
    item = target.sent[-1].items[0]
    # Every hedge's own token first (a sibling of 14, a child of 14 at the bonus position), then their
    # continuations below them.
    assert list(item.draft_tokens) == [14, 40, 50, 41, 42, 51]
    assert list(item.draft_parents) == [-1, -1, 0, 1, 3, 2]
    _tree_verdict(scheduler, target, seq, [1, 3], pb.NEXT_TOKEN_KIND_RECOVERED, 99)  # 40, 41 kept; 42 rejected
    assert seq.committed == [1, 2, 3, 10, 11, 12, 13, 40, 41, 99] and seq.epoch == 1
    assert seq.stats.tree_hits == 1 and seq.stats.tree_nodes == 5
    assert seq.stats.hedge_tokens_kept == 1  # 41, below the branch's root
    reset = _commands(draft, RESET)[-1]
    assert (reset.adopt.pos, reset.adopt.token) == (7, 40)
    assert reset.start_pos <= 7 and list(reset.tail)[-3:] == [40, 41, 99]  # the main line parts at 7
    assert seq.drafts == [] and seq.spec.hedges == {}


async def test_a_bonus_past_a_branch_leaf_and_a_path_that_stays_on_the_main_chain():
    scheduler, target, draft, seq = _tree_setup()
    _tree_verdict(scheduler, target, seq, [0, 2, 5], pb.NEXT_TOKEN_KIND_BONUS, 77)  # 14, 50, 51, then 77
    assert seq.committed[-4:] == [14, 50, 51, 77] and seq.stats.tree_hits == 1
    assert (_commands(draft, RESET)[-1].adopt.pos, _commands(draft, RESET)[-1].adopt.token) == (8, 50)
    scheduler, target, draft, seq = _tree_setup()
    _tree_verdict(scheduler, target, seq, [0], pb.NEXT_TOKEN_KIND_RECOVERED, 60)  # 14 kept, no branch fits
    assert seq.committed[-2:] == [14, 60] and seq.stats.tree_hits == 0
    assert not _commands(draft, RESET)[-1].HasField("adopt")  # and no cached hedge for (8, 60)


async def test_a_tree_budget_cuts_a_hedge_and_what_follows_becomes_the_drafts():
    scheduler, target, draft, seq = _tree_setup(tree_nodes=2, cont=(41, 42, 43))
    item = target.sent[-1].items[0]
    assert list(item.draft_tokens) == [14, 40, 50] and list(item.draft_parents) == [-1, -1, 0]  # no room for more
    _tree_verdict(scheduler, target, seq, [1], pb.NEXT_TOKEN_KIND_BONUS, 41)  # 40, then the hedge's own next token
    assert seq.committed[-2:] == [40, 41]
    next_item = target.sent[-1].items[0]
    assert list(next_item.context) == [41] and list(next_item.draft_tokens) == [42, 43]
    assert list(_commands(draft, RESET)[-1].tail)[-3:] == [41, 42, 43]


async def test_a_path_two_nodes_into_a_hedge_continues_after_what_it_accepted():
    scheduler, target, draft, seq = _tree_setup(tree_nodes=3, cont=(41, 42, 43))
    item = target.sent[-1].items[0]
    assert list(item.draft_tokens) == [14, 40, 50, 41] and list(item.draft_parents) == [-1, -1, 0, 1]
    _tree_verdict(scheduler, target, seq, [1, 3], pb.NEXT_TOKEN_KIND_BONUS, 42)  # 40, 41 kept; bonus 42 = the hedge's
    assert seq.committed[-3:] == [40, 41, 42]
    next_item = target.sent[-1].items[0]
    assert list(next_item.context) == [42] and list(next_item.draft_tokens) == [43]  # the hedge's rest past 42
    assert seq.stats.hedge_tokens_kept == 1  # 41
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 44)
    assert seq.committed[-2:] == [43, 44] and seq.stats.hedge_tokens_kept == 2  # and the rest's 43


@pytest.mark.parametrize("n,tokens,parents", [
    (6, [14, 40, 50, 41], [-1, -1, 0, 1]),  # 2 tokens left: the root at the bonus position, no continuation
    (5, [14, 40], [-1, -1]),  # 1 left: a sibling of 14 only
])
async def test_a_tree_never_reaches_past_the_requests_length(n, tokens, parents):
    scheduler, target, draft, seq = _tree_setup(n=n)
    assert seq.remaining == n - 4
    item = target.sent[-1].items[0]
    assert (list(item.draft_tokens), list(item.draft_parents)) == (tokens, parents)


async def test_a_cache_hit_near_the_requests_end_keeps_only_what_fits():
    scheduler, target, draft, seq = _prefilled(_cache_policy(), n=4)
    _hedge(scheduler, seq, 5, 40, 6, [60, 61, 62])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 40)
    assert seq.committed == [1, 2, 3, 10, 11, 40] and seq.remaining == 1 and seq.stats.cache_hits == 1
    item = target.sent[-1].items[0]
    assert (list(item.context), list(item.draft_tokens)) == ([40], [60])
    assert list(_commands(draft, RESET)[-1].tail)[-2:] == [40, 60]


async def test_every_drafts_runner_up_is_a_sibling_in_the_tree():
    scheduler, target, draft, seq = _prefilled(_cache_policy(tree_nodes=8))
    scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[pb.DraftChunk(
        seq_id=seq.seq_id, epoch=seq.epoch, start_pos=6, tokens=[13, 14], alternatives=[23, -1])]))
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 13)  # [12] accepted, bonus 13 = the draft
    item = target.sent[-1].items[0]
    assert list(item.draft_tokens) == [14] and not item.draft_parents  # 13's runner-up is decided now
    scheduler, target, draft, seq = _prefilled(_cache_policy(tree_nodes=8))
    _chunks(scheduler, seq, 6, [13])
    scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[pb.DraftChunk(
        seq_id=seq.seq_id, epoch=seq.epoch, start_pos=7, tokens=[14, 15], alternatives=[24, 25])]))
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 13)
    item = target.sent[-1].items[0]  # [14, 15] with runners-up 24 (beside 14) and 25 (beside 15)
    assert list(item.draft_tokens) == [14, 15, 24, 25] and list(item.draft_parents) == [-1, 0, -1, 0]
    _tree_verdict(scheduler, target, seq, [0, 3], pb.NEXT_TOKEN_KIND_BONUS, 30)  # 14, 25, then 30
    assert seq.committed[-3:] == [14, 25, 30] and seq.stats.tree_hits == 1
    assert seq.stats.hedge_tokens_kept == 0  # a runner-up is the draft's own logits, not a hedge
    reset = _commands(draft, RESET)[-1]
    assert (reset.adopt.pos, reset.adopt.token) == (8, 25) and reset.start_pos <= 8  # no such hedge: a plain reset


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
async def test_sampled_requests_are_verified_as_chains(sampled):
    """The same drafts and hedge: a greedy request's verify is a tree, a sampled one's the chain alone
    (its tree verify rule needs i.i.d. siblings; a runner-up or a hedge's key is not a draw from q)."""
    from duospec.sampling import SamplingParams

    scheduler, target, draft, _ = _scheduler()
    sampling = SamplingParams(temperature=1.0, seed=1) if sampled else SamplingParams()
    seq = scheduler._add(_request(n=20, sampling=sampling), _cache_policy(tree_nodes=8))
    _chunks(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # prefill; [10] goes out next
    _hedge(scheduler, seq, 4, 40, 5, [41])  # "the target puts 40 at 4": beside 11, still undecided
    _chunks(scheduler, seq, 4, [11])
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_NONE)  # [10] kept, no bonus: [11] goes out
    item = target.sent[-1].items[0]
    if sampled:
        assert list(item.draft_tokens) == [11] and list(item.draft_parents) == []
    else:
        assert list(item.draft_tokens) == [11, 40, 41] and list(item.draft_parents) == [-1, -1, 1]


# -- the drafter's hedges on a real tiny model ----------------------------------------------------------
import torch  # noqa: E402

from duospec.draft_worker.drafter import Drafter  # noqa: E402
from duospec.draft_worker.model_proposer import ModelProposer  # noqa: E402
from duospec.engine import SlotsExhausted, load_checkpoint  # noqa: E402
from duospec.internal.sampling_wire import sampling_to_proto  # noqa: E402
from duospec.sampling import SamplingParams  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

PROMPT = [5, 17, 42, 9, 30, 77, 12, 3, 64, 101]
SAMPLED = SamplingParams(temperature=1.0, top_k=8, seed=3)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hedges") / "draft", "llama", seed=5, hidden_size=64,
                                num_layers=2)


def _drafter(draft_dir, max_slots=8):
    torch.set_num_threads(1)
    return Drafter(ModelProposer(load_checkpoint(draft_dir, device="cpu", dtype="float32", max_slots=max_slots).runner))


def _start(drafter, seq_id, tokens, committed_len, draft_until, sampling=SamplingParams(), hedges=4):
    drafter.apply(pb.DraftCommand(seq_id=seq_id, epoch=0, kind=pb.DRAFT_COMMAND_KIND_START, start_pos=0, tail=tokens,
                                  draft_until=draft_until, sampling=sampling_to_proto(sampling),
                                  committed_len=committed_len, max_hedges=hedges))


def _drain(drafter):
    chunks = []
    while drafter.has_work():
        chunks += drafter.step()
    return chunks


def _main_line(chunks, seq_id=1):
    return [(c.start_pos, list(c.tokens), list(c.draft_probs)) for c in chunks
            if c.seq_id == seq_id and not c.HasField("hedge")]


def _hedges(chunks):
    out = {}
    for c in chunks:
        if c.HasField("hedge"):
            tokens, probs = out.setdefault((c.hedge.pos, c.hedge.token), ([], []))
            tokens.extend(c.tokens)
            probs.extend(c.draft_probs)
    return out


def _reference(draft_dir, prefix, n, sampling):
    """What a fresh drafter drafts after `prefix`: what a RESET to that outcome would draft."""
    ref = _drafter(draft_dir, max_slots=1)
    _start(ref, 9, prefix, len(prefix), len(prefix) + n, sampling, hedges=0)
    tokens, probs = [], []
    for _, t, q in _main_line(_drain(ref), seq_id=9):
        tokens += t
        probs += q
    return tokens, probs


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_a_hedge_is_what_a_reset_would_draft_and_adoption_keeps_its_branch(draft_dir, sampling):
    drafter = _drafter(draft_dir)
    n = len(PROMPT)
    _start(drafter, 1, PROMPT, n, n + 6, sampling)
    chunks = _drain(drafter)
    main = [t for _, tokens, _ in _main_line(chunks) for t in tokens]
    hedges = _hedges(chunks)
    assert len(main) == 6 and 1 <= len(hedges) <= 4
    for (pos, token), (tokens, probs) in hedges.items():
        assert n <= pos < n + 6 and token != main[pos - n] and 1 <= len(tokens) <= 4
        prefix = PROMPT + main[: pos - n] + [token]
        assert (tokens, probs) == _reference(draft_dir, prefix, len(tokens), sampling)  # same tokens, same q
    # The verdict hits the first key: the coordinator keeps its tokens and RESETs with adopt.
    (pos, token), (tokens, _) = next(iter(hedges.items()))
    committed = PROMPT + main[: pos - n] + [token]
    drafter.apply(pb.DraftCommand(seq_id=1, epoch=1, kind=RESET, start_pos=pos, tail=[token] + tokens,
                                  draft_until=len(committed) + len(tokens) + 3, committed_len=len(committed),
                                  max_hedges=0, adopt=pb.HedgeKey(pos=pos, token=token)))
    assert drafter.hedges.adopted == 1 and drafter.hedges.live() == 0
    assert drafter.proposer.runner.free_slots == drafter.proposer.runner.max_slots - 1  # only the main line
    after = [t for _, t, _ in _main_line(_drain(drafter))]
    expected, _ = _reference(draft_dir, committed + tokens, 3, sampling)
    assert [t for part in after for t in part] == expected


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_an_adopted_branch_the_verdict_leaves_partway_drafts_after_the_verdicts_tokens(draft_dir, sampling):
    """The target kept the hedge's key and first token, then put another token where the hedge had its
    second: the drafter keeps the branch up to there and drafts what a fresh RESET would."""
    drafter = _drafter(draft_dir)
    n = len(PROMPT)
    _start(drafter, 1, PROMPT, n, n + 6, sampling)
    chunks = _drain(drafter)
    main = [t for _, tokens, _ in _main_line(chunks) for t in tokens]
    (pos, token), (tokens, _) = next((key, hedge) for key, hedge in _hedges(chunks).items() if len(hedge[0]) >= 2)
    other = next(t for t in PROMPT if t != tokens[1])
    committed = PROMPT + main[: pos - n] + [token, tokens[0], other]
    drafter.apply(pb.DraftCommand(seq_id=1, epoch=1, kind=RESET, start_pos=pos, tail=[token, tokens[0], other],
                                  draft_until=len(committed) + 3, committed_len=len(committed), max_hedges=0,
                                  adopt=pb.HedgeKey(pos=pos, token=token)))
    assert drafter.hedges.adopted == 1 and drafter.hedges.live() == 0
    after = [t for _, part, _ in _main_line(_drain(drafter)) for t in part]
    assert after == _reference(draft_dir, committed, 3, sampling)[0]


def test_a_reset_without_a_hit_and_an_advance_drop_hedges(draft_dir):
    drafter = _drafter(draft_dir)
    n = len(PROMPT)
    _start(drafter, 1, PROMPT, n, n + 6)
    main = [t for _, tokens, _ in _main_line(_drain(drafter)) for t in tokens]
    before = set(drafter.hedges._hedges.get(1, {}))
    undecided = {key for key in before if key[0] >= n + 2}
    assert undecided and undecided != before  # hedges on both sides of the positions the ADVANCE decides
    drafter.apply(pb.DraftCommand(seq_id=1, epoch=0, kind=pb.DRAFT_COMMAND_KIND_ADVANCE, draft_until=n + 8,
                                  committed_len=n + 2, max_hedges=4))
    assert set(drafter.hedges._hedges.get(1, {})) == undecided  # positions n, n+1 are decided: only theirs go
    drafter.apply(pb.DraftCommand(seq_id=1, epoch=1, kind=RESET, start_pos=n + 2, tail=[main[2] + 1],
                                  draft_until=n + 8, committed_len=n + 3, max_hedges=4))
    assert drafter.hedges.live() == 0
    assert drafter.proposer.runner.free_slots == drafter.proposer.runner.max_slots - 1


def test_hedges_never_keep_a_new_sequence_out(draft_dir):
    drafter = _drafter(draft_dir, max_slots=3)
    _start(drafter, 1, PROMPT, len(PROMPT), len(PROMPT) + 6)
    _drain(drafter)
    assert drafter.hedges.live() == 2  # every free slot holds a hedge
    _start(drafter, 2, PROMPT[:5], 5, 9)  # evicts them
    _start(drafter, 3, PROMPT[:4], 4, 8)
    assert set(drafter.sequences) == {1, 2, 3} and drafter.hedges.live() == 0
    with pytest.raises(SlotsExhausted):
        _start(drafter, 4, PROMPT[:3], 3, 6)


async def test_adaptive_pearl_hedges_less_the_more_its_drafts_are_accepted():
    from duospec.coordinator.scheduling.adaptive import AcceptanceTracker
    from duospec.coordinator.scheduling.draft_commands import max_hedges

    scheduler, target, draft, _ = _scheduler()
    adaptive = SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=8, adaptive=True,
                                 hedges=4)
    seq = scheduler._add(_request(n=20), adaptive)
    for alpha, hedges in ((0.5, 4), (0.75, 2), (0.95, 1)):
        seq.acceptance = AcceptanceTracker.with_prior(alpha)
        assert max_hedges(seq) == hedges, alpha
    fixed = scheduler._add(_request(n=20, tenant="b"), _cache_policy())  # adaptive off: the configured number
    fixed.acceptance = AcceptanceTracker.with_prior(0.95)
    assert max_hedges(fixed) == 4
