"""Self-distillation data: the target's own greedy answers to instruction prompts, generated with
duospec (the `off` mode, batched), for `duospec distill` / `duospec train-heads`.

A draft is judged by how often it guesses what the target says, so it should learn from text the
target writes when asked what users ask: chat questions and coding requests. The prompts are built
here, deterministically, with no download:

- code: "Write a Python function `name(args)` that <first sentence of its docstring>" and "Explain
  what this Python function does" over public functions of the standard library's training split
  (duospec/training/corpus.py);
- chat: templates over a fixed list of everyday and technical subjects;
- open: everyday requests, broader (duospec/training/open_prompts.py), after the others in the order.

Held-out rule (the corpus's, on the prompt text): `int(sha1(text), 16) % 20 == 0` keeps a prompt out
of the generated data; `heldout_prompts()` returns those for the acceptance figure.

Output folder: `answers.jsonl` (one record per prompt: id, kind, prompt, answer, tokens) and
`conversations.txt` (every record rendered with the chat template, the text `--data` reads).
Rerunning continues where the last run stopped (records are appended as they finish).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from duospec.demo import CHAT_QUESTIONS
from duospec.training.open_prompts import open_prompt_texts

ANSWERS_FILE = "answers.jsonl"
CONVERSATIONS_FILE = "conversations.txt"
HELDOUT_MODULUS = 20
KINDS = ("code", "explain", "chat", "open")  # open: everyday requests (duospec/training/open_prompts.py)
MEASURING = frozenset(CHAT_QUESTIONS)  # the demo's questions are never answered for training

_SUBJECTS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "compound interest",
    "machine learning", "climate change", "the immune system", "volcanoes", "the stock market",
    "electric cars", "the Roman Empire", "sleep", "vaccines", "recycling", "the internet",
    "healthy eating", "time management", "public speaking", "learning a new language", "gardening",
    "the solar system", "earthquakes", "democracy", "inflation", "renewable energy", "the human brain",
    "coffee", "chess", "meditation", "bread baking", "marathon training", "budgeting", "job interviews",
    "databases", "encryption", "recursion", "version control with git", "unit testing", "HTTP",
    "sorting algorithms", "hash tables", "binary search", "the Python GIL", "regular expressions",
    "REST APIs", "cloud computing", "operating systems", "compilers", "linked lists",
)
_CHAT_TEMPLATES = (
    "What is {s}?",
    "Explain {s} in simple terms.",
    "Give me three interesting facts about {s}.",
    "Write a short paragraph about {s} for a ten-year-old.",
    "What are the pros and cons of {s}?",
    "Summarize the key ideas of {s} in a few sentences.",
    "How would you teach {s} to a beginner?",
    "Write a haiku about {s}.",
)


@dataclass(frozen=True)
class AnswerOptions:
    count: int = 300  # prompts answered in all (a few hundred fit a CPU in well under an hour)
    max_new_tokens: int = 160
    batch_size: int = 8
    kinds: tuple[str, ...] = KINDS  # which prompts: the first `count` of these kinds
    skip_answered: tuple[Path, ...] = ()  # folders whose answers count toward `count` but stay out of this one
    skip_first: int = 0  # the first prompts of the order, left to a folder not at hand (answered there already)

    def validate(self) -> None:
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown or not self.kinds:
            raise ValueError(f"--kinds {','.join(self.kinds)}: use a comma-separated subset of {','.join(KINDS)}")
        missing = [str(d) for d in self.skip_answered if not (Path(d) / ANSWERS_FILE).is_file()]
        if missing:
            raise ValueError(f"--skip-answered {' '.join(missing)}: no {ANSWERS_FILE} there (pass distill-data folders)")
        for name in ("count", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.skip_first < self.count:
            raise ValueError(f"--skip-first {self.skip_first}: must be >= 0 and below --count {self.count} "
                             "(it skips the first prompts of those --count)")


@dataclass(frozen=True)
class InstructionPrompt:
    id: str
    kind: str  # "code" | "explain" | "chat"
    text: str

    @property
    def heldout(self) -> bool:
        return int(hashlib.sha1(self.text.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def _function_prompts(where: str, node: ast.FunctionDef, lines: list[str], owner: str = "") -> list[InstructionPrompt]:
    """A "write this" prompt from a documented function, an "explain this" prompt from a short undocumented one."""
    prompts = []
    doc = (ast.get_docstring(node) or "").split("\n\n")[0].replace("\n", " ").strip()
    sentence = doc.split(". ")[0].rstrip(".")
    if 20 <= len(sentence) <= 150:
        args = ", ".join(a.arg for a in node.args.args)
        task = sentence[0].lower() + sentence[1:]
        what = f"a method `{node.name}({args})` of a class `{owner}`" if owner else f"a Python function `{node.name}({args})`"
        prompts.append(InstructionPrompt(f"code:{where}", "code", f"Write {what} that does this: {task}."))
    body = lines[node.lineno - 1: node.end_lineno]
    if 3 <= len(body) <= 12 and not doc:
        snippet = "\n".join(body)
        what = f"method of the class `{owner}`" if owner else "function"
        prompts.append(InstructionPrompt(f"explain:{where}", "explain",
                                         f"Explain what this Python {what} does:\n\n```python\n{snippet}\n```"))
    return prompts


def _code_prompts(methods: bool) -> list[InstructionPrompt]:
    """Prompts over the public top-level functions of the standard library's training split, or (methods)
    over the public methods of its public classes."""
    from duospec.training import corpus

    train, _ = corpus.split_files(corpus.stdlib_files())
    prompts = []
    for file in train:
        source = corpus.read_text(file.path)
        try:
            tree = ast.parse(source or "")
        except (SyntaxError, ValueError):
            continue
        lines = (source or "").splitlines()
        for node in tree.body:
            if not methods and isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                prompts += _function_prompts(f"{file.relative_path}:{node.lineno}", node, lines)
            elif methods and isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for method in node.body:
                    if isinstance(method, ast.FunctionDef) and not method.name.startswith("_"):
                        prompts += _function_prompts(f"{file.relative_path}:{method.lineno}", method, lines, node.name)
    return prompts


@functools.lru_cache(maxsize=1)  # parsing the standard library takes seconds
def instruction_prompts() -> tuple[InstructionPrompt, ...]:
    """Every prompt, in one fixed order: chat and functions shuffled together (kinds interleaved, so any
    prefix is a mix), then the methods' prompts, shuffled apart so that adding them left the first part
    (and with it the held-out sets measured so far) as it was."""
    chat = [InstructionPrompt(f"chat:{i}:{j}", "chat", template.format(s=subject))
            for i, template in enumerate(_CHAT_TEMPLATES) for j, subject in enumerate(_SUBJECTS)]
    prompts = chat + _code_prompts(methods=False)
    random.Random(0).shuffle(prompts)
    methods = _code_prompts(methods=True)
    random.Random(1).shuffle(methods)
    everyday = [InstructionPrompt(f"open:{i}", "open", text) for i, text in enumerate(open_prompt_texts(MEASURING))]
    return tuple(prompts + methods + everyday)


def heldout_prompts(count: int, kinds: tuple[str, ...] = KINDS) -> list[InstructionPrompt]:
    return [p for p in instruction_prompts() if p.heldout and p.kind in kinds][:count]


def chat_prompt_ids(tokenizer, prompt: InstructionPrompt) -> list[int]:
    """The prompt as the server builds a chat request: the template rendered to text, then encoded."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def conversation_text(tokenizer, record: dict) -> str:
    """One exchange as the target saw and wrote it: an answer cut at the token budget gets no
    end-of-turn token (the draft must not learn to end turns where the target did not)."""
    messages = [{"role": "user", "content": record["prompt"]}]
    if record["ended"]:
        return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": record["answer"]}],
                                             tokenize=False)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + record["answer"] + "\n"


