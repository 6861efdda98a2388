"""The draft distribution q on the wire, and the drafter's sampling from it.

q crosses from the drafter to the target with every draft token (``DraftChunk.draft_probs``). It is
sent sparse in float16, and bounded: only the likeliest tokens that together carry all but TAIL_MASS
of q, at most MAX_SUPPORT of them (24 KB), so a flat q over a 150k vocabulary does not make a
megabyte per token. Losslessness needs the drafter to sample from exactly the q the verifier uses —
the truncated one — so neither side uses its float32 q directly: both use ``DraftProbs.dense()``, a
deterministic function of the encoded bytes. (Rejection sampling is exact for any q the draft token
was really drawn from; a truncated q only lowers acceptance, by at most the mass cut.)

Wire format (``to_bytes``), little-endian, no header, for a support of ``s`` tokens::

    token_ids  s × int32    strictly increasing, >= 0
    probs      s × float16  finite, > 0 (not necessarily summing to 1; dense() renormalises)

so a message is ``6 * s`` bytes and ``s = len(message) // 6``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from duospec.sampling import Purpose, SamplingParams, probs_from_logits, sample_token, uniform

_IDS_DTYPE = np.dtype("<i4")
_PROBS_DTYPE = np.dtype("<f2")
_BYTES_PER_TOKEN = _IDS_DTYPE.itemsize + _PROBS_DTYPE.itemsize
MAX_SUPPORT = 4096  # tokens of q on the wire per draft position: at most 24 KB
TAIL_MASS = 1e-4  # q's least likely tokens carrying at most this much mass are not sent


@dataclass(frozen=True, eq=False)
class DraftProbs:
    """One draft position's q, sparse. Arrays are read-only; equality compares the encoded bytes."""

    # [s] int32, strictly increasing
    token_ids: np.ndarray
    # [s] float16, > 0
    probs: np.ndarray

    def __post_init__(self) -> None:
        # Own copies: freezing them must not make the caller's arrays read-only.
        ids = np.array(self.token_ids, dtype=_IDS_DTYPE, copy=True)
        probs = np.array(self.probs, dtype=_PROBS_DTYPE, copy=True)
        if ids.ndim != 1 or probs.shape != ids.shape:
            raise ValueError(
                f"DraftProbs.token_ids and .probs must be 1-D of equal length, got "
                f"{ids.shape} and {probs.shape}"
            )
        if ids.size == 0:
            raise ValueError("DraftProbs has an empty support: q must give some token mass")
        if ids[0] < 0 or (ids.size > 1 and not (np.diff(ids) > 0).all()):
            raise ValueError("DraftProbs.token_ids must be >= 0 and strictly increasing")
        if not (np.isfinite(probs).all() and (probs > 0).all()):
            raise ValueError("DraftProbs.probs must be finite and > 0 (drop zero-mass tokens)")
        ids.setflags(write=False)
        probs.setflags(write=False)
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "probs", probs)

    @classmethod
    def from_probs(cls, probs_row: torch.Tensor, *, max_support: int = MAX_SUPPORT,
                   tail_mass: float = TAIL_MASS) -> DraftProbs:
        """Encode ``probs_row [V]``: the likeliest tokens carrying all but ``tail_mass`` (at most
        ``max_support`` of them), rounded to float16, those still > 0 kept."""
        if not isinstance(probs_row, torch.Tensor) or probs_row.dim() != 1:
            raise ValueError("probs_row must be a 1-D tensor [vocab]")
        row = probs_row.detach().cpu().to(torch.float32)
        top = torch.topk(row, min(max_support, row.numel()), sorted=True)
        total = float(row.sum())
        cumulative = torch.cumsum(top.values.double(), 0)
        n = int(torch.searchsorted(cumulative, torch.tensor([(1.0 - tail_mass) * total], dtype=torch.float64)))
        keep = top.indices[: min(n + 1, top.indices.numel())].sort().values
        half = row[keep].to(torch.float16)
        keep = keep[half > 0]
        if keep.numel() == 0:
            raise ValueError(
                "probs_row has no entry > 0 after float16 rounding; pass a normalised distribution"
            )
        return cls(keep.numpy().astype(_IDS_DTYPE), row[keep].to(torch.float16).numpy())

    def dense(self, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` float32, renormalised: THE q that both drafter and verifier use."""
        if int(self.token_ids[-1]) >= vocab_size:
            raise ValueError(
                f"DraftProbs holds token id {int(self.token_ids[-1])} but vocab_size is "
                f"{vocab_size}: the draft and target vocabularies disagree"
            )
        mass = self.probs.astype(np.float64)
        # float64 division then one rounding to float32: identical bytes → identical q everywhere.
        values = (mass / mass.sum()).astype(np.float32)
        q = torch.zeros(vocab_size, dtype=torch.float32)
        q[torch.from_numpy(self.token_ids.astype(np.int64))] = torch.from_numpy(values)
        return q

    def to_bytes(self) -> bytes:
        return self.token_ids.tobytes() + self.probs.tobytes()

    @classmethod
    def from_bytes(cls, b: bytes) -> DraftProbs:
        if len(b) == 0 or len(b) % _BYTES_PER_TOKEN:
            raise ValueError(
                f"draft_probs message of {len(b)} bytes is malformed: expected a positive "
                f"multiple of {_BYTES_PER_TOKEN} (int32 id + float16 prob per token)"
            )
        s = len(b) // _BYTES_PER_TOKEN
        ids = np.frombuffer(b, dtype=_IDS_DTYPE, count=s)
        probs = np.frombuffer(b, dtype=_PROBS_DTYPE, count=s, offset=s * _IDS_DTYPE.itemsize)
        return cls(ids, probs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DraftProbs):
            return NotImplemented
        return self.to_bytes() == other.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())

    def __repr__(self) -> str:
        return f"DraftProbs(support={self.token_ids.size}, ids={self.token_ids[:8].tolist()}...)"


def draft_sample(
    logits_row: torch.Tensor, params: SamplingParams, position: int
) -> tuple[int, DraftProbs | None]:
    """The drafter's draw at ``position``: ``(token, q)``; q is None when greedy (nothing sent)."""
    if not isinstance(logits_row, torch.Tensor) or logits_row.dim() != 1:
        raise ValueError("logits_row must be a 1-D tensor [vocab]")
    if params.greedy:
        params.validate()
        return int(torch.argmax(logits_row)), None
    q = probs_from_logits(logits_row.unsqueeze(0), params)[0]
    dq = DraftProbs.from_probs(q)
    u = uniform(params.seed, position, Purpose.DRAFT)
    token = sample_token(dq.dense(logits_row.shape[0]), u)
    return token, dq
