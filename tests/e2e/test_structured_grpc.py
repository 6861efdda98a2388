"""Constrained generation through a real gRPC server on the tiny pair: JSON schemas, regexes and Lark
grammars give output that validates, token for token the same in every speculation mode and equal to
the target alone decoding under the same masks (transformers + the grammar, written independently of
the workers); bad constraints are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import re

import grpc
import pytest
import torch

from duospec.v1 import generation_pb2 as pb
from exactness import reference_model
from server_support import collect, request, rpc_error, running_server, server_coordinator

jsonschema = pytest.importorskip("jsonschema")

# Closed structures (enums, bounded integers, bounded strings): a random tiny model must still finish.
SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["color", "n"],
             "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "tags"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["ok", "name"],
                                       "properties": {"ok": {"type": "boolean"},
                                                      "name": {"type": "string", "pattern": "^[a-z]{1,4}$"}}},
                              "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["x", "y"]}}}},
}
MODES = (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_VANILLA, pb.SPECULATION_MODE_PEARL)


@pytest.fixture
async def harness(tiny_pair):
    async with running_server(server_coordinator(tiny_pair)) as h:
        yield h


async def _generate(h, constraint: pb.Constraint, mode=pb.SPECULATION_MODE_PEARL, max_new_tokens=60):
    req = request("def fib(n):", max_new_tokens, constraint=constraint,
                  speculation=pb.SpeculationParams(mode=mode))
    messages = await collect(h.stub, req)
    ids = [t for m in messages for t in m.token_ids]
    return "".join(m.text for m in messages), ids, messages[-1].finish_reason


def masked_reference(target_path, prompt: str, constraint_text: str, kind: str, max_new: int) -> list[int]:
    """The target alone under the same masks: transformers' logits, llguidance's masks, argmax."""
    from transformers import AutoTokenizer

    from duospec.coordinator.config import ModelConfig
    from duospec.coordinator.models import model_info
    from duospec.structured import Constraint, ConstraintKind
    from duospec.structured.backend import allocate_bitmask, apply_bitmask
    from duospec.structured.llguidance_backend import LLGuidanceBackend

    info = model_info(ModelConfig(name="ref", target=str(target_path), device="cpu"))
    backend = LLGuidanceBackend.from_pretrained(str(target_path), sorted(info.end_token_ids))
    constraint = Constraint.json_schema(constraint_text) if kind == "json_schema" else Constraint(
        ConstraintKind.REGEX, constraint_text)
    matcher = backend.compile(constraint).matcher()
    model = reference_model(target_path)
    ids = AutoTokenizer.from_pretrained(str(target_path)).encode(prompt, add_special_tokens=False)
    out = []
    with torch.no_grad():
        while len(out) < max_new:
            logits = model(torch.tensor([ids + out])).logits[0, -1:].float().clone()
            bitmask = allocate_bitmask(1, backend.vocab_size)
            matcher.fill_bitmask(bitmask, 0)
            apply_bitmask(logits, [0], bitmask)
            token = int(logits[0].argmax())
            out.append(token)
            matcher.accept_tokens([token])
            if token in info.end_token_ids:
                break
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
async def test_json_schema_output_validates_and_is_the_same_in_every_mode(harness, tiny_pair, name):
    schema = SCHEMAS[name]
    constraint = pb.Constraint(json_schema=json.dumps(schema))
    results = [await _generate(harness, constraint, mode) for mode in MODES]
    texts = {text for text, _, _ in results}
    assert len({tuple(ids) for _, ids, _ in results}) == 1, texts
    text, ids, finish = results[0]
    assert finish == pb.FINISH_REASON_EOS, text
    jsonschema.validate(json.loads(text), schema)
    want = masked_reference(tiny_pair[0], "def fib(n):", json.dumps(schema), "json_schema", 60)
    assert ids == want


async def test_regex_and_grammar_constraints(harness):
    text, _, finish = await _generate(harness, pb.Constraint(regex="(yes|no), [0-9]{2}"))
    assert re.fullmatch("(yes|no), [0-9]{2}", text) and finish == pb.FINISH_REASON_EOS
    grammar = 'start: "[" num ("," num)* "]"\nnum: /[1-9]/'
    text, _, _ = await _generate(harness, pb.Constraint(grammar=grammar), max_new_tokens=12)
    assert re.fullmatch(r"\[[1-9](,[1-9])*\]?", text) or re.fullmatch(r"\[[1-9](,[1-9])*(,)?", text), text


async def test_sampled_constrained_output_validates(harness):
    schema = SCHEMAS["nested"]
    req = request("x", 60, constraint=pb.Constraint(json_schema=json.dumps(schema)),
                  sampling=pb.SamplingParams(temperature=1.0, seed=7))
    messages = await collect(harness.stub, req)
    jsonschema.validate(json.loads("".join(m.text for m in messages)), schema)


@pytest.mark.parametrize("constraint, field, words", [
    (pb.Constraint(json_schema="{not json"), "constraint.json_schema", "not valid JSON"),
    (pb.Constraint(json_schema='{"type": "frobnicate"}'), "constraint.json_schema", "frobnicate"),
    (pb.Constraint(regex="[^\\s\\S]"), "constraint.regex", "matches no text"),
    (pb.Constraint(regex="(open"), "constraint.regex", "unclosed"),
    (pb.Constraint(grammar="start: nowhere"), "constraint.grammar", "nowhere"),
    (pb.Constraint(json_object=False), "constraint.json_object", "must be true"),
    (pb.Constraint(), "constraint", "set one of"),
])
async def test_bad_constraints_are_invalid_argument_naming_the_field(harness, constraint, field, words):
    err = await rpc_error(harness.stub, request("x", 8, constraint=constraint))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field + ":") and words in err.details(), err.details()


async def test_a_bad_constraint_does_not_disturb_a_good_one_running_beside_it(harness):
    import asyncio

    good = asyncio.ensure_future(_generate(harness, pb.Constraint(json_schema=json.dumps(SCHEMAS["flat"]))))
    err = await rpc_error(harness.stub, request("x", 8, constraint=pb.Constraint(regex="(")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    text, _, _ = await good
    jsonschema.validate(json.loads(text), SCHEMAS["flat"])


async def test_the_workers_report_their_grammar_work_to_the_scheduler(harness):
    """Each worker's messages carry its mask time and rows (the drafter's forced tokens too): the
    scheduler's stats, and so /metrics, have them per worker."""
    from duospec.coordinator.serving.metrics import per_model_stats

    await _generate(harness, pb.Constraint(json_schema=json.dumps(SCHEMAS["nested"])))
    [entry] = per_model_stats(await harness.coordinator.stats()).values()
    target, draft = entry["target"], entry["draft"]
    assert target["grammar_mask_rows"] > 0 and target["grammar_mask_seconds"] > 0
    assert draft["grammar_mask_rows"] > 0 and draft["grammar_forced_tokens"] > 0  # '{"' at least is forced
    assert target["grammar_mask_seconds"] < target["busy_s"]  # within the forwards it was part of


