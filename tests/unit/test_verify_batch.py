"""The batched verify rule (duospec/verify/batch.py) makes the reference's decisions, item for item.

Randomized batches mix greedy and sampled items, chains and trees (with siblings and deterministic
alternatives, some with nodes below them), top-k / top-p / temperature, declined bonuses and draft
ids past the target's vocabulary; every verdict (path, next token, kind) must equal `verify` /
`verify_tree` on the item's own rows. The draft tokens are drawn from q or near the target's argmax,
so acceptances, rejections at every depth, sibling recoveries, paths into and below a branch and
bonuses all occur (counted and required).
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from duospec.qcodec import DraftProbs
from duospec.sampling import Purpose, SamplingParams, probs_from_logits, sample_token, uniform
from duospec.verify import TreeVerdict, verify, verify_tree
from duospec.sampling import probs_from_logits_rows
from duospec.verify.batch import VerifyTask, verify_batch, verify_each

torch.set_num_threads(1)


def _params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.35:
        return SamplingParams()
    return SamplingParams(temperature=rng.choice([0.3, 0.7, 1.0, 1.3]), top_k=rng.choice([0, 0, 5, 40]),
                          top_p=rng.choice([1.0, 1.0, 0.9, 0.6]), seed=rng.randrange(2**64))


def _tree(rng: random.Random, k: int) -> list[int]:
    """A main chain of k nodes plus up to 4 more: alternatives hanging off its first positions, some
    with nodes below them (a hedge's continuation under its root, as Sequence.add_branches builds)."""
    parents = list(range(-1, k - 1))
    for _ in range(rng.randrange(5)):
        if len(parents) > k and rng.random() < 0.5:
            parents.append(rng.randrange(k, len(parents)))  # below an alternative
        else:
            parents.append(rng.randrange(-1, min(k, 2)) if k else -1)
    return parents


def _main_chain(parents: list[int]) -> int:
    return next((i for i, p in enumerate(parents) if p != i - 1), len(parents))


def _case(rng: random.Random, gen: torch.Generator, vocab: int, first_row: int):
    """(task, its logits rows [k+1, V])."""
    params = _params(rng)
    k = rng.randrange(0, 6)
    tree = rng.random() < 0.4 and (params.greedy or rng.random() < 0.7)
    parents = _tree(rng, k) if tree else None
    n = len(parents) if parents is not None else k
    rows = torch.randn(n + 1, vocab, generator=gen) * rng.choice([1.0, 3.0, 8.0])
    draft_logits = rows + torch.randn(n + 1, vocab, generator=gen) * rng.choice([0.0, 0.3, 1.5])
    tokens, probs = [], []
    for i in range(n):
        parent = parents[i] if parents is not None else i - 1
        row = parent + 1  # logits after the parent predict this node
        if params.greedy or (parents is not None and i >= k):
            best = int(rows[row].argmax())  # (a branch node more often: paths into and below branches occur)
            tokens.append(best if rng.random() < (0.6 if i < k else 0.8) else rng.randrange(vocab + 2))
        else:
            q = DraftProbs.from_probs(probs_from_logits(draft_logits[row : row + 1], params)[0])
            probs.append(q)
            pos = 10 + i
            tokens.append(sample_token(q.dense(vocab), uniform(params.seed, pos, Purpose.DRAFT)))
    if parents is not None and rng.random() < 0.3:
        probs = []  # every candidate deterministic (q = its point mass)
    task = VerifyTask(draft_tokens=tokens, first_row=first_row, params=params, start_pos=rng.randrange(0, 500),
                      parents=parents, draft_probs=probs or None, sample_bonus=rng.random() < 0.8)
    return task, rows


def _reference(task: VerifyTask, rows: torch.Tensor) -> TreeVerdict:
    widest = max([*task.draft_tokens, *(int(q.token_ids[-1]) for q in task.draft_probs or ())], default=0) + 1
    if widest > rows.shape[-1]:
        rows = torch.nn.functional.pad(rows, (0, widest - rows.shape[-1]), value=float("-inf"))
    if task.parents is None:
        verdict = verify(task.draft_tokens, rows, task.draft_probs, task.params, task.start_pos,
                         sample_bonus=task.sample_bonus)
        return TreeVerdict(tuple(range(verdict.n_accepted)), verdict)
    return verify_tree(task.draft_tokens, task.parents, rows, task.params, task.start_pos,
                       draft_probs=task.draft_probs, sample_bonus=task.sample_bonus)


@pytest.mark.parametrize("vocab", [7, 61, 3001])
def test_batched_verdicts_equal_the_reference(vocab, test_device):
    rng, gen = random.Random(vocab), torch.Generator().manual_seed(vocab)
    seen = Counter()
    for _trial in range(40 if vocab < 1000 else 16):
        tasks, blocks, row = [], [], 0
        for _ in range(rng.randrange(1, 9)):
            # a context chunk's rows sit before the verify rows, as in a real forward
            context = torch.randn(rng.randrange(0, 3), vocab, generator=gen)
            task, rows = _case(rng, gen, vocab, row + context.shape[0])
            tasks.append(task)
            blocks += [context, rows]
            row += context.shape[0] + rows.shape[0]
        logits = torch.cat(blocks)
        got = verify_batch(logits.to(test_device), tasks)
        assert verify_each(logits, tasks) == got
        for task, verdict in zip(tasks, got):
            k = len(task.draft_tokens)
            want = _reference(task, logits[task.first_row : task.first_row + k + 1])
            assert verdict == want, (task, verdict, want)
            seen["greedy" if task.params.greedy else "sampled"] += 1
            seen["tree" if task.parents is not None else "chain"] += 1
            seen[want.verdict.kind.value] += 1
            seen["accepted some" if want.path else "accepted none"] += 1
            if task.parents is not None and want.path:
                branch_nodes = [node for node in want.path if node >= _main_chain(task.parents)]
                seen["alternative won"] += bool(branch_nodes)
                seen["path below an alternative"] += len(branch_nodes) >= 2
    required = ["greedy", "sampled", "tree", "chain", "recovered", "bonus", "none", "accepted some",
                "accepted none", "alternative won"]
    if vocab < 1000:  # (over 3001 tokens a branch's second node is too rarely the target's for 32 trials)
        required.append("path below an alternative")
    for what in required:
        assert seen[what] > 0, (what, seen)


def test_rows_with_their_own_parameters_match_probs_from_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=gen) * 4
    settings = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=1)
                for t, k, p in [(1.0, 0, 1.0), (0.5, 10, 1.0), (1.7, 0, 0.8), (0.9, 499, 0.95), (2.0, 500, 1.0),
                                (0.123, 1, 0.3)]]
    got = probs_from_logits_rows(logits, torch.tensor([s.temperature for s in settings], dtype=torch.float64),
                                 torch.tensor([s.top_k for s in settings]),
                                 torch.tensor([s.top_p for s in settings], dtype=torch.float64))
    for row, s in enumerate(settings):
        assert torch.equal(got[row], probs_from_logits(logits[row : row + 1], s)[0]), s


