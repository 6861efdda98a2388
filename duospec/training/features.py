"""The target's features cached on disk once, for many epochs of head training (EAGLE-3).

A head learns from the target's hidden states; computing them is the expensive part of a step (the
target is ~30x the head). So the target runs once over the training sequences and its features are
written to disk in float16; training then reads windows of them, epoch after epoch.

Sequences: the target's own answers (`duospec distill-data`'s answers.jsonl: prompt through the
chat template, then the answer; loss on the answer only) and windows of the standard library's
training split (raw code, as `duospec bench` prompts; loss everywhere).

Layout of the cache folder (all arrays row-aligned by token, numpy memmaps):

- ``tokens.i32``    [N] token ids, the sequences one after another
- ``taps.f16``      [N, 3 * hidden] the residual stream entering each feature layer, concatenated
                    (absent when no layers were asked for: a draft model learns from ``final`` alone)
- ``final.f16``     [N, hidden] the final norm's output (the target's LM head turns it into p)
- ``index.json``    the sequences (start, length, loss_from, kind, held_out), the feature layers,
                    the target's fingerprint; written last, so a cache without it is incomplete

Building resumes: sequences are appended in a fixed order and ``progress.json`` records how many
are done. A built cache whose sequences are the first of a longer list (data added at the end of
`--data`) is extended: only the new ones are run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

INDEX = "index.json"
PROGRESS = "progress.json"
HELDOUT_MODULUS = 50  # ~2 % of sequences: the cache's own held-out agreement


@dataclass(frozen=True)
class CachedSequence:
    start: int
    length: int
    loss_from: int  # positions >= loss_from - 1 predict a token the loss counts
    kind: str  # "chat" | "code" | "explain" | "open" | "stdlib"
    held_out: bool


def _held_out(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


@dataclass(frozen=True)
class AnswerSource:
    """An answers folder written by `duospec distill-data`, all of it or its first `first` answers
    (`--data FOLDER:N`: a part of an earlier run's data kept as replay beside new data)."""

    folder: Path
    first: int | None = None


def cache_sources(data, stdlib_tokens: int) -> list:
    """The sources of `--data` in its order: answer folders written by `duospec distill-data`
    (AnswerSource; `FOLDER:N` takes its first N answers) and 'stdlib' (the string); ValueError naming
    the item otherwise. The order is the cache's: data added at the end extends a built cache instead
    of rebuilding it (build_feature_cache)."""
    from duospec.training.answers import ANSWERS_FILE
    from duospec.training.data import STDLIB

    sources = []
    for item in data:
        if str(item) == STDLIB:
            if stdlib_tokens > 0:
                sources.append(STDLIB)
            continue
        folder, first = Path(item), None
        if not (folder / ANSWERS_FILE).is_file() and ":" in str(item):
            head, _, count = str(item).rpartition(":")
            if count.isdigit() and (Path(head) / ANSWERS_FILE).is_file():
                folder, first = Path(head), int(count)
                if first < 1:
                    raise ValueError(f"--data {item}: take at least one answer (FOLDER:N with N >= 1)")
        if not (folder / ANSWERS_FILE).is_file():
            raise ValueError(f"--data {item}: training on the target's cached outputs reads folders written by "
                             "`duospec distill-data` (with answers.jsonl; FOLDER:N takes its first N answers) "
                             "and/or 'stdlib'")
        sources.append(AnswerSource(folder, first))
    return sources


def training_sequences(tokenizer, sources, stdlib_tokens: int, max_len: int) -> list[tuple[str, str, list[int], int]]:
    """(key, kind, token ids, loss_from) of every sequence to cache, source after source (cache_sources).
    Each 'stdlib' takes the next `stdlib_tokens` of the training split: naming it again later in --data
    adds raw code the cache does not hold yet, so a built cache extends instead of rebuilding."""
    out, windows = [], None
    for source in sources:
        if isinstance(source, str):
            if windows is None:  # one walk of the split, shared by every 'stdlib'
                windows = _stdlib_windows(tokenizer, max_len)
            out += _take(windows, stdlib_tokens)
        else:
            out += _answer_sequences(tokenizer, source, max_len)
    return out


def _answer_sequences(tokenizer, source: AnswerSource, max_len: int) -> list[tuple[str, str, list[int], int]]:
    from duospec.training.answers import ANSWERS_FILE, conversation_text, read_records

    out = []
    for record in read_records(source.folder / ANSWERS_FILE)[: source.first]:
        text = conversation_text(tokenizer, record)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}],
                                               add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)[:max_len]
        loss_from = len(tokenizer.encode(prompt, add_special_tokens=False))
        if loss_from < len(ids) - 1:
            out.append((record["id"], record["kind"], ids, loss_from))
    return out


