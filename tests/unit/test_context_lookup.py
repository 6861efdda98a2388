"""The model drafter's context lookup (draft_worker/context_lookup.py): what it copies, from where, and when."""

from __future__ import annotations

import dataclasses
import math

import torch

from duospec.draft_worker.context_lookup import MAX_CONFIDENCE, ContextLookup
from duospec.draft_worker.model_proposer import proposals_from_logits
from duospec.draft_worker.proposer import DraftState
from duospec.sampling import SamplingParams

GREEDY = SamplingParams()


def _seq(tokens, committed=None, seq_id=1, sampling=GREEDY) -> DraftState:
    return DraftState(seq_id=seq_id, epoch=0, sampling=sampling, tokens=list(tokens),
                      committed_len=len(tokens) if committed is None else committed, draft_until=len(tokens) + 8)


def _opened(tokens, committed=None) -> tuple[ContextLookup, DraftState]:
    lookup = ContextLookup()
    seq = _seq(tokens, committed)
    lookup.open(seq)
    return lookup, seq


def test_the_token_after_an_earlier_occurrence_of_the_last_bigram_is_suggested():
    lookup, seq = _opened([5, 1, 2, 3, 9, 1, 2])
    assert lookup.suggest(seq) == 3


def test_no_earlier_occurrence_or_a_single_matching_token_suggests_nothing():
    lookup, seq = _opened([1, 2, 3, 4, 5, 6, 2])  # "2" recurs, but the bigram "6 2" does not
    assert lookup.suggest(seq) is None
    assert ContextLookup().suggest(_seq([1, 2])) is None  # never opened


def test_the_occurrence_matching_furthest_back_wins_then_the_latest():
    # "7 1 2" -> 3 (early), "8 1 2" -> 4 (later): the text ends "7 1 2", so the deeper match (3) wins
    lookup, seq = _opened([7, 1, 2, 3, 8, 1, 2, 4, 0, 7, 1, 2])
    assert lookup.suggest(seq) == 3
    # equally deep matches: the latest
    lookup, seq = _opened([6, 1, 2, 3, 6, 1, 2, 4, 9, 1, 2])
    assert lookup.suggest(seq) == 4


def test_only_verified_text_is_copied_from():
    # the earlier "1 2 -> 3" lies in the unverified draft (positions >= 4): not a source
    lookup, seq = _opened([0, 0, 0, 0, 1, 2, 3, 1, 2], committed=4)
    assert lookup.suggest(seq) is None
    seq.committed_len = 7  # verified up to the 3: now it is
    assert lookup.suggest(seq) == 3


def test_a_rewind_forgets_the_replaced_positions_and_the_new_ones_are_indexed_once_verified():
    lookup, seq = _opened([1, 2, 3, 4, 1, 2])
    assert lookup.suggest(seq) == 3
    lookup.rewind(seq, 2)  # an abort replaces everything from position 2
    seq.tokens[2:] = [5, 6, 1, 2]
    seq.committed_len = 2
    assert lookup.suggest(seq) is None  # the old "1 2 -> 3" is gone
    seq.committed_len = 4
    seq.tokens[4:] = [5, 1, 2]
    seq.committed_len = 5
    # verified now: 1 2 5 6 5; the text ends "1 2": 5 followed "1 2" at position 2
    assert lookup.suggest(seq) == 5


def test_hedges_read_the_index_but_never_change_or_free_it():
    lookup, seq = _opened([1, 2, 3, 4, 1, 2, 3])
    hedge = dataclasses.replace(seq, tokens=seq.tokens[:6] + [9, 1, 2], committed_len=6)
    assert lookup.suggest(hedge) == 3
    lookup.rewind(hedge, 1)
    lookup.close(hedge)
    seq.tokens.extend([4, 1, 2])
    assert lookup.suggest(seq) == 3
    lookup.close(seq)
    assert lookup.suggest(seq) is None


def _logits(rows: list[dict[int, float]], vocab: int = 16) -> torch.Tensor:
    """Rows with the given probabilities (the rest of each row's mass spread evenly)."""
    out = torch.empty(len(rows), vocab)
    for i, probs in enumerate(rows):
        rest = (1.0 - sum(probs.values())) / (vocab - len(probs))
        out[i] = math.log(rest)
        for token, p in probs.items():
            out[i, token] = math.log(p)
    return out


def test_a_greedy_row_copies_only_where_the_model_is_unsure_and_keeps_its_choice_as_the_next_best():
    lookup = ContextLookup()
    unsure, sure = _seq([1, 2, 3, 4, 1, 2], seq_id=1), _seq([1, 2, 3, 4, 1, 2], seq_id=2)
    lookup.open(unsure)
    lookup.open(sure)
    low, high = MAX_CONFIDENCE - 0.2, MAX_CONFIDENCE + 0.1
    proposals = proposals_from_logits(_logits([{7: low, 3: 0.05}, {7: high}]), [unsure, sure], lookup)
    assert proposals[0].tokens == [3]  # copied: what followed "1 2" before
    assert proposals[0].alternatives[0][0] == 7  # the model's argmax is the first hedge key
    assert proposals[1].tokens == [7]  # the model was sure: its argmax
    assert lookup.stats() == {"lookup_consulted": 1, "lookup_used": 1}  # the sure row was not asked
    without = proposals_from_logits(_logits([{7: low, 3: 0.05}]), [unsure])
    assert without[0].tokens == [7]


