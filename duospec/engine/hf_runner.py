"""Fallback runner: any transformers causal LM, one sequence per forward, behind the slot interface.

Each slot owns a transformers ``DynamicCache`` plus the token ids it holds; a chunk starting before
the cache's end crops the cache (rollback). Where a cache layer cannot be cropped (a sliding window
already past its size), the slot is rebuilt by re-running its kept prefix — slower, still exact.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence

import torch

from duospec.engine.runner import ModelRunner, SlotChunk

__all__ = ["HFRunner"]


class HFRunner(ModelRunner):
    backend = "hf"

    def __init__(self, model, *, max_slots: int, max_context: int) -> None:
        super().__init__(max_slots, max_context)
        self.model = model.eval()
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.config.vocab_size
        # transformers 5 renamed the forward's `past_key_values` argument and output to `cache`.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._caches: list = [None] * max_slots
        # [slot] token ids whose keys/values the slot's cache holds
        self._tokens: list[list[int]] = [[] for _ in range(max_slots)]

    def _on_allocate(self, slot: int) -> None:
        self._caches[slot] = None
        self._tokens[slot] = []

    def _on_free(self, slot: int) -> None:
        self._caches[slot] = None
        self._tokens[slot] = []

    def _copy_prefix(self, src: int, dst: int, length: int) -> None:
        # A cropped deep copy; _cropped_cache rebuilds from the tokens where a cache cannot crop.
        self._caches[dst] = copy.deepcopy(self._caches[src])
        self._tokens[dst] = self._tokens[src][:length]
        if self._caches[dst] is not None:
            self._caches[dst] = self._cropped_cache(dst, length)

    def _forward(self, chunks: Sequence[SlotChunk], *, last_only: bool, to_cpu: bool):
        outputs = []
        # no_grad, not inference_mode: the returned logits stay ordinary tensors callers may edit in place.
        with torch.no_grad():
            for chunk in chunks:
                logits = self._run_chunk(chunk, last_only)
                outputs.append(logits.float().cpu() if to_cpu else logits.float())
        self._commit_lengths(chunks)
        return torch.stack(outputs) if last_only else outputs

    def _run_chunk(self, chunk: SlotChunk, last_only: bool) -> torch.Tensor:
        slot = chunk.slot
        keep = chunk.start_pos  # validated: <= the slot's logical length (after any truncate)
        del self._tokens[slot][keep:]
        cache = self._cropped_cache(slot, keep)
        ids = torch.tensor([list(chunk.token_ids)], dtype=torch.long, device=self.device)
        extra = {"logits_to_keep": 1} if last_only else {}
        out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: cache}, **extra)
        self._caches[slot] = _returned_cache(out)
        self._tokens[slot].extend(chunk.token_ids)
        return out.logits[0, -1] if last_only else out.logits[0]

    def _cropped_cache(self, slot: int, keep: int):
        cache = self._caches[slot]
        if cache is None or keep == 0:
            return None
        cached = cache.get_seq_length()
        if cached == keep:
            return cache
        try:
            cache.crop(keep - cached)  # negative = drop that many from the end (transformers 4.x and 5)
            if cache.get_seq_length() == keep:
                return cache
        except (RuntimeError, ValueError):
            pass
        # Cannot crop this cache type: rebuild from the kept prefix.
        prefix = torch.tensor([self._tokens[slot][:keep]], dtype=torch.long, device=self.device)
        return _returned_cache(self.model(input_ids=prefix, use_cache=True, logits_to_keep=1))


def _returned_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
