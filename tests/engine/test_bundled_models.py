"""The bundled pair in models/: loads with transformers, duospec's engine reproduces its logits,
and greedy acceptance has not regressed below what benchmarks/acceptance.py measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

MODELS = Path(__file__).resolve().parents[2] / "models"
TARGET, DRAFT = MODELS / "target", MODELS / "draft"
METRICS = MODELS / "metrics.json"
# Acceptance may move a little across CPUs (argmax near-ties); a real regression moves it a lot.
ACCEPTANCE_MARGIN = 0.9

pytestmark = pytest.mark.skipif(not (TARGET / "config.json").is_file() or not (DRAFT / "config.json").is_file(),
                                reason="models/target and models/draft are not trained yet (duospec train-tiny)")


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(DRAFT), dtype=torch.float32).eval()
    return target, draft, AutoTokenizer.from_pretrained(str(TARGET))


def test_pair_loads_and_shares_one_tokenizer(pair):
    from transformers import AutoTokenizer

    target, draft, tokenizer = pair
    assert target.config.model_type == draft.config.model_type == "llama"
    assert target.config.vocab_size == draft.config.vocab_size == len(tokenizer)
    assert AutoTokenizer.from_pretrained(str(DRAFT)).get_vocab() == tokenizer.get_vocab()
    assert target.config.num_hidden_layers > draft.config.num_hidden_layers
    text = "def greet(name):\n    return f'hello {name}'\n"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    size = sum(f.stat().st_size for d in (TARGET, DRAFT) for f in d.iterdir() if f.is_file())
    assert size <= 60 * 2**20, f"bundled models take {size / 2**20:.1f} MiB, over the 60 MB budget"


@pytest.mark.parametrize("which", ["target", "draft"])
def test_engine_logits_match_transformers(which, pair):
    engine = pytest.importorskip("duospec.engine", reason="duospec.engine is not importable yet")
    model = pair[0] if which == "target" else pair[1]
    tokenizer = pair[2]
    ids = tokenizer("import os\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n",
                    add_special_tokens=False)["input_ids"]
    runner = engine.load_model(MODELS / which, device="cpu", dtype=torch.float32, max_slots=1)
    slot = runner.allocate_slot()
    prefill = runner.forward([engine.SlotChunk(slot, 0, ids[:-1])])[0]
    step = runner.forward_last([engine.SlotChunk(slot, len(ids) - 1, ids[-1:])])[0]
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([ids])).logits[0]
    assert (prefill - reference[:-1]).abs().max().item() <= 1e-4
    assert (step - reference[-1]).abs().max().item() <= 1e-4


def test_greedy_acceptance_has_not_regressed(pair):
    from duospec.training.acceptance import heldout_prompts, measure_pair

    if not METRICS.is_file():
        pytest.skip("models/metrics.json missing: run benchmarks/acceptance.py --record models/metrics.json")
    recorded = json.loads(METRICS.read_text())["regression_set"]
    target, draft, tokenizer = pair
    prompts = heldout_prompts(tokenizer, recorded["prompts"], recorded["prompt_tokens"])
    stats = measure_pair(target, draft, prompts, recorded["new_tokens"], recorded["draft_len"])
    floor = ACCEPTANCE_MARGIN * recorded["mean_accepted_length"]
    assert stats.mean_accepted_length >= floor, (
        f"greedy mean accepted length {stats.mean_accepted_length:.3f} fell below {floor:.3f} "
        f"({ACCEPTANCE_MARGIN} x the recorded {recorded['mean_accepted_length']:.3f})"
    )
