"""The benchmark prompt sets: held-out Python snippets plus docstring-style prompts; and the
document-grounded set, where the prompt quotes a whole held-out function and then starts it again
(the output mostly repeats the input, as in code editing — where the n-gram drafter shines).

    prompts = load_prompts()                      # benchmarks/prompts/prompts.jsonl
    python -m duospec.bench.prompts --write benchmarks/prompts/prompts.jsonl   # regenerate
    python -m duospec.bench.prompts --set grounded --write benchmarks/prompts/grounded.jsonl

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
GROUNDED_PROMPTS = REPO_ROOT / "benchmarks" / "prompts" / "grounded.jsonl"
KINDS = ("heldout-snippet", "docstring", "grounded")
SNIPPET_BODY_LINES = 3  # body lines kept after the def line: enough context, short enough to fit
MAX_SNIPPET_CHARS = 400
GROUNDED_CHARS = (250, 600)  # a quoted function this long fits the bench's 256-token prompt window twice over
GROUNDED_HEADER = "# The same function, restated:\n"

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


def _function_starts(source: str) -> list[tuple[int, int, int]]:
    """(def line, first body line, last line), 1-based, of every function with a multi-line body, in
    file order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    starts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno > 4:
            starts.append((node.lineno, node.body[0].lineno, node.end_lineno))
    return sorted(starts)


def _heldout_functions():
    """(relative path, file lines, (def, body, end) lines) of every held-out stdlib function, in sorted
    path order."""
    from duospec.training.corpus import read_text, split_files, stdlib_files

    _, heldout = split_files(stdlib_files())
    for corpus_file in heldout:
        text = read_text(corpus_file.path)
        if text is not None:
            lines = text.splitlines(keepends=True)
            yield corpus_file.relative_path, lines, _function_starts(text)


def heldout_snippets(count: int) -> list[Prompt]:
    """The first long-enough function of each held-out file, in sorted path order, up to `count`."""
    snippets, seen_defs = [], set()
    for relative_path, lines, functions in _heldout_functions():
        for def_line, body_line, _ in functions:
            snippet = "".join(lines[def_line - 1 : body_line - 1 + SNIPPET_BODY_LINES])
            def_text = lines[def_line - 1].strip()
            # Generated codec modules repeat the same functions file after file: keep one of each.
            if "\t" not in snippet and len(snippet) <= MAX_SNIPPET_CHARS and def_text not in seen_defs:
                seen_defs.add(def_text)
                snippets.append(Prompt(f"heldout-{len(snippets):02d}", "heldout-snippet",
                                       f"{relative_path}:{def_line}", snippet))
                break
        if len(snippets) == count:
            break
    return snippets


def grounded_prompts(count: int) -> list[Prompt]:
    """Per held-out file, its first function of GROUNDED_CHARS length quoted whole, then restated from
    its `def` line and first body line: the model's continuation should repeat the quote."""
    prompts, seen_defs = [], set()
    lo, hi = GROUNDED_CHARS
    for relative_path, lines, functions in _heldout_functions():
        for def_line, body_line, end_line in functions:
            whole = "".join(lines[def_line - 1 : end_line])
            start = "".join(lines[def_line - 1 : body_line])
            def_text = lines[def_line - 1].strip()
            if "\t" not in whole and lo <= len(whole) <= hi and def_text not in seen_defs:
                seen_defs.add(def_text)
                text = f"# {relative_path}\n{whole}\n{GROUNDED_HEADER}{start}"
                prompts.append(Prompt(f"grounded-{len(prompts):02d}", "grounded", f"{relative_path}:{def_line}",
                                      text))
                break
        if len(prompts) == count:
            break
    return prompts


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
    parser.add_argument("--set", choices=("default", "grounded"), default="default",
                        help="default: snippets + docstrings; grounded: quoted functions restated")
    parser.add_argument("--write", type=pathlib.Path, help="output JSONL path (default: the set's file)")
    parser.add_argument("--snippets", type=int, default=16, help="held-out snippets (or grounded prompts) to take")
    args = parser.parse_args(argv)
    if args.set == "grounded":
        prompts = grounded_prompts(args.snippets)
        args.write = args.write or GROUNDED_PROMPTS
    else:
        prompts = build_prompt_set(args.snippets)
        args.write = args.write or DEFAULT_PROMPTS
    write_prompts(prompts, args.write)
    print(f"wrote {len(prompts)} prompts to {args.write} (Python {sys.version.split()[0]} stdlib held-out split)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