def test_bad_items_get_their_own_error_and_the_rest_their_verdicts():
    logits = torch.randn(4, 10)
    logits[3] = float("nan")
    greedy = VerifyTask(draft_tokens=[1], first_row=0, params=SamplingParams(), start_pos=0)
    out_of_rows = VerifyTask(draft_tokens=[1, 2, 3], first_row=2, params=SamplingParams(), start_pos=0)
    missing_q = VerifyTask(draft_tokens=[1], first_row=0, params=SamplingParams(temperature=1.0), start_pos=0)
    broken = VerifyTask(draft_tokens=[1], first_row=3, params=SamplingParams(temperature=1.0), start_pos=0,
                        parents=[-1])  # its first row (the one the walk reads first) is NaN
    logits = torch.cat([logits, torch.randn(1, 10)])
    got = verify_batch(logits, [greedy, out_of_rows, missing_q, broken])
    assert isinstance(got[0], TreeVerdict)
    assert isinstance(got[1], ValueError) and "outside" in str(got[1])
    assert isinstance(got[2], ValueError) and "q for every draft token" in str(got[2])
    assert isinstance(got[3], ValueError) and "NaN" in str(got[3])


def test_only_small_results_leave_the_device():
    """The verdicts come back as one small integer table: the logits never go to the host."""
    seen = []
    real = torch.Tensor.cpu

    def spy(self, *args, **kwargs):
        seen.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    logits = torch.randn(12, 2000)
    tasks = [VerifyTask(draft_tokens=[int(logits[i * 4].argmax()), 3, 4], first_row=i * 4,
                        params=SamplingParams(), start_pos=5) for i in range(3)]
    torch.Tensor.cpu = spy
    try:
        got = verify_batch(logits, tasks)
    finally:
        torch.Tensor.cpu = real
    assert [v.verdict.n_accepted >= 1 for v in got] == [True] * 3
    assert seen and all(int(np.prod(shape)) <= 3 * 8 for shape in seen), seen


