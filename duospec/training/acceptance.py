"""How often the draft's greedy guesses survive the target's check, and what a step of each costs.

Greedy speculation is simulated exactly from two teacher-forced passes. With greedy decoding the
committed text is the target's own greedy continuation T whatever the draft does, and every draft
token that is accepted equals the corresponding token of T. So the draft's k-th guess in a round
that starts at position i is the draft's argmax given prompt + T[:i+k-1] — the teacher-forced draft
argmax on prompt + T. A round at i accepts the longest run of positions i, i+1, ... (at most
`draft_len`) where that argmax equals T, then commits one more token (the correction or the bonus).
Mean accepted length = committed tokens / rounds = accepted + 1 per target forward.

With the drafter's context lookup (`lookup=True`; draft_worker/context_lookup.py) a guess may instead
be copied from the text verified before its round: still a function of prompt + T[:i+k-1] and the
round's start i, so the rounds are simulated one by one with the drafter's own ContextLookup.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AcceptanceStats:
    rounds: int          # target forwards (one verify per round)
    committed: int       # tokens committed: accepted + one correction/bonus per round
    matches: int         # positions where the teacher-forced draft argmax equals the target's
    positions: int       # positions compared

    @property
    def mean_accepted_length(self) -> float:
        return self.committed / max(self.rounds, 1)

    @property
    def agreement(self) -> float:
        return self.matches / max(self.positions, 1)

    def __add__(self, other: AcceptanceStats) -> AcceptanceStats:
        return AcceptanceStats(self.rounds + other.rounds, self.committed + other.committed,
                               self.matches + other.matches, self.positions + other.positions)


def simulate_rounds(draft_hits: list[bool], draft_len: int) -> tuple[int, int]:
    """(rounds, committed) for greedy speculation, given per-position draft hits (see module doc)."""
    rounds = committed = i = 0
    n = len(draft_hits)
    while i < n:
        accepted = 0
        while accepted < draft_len and i + accepted < n and draft_hits[i + accepted]:
            accepted += 1
        step = min(accepted + 1, n - i)
        rounds += 1
        committed += step
        i += step
    return rounds, committed


@torch.no_grad()
def greedy_continuation(target, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """The target's greedy continuation (stops early only at an end-of-sequence token)."""
    inputs = torch.tensor([prompt_ids])
    out = target.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=1, pad_token_id=target.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def lookup_rounds(prompt_ids: list[int], continuation: list[int], guesses: list[int], confidences: list[float],
                  draft_len: int) -> tuple[int, int, int]:
    """(rounds, committed, matches) of greedy speculation whose drafter copies from the verified text
    where its confidence is below the lookup's threshold (module doc). `matches` counts every position
    as if its round started there (all before it verified), like the agreement without lookup."""
    from duospec.draft_worker.context_lookup import ContextLookup
    from duospec.draft_worker.proposer import DraftState
    from duospec.sampling import SamplingParams

    lookup = ContextLookup()
    seq = DraftState(seq_id=0, epoch=0, sampling=SamplingParams(), tokens=list(prompt_ids),
                     committed_len=len(prompt_ids), draft_until=0)
    lookup.open(seq)

    def guess(pos: int, round_start: int) -> int:
        seq.tokens = list(prompt_ids) + continuation[:pos]
        seq.committed_len = len(prompt_ids) + round_start
        return lookup.copies([seq], {0: confidences[pos]}).get(0, guesses[pos])  # the drafter's own rule

    n = len(continuation)
    rounds = committed = i = 0
    while i < n:
        accepted = 0
        while accepted < draft_len and i + accepted < n and guess(i + accepted, i) == continuation[i + accepted]:
            accepted += 1
        step = min(accepted + 1, n - i)
        rounds, committed, i = rounds + 1, committed + step, i + step
    matches = sum(guess(pos, pos) == token for pos, token in enumerate(continuation))
    return rounds, committed, matches


@torch.no_grad()
def teacher_forced(target, draft, prompt_ids: list[int], new_tokens: int,
                   draft_ids: torch.Tensor | None = None) -> tuple[list[int], list[int], list[float]]:
    """(the target's greedy continuation, the draft's teacher-forced guess for each of its positions, the
    draft's probability of that guess). `draft_ids`: the draft's trimmed output vocabulary
    (duospec/engine/draft_vocab.py), if it has one."""
    continuation = greedy_continuation(target, prompt_ids, new_tokens)
    sequence = torch.tensor([prompt_ids + continuation])
    # Row j of the logits predicts token j+1; continuation token t sits at index len(prompt)+t.
    rows = slice(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(continuation))
    logits = draft(input_ids=sequence).logits[0, rows]
    if draft_ids is not None:
        logits = logits[:, draft_ids]
    best = logits.float().softmax(-1).max(-1)
    guesses = best.indices if draft_ids is None else draft_ids[best.indices]
    return continuation, guesses.tolist(), best.values.tolist()


def round_stats(prompt_ids: list[int], continuation: list[int], guesses: list[int], confidences: list[float],
                draft_len: int = 4, lookup: bool = False) -> AcceptanceStats:
    """The simulated rounds of one teacher-forced pass; `lookup`: the drafter copies from the verified
    text where it is unsure (module doc)."""
    if lookup:
        rounds, committed, matches = lookup_rounds(prompt_ids, continuation, guesses, confidences, draft_len)
        return AcceptanceStats(rounds, committed, matches, len(continuation))
    hits = [guess == token for guess, token in zip(guesses, continuation)]
    rounds, committed = simulate_rounds(hits, draft_len)
    return AcceptanceStats(rounds, committed, sum(hits), len(hits))


