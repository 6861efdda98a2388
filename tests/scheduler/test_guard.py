"""The goodput guard: speculation off when it does not pay, back on when it does; output unchanged.

Pure tests drive `GoodputGuard` with a fake clock; the scenario tests drive the real `Scheduler` with
fake links and a fake clock: a drafter that never agrees, then one that agrees every time.
"""

from __future__ import annotations

import pytest

from duospec.coordinator.api import GenerationRequest, ModelInfo, SpeculationMode, TokensEvent
from duospec.coordinator.scheduling.guard import GoodputGuard, GuardState, load_bucket
from duospec.coordinator.scheduling.policies import SpeculationPolicy
from duospec.coordinator.scheduling.scheduler import Scheduler, SchedulerConfig
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.sampling import SamplingParams
from test_scheduler import FakeLink


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _run(guard, clock, rounds, seconds_per_token, tokens_per_round, live=1):
    """`rounds` verify rounds at the given goodput for each state; returns rounds spent speculating."""
    speculated = 0
    for _ in range(rounds):
        state = guard.state
        tokens = tokens_per_round[state]
        clock.now += tokens * seconds_per_token[state]
        speculated += state is GuardState.SPECULATE
        guard.observe_round(tokens, live)
    return speculated


SLOW_DRAFT = {GuardState.SPECULATE: 1 / 80, GuardState.TARGET_ONLY: 1 / 100}  # seconds per token
GOOD_DRAFT = {GuardState.SPECULATE: 1 / 250, GuardState.TARGET_ONLY: 1 / 100}
TOKENS = {GuardState.SPECULATE: 2, GuardState.TARGET_ONLY: 1}


def _guard():
    """A guard on a fake clock, and the rounds one of its windows takes (settling included)."""
    clock = FakeClock()
    guard = GoodputGuard(clock=clock, window_s=0.0)  # windows of window_rounds exactly
    return guard, clock, guard.window_rounds + guard.settle_rounds + 1  # + the round that starts the clock


