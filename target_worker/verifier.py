"""The target's side of a verify round: one ragged batched forward, then the verify rule for the whole
batch where the logits are — on a GPU as batched tensor code (`duospec.verify.batch`, which makes
`duospec.verify.rule`'s decisions, tested bit for bit), on a CPU the reference item by item; only token
ids, counts and asked-for logprobs and features leave the device.

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

KV blocks (a paged runner): after each verdict the slot's positions are all verified and committed to
the prefix cache; an item whose context is longer than one token (a prompt, or a re-prefill) first
takes what it can of it from the cache (`match_prefix`, under the sequence's `cache_salt`) and feeds
only the rest. An item asking for features takes cached blocks only as far as their hidden states are
kept too (target_worker/hidden_cache.py), and its verdict sends those as it would computed ones.
A prefill chunk with `max_compute` carries more of the prompt than it may compute: it is fed as far as
the cache supplies plus `max_compute` positions, and its verdict says how far (`context_fed`).
When the pool cannot hold a batch, items are left out from the last one on, each answered with a
KV_CACHE_FULL error (nothing of it changed), until the rest fits.

Constrained sequences (an item with start_pos 0 carries the constraint): the verifier holds each one's
authoritative matcher (`duospec.structured.SequenceGrammars`), advanced only by committed tokens (the
items' context and the verdicts). Each verify row's logits are masked (-inf outside the grammar) before
the verify rule, which then sees p = 0 for every illegal token: greedy takes the masked argmax, sampling
accepts an illegal draft with probability 0 and recovers from norm(max(0, p' - q)). A grammar that
fails answers its own item with a GRAMMAR error; the batch goes on. A dead end (no legal token, here
or after an accepted draft) is no error: the verdict stops before it, as the target alone would, and
says so (`grammar_dead_end`), and the sequence ends with its tokens.
"""

from __future__ import annotations

import itertools
import time
from concurrent import futures

import torch

from duospec.engine import BlocksExhausted, ModelRunner, SlotChunk, SlotsExhausted
from duospec.internal.constraint_wire import GrammarWorkReport, constraint_from_proto
from duospec.internal.features_wire import features_to_proto
from duospec.internal.kv_wire import kv_usage_to_proto
from duospec.internal.sampling_wire import sampling_from_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.target_worker.hidden_cache import HiddenRowCache
from duospec.qcodec import DraftProbs
from duospec.sampling import logprobs_from_logits
from duospec.structured import ConstraintError, GrammarStateError, ItemMasks, SequenceGrammars, apply_bitmask
from duospec.structured.manager import INLINE_COMPILE_S, WorkerCompilers
from duospec.verify import NextTokenKind, TreeVerdict, Verdict
from duospec.verify.batch import VerifyTask, verify_batch, verify_each

# A new constraint's compile is awaited INLINE_COMPILE_S per batch at most; a slower one goes on in the
# background, its sequence left out of the batches until it is ready. A batch whose every item waits
# returns after COMPILE_POLL_S at most (or the first compile's end): the coordinator resends them, so
# it must not spin on empty rounds meanwhile.
COMPILE_POLL_S = 0.05

_KIND_TO_PROTO = {
    NextTokenKind.RECOVERED: pb.NEXT_TOKEN_KIND_RECOVERED,
    NextTokenKind.BONUS: pb.NEXT_TOKEN_KIND_BONUS,
    NextTokenKind.NONE: pb.NEXT_TOKEN_KIND_NONE,
}