def measure_pair(target, draft, prompts: list[list[int]], new_tokens: int, draft_len: int = 4,
                 draft_ids: torch.Tensor | None = None, lookup: bool = False) -> AcceptanceStats:
    return measure_lookups(target, draft, prompts, new_tokens, draft_len, draft_ids, (lookup,))[0]


def measure_lookups(target, draft, prompts: list[list[int]], new_tokens: int, draft_len: int = 4,
                    draft_ids: torch.Tensor | None = None, lookups: tuple[bool, ...] = (False, True)) -> list[AcceptanceStats]:
    """The pair's stats over `prompts`, one per entry of `lookups` (without / with context lookup),
    from one teacher-forced pass per prompt."""
    totals = [AcceptanceStats(0, 0, 0, 0) for _ in lookups]
    for prompt in prompts:
        passed = teacher_forced(target, draft, prompt, new_tokens, draft_ids)
        totals = [total + round_stats(prompt, *passed, draft_len, lookup) for total, lookup in zip(totals, lookups)]
    return totals


def heldout_prompts(tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """Up to `count` prompts of `prompt_tokens` tokens from the held-out stdlib files, deterministic.

    Candidates are the line starts nearest the middle, first quarter and third quarter of every
    held-out file (sorted path order, middles first); `count` of them are picked evenly spread.
    """
    from duospec.training import corpus

    _, heldout = corpus.split_files(corpus.stdlib_files())
    texts = [t for t in (corpus.read_text(f.path) for f in heldout) if t]
    candidates = []
    for fraction in (0.5, 0.25, 0.75):
        for text in texts:
            cut = text.find("\n", int(len(text) * fraction)) + 1
            ids = tokenizer(text[cut:], add_special_tokens=False)["input_ids"][:prompt_tokens]
            if len(ids) == prompt_tokens:
                candidates.append(ids)
    if not candidates:
        raise ValueError(f"no held-out stdlib file has {prompt_tokens} tokens to spare; lower prompt_tokens")
    count = min(count, len(candidates))
    return [candidates[k * len(candidates) // count] for k in range(count)]


def tail_prompts(heldout_tokens, count: int, prompt_tokens: int = 64) -> list[list[int]]:
    """Up to `count` prompts of `prompt_tokens` tokens, evenly spaced over a held-out token stream."""
    step = max(len(heldout_tokens) // max(count, 1), prompt_tokens + 1)
    starts = range(0, len(heldout_tokens) - prompt_tokens, step)
    return [heldout_tokens[s: s + prompt_tokens].tolist() for s in starts][:count]


def prompt_sets(tokenizer, data, heldout_tokens, count: int, prompt_tokens: int = 64) -> dict[str, list[list[int]]]:
    """Held-out prompts for a draft's acceptance figure, by kind: `code` (held-out stdlib files) when
    the data includes the stdlib, `chat` (held-out instruction prompts through the chat template: the
    coding requests and fixed-subject questions of duospec/training/answers.py) and `open` (its held-out
    everyday requests) when the tokenizer has one, else `heldout` (the data's held-out tail)."""
    from duospec.training.data import STDLIB

    sets = {}
    if STDLIB in [str(d) for d in data]:
        sets["code"] = heldout_prompts(tokenizer, count, prompt_tokens)
    if getattr(tokenizer, "chat_template", None):
        from duospec.training.answers import KINDS, chat_prompt_ids, heldout_prompts as heldout_instructions

        templated = tuple(kind for kind in KINDS if kind != "open")
        sets["chat"] = [chat_prompt_ids(tokenizer, p) for p in heldout_instructions(count, templated)]
        sets["open"] = [chat_prompt_ids(tokenizer, p) for p in heldout_instructions(count, ("open",))]
    if not sets and len(heldout_tokens) > prompt_tokens:
        sets["heldout"] = tail_prompts(heldout_tokens, count, prompt_tokens)
    return sets


def decode_step_seconds(path, prompt_len: int = 64, repeats: int = 200, draft: bool = False) -> float:
    """Median seconds of one single-token decode step of the checkpoint at `path` on duospec's
    engine (fp32, the current thread count), at position `prompt_len`; `draft`: as a drafter loads it
    (its trimmed vocabulary, if any)."""
    from duospec.draft_worker.proposer import DraftSpec
    from duospec.engine import load_model

    runner = load_model(path, device="cpu", dtype=torch.float32, max_slots=1, drafter=draft,
                        float16_products=DraftSpec.float16_products)
    return runner_step_seconds(runner, prompt_len, repeats)


def runner_step_seconds(runner, prompt_len: int = 64, repeats: int = 200) -> float:
    """The same for any runner with slots and `forward_last` (an EAGLE head: duospec.bench.simulate_heads)."""
    from duospec.engine import SlotChunk

    slot = runner.allocate_slot()
    try:
        runner.forward_last([SlotChunk(slot, 0, list(range(3, 3 + prompt_len)))])
        timings = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward_last([SlotChunk(slot, prompt_len, [7])])  # same position: the slot rolls back
            timings.append(time.perf_counter() - start)
    finally:
        runner.free_slot(slot)
    return statistics.median(timings)
