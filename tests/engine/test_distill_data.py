"""`duospec distill-data` (the target's own answers to instruction prompts) and `--data stdlib` for
`duospec distill`: answers equal transformers' greedy reply, a killed run resumes, held-out prompts
never reach the data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from duospec.training import answers as A
from duospec.training.data import collect_data_files
from tiny_models import CHAT_TEMPLATE, make_tiny_checkpoint
from exactness import reference_model


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    target = make_tiny_checkpoint(tmp_path_factory.mktemp("chat") / "target", "llama", seed=5)
    tok = AutoTokenizer.from_pretrained(str(target))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(target))
    return target


def test_prompts_are_fixed_mixed_and_split():
    prompts = A.instruction_prompts()
    assert [p.id for p in prompts] == [p.id for p in A.instruction_prompts()]
    assert len({p.id for p in prompts}) == len(prompts)
    assert {p.kind for p in prompts[:40]} == {"code", "explain", "chat"}  # any prefix is a mix
    heldout = A.heldout_prompts(1000)
    assert heldout and all(p.heldout for p in heldout)
    assert 0.02 < len(heldout) / len(prompts) < 0.1  # about 1 in 20
    # Methods' prompts come after every function's and chat prompt, and the everyday requests after
    # those, so adding each kept the part before it (and the held-out sets measured on it).
    order = ["open" if p.kind == "open" else "method" if "of the class" in p.text or "of a class" in p.text
             else "first" for p in prompts]
    assert order == sorted(order, key=["first", "method", "open"].index)
    assert order.count("open") > 1000 and order.count("method") > 100


def test_everyday_requests_leave_out_the_demo_questions_and_are_picked_by_kind(chat_target, tmp_path):
    from duospec.demo import CHAT_QUESTIONS

    from duospec.training.open_prompts import open_prompt_texts

    texts = {p.text for p in A.instruction_prompts() if p.kind == "open"}
    assert not texts & set(CHAT_QUESTIONS)
    some = open_prompt_texts()[:3]  # what the exclusion does, on texts the templates do produce
    assert open_prompt_texts(frozenset(some)) == open_prompt_texts()[3:]
    assert {t.split()[0] for t in texts} >= {"What", "Write", "Give", "Plan", "Explain", "How"}  # varied requests
    # The second and third groups of requests were each added after the earlier ones had been answered:
    # each comes after every one of those, so the answers (and feature caches) built from them stay a prefix.
    from duospec.training import open_prompts as O

    first = set(O._texts(O._REQUESTS, 2))
    ordered = open_prompt_texts()
    assert set(ordered[:len(first)]) == first and len(ordered) > len(first) + 1500
    assert "Where do penguins live?" in ordered[len(first):] and any(t.startswith("Solve for x") for t in ordered)
    second = {t for t in O._texts(O._MORE_REQUESTS, 3, O._arithmetic(280))} - first  # the third group follows it
    assert set(ordered[len(first):len(first) + len(second)]) == second and len(ordered) > len(first) + len(second) + 1000
    assert "How do I unclog a drain?" in ordered[len(first) + len(second):]
    heldout = A.heldout_prompts(5, ("open",))
    assert len(heldout) == 5 and all(p.kind == "open" and p.heldout for p in heldout)
    options = A.AnswerOptions(count=2, max_new_tokens=3, batch_size=2, kinds=("open",))
    assert A.generate_answers(chat_target, tmp_path, options, log=lambda _: None) == 2
    records = A.read_records(tmp_path / A.ANSWERS_FILE)
    assert [r["id"] for r in records] == [p.id for p in A.instruction_prompts() if p.kind == "open" and not p.heldout][:2]


def _transformers_reply(target: Path, prompt: A.InstructionPrompt, max_new_tokens: int) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    model = reference_model(str(target))
    ids = A.chat_prompt_ids(tok, prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_answers_are_the_targets_greedy_replies_and_a_killed_run_resumes(chat_target, tmp_path):
    options = A.AnswerOptions(count=3, max_new_tokens=6, batch_size=2)
    assert A.generate_answers(chat_target, tmp_path, options, log=lambda _: None) == 3
    records = A.read_records(tmp_path / A.ANSWERS_FILE)
    train = [p for p in A.instruction_prompts() if not p.heldout]
    assert [r["id"] for r in records] == [p.id for p in train[:3]]
    assert records[0]["answer"] == _transformers_reply(chat_target, train[0], 6)

    # A run killed in the middle of a write leaves a partial line; the next run drops it and goes on.
    with (tmp_path / A.ANSWERS_FILE).open("a") as f:
        f.write('{"id": "cut sh')
    bigger = A.AnswerOptions(count=5, max_new_tokens=6, batch_size=2)
    assert A.generate_answers(chat_target, tmp_path, bigger, log=lambda _: None) == 5
    records = A.read_records(tmp_path / A.ANSWERS_FILE)
    assert [r["id"] for r in records] == [p.id for p in train[:5]]
    text = (tmp_path / A.CONVERSATIONS_FILE).read_text()
    assert all(p.text in text for p in train[:5]) and text.count("assistant:") == 5


def test_a_folder_of_new_answers_skips_those_answered_elsewhere(chat_target, tmp_path):
    """--skip-answered: the prompts answered in another folder count toward --count but are not
    answered again, so the new folder can follow the old one in --data (a cache built on it extends)."""
    first = A.AnswerOptions(count=2, max_new_tokens=3, batch_size=2)
    assert A.generate_answers(chat_target, tmp_path / "old", first, log=lambda _: None) == 2
    more = A.AnswerOptions(count=4, max_new_tokens=3, batch_size=2, skip_answered=(tmp_path / "old",))
    more.validate()
    assert A.generate_answers(chat_target, tmp_path / "new", more, log=lambda _: None) == 2
    train = [p for p in A.instruction_prompts() if not p.heldout]
    assert [r["id"] for r in A.read_records(tmp_path / "new" / A.ANSWERS_FILE)] == [p.id for p in train[2:4]]
    with pytest.raises(ValueError, match=f"--skip-answered {tmp_path / 'nowhere'}: no answers.jsonl there"):
        A.AnswerOptions(skip_answered=(tmp_path / "nowhere",)).validate()


def test_skip_first_answers_only_the_prompts_after_the_first_n(chat_target, tmp_path):
    """--skip-first: the first prompts of the order were answered in a folder no longer at hand; OUT
    gets the ones after them, so a new run adds new prompts rather than repeating old ones."""
    later = A.AnswerOptions(count=5, max_new_tokens=3, batch_size=2, skip_first=3)
    later.validate()
    assert A.generate_answers(chat_target, tmp_path, later, log=lambda _: None) == 2
    train = [p for p in A.instruction_prompts() if not p.heldout]
    assert [r["id"] for r in A.read_records(tmp_path / A.ANSWERS_FILE)] == [p.id for p in train[3:5]]
    for bad in (-1, 5):
        with pytest.raises(ValueError, match=f"--skip-first {bad}: must be >= 0 and below --count 5"):
            A.AnswerOptions(count=5, skip_first=bad).validate()


def test_an_answer_cut_at_the_budget_has_no_end_of_turn():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[2] / "models" / "target"))
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<end>{% endfor %}" \
                        "{% if add_generation_prompt %}<assistant>{% endif %}"
    record = {"prompt": "hi", "answer": "hello"}
    assert A.conversation_text(tok, {**record, "ended": True}) == "<user>hi<end><assistant>hello<end>"
    assert A.conversation_text(tok, {**record, "ended": False}) == "<user>hi<end><assistant>hello\n"


def test_data_stdlib_is_the_training_split_plus_named_files(tmp_path):
    from duospec.training import corpus

    extra = tmp_path / "answers.txt"
    extra.write_text("hello\n")
    files = collect_data_files(["stdlib", str(extra)])
    train, heldout = corpus.split_files(corpus.stdlib_files())
    assert extra.resolve() in files and len(files) == len(train) + 1
    assert not {f.path.resolve() for f in heldout} & set(files)


def test_cli_rejects_bad_counts_without_a_traceback(capsys):
    from duospec.cli import main

    assert main(["distill-data", "--target", "models/target", "--out", "unused", "--count", "0"]) == 2
    assert "--count must be >= 1" in capsys.readouterr().err
    assert main(["distill-data", "--target", "models/target", "--out", "unused", "--kinds", "open,poems"]) == 2
    assert "--kinds open,poems: use a comma-separated subset of code,explain,chat,open" in capsys.readouterr().err
    assert not Path("unused").exists()



def test_acceptance_prompt_sets_follow_the_data_and_the_template(chat_target):
    import numpy as np
    from transformers import AutoTokenizer

    from duospec.training.acceptance import prompt_sets

    tok = AutoTokenizer.from_pretrained(str(chat_target))
    sets = prompt_sets(tok, ["stdlib", "notes.txt"], np.zeros(0, np.int64), 3)
    assert set(sets) == {"code", "chat", "open"} and all(len(p) == 3 for p in sets.values())
    assert tok.decode(sets["chat"][0]).startswith("user: ") and all(len(p) == 64 for p in sets["code"])
    tok.chat_template = None
    tail = np.arange(1000) % 300
    assert set(prompt_sets(tok, ["notes.txt"], tail, 3)) == {"heldout"}


def test_data_folder_with_a_count_takes_its_first_answers(chat_target, tmp_path):
    """`--data FOLDER:N`: the first N answers of a distill-data folder (replay of part of an earlier
    run's data), the same sequences the whole folder starts with; a bad count or path is refused."""
    import json

    from transformers import AutoTokenizer

    from duospec.training.features import AnswerSource, cache_sources, training_sequences

    folder = tmp_path / "answers"
    folder.mkdir()
    records = [{"id": f"open:{i}", "kind": "open", "prompt": f"Say {i} words.", "tokens": 6, "ended": True,
                "answer": " ".join(["word"] * (i + 2))} for i in range(5)]
    (folder / A.ANSWERS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cache_sources([folder, f"{folder}:3", "stdlib"], 100) == [
        AnswerSource(folder), AnswerSource(folder, 3), "stdlib"]
    tokenizer = AutoTokenizer.from_pretrained(str(chat_target))
    whole, first = (training_sequences(tokenizer, cache_sources([d], 0), 0, 64) for d in (folder, f"{folder}:3"))
    assert [key for key, *_ in whole] == [r["id"] for r in records]
    assert first == whole[:3]
    for bad in (f"{folder}:0", f"{folder}:x", f"{tmp_path / 'nowhere'}:3"):
        with pytest.raises(ValueError, match="--data"):
            cache_sources([bad], 0)
