"""Token streams for training: files are tokenized one at a time into an on-disk cache, and training
batches are random windows of that cache chosen by `(seed, step)` alone.

Choosing windows from the step number (not from an iterator's position) is what makes resuming
exact: a resumed run at step k draws the same batch an uninterrupted run would have drawn.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

# Extensions read from directories without sniffing; other files are read only if they look like
# UTF-8 text (no NUL byte in the first 8 KiB and decodable).
TEXT_EXTENSIONS = {
    ".py", ".pyi", ".txt", ".md", ".rst", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".cfg",
    ".ini", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".html",
    ".css", ".sh", ".sql", ".tex", ".csv",
}
_SKIPPED_DIRS = {".git", "__pycache__", ".venv", "node_modules", ".hg", ".svn"}
# `--data stdlib`: the training split of the Python standard library (duospec/training/corpus.py).
STDLIB = "stdlib"


class DataError(ValueError):
    """Bad data input; the message names the path and what to do."""


def _looks_like_text(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            head = handle.read(8192)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        # A multi-byte character cut at the 8 KiB boundary is still text.
        return err.start >= len(head) - 3
    return True


def collect_text_files(paths: Iterable[str | Path]) -> list[Path]:
    """Text files named by `paths` (files, or directories walked recursively), sorted, deduplicated.

    Raises DataError naming the path when a path does not exist, a named file is not text, or
    nothing at all is found.
    """
    found: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise DataError(f"--data {raw}: no such file or directory")
        if path.is_file():
            if not _looks_like_text(path):
                raise DataError(f"--data {raw}: not a UTF-8 text file; pass text files or directories")
            found.add(path.resolve())
            continue
        before = len(found)
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
            for name in names:
                candidate = Path(root) / name
                if candidate.suffix.lower() in TEXT_EXTENSIONS or _looks_like_text(candidate):
                    found.add(candidate.resolve())
        if len(found) == before:
            raise DataError(f"--data {raw}: directory holds no text files")
    if not found:
        raise DataError("--data: no text files given")
    return sorted(found)


def collect_data_files(paths: Iterable[str | Path]) -> list[Path]:
    """`collect_text_files`, where the word `stdlib` stands for the standard library's training split."""
    paths = [str(p) for p in paths]
    named = [p for p in paths if p != STDLIB]
    found = set(collect_text_files(named)) if named else set()
    if STDLIB in paths:
        from duospec.training import corpus

        train, _ = corpus.split_files(corpus.stdlib_files())
        found.update(f.path.resolve() for f in train)
    return sorted(found)


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65535 else np.uint32


def files_fingerprint(files: list[Path], tokenizer_name: str) -> str:
    """Identity of a token cache: which files (with sizes and mtimes) and which tokenizer."""
    digest = hashlib.sha1(tokenizer_name.encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def build_token_cache(texts: Iterable[str], encode, vocab_size: int, bos_id: int | None,
                      eos_id: int | None, cache_path: Path, fingerprint: str) -> np.ndarray:
    """Tokenize `texts` one document at a time into `cache_path` and return it memory-mapped.

    Each document is framed as `<bos> tokens <eos>` so the models learn where files start and end.
    A cache whose fingerprint matches is reused as is.
    """
    dtype = token_dtype(vocab_size)
    meta_path = cache_path.with_suffix(".json")
    if cache_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fingerprint:
            return np.memmap(cache_path, dtype=dtype, mode="r")
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = cache_path.with_suffix(".tmp")
    count = 0
    with tmp_path.open("wb") as out:
        for text in texts:
            ids = list(encode(text))
            framed = ([bos_id] if bos_id is not None else []) + ids + ([eos_id] if eos_id is not None else [])
            out.write(np.asarray(framed, dtype=dtype).tobytes())
            count += len(framed)
    os.replace(tmp_path, cache_path)
    meta_path.write_text(json.dumps({"fingerprint": fingerprint, "tokens": count}))
    if count == 0:
        raise DataError(f"tokenizing the data produced no tokens (cache {cache_path})")
    return np.memmap(cache_path, dtype=dtype, mode="r")


class WindowSource:
    """Windows of `seq_len + 1` tokens (inputs plus shifted labels) from a token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        if len(tokens) < seq_len + 2:
            raise DataError(
                f"the data has {len(tokens)} tokens, fewer than one training window of "
                f"{seq_len + 1}; add more text or lower --seq-len"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed

    def batch(self, step: int, batch_size: int):
        """Random windows for training step `step`: a LongTensor [batch_size, seq_len + 1]."""
        import torch

        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=batch_size)
        rows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(rows)

    def fixed_batches(self, n_batches: int, batch_size: int):
        """Evenly spaced windows covering the array, for held-out evaluation (same every call)."""
        import torch

        total = n_batches * batch_size
        last_start = len(self.tokens) - self.seq_len - 1
        starts = np.linspace(0, last_start, num=total).astype(np.int64)
        rows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return [torch.from_numpy(rows[i : i + batch_size]) for i in range(0, total, batch_size)]
