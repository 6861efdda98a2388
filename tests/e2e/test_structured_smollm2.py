"""Structured output on the pulled SmolLM2-135M-Instruct with its distilled drafter, served as
deploy/examples/smollm2.yaml serves it: five realistic JSON schemas (nested objects, arrays, enums),
greedy. Every output validates against its schema, off and pearl give the same tokens, and both equal
the target alone under the same masks (transformers' logits + the grammar, outside the server). The
OpenAI client's json_schema path gives the same text. Skips when the model has not been pulled."""

from __future__ import annotations

import json

import pytest

from duospec.coordinator.config import ServerSettings
from duospec.demo import free_port
from duospec.v1 import generation_pb2 as pb
from duospec.bench.schemas import QUESTIONS, SCHEMAS
from server_support import collect, running_server
from test_smollm2_served import TARGET, example_model, hf  # noqa: F401  (the pulled model and its loader)
from test_structured_grpc import masked_reference

jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 160


def _chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


async def test_json_schemas_validate_and_equal_the_masked_target_alone_in_off_and_pearl(hf):  # noqa: F811
    import openai

    from duospec.coordinator.local import LocalCoordinator

    tokenizer, _ = hf
    config = example_model()
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=free_port())
    outputs, stats = {}, []
    async with running_server(LocalCoordinator([config]), settings) as h:
        for name, schema in SCHEMAS.items():
            prompt = _chat_prompt(tokenizer, QUESTIONS[name])
            per_mode = {}
            for mode in (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_PEARL):
                # the chat path's ids (template text, encoded without special tokens), as the reference's
                req = pb.GenerateRequest(model=config.name, prompt_token_ids=pb.TokenIds(
                                             ids=tokenizer.encode(prompt, add_special_tokens=False)),
                                         speculation=pb.SpeculationParams(mode=mode),
                                         stopping=pb.StoppingCriteria(max_new_tokens=MAX_TOKENS),
                                         constraint=pb.Constraint(json_schema=json.dumps(schema)))
                messages = await collect(h.stub, req, timeout=900)
                per_mode[mode] = ([t for m in messages for t in m.token_ids], "".join(m.text for m in messages))
                if mode == pb.SPECULATION_MODE_PEARL:
                    stats.append(messages[-1].stats)
            (ids, text), (pearl_ids, _) = per_mode[pb.SPECULATION_MODE_OFF], per_mode[pb.SPECULATION_MODE_PEARL]
            assert pearl_ids == ids, f"{name}: pearl differs from off"
            jsonschema.validate(json.loads(text), schema)
            outputs[name] = (prompt, ids, text)
        base_url = f"http://127.0.0.1:{h.server.http_port}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900) as client:
            for name, schema in SCHEMAS.items():
                reply = await client.chat.completions.create(
                    model=config.name, messages=[{"role": "user", "content": QUESTIONS[name]}], temperature=0,
                    max_completion_tokens=MAX_TOKENS,
                    response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
                assert reply.choices[0].message.content == outputs[name][2], name
    for name, (prompt, ids, _) in outputs.items():
        want = masked_reference(TARGET, prompt, json.dumps(SCHEMAS[name]), "json_schema", MAX_TOKENS)
        assert ids == want, f"{name}: the server's output is not the masked target alone"
    drafted = sum(s.drafted_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    forwards = sum(s.target_forwards for s in stats)
    committed = sum(len(ids) for _, ids, _ in outputs.values())
    print(f"\n[structured smollm2] pearl, 5 schemas: {committed} tokens in {forwards} target forwards "
          f"({committed / max(forwards, 1):.2f} per forward), drafted {drafted}, accepted {accepted}")
