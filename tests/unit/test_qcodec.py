"""The draft-probability codec: sparse float16 q on the wire, and the drafter sampling from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duospec.qcodec import DraftProbs, draft_sample
from duospec.sampling import Purpose, SamplingParams, probs_from_logits, sample_token, uniform

torch.set_num_threads(1)

VOCAB = 1000


def _logits(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2.5


def _q(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return probs_from_logits(logits.unsqueeze(0), params)[0]


def test_round_trip_through_bytes_is_exact():
    dq = DraftProbs.from_probs(_q(_logits(0), SamplingParams(temperature=0.8)))
    wire = dq.to_bytes()
    received = DraftProbs.from_bytes(wire)
    assert received == dq
    assert received.token_ids.tolist() == dq.token_ids.tolist()
    assert received.probs.tobytes() == dq.probs.tobytes()
    assert len(wire) == 6 * dq.token_ids.size


def test_wire_layout_is_little_endian_ids_then_float16():
    dq = DraftProbs(np.array([3, 258]), np.array([0.25, 0.75]))
    expected = np.array([3, 258], "<i4").tobytes() + np.array([0.25, 0.75], "<f2").tobytes()
    assert dq.to_bytes() == expected


def test_top_k_support_is_sparse_and_sorted():
    logits = _logits(1)
    dq = DraftProbs.from_probs(_q(logits, SamplingParams(temperature=1.0, top_k=5)))
    assert dq.token_ids.dtype == np.int32 and dq.probs.dtype == np.float16
    assert dq.token_ids.tolist() == sorted(torch.topk(logits, 5).indices.tolist())
    assert len(dq.to_bytes()) == 30


def test_dense_is_identical_on_both_sides_and_close_to_the_float32_q():
    q = _q(_logits(2), SamplingParams(temperature=1.0, top_p=0.95))
    sender = DraftProbs.from_probs(q)
    receiver = DraftProbs.from_bytes(sender.to_bytes())
    dense_sender, dense_receiver = sender.dense(VOCAB), receiver.dense(VOCAB)
    assert dense_sender.dtype == torch.float32
    assert torch.equal(dense_sender, dense_receiver)
    assert abs(float(dense_sender.double().sum()) - 1.0) < 1e-6
    # float16 keeps ~11 significant bits; only entries that survived rounding are compared.
    kept = dense_sender > 0
    torch.testing.assert_close(dense_sender[kept], q[kept], rtol=2e-3, atol=1e-7)


def test_mass_below_float16_resolution_leaves_the_support():
    q = torch.tensor([0.999999, 1e-9, 0.0, 1e-6], dtype=torch.float32)
    assert DraftProbs.from_probs(q).token_ids.tolist() == [0]  # 1e-6 is in the tail that is not sent
    dq = DraftProbs.from_probs(q, tail_mass=0.0)
    assert dq.token_ids.tolist() == [0, 3]
    dense = dq.dense(4)
    assert dense[1] == 0.0 and dense[2] == 0.0


def test_draft_sample_samples_from_the_decoded_q():
    logits = _logits(3)
    for seed in range(100):
        params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=seed)
        token, dq = draft_sample(logits, params, position=9)
        assert dq == DraftProbs.from_probs(_q(logits, params))
        assert token == sample_token(dq.dense(VOCAB), uniform(seed, 9, Purpose.DRAFT))


def test_draft_sample_draws_only_from_the_support():
    logits = _logits(4)
    allowed = set(torch.topk(logits, 3).indices.tolist())
    drawn = set()
    for seed in range(300):
        token, dq = draft_sample(logits, SamplingParams(temperature=2.0, top_k=3, seed=seed), 0)
        assert set(dq.token_ids.tolist()) == allowed
        drawn.add(token)
    assert drawn == allowed


def test_draft_sample_greedy_sends_no_q():
    logits = torch.tensor([0.0, 5.0, 5.0, 1.0])
    assert draft_sample(logits, SamplingParams(), position=3) == (1, None)


def test_arrays_are_frozen_without_freezing_the_callers():
    ids, probs = np.array([1, 4], dtype=np.int32), np.array([0.5, 0.5], dtype=np.float16)
    dq = DraftProbs(ids, probs)
    with pytest.raises(ValueError):
        dq.probs[0] = 1.0
    ids[0] = 2  # the caller's array is still theirs
    assert dq.token_ids.tolist() == [1, 4]


@pytest.mark.parametrize(
    "ids, probs, message",
    [
        ([], [], "empty support"),
        ([2, 1], [0.5, 0.5], "strictly increasing"),
        ([1, 1], [0.5, 0.5], "strictly increasing"),
        ([-1, 1], [0.5, 0.5], ">= 0"),
        ([0, 1], [0.5, 0.0], "> 0"),
        ([0, 1], [0.5, float("nan")], "finite"),
        ([0, 1], [0.5], "equal length"),
    ],
)
def test_invalid_draft_probs_are_rejected(ids, probs, message):
    with pytest.raises(ValueError, match=message):
        DraftProbs(np.array(ids, dtype=np.int32), np.array(probs, dtype=np.float16))


@pytest.mark.parametrize("length", [0, 5, 13])
def test_malformed_bytes_are_rejected(length):
    with pytest.raises(ValueError, match="malformed"):
        DraftProbs.from_bytes(b"\x01" * length)


def test_dense_rejects_a_smaller_vocabulary():
    dq = DraftProbs(np.array([0, 99]), np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match="vocab"):
        dq.dense(50)


def test_all_zero_row_cannot_be_encoded():
    with pytest.raises(ValueError, match="no entry > 0"):
        DraftProbs.from_probs(torch.zeros(8))
