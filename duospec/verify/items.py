"""What the reference and the batched rule both check about a verify item before deciding it; each
adds only what its inputs make different (the reference: the logits it is handed; the batch: the
rows of the shared logits an item names)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from duospec.qcodec import DraftProbs
from duospec.sampling import SamplingParams
from duospec.trees import check_parents


def check_item(draft_tokens: Sequence[int], parents: Sequence[int] | None, params: SamplingParams, start_pos: int,
               draft_probs) -> int:
    """Raise ValueError naming what is wrong; return k, the number of draft nodes.

    A sampled chain needs q for every draft (a DraftProbs each, or a ``[k, V]`` tensor the reference
    checks against its vocabulary); a tree's nodes past the given q are deterministic candidates."""
    params.validate()
    k = len(draft_tokens)
    if start_pos < 0:
        raise ValueError(f"start_pos={start_pos} must be >= 0")
    negative = [int(t) for t in draft_tokens if int(t) < 0]
    if negative:
        raise ValueError(f"draft_tokens {negative} are outside the target vocabulary: negative ids")
    if parents is not None:
        check_parents(parents, k)
    elif not params.greedy and not isinstance(draft_probs, torch.Tensor):
        if draft_probs is None:
            if k:
                raise ValueError("draft_probs is None but sampling needs q for every draft token")
        elif len(draft_probs) != k or not all(isinstance(d, DraftProbs) for d in draft_probs):
            raise ValueError(f"draft_probs must hold one DraftProbs per draft token ({k}), got "
                             f"{[type(d).__name__ for d in draft_probs]}: sampling needs q for every draft token")
    return k