class Verifier:
    """Target model state (one KV slot per sequence) and the verify step."""

    def __init__(self, runner: ModelRunner, *, batched: bool | None = None, tokenizer_path: str | None = None,
                 grammar_compilers=None):
        """`batched`: decide a batch with `verify_batch` on the runner's device (default: where that
        is an accelerator) instead of the reference item by item (`verify_each`, faster on a CPU).
        `tokenizer_path`: the target's checkpoint, whose tokenizer compiles constraints (None: none
        can be served); `grammar_compilers`: a callable (end token ids) -> GrammarCompiler in its place
        (tests with a toy vocabulary)."""
        self.runner = runner
        self.grammars = SequenceGrammars()
        self.compilers = WorkerCompilers(tokenizer_path, grammar_compilers)
        self._grammar_work = GrammarWorkReport(lambda: (self.grammars.mask_seconds, self.grammars.mask_rows, 0))
        self._decide = verify_batch if (runner.device.type != "cpu" if batched is None else batched) else verify_each
        self.slots: dict[int, int] = {}  # seq_id -> slot
        self.forwards = 0
        self.tokens_verified = 0
        kv = runner.kv
        # Head drafters' sequences take cached blocks only with these rows (a paged runner with hidden states).
        self.hidden_rows = (HiddenRowCache(kv.block_size, kv.pool.num_blocks)
                            if kv is not None and kv.prefix_caching and runner.supports_hidden else None)

    def grammar_stats(self) -> dict:
        """Constrained sequences' cost on this worker: compiles and mask rows (for `stats`)."""
        return {"grammar_sequences": len(self.grammars), "grammar_mask_rows": self.grammars.mask_rows,
                "grammar_mask_seconds": self.grammars.mask_seconds, **self.compilers.stats()}

    def release(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.runner.free_slot(slot)
        if self.hidden_rows is not None:
            self.hidden_rows.forget(seq_id)
        self.grammars.release(seq_id)

    def release_all(self) -> None:
        for seq_id in list(self.slots):
            self.release(seq_id)

    def run(self, batch: pb.VerifyBatch) -> pb.VerdictBatch:
        started = time.perf_counter()
        for seq_id in batch.release_seq_ids:
            self.release(seq_id)
        out = pb.VerdictBatch(batch_id=batch.batch_id)
        items, chunks, tasks, cached, compiling = [], [], [], [], []
        first_row = 0  # where the next item's verify rows start in the forward's logits
        for item in batch.items:
            try:
                if (future := self._grammar_compiling(item, started + INLINE_COMPILE_S)) is not None:
                    compiling.append(future)  # unanswered: the coordinator sends it again next round
                    continue
            except ConstraintError as exc:
                out.errors.append(_error(item, pb.VERIFY_ERROR_KIND_GRAMMAR, f"constraint: {exc}"))
                continue
            error = self._check(item)
            if error is not None:
                out.errors.append(error)
                continue
            item = self._as_supported(item)
            skip = self._cached_prefix(item)
            item = _fed_part(item, skip)
            try:
                self._open_grammar(item)
            except ConstraintError as exc:  # this sequence ends; the batch goes on
                self.release(item.seq_id)
                out.errors.append(_error(item, pb.VERIFY_ERROR_KIND_GRAMMAR, f"constraint: {exc}"))
                continue
            try:
                tasks.append(_task(item, first_row))
            except ValueError as exc:  # a malformed q fails its own item only
                self.release(item.seq_id)
                out.errors.append(_error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, f"verify failed: {exc}"))
                continue
            items.append(item)
            first_row += len(item.draft_tokens) + 1
            cached.append(skip)
            chunks.append(SlotChunk(self.slots[item.seq_id], item.start_pos + skip,
                                    [*item.context[skip:], *item.draft_tokens], _chunk_parents(item, skip)))
        if compiling and not chunks:  # nothing else to run: wait a little for a compile, not a spin of empty rounds
            futures.wait(compiling, timeout=COMPILE_POLL_S, return_when=futures.FIRST_COMPLETED)
        if chunks:
            want_hidden = any(item.features for item in items) and self.runner.supports_hidden
            masks, grammar_failed = {}, {}
            try:
                logits, hidden = self._forward_fitting(chunks, items, tasks, cached, out, want_hidden)
                # The masks are filled while the device runs the forward (launched, not awaited): on an
                # accelerator the grammar's host time hides behind it.
                masks, grammar_failed = self._grammar_masks(items)
                for item, task in zip(items, tasks):
                    if item.seq_id in masks:  # p = 0 outside the grammar, before anything reads the rows
                        rows = range(task.first_row, task.first_row + len(item.draft_tokens) + 1)
                        apply_bitmask(logits, rows, masks[item.seq_id].bitmask)
                decisions = self._decide(logits, tasks) if items else []
            except Exception as exc:  # a broken batch must not take the worker down: report, go on
                for item in items:
                    self.release(item.seq_id)
                    out.errors.append(_error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, f"target forward failed: {exc}"))
                items = []
            else:
                self.forwards += bool(items)
            hidden_start = 0
            for item, task, decision, chunk, skip in zip(items, tasks, decisions if items else [], chunks, cached):
                rows = logits[task.first_row : task.first_row + len(item.draft_tokens) + 1]
                item_hidden = hidden[hidden_start : hidden_start + len(chunk.token_ids)] if hidden is not None else None
                hidden_start += len(chunk.token_ids)
                try:
                    if item.seq_id in grammar_failed:
                        raise GrammarStateError(grammar_failed[item.seq_id])
                    if isinstance(decision, Exception):
                        raise decision
                    dead_at = masks[item.seq_id].cut_at_dead_end(decision.path) if item.seq_id in masks else None
                    if dead_at is not None:  # the grammar allows nothing past the path's first dead_at nodes
                        path = decision.path[:dead_at]
                        decision = TreeVerdict(path, Verdict(len(path), None, NextTokenKind.NONE))
                    verdict = self._verdict(item, task, decision, rows, item_hidden, skip)
                    verdict.grammar_dead_end = dead_at is not None
                    if item.seq_id in masks:
                        self._commit_grammar(item, decision)
                    out.verdicts.append(verdict)
                except GrammarStateError as exc:
                    self.release(item.seq_id)
                    out.errors.append(_error(item, pb.VERIFY_ERROR_KIND_GRAMMAR, f"constraint: {exc}"))
                except Exception as exc:
                    self.release(item.seq_id)
                    out.errors.append(_error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, f"verify failed: {exc}"))
                self.tokens_verified += len(item.draft_tokens)
        out.forward_seconds = time.perf_counter() - started
        if (work := self._grammar_work.take()) is not None:
            out.grammar.CopyFrom(work)
        if (kv := kv_usage_to_proto(self.runner.cache_stats())) is not None:
            out.kv.CopyFrom(kv)
        return out

    def _grammar_compiling(self, item: pb.VerifyItem, deadline: float):
        """The compile future of a sequence starting with a constraint not compiled here yet (None when
        there is none, or it is ready; awaited until `deadline` at most): the item waits, unanswered and
        untouched, while the batch's other sequences go on. A grammar that takes seconds to compile
        stalls nobody but its own."""
        if item.start_pos != 0 or (constraint := constraint_from_proto(item.constraint)) is None:
            return None
        wait_s = max(0.0, deadline - time.perf_counter())
        return self.compilers.get(item.constraint.end_token_ids).prepare(constraint, wait_s)

    def _open_grammar(self, item: pb.VerifyItem) -> None:
        """An item at position 0 (re)starts its sequence: with a constraint, at the grammar's start."""
        if item.start_pos == 0:
            self.grammars.release(item.seq_id)  # whatever the sequence held is gone
            constraint = constraint_from_proto(item.constraint)
            if constraint is not None:
                grammar = self.compilers.get(item.constraint.end_token_ids).compile(constraint)
                self.grammars.open(item.seq_id, grammar, item.constraint.output_start)

    def _grammar_masks(self, items: list[pb.VerifyItem]) -> tuple[dict[int, ItemMasks], dict[int, str]]:
        """Each constrained item's mask rows, its matcher moved to its first draft; and the items whose
        grammar cannot go on (seq_id -> why): they end with a GRAMMAR error after the forward."""
        masks, failed = {}, {}
        for item in items:
            try:
                item_masks = self.grammars.prepare(item.seq_id, item.start_pos, item.context, item.draft_tokens,
                                                   item.draft_parents or None)
            except GrammarStateError as exc:
                failed[item.seq_id] = str(exc)
                continue
            if item_masks is not None:
                masks[item.seq_id] = item_masks
        return masks, failed

    def _commit_grammar(self, item: pb.VerifyItem, decision: TreeVerdict) -> None:
        """The verdict's committed tokens (the accepted path, then the next token) advance the matcher."""
        tokens = [item.draft_tokens[i] for i in decision.path]
        if decision.verdict.next_token is not None:
            tokens.append(decision.verdict.next_token)
        self.grammars.commit(item.seq_id, item.start_pos + len(item.context), tokens)

    def _cached_prefix(self, item: pb.VerifyItem) -> int:
        """How many of the item's context positions the prefix cache supplies (the slot then holds them)."""
        slot, context = self.slots[item.seq_id], item.context
        if len(context) >= 2 and item.features:
            if self.hidden_rows is None:
                return 0
            # Only as far as the blocks' hidden rows are kept: limit the tokens offered to the match.
            first = item.start_pos // self.hidden_rows.block_size
            chain = self.runner.kv.chain(slot, item.start_pos, context)
            usable = first + self.hidden_rows.usable_blocks(itertools.islice(chain, first, None))
            context = context[: max(0, usable * self.hidden_rows.block_size - item.start_pos) + 1]
        if len(context) < 2:
            return 0
        return self.runner.match_prefix(slot, item.start_pos, context) - item.start_pos

    def _forward_fitting(self, chunks: list[SlotChunk], items: list, tasks: list, cached: list[int],
                         out: pb.VerdictBatch, hidden: bool):
        """The batch's forward; when the KV pool cannot hold it, the last items leave the batch (the
        lists shrink in place) with a KV_CACHE_FULL error each, until the rest fits."""
        while True:
            try:
                return self.runner.forward_for_verify(
                    chunks, [len(item.context) - 1 - skip for item, skip in zip(items, cached)], hidden=hidden)
            except BlocksExhausted as exc:  # raised before the forward changed anything
                item = items.pop()
                for rest in (chunks, tasks, cached):
                    rest.pop()
                out.errors.append(_error(item, pb.VERIFY_ERROR_KIND_KV_CACHE_FULL, str(exc)))
                if not items:
                    return None, None

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
        if item.max_compute and item.draft_tokens:
            return _error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, "max_compute is for prefill chunks, without drafts")
        if item.seq_id not in self.slots:
            if item.start_pos != 0:
                # A restarted target lost its cache: the coordinator must re-send from position 0.
                return _error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, "unknown sequence; resend from position 0")
            try:
                self.slots[item.seq_id] = self.runner.allocate_slot(item.cache_salt)
            except SlotsExhausted as exc:
                return _error(item, pb.VERIFY_ERROR_KIND_SLOTS_EXHAUSTED, str(exc))
        elif item.start_pos > self.runner.slot_length(self.slots[item.seq_id]):
            return _error(item, pb.VERIFY_ERROR_KIND_BAD_REQUEST, "start_pos is past the cached prefix")
        return None

    def _verdict(self, item: pb.VerifyItem, task: VerifyTask, decision: TreeVerdict, rows: torch.Tensor,
                 hidden=None, cached: int = 0) -> pb.Verdict:
        """The verdict message for one decided item; its KV slot keeps the committed prefix less the
        newest token (fed at the start of the next round). `rows`: its k + 1 logits rows (device);
        `cached`: its context positions read from the prefix cache."""
        n_ctx = len(item.context)
        slot = self.slots[item.seq_id]
        if item.features and hidden is not None and cached:  # the cached positions' rows, kept with their blocks
            kept = self.hidden_rows.rows(self.runner.kv.hashes(slot), item.start_pos, item.start_pos + cached)
            hidden = torch.cat([kept.to(hidden.device, hidden.dtype), hidden])
        result = decision.verdict
        path = decision.path if item.draft_parents else ()
        if item.draft_parents:
            self.runner.keep_path(slot, item.start_pos + n_ctx, path)
        committed_len = item.start_pos + n_ctx + result.n_accepted + (result.next_token is not None)
        self.runner.truncate(slot, committed_len - 1)
        self.runner.commit(slot, committed_len - 1)  # every position it keeps is verified
        verdict = pb.Verdict(
            seq_id=item.seq_id,
            epoch=item.epoch,
            n_accepted=result.n_accepted,
            kind=_KIND_TO_PROTO[result.kind],
            next_token=result.next_token if result.next_token is not None else 0,
            path=path,
            cached_tokens=cached,
            context_fed=n_ctx if item.max_compute else 0,
        )
        accepted = list(decision.path)  # a chain's path is 0 .. n_accepted - 1
        if item.features and hidden is not None:
            committed_rows = torch.tensor([*range(n_ctx), *(n_ctx + i for i in accepted)], device=hidden.device)
            committed_hidden = hidden[committed_rows].to(torch.float16).cpu()  # as sent and as kept
            verdict.features.CopyFrom(features_to_proto(item.start_pos, committed_hidden))
            if self.hidden_rows is not None:
                self.hidden_rows.observe(item.seq_id, item.start_pos, committed_hidden, self.runner.kv.hashes(slot))
        if item.logprobs:
            tokens = [item.draft_tokens[i] for i in accepted]
            if result.next_token is not None:
                tokens.append(result.next_token)
            verdict.logprobs.extend(_logprobs(rows, accepted, list(item.draft_parents), tokens, task.params,
                                              item.top_logprobs))
        return verdict