def test_load_buckets():
    assert [load_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_a_losing_draft_is_switched_off_within_two_windows_and_probed_rarely():
    guard, clock, per_window = _guard()
    _run(guard, clock, 2 * per_window, SLOW_DRAFT, TOKENS)
    assert guard.state is GuardState.TARGET_ONLY
    speculated = _run(guard, clock, 200 * per_window, SLOW_DRAFT, TOKENS)
    # Probes back off exponentially while they lose: a small share of the time goes to them.
    assert speculated / (200 * per_window) < 0.08
    assert guard.stats()["goodput"]["speculate@1"] < guard.stats()["goodput"]["target_only@1"]


def test_a_draft_that_becomes_good_is_switched_back_on():
    guard, clock, per_window = _guard()
    _run(guard, clock, 20 * per_window, SLOW_DRAFT, TOKENS)
    assert guard.state is GuardState.TARGET_ONLY
    # At most the current probe interval (<= max_probe_every windows) passes before the next probe.
    _run(guard, clock, (guard.max_probe_every + 3) * per_window, GOOD_DRAFT, TOKENS)
    assert guard.state is GuardState.SPECULATE
    speculated = _run(guard, clock, 40 * per_window, GOOD_DRAFT, TOKENS)
    assert speculated > 0.85 * 40 * per_window


def test_a_winning_draft_keeps_speculating():
    guard, clock, per_window = _guard()
    speculated = _run(guard, clock, 100 * per_window, GOOD_DRAFT, TOKENS)
    assert guard.state is GuardState.SPECULATE and speculated > 0.9 * 100 * per_window


def test_an_unlucky_first_window_does_not_decide_a_short_run():
    """The first speculating window is slow (a request's start-up); speculation pays after that. The
    guard turns it off on that one window, but checks again within `confirm_every` windows instead of
    spending the next `probe_every` windows target-only."""
    guard, clock, per_window = _guard()
    _run(guard, clock, per_window, {**GOOD_DRAFT, GuardState.SPECULATE: 1 / 60}, TOKENS)  # unlucky start
    _run(guard, clock, per_window, GOOD_DRAFT, TOKENS)
    assert guard.state is GuardState.TARGET_ONLY  # the one-window comparison went against speculation
    _run(guard, clock, (guard.confirm_every + 2) * per_window, GOOD_DRAFT, TOKENS)
    assert guard.state is GuardState.SPECULATE
    speculated = _run(guard, clock, 20 * per_window, GOOD_DRAFT, TOKENS)
    assert speculated > 0.85 * 20 * per_window


def test_windows_compare_like_with_like_load():
    guard, clock, per_window = _guard()
    _run(guard, clock, 2 * per_window, GOOD_DRAFT, TOKENS, live=1)
    assert guard.state is GuardState.SPECULATE
    _run(guard, clock, 2 * per_window, SLOW_DRAFT, TOKENS, live=8)  # another load: measured afresh
    assert {(s.value, b) for s, b in guard.goodput} == {("target_only", 0), ("speculate", 0), ("speculate", 3),
                                                       ("target_only", 3)}
    assert guard.state is GuardState.TARGET_ONLY


def test_speculation_that_lost_at_a_lighter_load_is_not_measured_at_once_at_a_heavier_one():
    """A burst at a new, heavier load starts target-only when speculation lost at a lighter one; it is
    still measured there, at the first regular probe, and taken when it wins."""
    guard, clock, per_window = _guard()
    _run(guard, clock, 2 * per_window, SLOW_DRAFT, TOKENS, live=1)
    assert guard.state is GuardState.TARGET_ONLY
    speculated = _run(guard, clock, (guard.probe_every - 1) * per_window, GOOD_DRAFT, TOKENS, live=8)
    assert speculated == 0 and (GuardState.SPECULATE, load_bucket(8)) not in guard.goodput
    _run(guard, clock, 3 * per_window, GOOD_DRAFT, TOKENS, live=8)
    assert guard.state is GuardState.SPECULATE and (GuardState.SPECULATE, load_bucket(8)) in guard.goodput
    # after a long target-only stretch at the lighter load (its probe counter well past probe_every)
    guard, clock, per_window = _guard()
    _run(guard, clock, 40 * per_window, SLOW_DRAFT, TOKENS, live=1)
    if guard.state is GuardState.SPECULATE:  # mid-probe: let it lose and return
        _run(guard, clock, 2 * per_window, SLOW_DRAFT, TOKENS, live=1)
    assert guard.state is GuardState.TARGET_ONLY
    speculated = _run(guard, clock, (guard.probe_every - 1) * per_window, GOOD_DRAFT, TOKENS, live=8)
    assert speculated == 0 and (GuardState.SPECULATE, load_bucket(8)) not in guard.goodput
    # the other way round there is no such rule: a lighter load never inherits a heavier one's verdict
    guard, clock, per_window = _guard()
    _run(guard, clock, 2 * per_window, SLOW_DRAFT, TOKENS, live=8)
    assert guard.state is GuardState.TARGET_ONLY
    _run(guard, clock, 3 * per_window, GOOD_DRAFT, TOKENS, live=1)
    assert (GuardState.SPECULATE, load_bucket(1)) in guard.goodput and guard.state is GuardState.SPECULATE


def test_idle_time_between_requests_does_not_count():
    guard, clock, _ = _guard()
    for _ in range(40):  # short requests with long gaps between them
        guard.work_arrived()
        _run(guard, clock, 7, GOOD_DRAFT, TOKENS)
        clock.now += 5.0
    rates = guard.stats()["goodput"]
    assert rates["speculate@1"] == pytest.approx(250, rel=0.01)
    assert rates["target_only@1"] == pytest.approx(100, rel=0.01)


def test_a_window_lasts_at_least_window_s():
    clock = FakeClock()
    guard = GoodputGuard(clock=clock, window_s=1.0)
    _run(guard, clock, 60, GOOD_DRAFT, TOKENS)  # 60 rounds of 8 ms: under a second of measurement
    assert not guard.goodput
    _run(guard, clock, 80, GOOD_DRAFT, TOKENS)
    assert guard.goodput


# -- through the scheduler ------------------------------------------------------------------------------
def _target_token(pos: int) -> int:
    return 10 + pos % 50


def _scheduler(clock):
    info = ModelInfo(name="m", target_path="t", draft_path="d", vocab_size=100, max_context=4096, eos_token_id=None,
                     draft_method="model")
    target, draft = FakeLink(), FakeLink()
    scheduler = Scheduler(info, target, draft, SchedulerConfig())
    scheduler.guard.clock = clock
    scheduler.guard.window_s = 0.0  # fake rounds are a few ms: count windows in rounds only
    return scheduler, target, draft


def _drive(scheduler, target, seq, clock, rounds, draft_agrees: bool):
    """Plays drafter and target for `rounds` verify rounds: a speculating round costs 3 ms, a
    target-only one 2 ms (so a draft that never agrees loses, one that always agrees wins)."""
    for _ in range(rounds):
        if seq.uses_draft and not seq.draft_paused and not seq.drafts:
            pos = seq.next_draft_pos
            tokens = [_target_token(p) + (0 if draft_agrees else 1) for p in range(pos, min(pos + 4, seq.draft_until()))]
            if tokens:
                scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[
                    pb.DraftChunk(seq_id=seq.seq_id, epoch=seq.epoch, start_pos=pos, tokens=tokens)]))
        assert scheduler.inflight is not None, "the target should be busy"
        item = target.sent[-1].items[0]
        start = item.start_pos + len(item.context)
        drafts = list(item.draft_tokens)
        accepted = next((i for i, t in enumerate(drafts) if t != _target_token(start + i)), len(drafts))
        kind = pb.NEXT_TOKEN_KIND_RECOVERED if accepted < len(drafts) else pb.NEXT_TOKEN_KIND_BONUS
        clock.now += 0.003 if drafts else 0.002
        # forward_seconds=0: the verify cost model stays unfitted, so only the guard decides here
        scheduler.on_verdict_batch(pb.VerdictBatch(batch_id=target.sent[-1].batch_id, verdicts=[pb.Verdict(
            seq_id=seq.seq_id, epoch=item.epoch, n_accepted=accepted, kind=kind,
            next_token=_target_token(start + accepted))]))


