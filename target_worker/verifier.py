"""The target's side of a verify round: one ragged batched forward, then the pure verify rule.

For each item the target feeds `context` (committed tokens it has not seen) followed by the draft
tokens, in one forward with every other sequence of the batch. Rows n_ctx-1 .. n_ctx-1+k of the
item's logits predict the draft positions and the bonus position. After the verdict the slot keeps
committed[:-1]: the newest committed token is fed at the start of the next round.

A greedy item may carry a token tree (`draft_parents`): the drafts go in as one tree-masked chunk,
the verdict is the longest accepted path (`duospec.verify.verify_tree`), and `keep_path` moves that
path's keys and values to their positions. A backend without trees verifies the tree's main chain
(the leading drafts that form a chain): a shorter verdict, never a wrong one.

An item that asks for `features` (its drafter is an EAGLE or Medusa head) gets the final hidden
states of its committed positions with the verdict: the context's and the accepted drafts', never a
rejected draft's.
"""

from __future__ import annotations

import time

import torch

from duospec.engine import ModelRunner, SlotChunk, SlotsExhausted
from duospec.internal.features_wire import features_to_proto
from duospec.internal.sampling_wire import sampling_from_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.qcodec import DraftProbs
from duospec.sampling import logprobs_from_logits
from duospec.verify import NextTokenKind, verify, verify_tree

_KIND_TO_PROTO = {
    NextTokenKind.RECOVERED: pb.NEXT_TOKEN_KIND_RECOVERED,
    NextTokenKind.BONUS: pb.NEXT_TOKEN_KIND_BONUS,
    NextTokenKind.NONE: pb.NEXT_TOKEN_KIND_NONE,
}