async def test_a_compile_past_the_configured_limit_is_invalid_argument(tiny_pair, monkeypatch):
    """server.grammar_compile_timeout_s bounds a compile; the request is refused naming the field."""
    import time

    from duospec.coordinator.config import ServerSettings
    from duospec.structured.llguidance_backend import LLGuidanceBackend

    real = LLGuidanceBackend.compile

    def crawl(self, constraint):
        time.sleep(0.5)
        return real(self, constraint)

    monkeypatch.setattr(LLGuidanceBackend, "compile", crawl)
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0, grammar_compile_timeout_s=0.1)
    async with running_server(server_coordinator(tiny_pair), settings) as h:
        err = await rpc_error(h.stub, request("x", 8, constraint=pb.Constraint(regex="[ab]+")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "constraint.regex: did not compile within 0.1 s; simplify it", err.details()


def _exact_output_distribution(target_path, prompt: str, regex: str, temperature: float) -> dict:
    """P(output tokens) of the masked target alone, by enumerating the finite language token by token
    (transformers' logits, the grammar's masks, then temperature)."""
    from transformers import AutoTokenizer

    from duospec.coordinator.config import ModelConfig
    from duospec.coordinator.models import model_info
    from duospec.sampling import SamplingParams, probs_from_logits
    from duospec.structured import Constraint, ConstraintKind
    from duospec.structured.backend import allocate_bitmask, apply_bitmask
    from duospec.structured.llguidance_backend import LLGuidanceBackend

    info = model_info(ModelConfig(name="ref", target=str(target_path), device="cpu"))
    backend = LLGuidanceBackend.from_pretrained(str(target_path), sorted(info.end_token_ids))
    grammar = backend.compile(Constraint(ConstraintKind.REGEX, regex))
    model = reference_model(target_path)
    ids = AutoTokenizer.from_pretrained(str(target_path)).encode(prompt, add_special_tokens=False)
    out, frontier = {}, [((), 1.0)]
    with torch.no_grad():
        while frontier:
            prefix, mass = frontier.pop()
            matcher = grammar.matcher()
            matcher.accept_tokens(list(prefix))
            logits = model(torch.tensor([ids + list(prefix)])).logits[0, -1:].float().clone()
            bitmask = allocate_bitmask(1, backend.vocab_size)
            matcher.fill_bitmask(bitmask, 0)
            apply_bitmask(logits, [0], bitmask)
            p = probs_from_logits(logits, SamplingParams(temperature=temperature, seed=0))[0].double()
            for token in torch.nonzero(p).flatten().tolist():
                if token in info.end_token_ids:
                    out[prefix + (token,)] = out.get(prefix + (token,), 0.0) + mass * float(p[token])
                else:
                    frontier.append((prefix + (token,), mass * float(p[token])))
    return out


@pytest.mark.slow
async def test_sampled_constrained_output_follows_the_masked_target_chi_square(harness, tiny_pair):
    """Seeded sampled requests through the server (pearl, the drafter masking its q and drafting forced
    tokens): the outputs' frequencies match the masked target's exact distribution."""
    import asyncio
    from collections import Counter

    from exactness import chi_square_pvalue

    regex, n = "(yes|no|maybe)!?", 400
    joint = _exact_output_distribution(tiny_pair[0], "x", regex, 1.0)
    assert abs(sum(joint.values()) - 1.0) < 1e-6 and len(joint) >= 4

    async def one(seed):
        req = request("x", 12, constraint=pb.Constraint(regex=regex), sampling=pb.SamplingParams(temperature=1.0, seed=seed),
                      speculation=pb.SpeculationParams(mode=pb.SPECULATION_MODE_PEARL))
        return tuple(t for m in await collect(harness.stub, req) for t in m.token_ids)

    counts = Counter()
    for start in range(0, n, 16):
        counts.update(await asyncio.gather(*(one(seed) for seed in range(start, start + 16))))
    assert set(counts) <= set(joint), set(counts) - set(joint)
    assert chi_square_pvalue(joint, counts, n) > 1e-3


async def test_constrained_requests_are_counted_in_metrics(harness):
    await _generate(harness, pb.Constraint(json_schema=json.dumps(SCHEMAS["flat"])))
    await _generate(harness, pb.Constraint(json_schema=json.dumps(SCHEMAS["flat"])))  # a cached compile
    get = harness.server.metrics.registry.get_sample_value
    assert get("duospec:constrained_requests_total", {"tenant": "default"}) == 2
    assert get("duospec:spec_decode_constrained_num_draft_tokens_total", {"tenant": "default"}) > 0
    assert get("duospec:grammar_compile_seconds_count", {"model": "tiny"}) == 2
