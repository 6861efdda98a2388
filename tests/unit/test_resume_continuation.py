"""Resuming a broken stream, without a server: the continuation a `GenerateRequest.resume` becomes,
what it refuses (INVALID_ARGUMENT naming the field), the usage id's binding to its request, and the
text a resumed stream sends next (tests/e2e/test_resume.py runs it through servers)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from duospec.coordinator.api import FinishReason, GenerationRequest, ModelInfo
from duospec.coordinator.serving.gateway import _cut_at_stop, text_state
from duospec.coordinator.serving.resume import Continuation, continue_request, load_secret, usage_id
from duospec.coordinator.serving.validation import RequestError, ValidatedRequest
from duospec.sampling import SamplingParams
from duospec.v1 import generation_pb2 as pb
from tiny_models import tiny_tokenizer

SECRET = b"0123456789abcdef-test-secret"
ROW = "ab" * 16
EOS = 2
INFO = ModelInfo(name="m", target_path="/t", draft_path=None, vocab_size=400, max_context=256, eos_token_id=EOS)
PROMPT = (10, 11, 12)


def validated(temperature=0.0, seed=7, max_new=8, prompt=PROMPT, stops=(), stop_ids=(), ignore_eos=False,
              client_id="") -> ValidatedRequest:
    request = GenerationRequest(request_id="internal", prompt_token_ids=prompt, max_new_tokens=max_new,
                                sampling=SamplingParams(temperature=temperature, seed=seed), model="m",
                                stop_token_ids=frozenset(stop_ids), ignore_eos=ignore_eos)
    return ValidatedRequest(request, tuple(stops), client_id or "internal")


def resume_of(delivered, v: ValidatedRequest, *, seeded=True, tenant="acme", **pb_fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(**pb_fields)
    if seeded:
        req.sampling.seed = v.request.sampling.seed
    req.resume.usage_id = usage_id(SECRET, ROW, tenant, v)
    req.resume.delivered_token_ids.extend(delivered)
    return req


def refusal(req, v, tenant="acme", v_for_check=None) -> RequestError:
    with pytest.raises(RequestError) as info:
        continue_request(req, v_for_check or v, INFO, tenant, SECRET)
    assert info.value.code == "INVALID_ARGUMENT"
    return info.value


def test_the_continuation_extends_the_prompt_and_shortens_the_budget():
    v = validated(temperature=0.8, seed=42)
    resumed, cont = continue_request(resume_of([20, 21, 22], v), v, INFO, "acme", SECRET)
    r = resumed.request
    assert r.prompt_token_ids == PROMPT + (20, 21, 22) and r.max_new_tokens == 5
    assert (r.resumed_tokens, r.output_start) == (3, len(PROMPT))
    assert r.sampling == v.request.sampling  # same seed: draws keyed by absolute position line up
    assert cont == Continuation(ROW) and resumed.client_request_id == ROW  # one request id on every chunk


def test_a_resume_with_nothing_delivered_is_the_request_itself():
    v = validated()
    resumed, cont = continue_request(resume_of([], v), v, INFO, "acme", SECRET)
    assert resumed.request == v.request and cont.finished is None


@pytest.mark.parametrize("delivered, reason", [
    ((20, EOS), FinishReason.EOS),           # broke between the end token's delta and the final message
    ((20, 30), FinishReason.STOP),           # 30 is a stop token id
    (tuple(range(20, 28)), FinishReason.LENGTH),  # all max_new_tokens delivered
])
def test_delivered_tokens_that_already_end_the_request_get_only_the_final_message(delivered, reason):
    v = validated(stop_ids=(30,))
    resumed, cont = continue_request(resume_of(delivered, v), v, INFO, "acme", SECRET)
    assert cont.finished is reason and resumed.request.resumed_tokens == len(delivered)


def test_ignore_eos_lets_the_eos_token_be_delivered_mid_stream():
    v = validated(ignore_eos=True)
    resumed, cont = continue_request(resume_of([EOS, 20], v), v, INFO, "acme", SECRET)
    assert cont.finished is None and resumed.request.max_new_tokens == 6


def test_tokens_past_max_new_tokens_are_refused():
    v = validated(max_new=4)
    exc = refusal(resume_of([20] * 5, v), v)
    assert exc.field == "resume.delivered_token_ids" and "max_new_tokens" in str(exc)


def test_a_token_outside_the_vocabulary_is_refused():
    v = validated()
    exc = refusal(resume_of([20, 400], v), v)
    assert exc.field == "resume.delivered_token_ids[1]" and "vocabulary" in str(exc)


def test_tokens_after_an_end_token_are_refused():
    v = validated()
    exc = refusal(resume_of([20, EOS, 21], v), v)
    assert exc.field == "resume.delivered_token_ids[1]" and "ends the generation" in str(exc)


def test_an_unseeded_sampled_request_cannot_be_resumed():
    v = validated(temperature=0.7)
    exc = refusal(resume_of([20], v, seeded=False), v)
    assert exc.field == "resume" and "seed" in str(exc)


@pytest.mark.parametrize("other", [
    validated(prompt=(10, 11, 13)),  # another prompt
    validated(temperature=0.5, seed=8),  # another seed (sampled)
    validated(max_new=9),
    validated(stops=("\n",)),
])
def test_a_usage_id_verifies_only_for_the_request_it_was_issued_for(other):
    issued_for = validated(temperature=0.5, seed=7) if other.request.sampling.temperature else validated()
    exc = refusal(resume_of([20], issued_for), other)
    assert exc.field == "resume.usage_id" and "not issued for this request" in str(exc)


def test_a_usage_id_verifies_only_for_its_tenant():
    v = validated()
    exc = refusal(resume_of([20], v, tenant="acme"), v, tenant="other")
    assert exc.field == "resume.usage_id"


def test_a_greedy_requests_usage_id_ignores_the_servers_random_seed():
    # greedy requests get a random seed from the server each time; it decides nothing
    issued, resent = validated(seed=1), validated(seed=2)
    resumed, _ = continue_request(resume_of([20], issued), resent, INFO, "acme", SECRET)
    assert resumed.request.resumed_tokens == 1


@pytest.mark.parametrize("value", ["", "nothex", ROW, ROW + ".0123", ROW.upper() + ".0123456789abcdef"])
def test_a_malformed_usage_id_is_refused(value):
    v = validated()
    req = resume_of([20], v)
    req.resume.usage_id = value
    assert refusal(req, v).field == "resume.usage_id"


def test_a_resume_secret_must_be_long_enough(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        load_secret(str(short))
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))
    assert load_secret(None) != load_secret(None)  # random per process when not configured


# ---- text: the first delta of a resumed stream is what the unbroken stream would have sent next ----

TEXT = "Hé said “日本語” 😀 then STOP-ish, then STOPPED here — ok."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(str(tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def stream_pieces(tokenizer, v: ValidatedRequest, tokens) -> list[tuple[str, bool]]:
    """What the gateway sends per token (text, stop found), then the closing text; as gateway._run."""
    detok, stopper = text_state(tokenizer, v)
    pieces = []
    for token in tokens:
        text, _, hit = _cut_at_stop(detok, stopper, (token,))
        pieces.append((text, hit))
        if hit:
            return pieces
    text, hit = stopper.feed(detok.flush())
    pieces.append((text if hit else text + stopper.flush(), hit))
    return pieces


@pytest.mark.parametrize("stops", [(), ("STOPPED",), ("日本語”", "😀 t")])
def test_a_resumed_streams_text_continues_the_delivered_text_exactly(tokenizer, stops):
    prompt = tuple(tokenizer.encode("Prompt: ", add_special_tokens=False))
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(tokens) > len(TEXT.encode()) // 3, "the text should split characters across tokens"
    unbroken = stream_pieces(tokenizer, validated(prompt=prompt, stops=stops, max_new=200), tokens)
    for k in range(len(unbroken) - 1):  # a break after every token the unbroken stream delivered
        v = validated(prompt=prompt, stops=stops, max_new=200)
        resumed, _ = continue_request(resume_of(tokens[:k], v), v, INFO, "acme", SECRET)
        assert stream_pieces(tokenizer, resumed, tokens[k:]) == unbroken[k:], f"broken after {k} tokens"


def test_delivered_text_holding_a_stop_string_is_refused(tokenizer):
    tokens = tokenizer.encode("one STOP two", add_special_tokens=False)
    v = validated(stops=("STOP",), max_new=50)
    resumed, _ = continue_request(resume_of(tokens, v), v, INFO, "acme", SECRET)
    with pytest.raises(RequestError) as info:
        text_state(tokenizer, resumed)
    assert info.value.field == "resume.delivered_token_ids" and "stop string" in str(info.value)
