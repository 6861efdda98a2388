"""The Python standard library as a training corpus, with a fixed held-out split.

Files come from the running interpreter's stdlib (`sysconfig.get_paths()["stdlib"]`), so the recipe
needs no download. Test suites are excluded (they are large, repetitive and not what users write),
and so are third-party packages under site-packages. Order is the sorted relative path, so every
machine with the same Python version sees the same corpus.

Split rule (documented in models/README.md): a file is held out when
`int(sha1(relative_path).hexdigest(), 16) % 20 == 0` — about 5 % of files, whole files only, stable
under additions and removals of other files.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_MODULUS = 20

# Directory names anywhere in the relative path that mark a test suite or non-stdlib code.
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class CorpusFile:
    relative_path: str  # posix-style, relative to the stdlib root
    path: Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    digest = hashlib.sha1(relative_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELDOUT_MODULUS == 0


def _is_excluded(relative: Path) -> bool:
    if any(part in _EXCLUDED_DIRS for part in relative.parts[:-1]):
        return True
    # lib2to3 keeps its test fixtures under lib2to3/tests (caught above) and grammar pickles.
    return relative.name.startswith("test_") or relative.name == "tests.py"


def stdlib_files(root: Path | None = None) -> list[CorpusFile]:
    """All non-test `.py` files under the stdlib root, sorted by relative path."""
    root = root or stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if not _is_excluded(relative) and path.is_file():
            files.append(CorpusFile(relative.as_posix(), path))
    files.sort(key=lambda f: f.relative_path)
    return files


def split_files(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(train, heldout) by the sha1 rule above; both keep the sorted order."""
    train = [f for f in files if not is_heldout(f.relative_path)]
    heldout = [f for f in files if is_heldout(f.relative_path)]
    return train, heldout


def read_text(path: Path) -> str | None:
    """File text, or None for files that are not UTF-8 (a handful of encoding test fixtures)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