def test_sampled_and_grammar_masked_rows_never_copy():
    lookup = ContextLookup()
    sampled = _seq([1, 2, 3, 4, 1, 2], seq_id=1, sampling=SamplingParams(temperature=1.0, seed=3))
    masked = _seq([1, 2, 3, 4, 1, 2], seq_id=2)
    for seq in (sampled, masked):
        lookup.open(seq)
    assert lookup.suggest(sampled) == 3 and lookup.suggest(masked) == 3
    from duospec.structured.backend import allocate_bitmask

    masked.grammar_mask = allocate_bitmask(1, 16)  # every token legal
    proposals_from_logits(_logits([{7: 0.3}, {7: 0.3}]), [sampled, masked], lookup)
    assert lookup.stats()["lookup_consulted"] == 0


def test_a_greedy_chain_ends_after_a_token_the_model_was_unsure_of_unless_it_was_copied():
    lookup = ContextLookup()
    copied, unsure, sure = (_seq([1, 2, 3, 4, 1, 2], seq_id=i) for i in (1, 2, 3))
    unsure.tokens[-1] = 11  # no earlier "1 11": nothing to copy
    for seq in (copied, unsure, sure):
        lookup.open(seq)
    sampled = _seq([1, 2, 3], seq_id=4, sampling=SamplingParams(temperature=1.0, seed=3))
    rows = _logits([{7: 0.3}, {7: 0.3}, {7: 0.9}, {7: 0.3}])
    proposals = proposals_from_logits(rows, [copied, unsure, sure, sampled], lookup, stop_below=0.4)
    assert [p.tokens[0] for p in proposals[:3]] == [3, 7, 7]
    # the copy goes on; the unsure argmax ends the chain; a sure token and a sampled draw go on
    assert [p.exhausted for p in proposals] == [False, True, False, False]
    assert not any(p.exhausted for p in proposals_from_logits(rows, [copied, unsure, sure, sampled], lookup))


def test_the_chain_stop_is_on_for_a_drafter_on_the_cpu_and_off_on_an_accelerator_unless_set():
    import types

    from duospec.draft_worker.methods import build_proposer
    from duospec.draft_worker.model_proposer import CPU_STOP_CONFIDENCE
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec

    def stop(device: str, **options) -> float:
        runner = types.SimpleNamespace(device=torch.device(device), max_context=64)
        return build_proposer(DraftSpec(DraftMethod.MODEL, path="d", **options), "t", runner=runner).stop_below

    assert CPU_STOP_CONFIDENCE > 0
    assert stop("cpu") == CPU_STOP_CONFIDENCE and stop("cuda") == 0.0
    assert stop("cpu", stop_confidence=0.0) == 0.0 and stop("cuda", stop_confidence=0.3) == 0.3
    # an EAGLE / EAGLE-3 head drafts with the same lookup and chain stop
    head = types.SimpleNamespace(device=torch.device("cpu"), max_context=64, config=types.SimpleNamespace(hidden_size=8))
    for method in (DraftMethod.EAGLE, DraftMethod.EAGLE3):
        proposer = build_proposer(DraftSpec(method, path="h"), "t", runner=head)
        assert proposer.lookup is not None and proposer.stop_below == CPU_STOP_CONFIDENCE
        assert build_proposer(DraftSpec(method, path="h", context_lookup=False), "t", runner=head).lookup is None


def test_the_teacher_forced_simulation_copies_only_from_text_verified_before_each_round():
    from duospec.training.acceptance import AcceptanceStats, round_stats

    prompt, continuation = [1, 2, 3, 4], [1, 2, 3, 9]
    wrong, unsure = [0] * 4, [0.1] * 4  # the model never guesses right and is never sure
    # rounds: 1 (miss), 2 (miss), then "1 2" -> 3 is copied (accepted) and "2 3" -> 4 is not the 9
    assert round_stats(prompt, continuation, wrong, unsure, 4, lookup=True) == AcceptanceStats(3, 4, 1, 4)
    assert round_stats(prompt, continuation, wrong, unsure, 4) == AcceptanceStats(4, 4, 0, 4)
    assert round_stats(prompt, continuation, wrong, [0.9] * 4, 4, lookup=True) == AcceptanceStats(4, 4, 0, 4)


def test_a_trimmed_vocabulary_is_searched_on_its_columns_with_the_same_proposals():
    # A draft vocabulary's logits are -inf outside its columns: choosing among the columns gives the
    # same tokens, runners-up, copies, chain ends and sampled draws as choosing among the whole row.

    columns = torch.tensor([1, 2, 3, 7, 9, 12])
    full = _logits([{7: 0.3, 9: 0.2}, {7: 0.3, 3: 0.1}, {12: 0.9}, {2: 0.4, 9: 0.35}, {9: 0.5, 1: 0.2}])
    outside = torch.ones(16, dtype=torch.bool)
    outside[columns] = False
    full[:, outside] = float("-inf")
    full[:, columns] += torch.arange(6) * 1e-3  # no ties: the two searches may break a tie differently

    def rows():
        seqs = [_seq([1, 2, 3, 4, 1, 2], seq_id=i) for i in range(1, 4)]
        seqs[1].tokens[-1] = 11  # nothing to copy
        seqs.append(_seq([1, 2, 3], seq_id=4, sampling=SamplingParams(temperature=1.0, seed=3)))
        masked = _seq([5, 6], seq_id=5)
        masked.grammar_mask = torch.tensor([[(1 << 1) | (1 << 12)]], dtype=torch.int32)  # 1 and 12 legal
        lookup = ContextLookup()
        for seq in seqs[:3]:
            lookup.open(seq)
        return seqs + [masked], lookup

    def summary(proposals):
        return [(p.tokens, p.exhausted, p.alternatives, p.probs) for p in proposals]

    seqs, lookup = rows()
    want = summary(proposals_from_logits(full.clone(), seqs, lookup, 0.4))
    seqs, lookup = rows()
    assert summary(proposals_from_logits(full.clone(), seqs, lookup, 0.4, columns)) == want
    assert [p[0] for p in want[:3]] == [[3], [7], [12]] and want[4][0] == [1]
