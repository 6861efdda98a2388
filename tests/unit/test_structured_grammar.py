"""The grammar subsystem on its own: compile errors, the compile cache and its limits, masks, and
rollback (a random walk of accepts and rollbacks leaves the matcher as a fresh replay leaves it)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import statistics
import time

import pytest

from duospec.structured import Constraint, ConstraintError, ConstraintKind, GrammarCompiler
from duospec.structured.backend import allocate_bitmask, allowed_tokens, apply_bitmask
from duospec.structured.llguidance_backend import LLGuidanceBackend
from structured_support import EOS, TOY_IDS, toy_backend

MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}


@pytest.fixture(scope="module")
def bundled():
    return LLGuidanceBackend.from_pretrained(str(MODELS / "target"))


def _legal(matcher, vocab):
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    return allowed_tokens(bitmask[0], vocab)


@pytest.mark.parametrize("constraint, message", [
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "frobnicate"}'), "frobnicate"),
    (Constraint(ConstraintKind.REGEX, "(unclosed"), "unclosed"),
    (Constraint(ConstraintKind.REGEX, "[^\\s\\S]"), "matches no text"),
    (Constraint(ConstraintKind.GRAMMAR, "start: missing_rule"), "missing_rule"),
    (Constraint.json_schema({"not": {"type": "string"}}), "not"),  # unsupported: said, not ignored
    (Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 2}), "Unsatisfiable"),
])
def test_bad_constraints_are_refused_with_a_reason(bundled, constraint, message):
    with pytest.raises(ConstraintError, match=message):
        GrammarCompiler(bundled).compile(constraint)


def test_constraint_data_is_checked_before_any_compile():
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json_schema("{nope")
    with pytest.raises(ConstraintError, match="non-empty"):
        Constraint(ConstraintKind.REGEX, "  ")
    with pytest.raises(ConstraintError, match="matches no JSON value"):
        Constraint.json_schema(False)
    assert Constraint.json_schema(True) == Constraint.json_schema({})
    with pytest.raises(ConstraintError, match="bytes"):
        Constraint(ConstraintKind.REGEX, "a" * (256 * 1024 + 1))
    # equal schemas written differently share one cache key; key order is the schema's (it orders the output)
    assert Constraint.json_schema({"type": "object", "b": 1}) == Constraint.json_schema('{"type": "object",  "b": 1}')
    assert Constraint.json_schema({"b": 1, "type": "object"}) != Constraint.json_schema({"type": "object", "b": 1})


def test_compiles_are_cached_per_constraint_and_tokenizer(bundled):
    compiler = GrammarCompiler(bundled, max_entries=2)
    schema = Constraint.json_schema(PERSON)
    assert compiler.compile(schema) is compiler.compile(Constraint.json_schema(json.dumps(PERSON)))
    assert compiler.compiles == 1
    compiler.compile(Constraint(ConstraintKind.REGEX, "a+"))
    compiler.compile(Constraint(ConstraintKind.REGEX, "b+"))  # evicts the schema (least recently used)
    compiler.compile(schema)
    assert compiler.compiles == 4
    # the same constraint for another tokenizer is another grammar
    other = GrammarCompiler(toy_backend())
    assert other.compile(Constraint(ConstraintKind.REGEX, "a+")) is not compiler.compile(
        Constraint(ConstraintKind.REGEX, "a+"))


async def test_a_compile_past_its_time_limit_is_a_constraint_error(bundled):
    compiler = GrammarCompiler(bundled)
    slow = Constraint(ConstraintKind.REGEX, "x+")
    real = bundled.compile

    def crawl(constraint):
        time.sleep(0.5)
        return real(constraint)

    bundled.compile = crawl
    try:
        with pytest.raises(ConstraintError, match="within 0.05 s"):
            await compiler.compile_async(slow, timeout_s=0.05)
        # the event loop was free meanwhile, and a later request finds the grammar compiled
        deadline = time.monotonic() + 10  # (its 0.5 s, then the compile, on however busy a machine)
        while compiler.compiles == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert compiler.compiles == 1
    finally:
        bundled.compile = real
    assert await compiler.compile_async(slow) is compiler.compile(slow)


def test_masks_follow_the_grammar_on_the_toy_vocabulary():
    matcher = toy_backend().compile(Constraint(ConstraintKind.REGEX, "(ab|ba|aa)c?")).matcher()
    vocab = len(TOY_IDS)
    assert _legal(matcher, vocab) == sorted([TOY_IDS["a"], TOY_IDS["b"], TOY_IDS["ab"]])
    assert matcher.validate_tokens([TOY_IDS["a"], TOY_IDS["x"]]) == 1
    assert matcher.accept_tokens([TOY_IDS["a"], TOY_IDS["x"]]) == 1  # stops before the illegal token
    assert _legal(matcher, vocab) == [TOY_IDS["a"], TOY_IDS["b"]]
    matcher.accept_tokens([TOY_IDS["b"]])
    assert _legal(matcher, vocab) == [EOS, TOY_IDS["c"]] and not matcher.is_terminated()
    matcher.accept_tokens([TOY_IDS["c"]])
    assert matcher.is_terminated() and matcher.forced_token(vocab) == EOS
    matcher.rollback(2)
    assert _legal(matcher, vocab) == [TOY_IDS["a"], TOY_IDS["b"]] and matcher.num_tokens == 1


def test_apply_bitmask_sets_illegal_logits_to_minus_infinity():
    import torch

    logits = torch.zeros(3, 40)
    bitmask = allocate_bitmask(2, 40)
    bitmask[0] = 0
    bitmask[0, 1] = 1 << 3  # only token 35
    apply_bitmask(logits, [2, 0], bitmask)
    assert torch.isinf(logits[2]).sum() == 39 and logits[2, 35] == 0
    assert not torch.isinf(logits[0]).any() and not torch.isinf(logits[1]).any()
    wide = torch.zeros(1, 70)  # padded embeddings past the tokenizer's 64 ids: never legal
    apply_bitmask(wide, [0], allocate_bitmask(1, 64))
    assert torch.isinf(wide[0, 64:]).all() and not torch.isinf(wide[0, :64]).any()


@pytest.mark.parametrize("seed", range(3))
def test_rollback_fuzz_leaves_the_matcher_as_a_fresh_replay(bundled, seed):
    """Random accepts of legal tokens and random rollbacks; after each step the matcher's mask and
    termination equal those of a fresh matcher fed the surviving tokens."""
    rng = random.Random(seed)
    grammar = GrammarCompiler(bundled).compile(Constraint.json_schema(PERSON))
    live, kept = grammar.matcher(), []
    vocab = bundled.vocab_size
    for _ in range(40):
        if kept and rng.random() < 0.35:
            n = rng.randint(1, len(kept))
            live.rollback(n)
            del kept[len(kept) - n:]
        else:
            legal = _legal(live, vocab)
            if not legal:
                break
            token = rng.choice(legal)
            assert live.accept_tokens([token]) == 1
            kept.append(token)
        replay = grammar.matcher()
        assert replay.accept_tokens(kept) == len(kept)
        assert _legal(live, vocab) == _legal(replay, vocab)
        assert live.is_terminated() == replay.is_terminated() and live.num_tokens == len(kept)


def test_mask_and_compile_times_are_reported(bundled, capsys):
    """Not a timed assertion: prints what docs/api.md's structured-output section quotes (a walk of
    legal tokens through a JSON schema, one mask per step)."""
    rng = random.Random(0)
    compiler = GrammarCompiler(bundled)
    started = time.perf_counter()
    grammar = compiler.compile(Constraint.json_schema(PERSON))
    compile_s = time.perf_counter() - started
    matcher, bitmask, times = grammar.matcher(), allocate_bitmask(1, bundled.vocab_size), []
    for _ in range(60):
        started = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        times.append(time.perf_counter() - started)
        legal = [t for t in allowed_tokens(bitmask[0], bundled.vocab_size) if t != EOS]
        if not legal:
            break
        assert matcher.accept_tokens([rng.choice(legal)]) == 1
    with capsys.disabled():
        print(f"\n[structured] bundled tokenizer ({bundled.vocab_size} tokens): JSON-schema compile "
              f"{compile_s * 1e3:.2f} ms; mask per token median {statistics.median(times) * 1e6:.0f} us, "
              f"max {max(times) * 1e6:.0f} us over {len(times)} tokens")
    assert len(times) > 5
