"""The verifier's logprobs line up with the committed tokens: accepted chain drafts, a path through a
token-tree branch, and the recovered / bonus token — each equal to transformers' log-softmax."""

from __future__ import annotations

import pytest
import torch

from duospec.engine import load_model
from duospec.internal.sampling_wire import sampling_to_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.sampling import SamplingParams
from duospec.target_worker.verifier import Verifier
from tiny_models import make_tiny_checkpoint
from exactness import reference_model

PROMPT = [5, 17, 42, 9, 77, 3, 120]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("lp") / "t", "llama", seed=6)
    hf = reference_model(str(path))
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)[0, len(PROMPT):].tolist()
    return load_model(path, dtype=torch.float32, max_slots=2, max_context=128), hf, greedy


def _reference(hf, ids: list[int]) -> torch.Tensor:
    """log-softmax after each prefix of `ids`: row i predicts ids[i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _verify(runner, tokens, parents=(), seq_id=1):
    item = pb.VerifyItem(seq_id=seq_id, start_pos=0, context=PROMPT, draft_tokens=tokens, draft_parents=parents,
                         sampling=sampling_to_proto(SamplingParams()), bonus=pb.BONUS_POLICY_SAMPLE,
                         logprobs=True, top_logprobs=2)
    verifier = Verifier(runner)
    [verdict] = verifier.run(pb.VerifyBatch(batch_id=1, items=[item])).verdicts
    verifier.release_all()
    return verdict


def _check(verdict, committed: list[int], hf):
    reference = _reference(hf, PROMPT + committed)
    assert len(verdict.logprobs) == len(committed)
    for i, (token, lp) in enumerate(zip(committed, verdict.logprobs)):
        row = reference[len(PROMPT) - 1 + i]
        assert abs(lp.logprob - float(row[token])) <= 1e-4, i
        assert list(lp.top_ids) == row.topk(2).indices.tolist()


def test_chain_logprobs_cover_accepted_drafts_and_the_recovered_token(setup):
    runner, hf, greedy = setup
    drafts = greedy[:3] + [(greedy[3] + 1) % 300]  # three right, the fourth wrong
    verdict = _verify(runner, drafts)
    assert verdict.n_accepted == 3 and verdict.kind == pb.NEXT_TOKEN_KIND_RECOVERED
    _check(verdict, greedy[:3] + [verdict.next_token], hf)


def test_tree_logprobs_follow_the_path_through_a_branch(setup):
    runner, hf, greedy = setup
    wrong = (greedy[1] + 1) % 300
    # main chain: greedy[0], wrong; a branch under node 0: greedy[1], greedy[2]
    tokens, parents = [greedy[0], wrong, greedy[1], greedy[2]], [-1, 0, 0, 2]
    verdict = _verify(runner, tokens, parents)
    assert list(verdict.path) == [0, 2, 3] and verdict.kind == pb.NEXT_TOKEN_KIND_BONUS
    _check(verdict, greedy[:3] + [verdict.next_token], hf)
