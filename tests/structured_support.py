"""A toy vocabulary for grammar tests: few enough tokens to enumerate every outcome exactly, with
multi-character tokens so that one text has several tokenizations (what makes masks non-trivial)."""

from __future__ import annotations

import llguidance

from duospec.structured.llguidance_backend import LLGuidanceBackend

EOS = 0
TOY_TOKENS = [b"<eos>", b"a", b"b", b"c", b"ab", b"{", b"}", b"x"]
TOY_IDS = {t.decode(): i for i, t in enumerate(TOY_TOKENS)}


class _ToyTokenizer:
    """What llguidance's TokenizerWrapper reads: the tokens' bytes, EOS, and an encoder (one token
    per character: the canonical tokenization of forced text)."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = TOY_TOKENS
    special_token_ids = [EOS]

    def __call__(self, text):
        data = text.encode() if isinstance(text, str) else text
        return [TOY_TOKENS.index(bytes([c])) for c in data]


def toy_backend() -> LLGuidanceBackend:
    return LLGuidanceBackend(llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ToyTokenizer())), key="toy")


# ---- a deterministic fake target over the toy vocabulary ---------------------------------------------

import hashlib  # noqa: E402

import torch  # noqa: E402

from duospec.engine.runner import ModelRunner  # noqa: E402


def fake_logits(history, vocab: int = len(TOY_TOKENS)) -> torch.Tensor:
    """The fake model's next-token logits after `history`: a pure function of the tokens, spread
    enough that masking changes the argmax often."""
    digest = hashlib.sha256(repr(tuple(int(t) for t in history)).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(vocab, generator=generator) * 3.0


class FakeRunner(ModelRunner):
    """A ModelRunner whose logits are `fake_logits` of each slot's tokens (chains only)."""

    backend = "fake"

    def __init__(self, max_slots: int = 4, max_context: int = 256, vocab: int = len(TOY_TOKENS)):
        super().__init__(max_slots, max_context)
        self.vocab_size = vocab
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self._tokens: dict[int, list[int]] = {}

    def _on_allocate(self, slot):
        self._tokens[slot] = []

    def _copy_prefix(self, src, dst, length):  # a drafter's hedge starts from its parent's prefix
        self._tokens[dst] = self._tokens[src][:length]

    def _set_length(self, slot, length):
        super()._set_length(slot, length)
        del self._tokens[slot][length:]

    def _forward(self, chunks, *, last_only, to_cpu):
        out = []
        for chunk in chunks:
            tokens = self._tokens[chunk.slot]
            del tokens[chunk.start_pos:]
            rows = []
            for token in chunk.token_ids:
                tokens.append(int(token))
                rows.append(fake_logits(tokens, self.vocab_size))
            self._lengths[chunk.slot] = len(tokens)
            out.append(torch.stack(rows))
        return torch.stack([rows[-1] for rows in out]) if last_only else out
