"""Token ids → streamed text, one push at a time, without ever emitting half a character.

Byte-level tokenizers split one character (an emoji, a CJK ideograph) across several tokens; a
token alone then decodes to U+FFFD. Decoding the whole sequence on every push would be correct but
quadratic. Instead, as in vLLM and TGI, two offsets bound a small window:

    ids:   ... | prefix_offset ........ read_offset ........ end |
                 └─ context already emitted ─┘ └─ not yet emitted ─┘

``decode(ids[prefix:read])`` is text already emitted, kept only as context (SentencePiece-style
decoders treat a leading space differently at the start of a decode); ``decode(ids[prefix:])``
minus that is the candidate new text. It is emitted when it is longer and does not end in U+FFFD
(an unfinished UTF-8 sequence); the window then slides forward. Held tokens wait for the next push.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context for the first generated tokens.
_PROMPT_CONTEXT = 5


class Tokenizer(Protocol):
    """What is needed of a tokenizer: ``tokenizers.Tokenizer`` and HF tokenizers both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Streams the text of generated ids.

    Invariant: the pieces returned by ``push`` and ``flush``, concatenated, equal
    ``tokenizer.decode(generated_ids, skip_special_tokens=...)`` for tokenizers whose decoding is
    a concatenation of token bytes (byte-level BPE). For SentencePiece-style tokenizers the text
    is the continuation of the prompt's text, keeping the space that starts the first word (which
    decoding the generated ids alone would strip).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pieces: list[str] = []
        self._flushed = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text that became complete (possibly "")."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.push after flush(): the stream has ended")
        new_text = []
        # Token by token, so text completed early in a chunk is not held back by a character
        # left unfinished at the chunk's end.
        for token_id in token_ids:
            self._ids.append(int(token_id))
            piece = self._advance(final=False)
            if piece:
                new_text.append(piece)
        return self._emit("".join(new_text))

    def flush(self) -> str:
        """Emit whatever is held (an unfinished character comes out as U+FFFD, as decode() has)."""
        if self._flushed:
            return ""
        self._flushed = True
        return self._emit(self._advance(final=True))

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, len(self._ids))
        if len(window_text) <= len(prefix_text) and not final:
            return ""  # e.g. a skipped special token: nothing visible yet
        if window_text.endswith(_REPLACEMENT) and not final:
            return ""
        # Slide the window; ids before it are never decoded again, so they are dropped.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece
