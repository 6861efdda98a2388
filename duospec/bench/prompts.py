"""The benchmark prompt set: held-out Python snippets plus docstring-style prompts.

    prompts = load_prompts()                      # benchmarks/prompts/prompts.jsonl
    python -m duospec.bench.prompts --write benchmarks/prompts/prompts.jsonl   # regenerate

Held-out snippets come from the training corpus's held-out split (duospec.training.corpus: whole
stdlib files with sha1(relative path) % 20 == 0), so the bundled models never trained on them. Each
is the start of a function: its `def` line and the first few lines of its body. Docstring prompts
are written here: a signature and a docstring, the model writes the body.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
from dataclasses import asdict, dataclass

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_PROMPTS = REPO_ROOT / "benchmarks" / "prompts" / "prompts.jsonl"
KINDS = ("heldout-snippet", "docstring")
SNIPPET_BODY_LINES = 3  # body lines kept after the def line: enough context, short enough to fit
MAX_SNIPPET_CHARS = 400

# Written for this benchmark (not taken from any corpus): what a user asks a code model for.
DOCSTRING_PROMPTS = (
    'def moving_average(values, window):\n    """Return the averages of each run of `window` consecutive values."""\n',
    'def parse_key_value_lines(text):\n    """Parse "key = value" lines into a dict, skipping blank lines and # comments."""\n',
    'def chunked(items, size):\n    """Yield lists of at most `size` items, in order."""\n',
    'def is_palindrome(word):\n    """Return True if `word` reads the same backwards, ignoring case."""\n',
    'class LRUCache:\n    """A mapping that keeps at most `capacity` items, evicting the least recently used."""\n\n'
    '    def __init__(self, capacity):\n',
    'def flatten(nested):\n    """Return a flat list of the leaves of arbitrarily nested lists and tuples."""\n',
    'def read_csv_rows(path):\n    """Return the rows of the CSV file at `path` as a list of dicts keyed by the header."""\n',
    'def retry(func, attempts=3, delay=0.5):\n    """Call func() until it succeeds, at most `attempts` times, sleeping `delay` between tries."""\n',
)


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # one of KINDS
    source: str  # stdlib relative path:line for snippets, "written" for docstring prompts
    text: str


def load_prompts(path: str | pathlib.Path = DEFAULT_PROMPTS, limit: int | None = None) -> list[Prompt]:
    """Reads a JSONL prompt file (one {"id", "kind", "source", "text"} object per line)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file; use benchmarks/prompts/prompts.jsonl or "
                                "regenerate it with `python -m duospec.bench.prompts --write FILE`")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            prompt = Prompt(id=str(raw["id"]), kind=str(raw["kind"]), source=str(raw.get("source", "")),
                            text=str(raw["text"]))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a prompt object with id, kind and text ({exc})") from None
        if not prompt.text:
            raise ValueError(f"{path}:{number}: prompt {prompt.id!r} has empty text")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path}: holds no prompts")
    return prompts[:limit] if limit else prompts


def _function_starts(source: str) -> list[tuple[int, int]]:
    """(def line, first body line), 1-based, of every function with a multi-line body, in file order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    starts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno > 4:
            starts.append((node.lineno, node.body[0].lineno))
    return sorted(starts)


def heldout_snippets(count: int) -> list[Prompt]:
    """The first long-enough function of each held-out file, in sorted path order, up to `count`."""
    from duospec.training.corpus import read_text, split_files, stdlib_files

    _, heldout = split_files(stdlib_files())
    snippets, seen_defs = [], set()
    for corpus_file in heldout:
        text = read_text(corpus_file.path)
        if text is None:
            continue
        lines = text.splitlines(keepends=True)
        for def_line, body_line in _function_starts(text):
            snippet = "".join(lines[def_line - 1 : body_line - 1 + SNIPPET_BODY_LINES])
            def_text = lines[def_line - 1].strip()
            # Generated codec modules repeat the same functions file after file: keep one of each.
            if "\t" not in snippet and len(snippet) <= MAX_SNIPPET_CHARS and def_text not in seen_defs:
                seen_defs.add(def_text)
                snippets.append(Prompt(f"heldout-{len(snippets):02d}", "heldout-snippet",
                                       f"{corpus_file.relative_path}:{def_line}", snippet))
                break
        if len(snippets) == count:
            break
    return snippets


def build_prompt_set(n_snippets: int = 16) -> list[Prompt]:
    docstrings = [Prompt(f"docstring-{i:02d}", "docstring", "written", text) for i, text in enumerate(DOCSTRING_PROMPTS)]
    return heldout_snippets(n_snippets) + docstrings


def write_prompts(prompts: list[Prompt], path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for prompt in prompts:
            out.write(json.dumps(asdict(prompt), ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the benchmark prompt set from the held-out split.")
    parser.add_argument("--write", type=pathlib.Path, default=DEFAULT_PROMPTS, help="output JSONL path")
    parser.add_argument("--snippets", type=int, default=16, help="held-out snippets to take")
    args = parser.parse_args(argv)
    prompts = build_prompt_set(args.snippets)
    write_prompts(prompts, args.write)
    print(f"wrote {len(prompts)} prompts to {args.write} (Python {sys.version.split()[0]} stdlib held-out split)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
