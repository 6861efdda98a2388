"""The prefix cache and the KV pool inside the workers: the target's verifier takes a prompt's cached
blocks (under the sequence's salt) and reports how many, with verdicts unchanged; a batch the pool
cannot hold loses its last items with KV_CACHE_FULL errors instead of failing; the drafter's model
proposer reuses cached prompts too and, short of blocks, drops hedges and then its newest sequences."""

from __future__ import annotations

import pytest
import torch

from duospec.draft_worker.drafter import Drafter
from duospec.draft_worker.model_proposer import ModelProposer
from duospec.engine import load_model
from duospec.engine.loader import KVOptions
from duospec.internal.sampling_wire import sampling_to_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.sampling import SamplingParams
from duospec.target_worker.verifier import Verifier
from tiny_models import make_tiny_checkpoint

BLOCK = 16
SYSTEM = torch.randint(4, 380, (70,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pc") / "m", "llama", seed=9)


def runner(path, blocks: int | None = None, **kv):
    # 2 layers x 2 kv heads x head_dim 16 x K and V x 4 bytes = 512 bytes per position
    memory = {"kv_cache_memory_bytes": blocks * BLOCK * 512} if blocks else {}
    return load_model(path, dtype=torch.float32, max_slots=8, max_context=256, kv=KVOptions(**memory, **kv))


def item(seq_id: int, context: list[int], drafts: list[int] = (), salt: str = "", start_pos: int = 0) -> pb.VerifyItem:
    return pb.VerifyItem(seq_id=seq_id, start_pos=start_pos, context=context, draft_tokens=drafts,
                         sampling=sampling_to_proto(SamplingParams()), bonus=pb.BONUS_POLICY_SAMPLE,
                         cache_salt=salt, logprobs=True)


def verify(verifier: Verifier, *items: pb.VerifyItem) -> pb.VerdictBatch:
    return verifier.run(pb.VerifyBatch(batch_id=1, items=items))


def same_verdict(a: pb.Verdict, b: pb.Verdict) -> bool:
    return (a.n_accepted, a.kind, a.next_token) == (b.n_accepted, b.kind, b.next_token) and all(
        abs(x.logprob - y.logprob) <= 1e-4 for x, y in zip(a.logprobs, b.logprobs))


def test_the_target_reuses_a_cached_prompt_and_says_how_much(path):
    plain = Verifier(runner(path, prefix_caching=False))
    cached = Verifier(runner(path))
    drafts = [7, 8, 9]
    for seq_id, (question, salt, want_cached) in enumerate([
            ([11, 12, 13], "a", 0),  # the first sees nothing cached
            ([21, 22], "a", 64),  # the system prompt's 4 full blocks, under the same salt
            ([31, 32, 33, 34], "b", 0),  # another tenant's salt
            ([41], "a", 64)]):
        prompt = SYSTEM + question
        want = verify(plain, item(seq_id, prompt, drafts)).verdicts[0]
        got = verify(cached, item(seq_id, prompt, drafts, salt)).verdicts[0]
        assert got.cached_tokens == want_cached and want.cached_tokens == 0
        assert same_verdict(got, want), seq_id
        # the next round feeds from the committed length as usual
        committed = len(prompt) + got.n_accepted + 1
        nxt = item(seq_id, [got.next_token], start_pos=committed - 1)
        assert same_verdict(verify(cached, nxt).verdicts[0], verify(plain, nxt).verdicts[0])
    stats = cached.runner.cache_stats()
    assert stats.hits == 128 and stats.queries == sum(70 + n for n in (3, 2, 4, 1))


def test_a_prompt_sent_in_prefill_chunks_is_matched_chunk_by_chunk(path):
    verifier = Verifier(runner(path))
    prompt = SYSTEM + SYSTEM[:30]  # 100 tokens
    first = verify(verifier, item(1, prompt, [5])).verdicts[0]
    # the same prompt again, in chunks of 40 (a prefill chunk's verdict keeps all but its last token)
    got = []
    start = 0
    for end in (40, 80):
        verdict = verify(verifier, item(2, prompt[start:end], start_pos=start)).verdicts[0]
        got.append(verdict.cached_tokens)
        start = end - 1
    last = verify(verifier, item(2, prompt[start:], [5], start_pos=start)).verdicts[0]
    got.append(last.cached_tokens)
    assert got == [32, 64 - 39, 96 - 79] and first.cached_tokens == 0
    assert same_verdict(last, first)


def _features(verdict: pb.Verdict) -> torch.Tensor:
    from duospec.internal.features_wire import features_from_proto

    return features_from_proto(verdict.features)[1]


def test_items_asking_for_features_take_cached_blocks_only_with_their_hidden_rows(path):
    """A head drafter's sequence needs the hidden states of every committed position: it takes cached
    blocks only where the target kept those too (blocks a head's sequence wrote), across rounds, and
    gets the same features and verdicts as a target without the cache."""
    verifier, plain = Verifier(runner(path)), Verifier(runner(path, prefix_caching=False))

    def both(it: pb.VerifyItem) -> pb.Verdict:
        it.features = True
        got, want = verify(verifier, it).verdicts[0], verify(plain, it).verdicts[0]
        assert same_verdict(got, want)
        assert got.features.start_pos == want.features.start_pos == it.start_pos
        assert torch.allclose(_features(got), _features(want), atol=2e-3)
        return got

    verify(verifier, item(1, SYSTEM + [1, 2], [3]))  # no features: its blocks keep no hidden rows
    first = both(item(2, SYSTEM + [1, 2], [3]))
    assert first.cached_tokens == 0 and len(first.features.fp16) == 2 * 64 * (len(SYSTEM) + 2 + first.n_accepted)
    # decode rounds complete the prompt's fifth block (positions 64 .. 79) a few tokens at a time
    tokens = SYSTEM + [1, 2] + [3][: first.n_accepted] + [first.next_token]
    while len(tokens) < 84:
        verdict = both(item(2, [tokens[-1]], [5, 6], start_pos=len(tokens) - 1))
        tokens += [5, 6][: verdict.n_accepted] + [verdict.next_token]
    second = both(item(3, SYSTEM + [1, 2], [3]))
    assert second.cached_tokens == 64  # the prompt's four full blocks
    assert _features(second)[:64].equal(_features(first)[:64])  # sent as kept, not recomputed
    third = both(item(4, tokens[:83], [9]))
    assert third.cached_tokens == 80  # the fifth block, whose rows came over four rounds
    other = both(item(5, SYSTEM + [1, 2], [3], salt="b"))
    assert other.cached_tokens == 0  # another tenant's salt finds neither blocks nor rows


def test_a_batch_the_pool_cannot_hold_loses_its_last_items(path):
    verifier = Verifier(runner(path, blocks=16))  # 256 positions
    prompts = [torch.randint(4, 380, (100,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    out = verify(verifier, *(item(i, p, [5, 6]) for i, p in enumerate(prompts)))
    assert [v.seq_id for v in out.verdicts] == [0, 1]
    assert [(e.seq_id, e.kind) for e in out.errors] == [(2, pb.VERIFY_ERROR_KIND_KV_CACHE_FULL)]
    assert "more blocks" in out.errors[0].message
    # the coordinator frees a sequence (preemption) and resends: it fits and gets the verdict it would have
    out = verifier.run(pb.VerifyBatch(batch_id=2, items=[item(2, prompts[2], [5, 6])], release_seq_ids=[0]))
    alone = verify(Verifier(runner(path)), item(2, prompts[2], [5, 6])).verdicts[0]
    assert not out.errors and same_verdict(out.verdicts[0], alone)
    verifier.release_all()
    assert verifier.runner.cache_stats().free_blocks == 16


def start(seq_id: int, tokens: list[int], salt: str = "", draft_until: int = 10_000, hedges: int = 0) -> pb.DraftCommand:
    return pb.DraftCommand(seq_id=seq_id, kind=pb.DRAFT_COMMAND_KIND_START, tail=tokens, committed_len=len(tokens),
                           draft_until=draft_until, sampling=sampling_to_proto(SamplingParams()), cache_salt=salt,
                           max_hedges=hedges)


def draft(drafter: Drafter, steps: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for _ in range(steps):
        for chunk in drafter.step():
            if not chunk.HasField("hedge"):
                out.setdefault(chunk.seq_id, []).extend(chunk.tokens)
    return out


def test_the_drafter_reuses_cached_prompts_and_drafts_the_same(path):
    plain = Drafter(ModelProposer(runner(path, prefix_caching=False)))
    cached = Drafter(ModelProposer(runner(path)))
    for drafter in (plain, cached):
        drafter.apply(start(1, SYSTEM + [1, 2, 3], draft_until=len(SYSTEM) + 3 + 6))
        drafter.apply(start(2, SYSTEM + [4, 5], draft_until=len(SYSTEM) + 2 + 6))
    first = draft(plain, 8)
    assert draft(cached, 8) == first and len(first[1]) == 6
    proposer = cached.proposer
    # the second sequence started after the first was committed up to its prompt: nothing to share yet
    assert proposer.runner.cache_stats().hits == 0
    cached.apply(start(3, SYSTEM + [6], draft_until=len(SYSTEM) + 1 + 4))
    plain.apply(start(3, SYSTEM + [6], draft_until=len(SYSTEM) + 1 + 4))
    assert draft(cached, 5) == draft(plain, 5)
    assert proposer.runner.cache_stats().hits == 64
    assert cached.stats()["prefix_cache_hits"] == 64


def test_a_drafter_short_of_blocks_drops_hedges_then_its_newest_sequence(path):
    drafter = Drafter(ModelProposer(runner(path, blocks=16)))  # 256 positions
    prompts = [torch.randint(4, 380, (110,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    drafter.apply(start(1, prompts[0], draft_until=120))
    drafter.apply(start(2, prompts[1], draft_until=120))
    drafter.apply(start(3, prompts[2], draft_until=120))
    tokens = draft(drafter, 12)
    assert set(drafter.sequences) == {1, 2} and drafter.dropped == [3] and len(tokens[1]) == 10
    drafter.release_all()
    assert drafter.proposer.runner.cache_stats().free_blocks == 16


def test_a_prefill_chunk_with_max_compute_is_fed_as_far_as_the_cache_allows(path):
    verifier = Verifier(runner(path))
    prompt = SYSTEM + SYSTEM[:30]  # 100 tokens
    verify(verifier, item(1, prompt, [5]))
    chunk = item(2, prompt, start_pos=0)
    chunk.max_compute, chunk.bonus = 20, pb.BONUS_POLICY_SKIP
    verdict = verify(verifier, chunk).verdicts[0]
    assert (verdict.cached_tokens, verdict.context_fed) == (96, 100)  # 96 cached, the last 4 computed
    assert verifier.runner.slot_length(verifier.slots[2]) == 99  # as after a prefill chunk of 100
    cold = item(3, SYSTEM[::-1] + SYSTEM[:30], start_pos=0)
    cold.max_compute, cold.bonus = 20, pb.BONUS_POLICY_SKIP
    verdict = verify(verifier, cold).verdicts[0]
    assert (verdict.cached_tokens, verdict.context_fed) == (0, 20)  # nothing cached: its budget only
    drafted = item(4, prompt, [5])
    drafted.max_compute = 20
    [error] = verify(verifier, drafted).errors
    assert error.kind == pb.VERIFY_ERROR_KIND_BAD_REQUEST and "without drafts" in error.message