async def test_guard_turns_a_never_agreeing_draft_off_and_a_good_one_back_on_exactly():
    clock = FakeClock()
    scheduler, target, draft = _scheduler(clock)
    policy = SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=9, adaptive=True)
    prompt = (1, 2, 3)
    seq = scheduler._add(GenerationRequest(request_id="r", prompt_token_ids=prompt, max_new_tokens=100_000,
                                           sampling=SamplingParams()), policy)
    per_window = scheduler.guard.window_rounds + scheduler.guard.settle_rounds + 1
    _drive(scheduler, target, seq, clock, 2 * per_window + 2, draft_agrees=False)
    assert scheduler.guard.state is GuardState.TARGET_ONLY and seq.draft_paused
    assert scheduler._draft_limit(seq) == 0
    last = [c for m in draft.sent for c in m.commands if c.seq_id == seq.seq_id][-1]
    assert last.draft_until <= len(seq.committed)  # the drafter was told to stop drafting
    # The first choice rested on one window each: one confirming probe comes soon, then they back off.
    _drive(scheduler, target, seq, clock, (scheduler.guard.confirm_every + 2) * per_window, draft_agrees=False)
    assert scheduler.guard.state is GuardState.TARGET_ONLY and seq.draft_paused
    drafted_while_off = seq.stats.drafted_tokens
    _drive(scheduler, target, seq, clock, 2 * per_window, draft_agrees=False)
    assert seq.stats.drafted_tokens == drafted_while_off  # backing off (4 windows now): nothing drafted
    _drive(scheduler, target, seq, clock, (scheduler.guard.max_probe_every + 3) * per_window, draft_agrees=True)
    assert scheduler.guard.state is GuardState.SPECULATE and not seq.draft_paused
    accepted_before = seq.stats.accepted_tokens
    _drive(scheduler, target, seq, clock, per_window, draft_agrees=True)
    assert seq.stats.accepted_tokens > accepted_before + 3 * per_window  # ~4 per round
    committed = seq.committed[len(prompt):]
    assert committed == [_target_token(len(prompt) + i) for i in range(len(committed))]  # the target's, always
    streamed = []
    while not seq.events.empty():
        event = seq.events.get_nowait()
        if isinstance(event, TokensEvent):
            streamed.extend(event.token_ids)
    assert streamed == committed
    guard = scheduler.stats()["guard"]
    assert 0 < guard["speculating_share"] < 1 and 0 < guard["drafted_rounds"] < guard["rounds"]