def _stdlib_windows(tokenizer, max_len: int):
    """Raw code windows of the standard library's training split, in file order: (key, kind, ids, 1)."""
    from duospec.training import corpus

    train, _ = corpus.split_files(corpus.stdlib_files())
    for file in train:
        text = corpus.read_text(file.path)
        if not text:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        for first in range(0, len(ids) - 32, max_len):
            yield f"stdlib:{file.relative_path}:{first}", "stdlib", ids[first: first + max_len], 1


def _take(windows, tokens: int) -> list:
    """The next windows of `windows` up to the first that reaches `tokens` in all."""
    out, taken = [], 0
    for window in windows:
        out.append(window)
        taken += len(window[2])
        if taken >= tokens:
            break
    return out


class FeatureCache:
    """A built cache, read-only: windows of tokens, taps and final hidden states."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index_file = self.folder / INDEX
        if not index_file.is_file():
            raise FileNotFoundError(f"{self.folder}: no {INDEX}; build the cache first (it is written last)")
        self.index = json.loads(index_file.read_text())
        self.sequences = [CachedSequence(**s) for s in self.index["sequences"]]
        total, width, hidden = self.index["tokens"], self.index["tap_width"], self.index["hidden_size"]
        self.tokens = np.memmap(self.folder / "tokens.i32", dtype=np.int32, mode="r", shape=(total,))
        self.taps = np.memmap(self.folder / "taps.f16", dtype=np.float16, mode="r", shape=(total, width)) \
            if width else np.zeros((total, 0), dtype=np.float16)  # a view of nothing: no memory
        self.final = np.memmap(self.folder / "final.f16", dtype=np.float16, mode="r", shape=(total, hidden))

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.index["feature_layers"])

    def split(self, held_out: bool) -> list[CachedSequence]:
        return [s for s in self.sequences if s.held_out == held_out]

    def emitted_token_weights(self, vocab_size: int) -> np.ndarray:
        """How often each token is the next token at a position the loss counts, each kind of data
        (the target's answers, raw code) weighing the same: the draft vocabulary's source. A kind
        alone would leave the other's tokens out (answers-only keeps 89 % of held-out stdlib code's
        tokens in 8,192, both 94 %)."""
        by_kind: dict[str, np.ndarray] = {}
        for seq in self.split(False):
            ids = self.tokens[seq.start + seq.loss_from: seq.start + seq.length]
            kind = "stdlib" if seq.kind == "stdlib" else "answers"
            by_kind[kind] = by_kind.get(kind, np.zeros(vocab_size, dtype=np.int64)) + np.bincount(ids, minlength=vocab_size)
        return sum(counts / max(counts.sum(), 1) for counts in by_kind.values())

    def window(self, seq: CachedSequence, length: int, offset: int = 0):
        """(tokens [n], taps [n, 3H], final [n, H], loss mask [n]) of up to `length` positions from `offset`."""
        lo = seq.start + offset
        hi = min(lo + length, seq.start + seq.length)
        positions = torch.arange(offset, offset + hi - lo)
        mask = positions >= seq.loss_from - 1  # row j predicts token j + 1
        mask[-1] = False  # the last row's next token is not in the window
        return (torch.from_numpy(self.tokens[lo:hi].astype(np.int64)), torch.from_numpy(np.array(self.taps[lo:hi])),
                torch.from_numpy(np.array(self.final[lo:hi])), mask)


def _holds_prefix(cache: FeatureCache, sequences) -> bool:
    """Whether the cache's sequences are the first of `sequences`, token for token."""
    if len(cache.sequences) > len(sequences):
        return False
    return all(seq.length == len(ids) and np.array_equal(cache.tokens[seq.start: seq.start + seq.length], ids)
               for seq, (_, _, ids, _) in zip(cache.sequences, sequences))


