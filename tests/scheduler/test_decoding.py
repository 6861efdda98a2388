"""In-process decoders on the engine: exact greedy output and exact sampling distribution."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from duospec.coordinator.api import FinishEvent, FinishReason, SpeculationMode
from duospec.decoding import _request, autoregressive, stream_events, stream_text, vanilla_speculative
from duospec.engine import load_checkpoint
from duospec.sampling import SamplingParams, probs_from_logits
from exactness import assert_greedy_equal, chi_square_pvalue, hf_greedy, reference_model
from tiny_models import make_tiny_checkpoint

N_PROMPTS, N_NEW = 20, 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("decoding")
    target_dir = make_tiny_checkpoint(root / "target", "llama", seed=11, hidden_size=64, num_layers=2)
    # A random-weight draft disagrees with the target almost everywhere: the rejection path.
    draft_dir = make_tiny_checkpoint(root / "draft", "llama", seed=12, hidden_size=32, num_layers=1)
    target = load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=32)
    draft = load_checkpoint(draft_dir, device="cpu", dtype="float32", max_slots=32)
    hf = reference_model(target_dir)
    return target, draft, hf


def _prompts(vocab: int, n: int = N_PROMPTS) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, vocab, size=int(rng.integers(3, 12))).tolist() for _ in range(n)]


def _tokens(events) -> list[int]:
    return [t for e in events if not isinstance(e, FinishEvent) for t in e.token_ids]


@pytest.mark.parametrize("mode", ["off", "vanilla", "pearl"])
def test_greedy_matches_target_alone(pair, mode):
    target, draft, hf = pair
    prompts = _prompts(target.runner.vocab_size)
    requests = [_request(p, N_NEW, mode, SamplingParams(), 4, True) for p in prompts]
    results = stream_events(target, draft if mode != "off" else None, requests)
    rejections = 0
    for prompt, request in zip(prompts, requests):
        events = results[request.request_id]
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert_greedy_equal(hf, prompt, _tokens(events), hf_greedy(hf, prompt, N_NEW))
        rejections += events[-1].stats.rejections
    if mode != "off":
        assert rejections > N_PROMPTS * 10, "a random draft should be rejected often (the path under test)"


def test_decoder_functions_and_stream(pair):
    target, draft, hf = pair
    prompt = _prompts(target.runner.vocab_size, 1)[0]
    want = hf_greedy(hf, prompt, 32)
    assert autoregressive(target, prompt, max_new_tokens=32, ignore_eos=True).token_ids == want
    result = vanilla_speculative(target, draft, prompt, gamma=3, max_new_tokens=32, ignore_eos=True)
    assert result.token_ids == want
    assert result.stats.target_forwards < 32 + 1 and result.stats.drafted_tokens > 0
    pieces = list(stream_text(target, draft, prompt, max_new_tokens=32, ignore_eos=True))
    assert "".join(pieces) == target.tokenizer.decode(want)


def test_draft_equal_to_target_accepts_everything(pair):
    target, _, hf = pair
    prompt = _prompts(target.runner.vocab_size, 1)[0]
    result = vanilla_speculative(target, target, prompt, gamma=4, max_new_tokens=40, ignore_eos=True)
    assert result.token_ids == hf_greedy(hf, prompt, 40)
    assert result.stats.accepted_tokens == result.stats.drafted_tokens
    assert result.stats.mean_accepted_length == pytest.approx(5.0, abs=0.5)


def _exact_two_token_distribution(hf, prompt, params, support=None):
    """p(t1, t2) of the target alone under `params`, computed from its logits."""
    with torch.no_grad():
        p1 = probs_from_logits(hf(torch.tensor([prompt])).logits[0, -1:].float(), params)[0]
        first = torch.nonzero(p1).flatten().tolist()
        joint = {}
        for t1 in first:
            p2 = probs_from_logits(hf(torch.tensor([prompt + [t1]])).logits[0, -1:].float(), params)[0]
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


@pytest.mark.parametrize("mode", ["vanilla", "pearl"])
def test_sampled_speculation_follows_target_distribution(pair, mode):
    """Chi-square: the first two sampled tokens follow the target's own distribution."""
    target, draft, hf = pair
    prompt = [5, 17, 42]
    params = SamplingParams(temperature=1.0, top_k=4, seed=0)
    joint = _exact_two_token_distribution(hf, prompt, params)
    n = 1500
    requests = [
        _request(prompt, 2, mode, SamplingParams(temperature=1.0, top_k=4, seed=1000 + i), 2, True) for i in range(n)
    ]
    results = stream_events(target, draft, requests, gamma=2, max_batch_size=16)
    counts = collections.Counter(tuple(_tokens(results[r.request_id])) for r in requests)
    assert set(counts) <= set(joint), f"tokens outside the target's top-k support: {set(counts) - set(joint)}"
    p_value = chi_square_pvalue(joint, counts, n)
    assert p_value > 1e-3, f"{mode}: sampled output does not follow p (chi-square p={p_value:.2e})"


def test_seeded_sampling_is_deterministic(pair):
    target, draft, _ = pair
    prompt = [7, 8, 9]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    runs = [
        [t for t in vanilla_speculative(target, draft, prompt, max_new_tokens=24, sampling=params, ignore_eos=True).token_ids]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_a_failing_draft_step_leaves_the_sequence_target_only(pair):
    """A drafter error must not kill the draft loop: the sequence finishes target-only, exactly."""
    target, draft, hf = pair
    prompt = [9, 10, 11]

    class Exploding:
        def __init__(self, runner):
            self.runner, self.calls = runner, 0

        def __getattr__(self, name):
            return getattr(self.runner, name)

        def forward_last(self, chunks, **kw):
            self.calls += 1
            if self.calls == 7:  # after the first verify round (γ = 4)
                raise RuntimeError("injected draft failure")
            return self.runner.forward_last(chunks, **kw)

    broken = type(draft)(Exploding(draft.runner), draft.tokenizer, draft.config, draft.path, draft.eos_token_ids)
    # Before the fix the draft thread died and a vanilla sequence waited for drafts forever.
    result = vanilla_speculative(target, broken, prompt, max_new_tokens=24, ignore_eos=True)
    assert result.token_ids == hf_greedy(hf, prompt, 24)
    assert result.stats.drafted_tokens > 0  # it speculated before the failure