def _task(item: pb.VerifyItem, first_row: int) -> VerifyTask:
    """The item's verify task; its k + 1 logits rows start at `first_row` of the batch's verify rows."""
    return VerifyTask(
        draft_tokens=list(item.draft_tokens), first_row=first_row, params=sampling_from_proto(item.sampling),
        start_pos=item.start_pos + len(item.context), parents=list(item.draft_parents) if item.draft_parents else None,
        draft_probs=[DraftProbs.from_bytes(b) for b in item.draft_probs] if item.draft_probs else None,
        sample_bonus=item.bonus != pb.BONUS_POLICY_SKIP)


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
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.long, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    if not top_n:
        return [pb.TokenLogprob(logprob=lp) for lp in chosen]
    values, ids = torch.topk(logp, min(top_n, logp.shape[1]), dim=-1)
    return [pb.TokenLogprob(logprob=lp, top_ids=i, top_logprobs=v)
            for lp, v, i in zip(chosen, values.tolist(), ids.tolist())]


def _fed_part(item: pb.VerifyItem, cached: int) -> pb.VerifyItem:
    """The item as far as its context is fed: with max_compute, `cached` positions and that many more."""
    end = cached + item.max_compute
    if not item.max_compute or len(item.context) <= end:
        return item
    part = pb.VerifyItem()
    part.CopyFrom(item)
    del part.context[end:]
    return part


def _chunk_parents(item: pb.VerifyItem, cached: int = 0) -> list[int] | None:
    """The forward chunk's parents: the context (less its `cached` leading tokens) is a chain, a draft
    root hangs off its last token."""
    if not item.draft_parents:
        return None
    n_ctx = len(item.context) - cached
    return [*range(-1, n_ctx - 1), *(n_ctx - 1 if p < 0 else n_ctx + p for p in item.draft_parents)]


def _error(item: pb.VerifyItem, kind: int, message: str) -> pb.VerifyError:
    return pb.VerifyError(seq_id=item.seq_id, kind=kind, message=message)