class Verifier:
    """Target model state (one KV slot per sequence) and the verify step."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.slots: dict[int, int] = {}  # seq_id -> slot
        self.forwards = 0
        self.tokens_verified = 0

    def release(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.runner.free_slot(slot)

    def release_all(self) -> None:
        for seq_id in list(self.slots):
            self.release(seq_id)

    def run(self, batch: pb.VerifyBatch) -> pb.VerdictBatch:
        started = time.perf_counter()
        for seq_id in batch.release_seq_ids:
            self.release(seq_id)
        out = pb.VerdictBatch(batch_id=batch.batch_id)
        items, chunks = [], []
        for item in batch.items:
            error = self._check(item)
            if error is not None:
                out.errors.append(error)
                continue
            item = self._as_supported(item)
            items.append(item)
            chunks.append(SlotChunk(self.slots[item.seq_id], item.start_pos, [*item.context, *item.draft_tokens],
                                    _chunk_parents(item)))
        if chunks:
            hidden = None
            try:
                if any(item.features for item in items) and self.runner.supports_hidden:
                    logits, hidden = self.runner.forward_with_hidden(chunks)
                else:
                    logits = self.runner.forward(chunks)
            except Exception as exc:  # a broken batch must not take the worker down: report, go on
                for item in items:
                    self.release(item.seq_id)
                    out.errors.append(_error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, f"target forward failed: {exc}"))
                items = []
            else:
                self.forwards += 1
            for i, (item, item_logits) in enumerate(zip(items, logits if items else [])):
                try:
                    out.verdicts.append(self._verdict(item, item_logits, hidden[i] if hidden is not None else None))
                except Exception as exc:
                    self.release(item.seq_id)
                    out.errors.append(_error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, f"verify failed: {exc}"))
                self.tokens_verified += len(item.draft_tokens)
        out.forward_seconds = time.perf_counter() - started
        return out

    def _as_supported(self, item: pb.VerifyItem) -> pb.VerifyItem:
        """The item, or its main chain when this backend has no trees."""
        if not item.draft_parents or self.runner.supports_trees:
            return item
        parents = list(item.draft_parents)
        chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
        stripped = pb.VerifyItem()
        stripped.CopyFrom(item)
        del stripped.draft_tokens[chain:]
        del stripped.draft_parents[:]
        return stripped

    def _check(self, item: pb.VerifyItem) -> pb.VerifyError | None:
        if not item.context:
            return _error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, "a verify item needs at least one context token")
        end = item.start_pos + len(item.context) + len(item.draft_tokens)
        if end > self.runner.max_context:
            return _error(
                item,
                pb.VERIFY_ERROR_KIND_CONTEXT_OVERFLOW,
                f"sequence reaches position {end}, past the target's context of {self.runner.max_context}",
            )
        if item.draft_parents and (len(item.draft_parents) != len(item.draft_tokens) or item.draft_probs):
            return _error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST,
                          "a token tree needs one parent per draft token and a greedy request")
        if item.seq_id not in self.slots:
            if item.start_pos != 0:
                # A restarted target lost its cache: the coordinator must re-send from position 0.
                return _error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, "unknown sequence; resend from position 0")
            try:
                self.slots[item.seq_id] = self.runner.allocate_slot()
            except SlotsExhausted as exc:
                return _error(item, pb.VERIFY_ERROR_KIND_SLOTS_EXHAUSTED, str(exc))
        elif item.start_pos > self.runner.slot_length(self.slots[item.seq_id]):
            return _error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, "start_pos is past the cached prefix")
        return None

    def _verdict(self, item: pb.VerifyItem, logits, hidden=None) -> pb.Verdict:
        n_ctx, k = len(item.context), len(item.draft_tokens)
        params = sampling_from_proto(item.sampling)
        probs = [DraftProbs.from_bytes(b) for b in item.draft_probs] if item.draft_probs else None
        rows = logits[n_ctx - 1 : n_ctx + k]
        # A draft whose logits are wider than the target's (padded embeddings) may propose an id the
        # target cannot produce: give such ids probability 0 (-inf logits) so the rule rejects them.
        widest = max([*item.draft_tokens, *(int(q.token_ids[-1]) for q in probs or ())], default=0) + 1
        if widest > rows.shape[-1]:
            rows = torch.nn.functional.pad(rows, (0, widest - rows.shape[-1]), value=float("-inf"))
        sample_bonus = item.bonus != pb.BONUS_POLICY_SKIP
        path: tuple[int, ...] = ()
        if item.draft_parents:
            tree = verify_tree(list(item.draft_tokens), list(item.draft_parents), rows, params,
                               item.start_pos + n_ctx, sample_bonus=sample_bonus)
            path, result = tree.path, tree.verdict
            self.runner.keep_path(self.slots[item.seq_id], item.start_pos + n_ctx, path)
        else:
            result = verify(list(item.draft_tokens), rows, probs, params, item.start_pos + n_ctx,
                            sample_bonus=sample_bonus)
        committed_len = item.start_pos + n_ctx + result.n_accepted + (result.next_token is not None)
        self.runner.truncate(self.slots[item.seq_id], committed_len - 1)
        verdict = pb.Verdict(
            seq_id=item.seq_id,
            epoch=item.epoch,
            n_accepted=result.n_accepted,
            kind=_KIND_TO_PROTO[result.kind],
            next_token=result.next_token if result.next_token is not None else 0,
            path=path,
        )
        accepted = list(path) if item.draft_parents else list(range(result.n_accepted))
        if item.features and hidden is not None:
            committed_rows = [*range(n_ctx), *(n_ctx + i for i in accepted)]
            verdict.features.CopyFrom(features_to_proto(item.start_pos, hidden[committed_rows]))
        if item.logprobs:
            tokens = [item.draft_tokens[i] for i in accepted]
            if result.next_token is not None:
                tokens.append(result.next_token)
            verdict.logprobs.extend(_logprobs(rows, accepted, list(item.draft_parents), tokens, params,
                                              item.top_logprobs))
        return verdict


LOGPROB_FLOOR = -9999.0


def _logprobs(rows, accepted: list[int], parents: list[int], tokens: list[int], params,
              top_n: int) -> list[pb.TokenLogprob]:
    """Each committed token's log p at its position. Row 0 follows the context (it predicts the
    drafts hanging off it); row 1 + j follows draft j (in a chain, it predicts draft j + 1)."""
    def row_after(j: int) -> int:  # j = -1: the context
        return 0 if j < 0 else 1 + j

    index = [row_after(parents[j] if parents else j - 1) for j in accepted]
    index.append(row_after(accepted[-1] if accepted else -1))  # the recovered / bonus token
    # Tokens that top-k / top-p remove have log p = -inf; users get OpenAI's floor (valid JSON everywhere).
    logp = logprobs_from_logits(rows[index[: len(tokens)]], params).clamp_min(LOGPROB_FLOOR)
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
    if not top_n:
        return [pb.TokenLogprob(logprob=lp) for lp in chosen]
    values, ids = torch.topk(logp, min(top_n, logp.shape[1]), dim=-1)
    return [pb.TokenLogprob(logprob=lp, top_ids=i, top_logprobs=v)
            for lp, v, i in zip(chosen, values.tolist(), ids.tolist())]


def _chunk_parents(item: pb.VerifyItem) -> list[int] | None:
    """The forward chunk's parents: the context is a chain, a draft root hangs off its last token."""
    if not item.draft_parents:
        return None
    n_ctx = len(item.context)
    return [*range(-1, n_ctx - 1), *(n_ctx - 1 if p < 0 else n_ctx + p for p in item.draft_parents)]


def _error(item: pb.VerifyItem, kind: int, message: str) -> pb.VerifyError:
    return pb.VerifyError(seq_id=item.seq_id, kind=kind, message=message)