def read_records(answers: Path) -> list[dict]:
    """The records of answers.jsonl; a last line cut short by a killed run is dropped from the file."""
    if not answers.is_file():
        return []
    text = answers.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        answers.write_text(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def generate_answers(target_dir: Path, out_dir: Path, options: AnswerOptions, log=print) -> int:
    """Answer the first `options.count` training prompts not yet answered (appending to answers.jsonl),
    then rewrite conversations.txt from all records; returns how many records the folder holds."""
    from duospec.decoding import _request, stream_events
    from duospec.engine import load_checkpoint
    from duospec.sampling import SamplingParams  # its default is greedy

    records = read_records(out_dir / ANSWERS_FILE)
    done = {r["id"] for r in records}
    elsewhere = {r["id"] for folder in options.skip_answered for r in read_records(Path(folder) / ANSWERS_FILE)}
    todo = [p for p in instruction_prompts() if not p.heldout and p.kind in options.kinds]
    todo = todo[options.skip_first:options.count]
    todo = [p for p in todo if p.id not in done and p.id not in elsewhere]
    log(f"{len(done)} answers present, {len(elsewhere)} in --skip-answered folders, {len(todo)} to generate")
    target = load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=options.batch_size)
    tokenizer = target.tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(todo), options.batch_size):
        group = todo[first: first + options.batch_size]
        requests = [_request(chat_prompt_ids(tokenizer, p), options.max_new_tokens, "off", SamplingParams(), 1,
                             False) for p in group]
        events = stream_events(target, None, requests, max_batch_size=options.batch_size)
        lines = []
        for prompt, request in zip(group, requests):
            *steps, finish = events[request.request_id]
            ids = [t for event in steps for t in event.token_ids]
            record = {"id": prompt.id, "kind": prompt.kind, "prompt": prompt.text, "tokens": len(ids),
                      "answer": tokenizer.decode(ids, skip_special_tokens=True),
                      "ended": finish.finish_reason.value != "length"}
            records.append(record)
            lines.append(json.dumps(record) + "\n")
            tokens += len(ids)
        with (out_dir / ANSWERS_FILE).open("a") as out:
            out.write("".join(lines))  # one write per batch: a kill loses at most this batch
        elapsed = time.perf_counter() - start
        log(f"{len(done) + first + len(group)}/{len(done) + len(todo)} answers, {tokens} tokens, "
            f"{tokens / elapsed:.1f} tokens/s")
    tmp = out_dir / (CONVERSATIONS_FILE + ".tmp")
    tmp.write_text("".join(conversation_text(tokenizer, r) for r in records))
    os.replace(tmp, out_dir / CONVERSATIONS_FILE)
    return len(records)