def test_the_verifier_gives_the_same_verdict_batch_either_way(tmp_path, test_device):
    """One real target, one batch of every item kind (greedy chain with logprobs, a tree, a sampled
    chain with q, a sampled item with a wrong-width q, features): the batched verify on the device and
    the reference item by item produce identical VerdictBatch messages and leave identical KV."""
    from duospec.engine import load_model
    from duospec.internal.sampling_wire import sampling_to_proto
    from duospec.internal.v1 import pearl_pb2 as pb
    from duospec.target_worker.verifier import Verifier
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "t", "llama", seed=4)
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=77)
    gen = torch.Generator().manual_seed(5)

    def q_bytes(vocab: int) -> bytes:
        return DraftProbs.from_probs(torch.softmax(torch.randn(vocab, generator=gen), 0)).to_bytes()

    qs = [q_bytes(384) for _ in range(3)] + [q_bytes(400)]
    greedy = sampling_to_proto(SamplingParams())

    def batch(batch_id: int, start: int) -> pb.VerifyBatch:
        context = [5, 17, 42, 9, 77, 3, 120][: 7 if start == 0 else 1]
        return pb.VerifyBatch(batch_id=batch_id, items=[
            pb.VerifyItem(seq_id=1, start_pos=start, context=context, draft_tokens=[11, 12, 13], sampling=greedy,
                          bonus=pb.BONUS_POLICY_SAMPLE, logprobs=True, top_logprobs=3, features=True),
            pb.VerifyItem(seq_id=2, start_pos=start, context=context, draft_tokens=[8, 9, 10, 11],
                          draft_parents=[-1, 0, -1, 2], sampling=greedy, bonus=pb.BONUS_POLICY_SAMPLE),
            pb.VerifyItem(seq_id=3, start_pos=start, context=context, draft_tokens=[30, 31, 32],
                          draft_probs=qs[:3], sampling=sampling_to_proto(sampled), bonus=pb.BONUS_POLICY_SKIP,
                          logprobs=True),
            pb.VerifyItem(seq_id=4, start_pos=start, context=context, draft_tokens=[33], draft_probs=qs[3:],
                          sampling=sampling_to_proto(sampled), bonus=pb.BONUS_POLICY_SAMPLE),
        ])

    outputs = []
    for batched in (True, False):
        runner = load_model(path, max_slots=4, max_context=64, device=test_device)
        verifier = Verifier(runner, batched=batched)
        first = verifier.run(batch(1, 0))
        lengths = {seq: runner.slot_length(slot) for seq, slot in verifier.slots.items()}
        second = verifier.run(pb.VerifyBatch(batch_id=2, items=[
            pb.VerifyItem(seq_id=v.seq_id, start_pos=lengths[v.seq_id], context=[v.next_token or 1],
                          draft_tokens=[7, 7], sampling=greedy, bonus=pb.BONUS_POLICY_SAMPLE, logprobs=True)
            for v in first.verdicts]))
        for out in (first, second):
            out.forward_seconds = 0.0
        outputs.append((first, second, lengths))
    (first_b, second_b, lengths_b), (first_r, second_r, lengths_r) = outputs
    assert not first_b.errors and len(first_b.verdicts) == 4
    assert first_b == first_r and second_b == second_r and lengths_b == lengths_r
    assert first_b.verdicts[0].features.fp16 and len(first_b.verdicts[0].logprobs) >= 1


def test_broken_logits_fail_an_item_exactly_where_the_reference_raises():
    """NaN / +inf / all -inf rows: an error where the reference reads such a row, a verdict where it
    does not (a chain's bonus row after a rejection, a declined bonus, a tree's unvisited node)."""
    gen = torch.Generator().manual_seed(3)
    sampled = SamplingParams(temperature=1.0, seed=9)
    vocab = 40

    def case(k, parents, bad_row, value, bonus=True, accept_first=False, q=True):
        rows = torch.randn(k + 1, vocab, generator=gen)
        tokens = [int(rows[0].argmax()) if accept_first else int(rows[0].argmin())] + [3] * (k - 1)
        if bad_row is not None:
            if value == "all -inf":
                rows[bad_row] = float("-inf")
            else:
                rows[bad_row, 5] = value
        probs = [DraftProbs.from_probs(torch.softmax(rows[i].nan_to_num(0, 0, 0), 0)) for i in range(k)] if q else None
        return VerifyTask(tokens[:k], 0, sampled, 10, parents=parents, draft_probs=probs, sample_bonus=bonus), rows

    cases = [
        case(2, None, 1, float("inf")),  # +inf in a draft row: the reference raises
        case(2, None, 2, float("nan")),  # NaN in the bonus row after an early rejection: a verdict
        case(2, None, 2, float("nan"), bonus=False),
        case(0, None, 0, float("nan"), bonus=False),  # nothing read: NONE
        case(0, None, 0, float("nan")),  # the bonus row is read: error
        case(2, [-1, -1], 2, float("nan"), q=False),  # a tree: node 1's row is never visited
        case(2, [-1, 0], 1, "all -inf", accept_first=True, q=False),  # visited: error
    ]
    outcomes = []
    for task, rows in cases:
        got, want = verify_batch(rows, [task])[0], verify_each(rows, [task])[0]
        assert isinstance(got, ValueError) == isinstance(want, ValueError), (task, got, want)
        if not isinstance(want, ValueError):
            assert got == want
        outcomes.append(isinstance(want, ValueError))
    assert True in outcomes and False in outcomes
