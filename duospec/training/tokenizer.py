"""Byte-level BPE tokenizer trained on the corpus, saved in the Hugging Face format.

Byte-level means every byte sequence is encodable (no unknown token), which matters for source code
with arbitrary string literals. `<bos>`/`<eos>` are ids 0/1; `<pad>` is id 2 (padding is never
trained on, it only lets batch tooling pad).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD]


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE on `texts`, save it to `out_dir`, return the HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: code starts lines with indentation, not a word boundary.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_as_iterator(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def _as_iterator(texts: Iterable[str]) -> Iterator[str]:
    yield from texts
