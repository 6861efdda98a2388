"""A drafter with nothing to propose says so (an EXHAUSTED chunk): the target verifies what has
arrived instead of waiting for drafts that will not come, in every mode, and the drafter is reset
with the tokens decided without it. Fake links, as in test_scheduler.py."""

from __future__ import annotations

from duospec.coordinator.api import SpeculationMode
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.sampling import SamplingParams
from test_scheduler import _adaptive_pearl, _chunks, _commands, _request, _restart_measured, _scheduler, _verdict


def _exhausted(scheduler, seq, pos, tokens=()):
    chunk = pb.DraftChunk(seq_id=seq.seq_id, epoch=seq.epoch, start_pos=pos, tokens=list(tokens),
                          outlook=pb.DRAFT_OUTLOOK_EXHAUSTED)
    scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[chunk]))


async def test_vanilla_verifies_an_exhausted_chunk_without_waiting_for_gamma():
    """The n-gram drafter ran out of matches after two tokens: vanilla must not wait for γ = 4."""
    scheduler, target, draft, policy = _scheduler(SpeculationMode.VANILLA)
    seq = scheduler._add(_request(), policy)
    _chunks(scheduler, seq, 3, [10])
    assert not target.sent  # one draft: vanilla waits for γ
    _exhausted(scheduler, seq, 4, [11])
    assert list(target.sent[-1].items[0].draft_tokens) == [10, 11]
    assert target.sent[-1].items[0].bonus == pb.BONUS_POLICY_SAMPLE
    _verdict(scheduler, target, seq, 2, pb.NEXT_TOKEN_KIND_BONUS, 12)
    assert seq.committed == [1, 2, 3, 10, 11, 12] and not seq.draft_exhausted  # the RESET asks again
    reset = [c for m in draft.sent for c in m.commands if c.kind == pb.DRAFT_COMMAND_KIND_RESET][-1]
    assert (reset.start_pos, list(reset.tail), reset.committed_len) == (4, [11, 12], 6)


async def test_sampled_pearl_takes_the_bonus_after_an_exhausted_chunk():
    """Pearl declines the bonus for sampled requests while drafts may still come; past an exhausted
    chunk none will, so the bonus is taken (otherwise the sequence would never move on)."""
    scheduler, target, draft, policy = _scheduler()
    sampled = SamplingParams(temperature=1.0, seed=3)
    seq = scheduler._add(_request(sampling=sampled), policy)
    _exhausted(scheduler, seq, 3)  # no match on the prompt
    prefill = target.sent[-1].items[0]
    assert list(prefill.draft_tokens) == [] and prefill.bonus == pb.BONUS_POLICY_SKIP  # prefill only
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)
    step = target.sent[-1].items[0]
    assert list(step.draft_tokens) == [] and step.bonus == pb.BONUS_POLICY_SAMPLE
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 42)
    assert seq.committed == [1, 2, 3, 42]
    # With drafts still coming (not exhausted), the bonus is declined as before.
    _chunks(scheduler, seq, 4, [7])
    assert target.sent[-1].items[0].bonus == pb.BONUS_POLICY_SKIP


async def test_an_exhausted_marker_from_an_old_epoch_is_ignored():
    scheduler, target, draft, policy = _scheduler(SpeculationMode.VANILLA)
    seq = scheduler._add(_request(), policy)
    old = pb.DraftChunk(seq_id=seq.seq_id, epoch=seq.epoch + 5, start_pos=3, outlook=pb.DRAFT_OUTLOOK_EXHAUSTED)
    scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[old]))
    assert not seq.draft_exhausted and not target.sent


async def test_an_empty_exhausted_chunk_counts_as_fed_so_resets_stay_short():
    """An n-gram drafter with no match sends empty EXHAUSTED chunks; the RESET after the next token
    must start where the drafter's text ends, not resend the whole sequence."""
    scheduler, target, draft, policy = _scheduler(SpeculationMode.VANILLA)
    seq = scheduler._add(_request(prompt=tuple(range(1, 40)), n=10), policy)
    _exhausted(scheduler, seq, 39)
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 50)
    reset = [c for m in draft.sent for c in m.commands if c.kind == pb.DRAFT_COMMAND_KIND_RESET][-1]
    assert (reset.start_pos, list(reset.tail)) == (38, [39, 50])


async def test_an_exhausted_drafter_is_reset_with_the_tokens_decided_without_it():
    """An n-gram-like drafter with nothing to propose: a round it sent EXHAUSTED for is not an empty
    round (its bonus restarts the drafter with that token, as before), and an EXHAUSTED chunk that
    arrives after an empty round decided its position gets a RESET carrying the decided token —
    an ADVANCE carries no tokens, and the drafter would wait for one forever."""
    scheduler, target, draft, _ = _scheduler()
    policy = _adaptive_pearl(scheduler)
    seq = scheduler._add(_request(n=40), policy)
    seq.acceptance.accepted, seq.acceptance.rejected = 3.0, 7.0
    await _restart_measured(scheduler, target, seq)  # [20] under verification
    _exhausted(scheduler, seq, 5)  # nothing more from the drafter past 20
    resets = len(_commands(draft, pb.DRAFT_COMMAND_KIND_RESET))
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 21)  # 20 accepted, bonus 21: not guessed
    assert seq.committed[3:] == [50, 20, 21] and len(_commands(draft, pb.DRAFT_COMMAND_KIND_RESET)) == resets + 1
    empty = target.sent[-1].items[0]  # the restarted drafter has sent nothing: an empty round
    assert list(empty.draft_tokens) == [] and list(empty.context) == [21] and seq.spec.empty_round
    epoch = seq.epoch
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 22)
    assert seq.epoch == epoch and seq.committed[-1] == 22  # kept: the drafter's chunk is checked later
    _exhausted(scheduler, seq, 6)  # it has nothing for position 6, which the target decided: 22
    reset = _commands(draft, pb.DRAFT_COMMAND_KIND_RESET)[-1]
    assert seq.epoch == epoch + 1 and reset.epoch == epoch + 1 and list(reset.tail)[-1] == 22
    await scheduler.close()
