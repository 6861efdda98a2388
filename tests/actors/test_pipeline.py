"""The PEARL pipeline through real Ray actors and gRPC streams (docs/design.md)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from duospec.coordinator.api import FinishReason, InvalidRequest
from duospec.coordinator.models import ModelPairError
from duospec.sampling import SamplingParams
from exactness import assert_greedy_equal, hf_greedy, reference_model
from pipeline_support import BackgroundLoop, model_config, request, run_all
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.ray

N_PROMPTS, N_NEW = 20, 64
REPO = pathlib.Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models"
LOOKAHEAD = 9  # pearl runs at least 2γ + 1 = 9 ahead with γ = 4 (coordinator/scheduling/policies.py)


@pytest.fixture(scope="module")
def loop():
    background = BackgroundLoop()
    yield background
    background.close()


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    target = make_tiny_checkpoint(root / "target", "llama", seed=11, hidden_size=64, num_layers=2)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=12, hidden_size=32, num_layers=1)
    return target, draft


@pytest.fixture(scope="module")
def pipeline(ray_runtime, loop, tiny_pair):
    from duospec.coordinator.pipeline import start_pipeline

    target, draft = tiny_pair
    coordinator = start_pipeline([model_config("tiny", target, draft, max_lookahead=LOOKAHEAD)])
    yield coordinator
    loop.run(coordinator.close())


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    return reference_model(tiny_pair[0])


def _prompts(n=N_PROMPTS, vocab=384, seed=5):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(3, 12))).tolist() for _ in range(n)]


@pytest.mark.parametrize("mode", ["pearl", "vanilla", "off"])
def test_greedy_through_actors_matches_target_alone(pipeline, loop, hf_target, mode):
    prompts = _prompts()
    results = loop.run(run_all(pipeline, [request(p, N_NEW, mode) for p in prompts]))
    for prompt, result in zip(prompts, results):
        assert result.finish.finish_reason is FinishReason.LENGTH
        assert_greedy_equal(hf_target, prompt, result.tokens, hf_greedy(hf_target, prompt, N_NEW))
    if mode != "off":
        assert sum(r.stats.rejections for r in results) > N_PROMPTS * 10  # random draft: the abort path


def test_eight_at_once_equal_one_at_a_time(pipeline, loop):
    prompts = _prompts(8, seed=9)
    together = loop.run(run_all(pipeline, [request(p, 48) for p in prompts]))
    alone = [loop.run(run_all(pipeline, [request(p, 48)]))[0] for p in prompts]
    assert [r.tokens for r in together] == [r.tokens for r in alone]


def test_seeded_pearl_sampling_is_repeatable(pipeline, loop):
    params = SamplingParams(temperature=0.9, top_k=20, seed=77)
    prompts = _prompts(4, seed=3)
    runs = [loop.run(run_all(pipeline, [request(p, 40, sampling=params) for p in prompts])) for _ in range(2)]
    assert [r.tokens for r in runs[0]] == [r.tokens for r in runs[1]]


def test_abort_bounds_wasted_drafting(pipeline, loop):
    results = loop.run(run_all(pipeline, [request(p, 64) for p in _prompts(6, seed=4)]))
    for r in results:
        assert r.stats.rejections > 0
        # Per rejection the drafter can have run at most `lookahead` positions ahead, plus the one step
        # that was already in its forward when the abort arrived.
        assert r.stats.wasted_draft_tokens <= r.stats.rejections * (LOOKAHEAD + 1)


def test_workers_refuse_streams_without_the_deployment_secret(pipeline, loop, hf_target):
    """A stranger (or a coordinator of an old deployment) on a worker port gets UNAUTHENTICATED and
    changes nothing: a request in flight at the same time finishes with the exact output."""
    import asyncio

    import grpc

    from duospec.cluster.secret import METADATA_KEY
    from duospec.internal.v1 import pearl_pb2 as ipb
    from duospec.internal.v1 import pearl_pb2_grpc as ipb_grpc

    prompt = _prompts(1, seed=21)[0]
    live = asyncio.run_coroutine_threadsafe(run_all(pipeline, [request(prompt, 200)]), loop.loop)
    pair = pipeline.pairs["tiny"]
    calls = {
        "verify": lambda ch, md: ipb_grpc.TargetServiceStub(ch).Verify(iter([ipb.VerifyBatch(batch_id=1)]), metadata=md),
        "draft": lambda ch, md: ipb_grpc.DraftServiceStub(ch).Draft(iter([ipb.DraftControl()]), metadata=md),
    }
    endpoints = {"verify": pair.target_info["endpoint"], "draft": pair.draft_info["endpoint"]}
    for name, call in calls.items():
        with grpc.insecure_channel(endpoints[name]) as channel:
            for metadata in (None, ((METADATA_KEY, "a-previous-deployment"),)):
                with pytest.raises(grpc.RpcError) as info:
                    list(call(channel, metadata))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
    (result,) = live.result(120)
    assert result.finish.finish_reason is FinishReason.LENGTH
    assert_greedy_equal(hf_target, prompt, result.tokens, hf_greedy(hf_target, prompt, 200))


def test_prompt_longer_than_context_is_rejected_at_once(pipeline, loop):
    info = pipeline.models()[0]
    with pytest.raises(InvalidRequest, match="context"):
        loop.run(run_all(pipeline, [request([5] * (info.max_context - 10), 64)]), timeout=10)


def test_different_tokenizers_are_refused_before_placement(tmp_path, ray_runtime):
    from duospec.coordinator.pipeline import start_pipeline

    target = make_tiny_checkpoint(tmp_path / "t", "llama", seed=1)
    other = make_tiny_checkpoint(tmp_path / "d", "llama", seed=2)
    tokenizer_file = other / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    vocab = spec["model"]["vocab"]
    vocab["A"], vocab["B"] = vocab["B"], vocab["A"]  # same size, two ids swapped
    tokenizer_file.write_text(json.dumps(spec))
    with pytest.raises(ModelPairError, match="different tokenizers"):
        start_pipeline([model_config("mismatch", target, other)])


@pytest.mark.skipif(not (BUNDLED / "target" / "config.json").exists(), reason="bundled pair not trained yet")
def test_bundled_pair_greedy_through_actors(ray_runtime, loop):
    from duospec.coordinator.pipeline import start_pipeline
    from duospec.engine import load_tokenizer

    hf = reference_model(BUNDLED / "target")
    tok = load_tokenizer(BUNDLED / "target")
    snippets = [
        "def fibonacci(n):\n    ",
        "import os\nimport sys\n\n\ndef main(",
        "class Stack:\n    def __init__(self):\n        self.",
        "    for i in range(len(",
    ]
    prompts = [tok.encode(s) for s in snippets] * 5
    coordinator = start_pipeline([model_config("bundled", BUNDLED / "target", BUNDLED / "draft")])
    try:
        for mode in ("pearl", "vanilla", "off"):
            results = loop.run(run_all(coordinator, [request(p, N_NEW, mode) for p in prompts]))
            for prompt, result in zip(prompts, results):
                assert_greedy_equal(hf, prompt, result.tokens, hf_greedy(hf, prompt, N_NEW))
            if mode != "off":
                mean_len = np.mean([r.stats.mean_accepted_length for r in results])
                assert mean_len > 1.3, f"{mode}: the trained draft should be accepted often ({mean_len:.2f})"
            if mode == "pearl":  # the speculation cache and token trees are on by default: both were used
                # (branches taken: tree nodes, a draft's runner-up or a hedge, and cache hits)
                used = {k: sum(getattr(r.stats, k) for r in results) for k in ("cache_lookups", "tree_nodes")}
                branches_taken = sum(r.stats.cache_hits + r.stats.tree_hits for r in results)
                assert used["cache_lookups"] > 0 and used["tree_nodes"] > 0 and branches_taken > 0, (used, branches_taken)
    finally:
        loop.run(coordinator.close())


def test_queued_draft_batches_merge_into_multi_token_chunks():
    from duospec.draft_worker.service import merge_batches
    from duospec.internal.v1 import pearl_pb2 as pb

    def batch(*chunks, busy=0.001):
        return pb.DraftChunkBatch(chunks=[pb.DraftChunk(**c) for c in chunks], busy_seconds=busy)

    [merged] = merge_batches(
        [
            batch({"seq_id": 1, "epoch": 0, "start_pos": 5, "tokens": [7]}, {"seq_id": 2, "epoch": 3, "start_pos": 9, "tokens": [1]}),
            batch({"seq_id": 1, "epoch": 0, "start_pos": 6, "tokens": [8]}),
            batch({"seq_id": 2, "epoch": 4, "start_pos": 9, "tokens": [2]}),  # new epoch: not merged
        ]
    )
    assert [(c.seq_id, c.epoch, c.start_pos, list(c.tokens)) for c in merged.chunks] == [
        (1, 0, 5, [7, 8]),
        (2, 3, 9, [1]),
        (2, 4, 9, [2]),
    ]
    assert merged.busy_seconds == pytest.approx(0.003)


def test_merged_draft_messages_stay_under_the_byte_budget_and_keep_every_chunk_in_order():
    from duospec.draft_worker.service import merge_batches
    from duospec.internal.v1 import pearl_pb2 as pb

    q = bytes(6 * 4096)  # one draft position's q at the largest support (24 KB)
    batches = [pb.DraftChunkBatch(chunks=[pb.DraftChunk(seq_id=s, epoch=0, start_pos=10 + step, tokens=[step],
                                                        draft_probs=[q]) for s in range(4)], busy_seconds=0.001)
               for step in range(40)]  # 160 positions, ~3.9 MB
    messages = merge_batches(batches, budget_bytes=1 << 20)
    assert len(messages) >= 4 and all(m.ByteSize() <= (1 << 20) for m in messages)
    for seq in range(4):  # each line's tokens, in order, continuing across messages
        parts = [(c.start_pos, list(c.tokens)) for m in messages for c in m.chunks if c.seq_id == seq]
        assert [t for _, t in parts] and sum((t for _, t in parts), []) == list(range(40))
        assert all(a[0] + len(a[1]) == b[0] for a, b in zip(parts, parts[1:]))
    assert sum(m.busy_seconds for m in messages) == pytest.approx(0.04)