async def test_sampled_and_vanilla_sequences_are_never_switched_off():
    clock = FakeClock()
    scheduler, target, draft = _scheduler(clock)
    scheduler.guard.state = GuardState.TARGET_ONLY
    for mode, sampling in ((SpeculationMode.PEARL, SamplingParams(temperature=1.0, seed=1)),
                           (SpeculationMode.VANILLA, SamplingParams())):
        policy = SpeculationPolicy(mode=mode, max_draft_tokens=4, max_lookahead=9, adaptive=True)
        seq = scheduler._add(GenerationRequest(request_id=f"r-{mode.value}", prompt_token_ids=(1, 2),
                                               max_new_tokens=8, sampling=sampling), policy)
        assert scheduler._draft_limit(seq) == 4 and not scheduler._guarded(seq)
    greedy = scheduler._add(GenerationRequest(request_id="g", prompt_token_ids=(1, 2), max_new_tokens=8,
                                              sampling=SamplingParams()),
                            SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=9))
    assert scheduler._guarded(greedy) and scheduler._draft_limit(greedy) == 0


@pytest.mark.parametrize("adaptive", [False])
async def test_adaptive_off_turns_the_guard_off(adaptive):
    clock = FakeClock()
    scheduler, _, _ = _scheduler(clock)
    scheduler.guard.state = GuardState.TARGET_ONLY
    policy = SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=9, adaptive=adaptive)
    seq = scheduler._add(GenerationRequest(request_id="r", prompt_token_ids=(1, 2), max_new_tokens=8,
                                           sampling=SamplingParams()), policy)
    assert scheduler._draft_limit(seq) == 4


def test_a_churning_load_still_closes_windows():
    """Live sequences crossing a bucket edge every few rounds (8 <-> 9) must not keep every window
    from closing (the guard would never probe)."""
    guard, clock, per_window = _guard()
    for i in range(200):
        _run(guard, clock, 15, SLOW_DRAFT, TOKENS, live=8 if i % 2 else 9)
    assert guard.goodput and guard.switches >= 1 and guard.state is GuardState.TARGET_ONLY


async def test_new_sequences_never_start_below_the_acceptance_floor():
    from duospec.coordinator.scheduling.scheduler import ACCEPTANCE_FLOOR

    scheduler, _, _ = _scheduler(FakeClock())
    scheduler.recent_acceptance.observe(0.02)  # the drafter did badly lately
    policy = SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=9)
    seq = scheduler._add(GenerationRequest(request_id="r", prompt_token_ids=(1, 2), max_new_tokens=8,
                                           sampling=SamplingParams()), policy)
    assert seq.acceptance.alpha == pytest.approx(ACCEPTANCE_FLOOR)
    scheduler.recent_acceptance.value = 0.9  # a good drafter: start from its record
    seq = scheduler._add(GenerationRequest(request_id="s", prompt_token_ids=(1, 2), max_new_tokens=8,
                                           sampling=SamplingParams()), policy)
    assert seq.acceptance.alpha == pytest.approx(0.9)


