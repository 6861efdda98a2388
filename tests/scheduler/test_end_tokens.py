"""A chat request on a checkpoint with a chat template and several end tokens (generation_config.json),
one of them a special token that is not the tokenizer's EOS (like Qwen's <|im_end|> or Llama 3's
<|eot_id|>): ids, text and finish reason equal transformers' apply_chat_template + generate +
decode(skip_special_tokens=True), through the real gRPC server, in every mode."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from duospec.coordinator.config import ModelConfig
from duospec.v1 import generation_pb2 as pb
from server_support import collect, running_server
from tiny_models import CHAT_TEMPLATE, make_tiny_checkpoint
from exactness import reference_model

TEMPLATE = CHAT_TEMPLATE
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]


def _chat_ids(tok) -> list[int]:
    """The prompt as chat servers build it: the template rendered to text (it holds any BOS), then
    encoded without adding special tokens."""
    return tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    target = make_tiny_checkpoint(root / "target", "llama", seed=21, hidden_size=64, num_layers=2)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=22, hidden_size=32, num_layers=1)
    tok = AutoTokenizer.from_pretrained(str(target))
    tok.chat_template = TEMPLATE
    prompt_ids = _chat_ids(tok)
    model = reference_model(str(target))
    with torch.no_grad():
        free = model.generate(torch.tensor([prompt_ids]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.pad_token_id)[0, len(prompt_ids):].tolist()
    # The second end token: one the model produces greedily after a few tokens (first occurrence),
    # made a special token of the tokenizer, as chat models' end-of-turn tokens are.
    position = next(i for i in range(4, len(free))
                    if free[i] not in free[:i] and free[i] > 3 and tok.decode([free[i]]).strip().isalnum())
    end_turn = free[position]
    tok.add_special_tokens({"additional_special_tokens": [tok.convert_ids_to_tokens(end_turn)]})
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(end_turn)) == end_turn  # no new id
    for directory in (target, draft):
        tok.save_pretrained(str(directory))
        GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, end_turn],
                         pad_token_id=tok.pad_token_id).save_pretrained(str(directory))
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"][1] == end_turn
    return target, draft, end_turn, position


def _transformers_reference(target, max_new_tokens):
    tok = AutoTokenizer.from_pretrained(str(target))
    model = reference_model(str(target))  # its generation_config: both end ids
    prompt_ids = _chat_ids(tok)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    ids = out[0, len(prompt_ids):].tolist()
    return ids, tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_VANILLA, pb.SPECULATION_MODE_OFF])
async def test_chat_reply_stops_at_any_end_token_and_its_text_has_no_special_tokens(chat_checkpoint, mode):
    from duospec.coordinator.local import LocalCoordinator

    target, draft, end_turn, position = chat_checkpoint
    want_ids, want_text = _transformers_reference(target, 30)
    assert want_ids[-1] == end_turn and len(want_ids) == position + 1  # transformers stopped there too
    config = ModelConfig(name="chat", target=str(target), draft=str(draft), device="cpu", dtype="float32")
    async with running_server(LocalCoordinator([config])) as h:
        req = pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]),
            stopping=pb.StoppingCriteria(max_new_tokens=30), speculation=pb.SpeculationParams(mode=mode))
        messages = await collect(h.stub, req)
        ids = [t for m in messages for t in m.token_ids]
        text = "".join(m.text for m in messages)
        assert ids == want_ids
        tok = AutoTokenizer.from_pretrained(str(target))
        assert text == want_text == tok.decode(ids[:-1]) != tok.decode(ids)  # everything but the end token
        assert messages[-1].finish_reason == pb.FINISH_REASON_EOS
        # ignore_eos ignores every end token
        req.stopping.ignore_eos = True
        messages = await collect(h.stub, req)
        assert sum(len(m.token_ids) for m in messages) == 30 and messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
