"""Incremental detokenization with a byte-level BPE where one character spans several tokens."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from duospec.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
EOS = "<|eos|>"
TEXT = (
    "Hello wörld, café naïve résumé — façade. 你好世界，我们一起学习中文。日本語のテキスト "
    "😀🚀👍🏽 🇫🇷 ñandú Ελληνικά Кириллица; plain ascii too.\n"
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    # A tiny vocabulary (256 bytes + a few merges) keeps most non-ASCII characters split into
    # several byte tokens, each of which decodes alone to U+FFFD.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 20 + ["plain ascii text for the merges"] * 20, trainer)
    return tok


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT * 3).ids
    assert sum(REPLACEMENT in tokenizer.decode([i]) for i in ids) > 30, "characters not split"
    return ids


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes) -> list[str]:
    pieces, pos = [], 0
    while pos < len(ids):
        size = next(chunk_sizes)
        pieces.append(detok.push(ids[pos : pos + size]))
        pos += size
    return pieces


def test_one_token_at_a_time(tokenizer, ids):
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([i]) for i in ids]
    assert all(REPLACEMENT not in piece for piece in pieces)
    tail = detok.flush()
    assert "".join(pieces) + tail == tokenizer.decode(ids) == TEXT * 3
    assert tail == ""
    assert detok.text == TEXT * 3
    # Text is streamed, not held until the end.
    assert sum(1 for piece in pieces if piece) > len(ids) // 3


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks(tokenizer, ids, seed):
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = _stream(detok, ids, iter(lambda: rng.randint(0, 7), None))
    assert all(REPLACEMENT not in piece for piece in pieces)
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids)


def test_text_completed_early_in_a_chunk_is_not_held_back(tokenizer):
    emoji = tokenizer.encode("😀").ids
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tokenizer)
    ab = tokenizer.encode("ab").ids
    assert detok.push(ab + emoji[:1]) == "ab"  # "ab" is ready though the emoji is not
    assert detok.push(emoji[1:]) == "😀"


def test_prompt_gives_context_but_is_not_emitted(tokenizer, ids):
    # Every split point, including prompts that end inside a character.
    cut_inside_a_character = 0
    for split in range(1, 80):
        cut_inside_a_character += tokenizer.decode(ids[:split]).endswith(REPLACEMENT)
        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=ids[:split])
        pieces = [detok.push([i]) for i in ids[split:]]
        assert "".join(pieces) + detok.flush() == tokenizer.decode(ids[split:]), split
    assert cut_inside_a_character > 10


def test_unfinished_character_comes_out_at_flush(tokenizer):
    emoji = tokenizer.encode("x😀").ids
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(emoji[:-1]) == "x"
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT)
    assert detok.text == tokenizer.decode(emoji[:-1])
    assert detok.flush() == ""
    with pytest.raises(RuntimeError, match="after flush"):
        detok.push([1])


@pytest.mark.parametrize("skip", [False, True])
def test_special_tokens(tokenizer, ids, skip):
    eos = tokenizer.token_to_id(EOS)
    stream = ids[:30] + [eos] + ids[30:60] + [eos, eos]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    pieces = _stream(detok, stream, iter(lambda: 3, None))
    expected = tokenizer.decode(stream, skip_special_tokens=skip)
    assert "".join(pieces) + detok.flush() == expected
    assert (EOS in expected) is not skip


@pytest.mark.parametrize("seed", range(3))
def test_arbitrary_ids_keep_the_invariant(tokenizer, seed):
    # Random ids form invalid UTF-8 too; decode() shows it as U+FFFD and so must the stream.
    rng = random.Random(seed)
    stream = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(400)]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = _stream(detok, stream, iter(lambda: rng.randint(1, 4), None))
    assert "".join(pieces) + detok.flush() == tokenizer.decode(stream, skip_special_tokens=False)


def test_sentencepiece_style_output_continues_the_prompt():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    sentence = "the quick brown fox jumps over the lazy dog while the cat sleeps"
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator([sentence] * 10, trainer)
    ids = tok.encode(sentence).ids
    for split in range(1, len(ids)):
        detok = IncrementalDetokenizer(tok, prompt_token_ids=ids[:split])
        out = "".join(detok.push([i]) for i in ids[split:]) + detok.flush()
        assert tok.decode(ids[:split]) + out == sentence, split
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == tok.decode(ids) == sentence


class _CountingTokenizer:
    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.longest = 0
        self.decoded_ids = 0

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decodes_a_bounded_window(tokenizer, ids):
    counting = _CountingTokenizer(tokenizer)
    long_stream = ids * 10
    detok = IncrementalDetokenizer(counting, prompt_token_ids=ids)
    for i in long_stream:
        detok.push([i])
    assert detok.flush() == ""
    assert detok.text == tokenizer.decode(long_stream)
    # A window spans one character's tokens plus context, never the sequence so far.
    assert counting.longest <= 12
    assert counting.decoded_ids < 12 * len(long_stream)


def test_works_with_a_transformers_tokenizer(tokenizer, ids):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    detok = IncrementalDetokenizer(hf, skip_special_tokens=True)
    pieces = _stream(detok, ids + [hf.eos_token_id], iter(lambda: 2, None))
    assert "".join(pieces) + detok.flush() == hf.decode(ids, skip_special_tokens=True)
