"""Prefix caching through a real server: multi-turn chats that share their prefixes come out exactly
as transformers' greedy decoding in every mode while both workers reuse cached prompt blocks; the
cached prompt tokens are reported (gRPC usage, OpenAI usage.prompt_tokens_details); a tenant never
reuses another tenant's cached prompt under the default `prefix_cache: tenant`, and does under
`shared`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from duospec.coordinator.config import ModelConfig, ServerSettings
from duospec.coordinator.local import LocalCoordinator
from duospec.coordinator.tenants.tenancy import Tenant, hash_api_key, new_api_key
from duospec.v1 import generation_pb2 as pb
from test_server_http import _free_port, chat_pair  # noqa: F401  (fixture)
from server_support import MODEL, collect, running_server
from exactness import reference_model

KEYS = {name: new_api_key() for name in ("alpha", "beta")}
TENANTS = [Tenant(name, key_hashes=(hash_api_key(key),)) for name, key in KEYS.items()]
# long enough for several 16-position blocks before anything differs
SYSTEM = ("You answer questions about Python code. Keep every answer short, name the functions you use, and "
          "never invent a module that does not exist in the standard library.")
QUESTIONS = ["def fib(n):", "how do I read a file?", "class Point:"]
MODES = {"pearl": pb.SPECULATION_MODE_PEARL, "vanilla": pb.SPECULATION_MODE_VANILLA, "off": pb.SPECULATION_MODE_OFF}


def coordinator(chat_pair, prefix_cache: str = "tenant") -> LocalCoordinator:
    target, draft = chat_pair
    return LocalCoordinator([ModelConfig(name=MODEL, target=str(target), draft=str(draft), device="cpu",
                                         dtype="float32", prefix_cache=prefix_cache)])


def chat(messages: list[dict], mode: str, n: int = 12) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
        stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
        speculation=pb.SpeculationParams(mode=MODES[mode]))


def transformers_greedy(target, messages: list[dict], n: int = 12) -> list[int]:
    """The prompt as the server builds it (template to text, then encoded), greedy, EOS not special."""
    tok = AutoTokenizer.from_pretrained(str(target))
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    model = reference_model(str(target))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
async def test_multi_turn_chats_sharing_prefixes_stay_exact(chat_pair, mode):
    target, _ = chat_pair
    async with running_server(coordinator(chat_pair)) as h:
        for first_question in (QUESTIONS[0], QUESTIONS[2]):  # two conversations on one system prompt
            messages = [{"role": "system", "content": SYSTEM}]
            for turn, question in enumerate([first_question, QUESTIONS[1]]):
                messages.append({"role": "user", "content": question})
                replies = await collect(h.stub, chat(messages, mode))
                got = [t for m in replies for t in m.token_ids]
                assert got == transformers_greedy(target, messages), (mode, turn)
                cached = replies[-1].usage.cached_prompt_tokens
                # every turn but the very first finds at least the system prompt's blocks cached
                assert cached >= 32 if (turn, first_question) != (0, QUESTIONS[0]) else cached == 0
                messages.append({"role": "assistant", "content": "".join(m.text for m in replies)})
        scheduler = await h.coordinator.entries[MODEL].get_scheduler()
        target_stats = scheduler.stats()["target"]
        assert target_stats["prefix_cache_hits"] > 0 and 0 <= target_stats["kv_cache_usage"] <= 1


async def system_then(h, tenant: str, question: str) -> int:
    """A request with the shared system prompt from `tenant`; the prompt tokens it found cached."""
    replies = await collect(h.stub, chat([{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": question}], "off", n=2),
                            api_key=KEYS[tenant])
    return replies[-1].usage.cached_prompt_tokens


@pytest.mark.parametrize("scope", ["tenant", "shared"])
async def test_one_tenants_cached_prompt_is_not_anothers_by_default(chat_pair, scope):
    async with running_server(coordinator(chat_pair, scope), tenants=TENANTS) as h:
        assert await system_then(h, "alpha", QUESTIONS[0]) == 0
        beta = await system_then(h, "beta", QUESTIONS[1])
        assert (beta == 0) if scope == "tenant" else (beta >= 32)
        assert await system_then(h, "alpha", QUESTIONS[2]) >= 32  # the owner's own cache still serves it


async def test_the_openai_usage_reports_cached_prompt_tokens(chat_pair):
    openai = pytest.importorskip("openai")
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=_free_port())
    async with running_server(coordinator(chat_pair), settings) as h:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{h.server.http_port}/v1", api_key="none",
                                      max_retries=0) as client:
            usages = []
            for question in QUESTIONS[:2]:
                done = await client.chat.completions.create(
                    model=MODEL, max_tokens=2, temperature=0,
                    messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
                usages.append(done.usage.prompt_tokens_details.cached_tokens)
    assert usages[0] == 0 and usages[1] >= 32


@pytest.mark.parametrize("method", ["eagle", "medusa"])
async def test_a_head_drafters_sequences_take_the_cached_prompt_too(method):
    """EAGLE and Medusa draft from the target's hidden states, which a cache hit does not compute:
    the target keeps them with the blocks, so the second request on a shared prompt skips its
    prefill, stays exact, and its drafts are accepted as the first's were."""
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec
    from exactness import hf_greedy

    models = Path(__file__).resolve().parents[2] / "models"
    target = models / "target"
    hf = reference_model(str(target))
    tok = AutoTokenizer.from_pretrained(str(target))
    shared = tok("def parse_args(argv):\n    parser = argparse.ArgumentParser(description='Copy files between "
                 "directories, keeping their modification times and permissions, and skipping files that did not change.')\n    parser.add_argument(",
                 add_special_tokens=False)["input_ids"]
    prompts = [shared + tok(tail, add_special_tokens=False)["input_ids"] for tail in ("'--src'", "'--verbose'")]
    assert len(shared) >= 48
    accepted, cached = {}, {}
    for scope in ("off", "tenant"):
        config = ModelConfig(name=MODEL, target=str(target), device="cpu", dtype="float32", prefix_cache=scope,
                             draft=DraftSpec(DraftMethod(method), path=str(models / method)))
        async with running_server(LocalCoordinator([config])) as h:
            for prompt in prompts:
                request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                             stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True),
                                             speculation=pb.SpeculationParams(mode=pb.SPECULATION_MODE_VANILLA))
                messages = await collect(h.stub, request)
                assert [t for m in messages for t in m.token_ids] == hf_greedy(hf, prompt, 24)
            # the second prompt's: its shared part cached or not
            accepted[scope] = messages[-1].stats.accepted_tokens
            cached[scope] = messages[-1].usage.cached_prompt_tokens
    assert cached["off"] == 0 and cached["tenant"] >= 32, cached
    # drafted from the kept hidden states as from computed ones
    assert accepted["off"] > 0 and accepted["tenant"] >= 0.8 * accepted["off"], accepted