@torch.no_grad()
def build_feature_cache(target_dir: Path, out: Path, sequences, feature_layers: tuple[int, ...], *,
                        fingerprint: str, batch_tokens: int = 4096, log=print) -> FeatureCache:
    """Run the target over `sequences` (training_sequences) once and write the cache; resumes.
    `feature_layers` None: the caller reads tokens and final states only, so an existing cache with
    any layers will do, and a new one is built without taps."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    progress_file = out / PROGRESS
    if (out / INDEX).is_file():
        cache = FeatureCache(out)
        if cache.index.get("fingerprint") != fingerprint or not _holds_prefix(cache, sequences) \
                or (feature_layers is not None and cache.feature_layers != tuple(feature_layers)):
            raise ValueError(f"{out}: holds a feature cache of another target, layers or data; pass a new folder")
        if len(cache.sequences) == len(sequences):
            return cache
        # Data added after what the cache holds: only the new sequences are run, at the cache's layers.
        log(f"features: extending the cache's {len(cache.sequences)} sequences to {len(sequences)}")
        feature_layers = cache.feature_layers
        progress_file.write_text(json.dumps({"done": len(cache.sequences)}))
        (out / INDEX).unlink()  # incomplete until the new index is written
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    feature_layers = tuple(feature_layers or ())
    hidden = model.config.hidden_size
    width = hidden * len(feature_layers)
    total = sum(len(ids) for _, _, ids, _ in sequences)
    done = json.loads(progress_file.read_text())["done"] if progress_file.is_file() else 0
    mode = "r+" if done else "w+"
    if done:  # an extended cache's files grow to the new length (a no-op when resuming at that length)
        for name, row in (("tokens.i32", 4), ("taps.f16", 2 * width), ("final.f16", 2 * hidden)):
            if row and (out / name).stat().st_size < total * row:
                os.truncate(out / name, total * row)
    tokens = np.memmap(out / "tokens.i32", dtype=np.int32, mode=mode, shape=(total,))
    taps = np.memmap(out / "taps.f16", dtype=np.float16, mode=mode, shape=(total, width)) if width else None
    final = np.memmap(out / "final.f16", dtype=np.float16, mode=mode, shape=(total, hidden))
    starts = np.cumsum([0] + [len(ids) for _, _, ids, _ in sequences])
    started, fresh_tokens = time.perf_counter(), 0
    i = done
    while i < len(sequences):
        group = [i]  # sequences of similar length batched up to batch_tokens (padded on the right)
        while group[-1] + 1 < len(sequences) and len(group) * max(len(sequences[j][2]) for j in group + [group[-1] + 1]) \
                <= batch_tokens:
            group.append(group[-1] + 1)
        longest = max(len(sequences[j][2]) for j in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, j in enumerate(group):
            seq = sequences[j][2]
            ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
        result = model.model(input_ids=ids, attention_mask=attention, output_hidden_states=bool(width), use_cache=False)
        fused = torch.cat([result.hidden_states[layer] for layer in feature_layers], dim=-1) if width else None
        for row, j in enumerate(group):
            n, s = len(sequences[j][2]), int(starts[j])
            tokens[s: s + n] = np.asarray(sequences[j][2], dtype=np.int32)
            if taps is not None:
                taps[s: s + n] = fused[row, :n].to(torch.float16).numpy()
            final[s: s + n] = result.last_hidden_state[row, :n].to(torch.float16).numpy()
            fresh_tokens += n
        i = group[-1] + 1
        for array in (tokens, taps, final):
            if array is not None:
                array.flush()
        progress_file.write_text(json.dumps({"done": i}))
        rate = fresh_tokens / (time.perf_counter() - started)
        log(f"features: {i}/{len(sequences)} sequences, {int(starts[i])}/{total} tokens, {rate:.0f} tokens/s")
    index = {"fingerprint": fingerprint, "feature_layers": list(feature_layers), "hidden_size": hidden,
             "tap_width": width, "tokens": total,
             "sequences": [{"start": int(starts[j]), "length": len(ids), "loss_from": loss_from, "kind": kind,
                            "held_out": _held_out(key)} for j, (key, kind, ids, loss_from) in enumerate(sequences)]}
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index))
    os.replace(tmp, out / INDEX)
    return FeatureCache(out)
