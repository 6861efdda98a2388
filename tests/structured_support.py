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