async def test_going_target_only_on_a_rejection_rolls_the_drafter_back():
    """The back-off that pauses a sequence on a rejecting verdict must RESET the drafter (new epoch,
    the correction in the tail), or the rejected draft would stay in the drafter's text."""
    clock = FakeClock()
    scheduler, target, draft = _scheduler(clock)
    policy = SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=9, adaptive=True)
    seq = scheduler._add(GenerationRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=50,
                                           sampling=SamplingParams()), policy)
    prefill = target.sent[-1]  # pearl prefills the prompt at once, taking no token
    scheduler.on_verdict_batch(pb.VerdictBatch(batch_id=prefill.batch_id, verdicts=[pb.Verdict(
        seq_id=seq.seq_id, epoch=0, n_accepted=0, kind=pb.NEXT_TOKEN_KIND_NONE)]))
    scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[pb.DraftChunk(seq_id=seq.seq_id, epoch=0, start_pos=3,
                                                                       tokens=[10, 11])]))
    item = target.sent[-1].items[0]
    scheduler.guard.state = GuardState.TARGET_ONLY  # the guard decided while the verify was in flight
    scheduler.on_verdict_batch(pb.VerdictBatch(batch_id=target.sent[-1].batch_id, verdicts=[pb.Verdict(
        seq_id=seq.seq_id, epoch=item.epoch, n_accepted=1, kind=pb.NEXT_TOKEN_KIND_RECOVERED, next_token=99)]))
    assert seq.committed == [1, 2, 3, 10, 99] and seq.draft_paused
    last = [c for m in draft.sent for c in m.commands if c.seq_id == seq.seq_id][-1]
    assert last.kind == pb.DRAFT_COMMAND_KIND_RESET and last.epoch == seq.epoch == 1
    assert list(last.tail)[-1] == 99 and last.draft_until == len(seq.committed)


def test_a_benchmark_keeps_one_guard_per_speculation_variant():
    """Interleaved variants: each continues from what it learned itself, none inherits another's."""
    import types

    from duospec.bench.guards import use_speculation_choices
    from duospec.coordinator.scheduling.replicas import ReplicaSet
    from duospec.coordinator.scheduling.router import ModelRouter

    def entry(opened):
        replicas = ReplicaSet()
        replicas.add(open_scheduler=None).scheduler = opened
        return types.SimpleNamespace(replicas=replicas)

    router = ModelRouter()
    scheduler = types.SimpleNamespace(guard=GoodputGuard())
    router.entries = {"m": entry(scheduler), "unopened": entry(None)}
    use_speculation_choices(router, "pearl")
    pearls = scheduler.guard
    pearls.state = GuardState.TARGET_ONLY  # what the pearl runs taught it
    use_speculation_choices(router, "pearl-notree")
    assert scheduler.guard is not pearls and scheduler.guard.state is GuardState.SPECULATE
    assert scheduler.guard.goodput == {}
    notrees = scheduler.guard
    use_speculation_choices(router, "pearl")
    assert scheduler.guard is pearls and scheduler.guard.state is GuardState.TARGET_ONLY
    use_speculation_choices(router, "pearl-notree")
    assert scheduler.guard is notrees
    other = ModelRouter()  # another coordinator: guards of its own
    other.entries = {"m": entry(types.SimpleNamespace(guard=GoodputGuard()))}
    use_speculation_choices(other, "pearl")
    assert other.entries["m"].replicas.replicas[0].scheduler.guard is not pearls


def test_rounds_that_read_prompts_are_not_measured():
    """A wave of prompt prefills costs the same in either state; counted, it made whichever state was
    running then look slow (requests arriving together at 8 streams)."""
    guard, clock, per_window = _guard()
    for _ in range(3 * per_window):  # speculating: decode rounds at 250 tok/s
        clock.now += 2 / 250
        guard.observe_round(2, 1)
        if guard.state is GuardState.TARGET_ONLY:
            break
    assert guard.state is GuardState.TARGET_ONLY  # the probe of the unmeasured state
    for i in range(3 * per_window):  # target-only at 100 tok/s, every other round a slow prefill
        if guard.state is not GuardState.TARGET_ONLY:
            break
        prefill = i % 2 == 0
        clock.now += 0.05 if prefill else 1 / 100
        guard.observe_round(1, 1, decode_only=not prefill)
    assert guard.stats()["goodput"]["target_only@1"] == pytest.approx(100, rel=0.01)
