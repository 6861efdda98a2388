"""Measure the bundled (or any) target/draft pair: single-step decode cost ratio and greedy
acceptance at draft length 4 on held-out prompts: code (held-out stdlib files) and, when the target's
tokenizer has a chat template, chat (held-out instruction prompts, duospec/training/answers.py).

    .venv/bin/python benchmarks/acceptance.py                       # models/target + models/draft
    .venv/bin/python benchmarks/acceptance.py --record models/metrics.json
    .venv/bin/python benchmarks/acceptance.py --heads models/eagle models/medusa --record models/metrics.json
    .venv/bin/python benchmarks/acceptance.py --target ~/.cache/duospec/models/smollm2-135m-instruct \
        --draft models/smollm2/draft --heads models/smollm2/eagle --prompts 16 --new-tokens 64 --no-regression

`--heads`: EAGLE / EAGLE-3 / Medusa heads of the target (duospec train-heads; EAGLE-3 also published),
measured on the same prompts by exact simulation (duospec/training/heads.py `measure_head`; EAGLE-3 on
the engine, duospec/training/eagle3_run.py `measure_eagle3`: each round the head drafts on the target's
features of the verified positions, then on its own) and reported next to the draft.

Cost: median seconds of one single-token decode step (position 64, one thread, fp32) on duospec's
engine (`duospec.engine.load_model`, `forward_last`). Acceptance: exact greedy simulation from
teacher-forced passes (see duospec/training/acceptance.py), on prompts from the held-out split.
`--record` also stores the figure for the small fixed prompt set that tests/engine/test_bundled_models.py
re-measures, so that test's floor is derived from a measurement, not typed in.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# The regression test re-measures exactly this configuration (it must stay under ~20 s).
REGRESSION_SET = {"prompts": 6, "prompt_tokens": 48, "new_tokens": 48, "draft_len": 4}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=Path("models/target"))
    parser.add_argument("--draft", type=Path, default=Path("models/draft"))
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=300, help="timed decode steps per model")
    parser.add_argument("--heads", type=Path, nargs="*", default=[], help="head directories to measure too")
    parser.add_argument("--context-lookup", action="store_true",
                        help="also the draft with the drafter's context lookup (draft.context_lookup), same passes")
    parser.add_argument("--demo", action="store_true", help="also the prompts `make demo` sends (duospec/demo.py)")
    parser.add_argument("--record", type=Path, help="write the figures as JSON here")
    parser.add_argument("--no-regression", action="store_true",
                        help="skip the small fixed set tests/engine/test_bundled_models.py re-measures")
    return parser.parse_args(argv)


def load_pair(target_dir: Path, draft_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    return target, draft, AutoTokenizer.from_pretrained(str(target_dir))


def prompts_by_kind(tokenizer, count: int, prompt_tokens: int) -> dict[str, list[list[int]]]:
    """{"code": held-out stdlib prompts, "chat": held-out instructions (when there is a chat template)}."""
    from duospec.training.acceptance import prompt_sets

    return prompt_sets(tokenizer, ["stdlib"], [], count, prompt_tokens)


def demo_prompts(tokenizer) -> list[list[int]]:
    """`make demo`'s chat questions through the chat template, then its code prompt."""
    from duospec.demo import CHAT_QUESTIONS, CODE_PROMPT
    from duospec.training.answers import InstructionPrompt, chat_prompt_ids

    chats = [chat_prompt_ids(tokenizer, InstructionPrompt("demo", "chat", q)) for q in CHAT_QUESTIONS]
    return chats + [tokenizer(CODE_PROMPT)["input_ids"]]


def measure_head_dir(target, tokenizer, head_dir: Path, target_dir: Path, kinds: dict, args):
    """(method, {kind: mean accepted length}, mean accepted length on the regression set or None, one
    draft step in seconds or None: EAGLE's on the engine; Medusa's heads run once per verify)."""
    from duospec.engine.eagle3 import is_published
    from duospec.engine.heads import read_head
    from duospec.training.acceptance import heldout_prompts
    from duospec.training.heads import load_trained_head, measure_head

    if is_published(head_dir) or read_head(head_dir).method == "eagle3":
        return measure_eagle3_dir(tokenizer, head_dir, target_dir, kinds, args)
    method, head = load_trained_head(head_dir, target_dir)
    step = None
    if method == "eagle":
        from duospec.bench.simulate_heads import eagle_cost_runner
        from duospec.training.acceptance import runner_step_seconds

        step = runner_step_seconds(eagle_cost_runner(str(head_dir), str(target_dir), 1), repeats=args.repeats)
    by_kind = {kind: measure_head(target, head, method, prompts, args.new_tokens, args.draft_len)[0]
               for kind, prompts in kinds.items()}
    small = None
    if not args.no_regression:
        small = measure_head(target, head, method,
                             heldout_prompts(tokenizer, REGRESSION_SET["prompts"], REGRESSION_SET["prompt_tokens"]),
                             REGRESSION_SET["new_tokens"], REGRESSION_SET["draft_len"])[0]
    return method, by_kind, small, step


def measure_eagle3_dir(tokenizer, head_dir: Path, target_dir: Path, kinds: dict, args):
    """As measure_head_dir, for an EAGLE-3 head (either layout), on the engine (eagle3_run.measure_eagle3)."""
    from duospec.bench.simulate_heads import eagle_cost_runner
    from duospec.training.acceptance import heldout_prompts, runner_step_seconds
    from duospec.training.eagle3_run import measure_eagle3, measurement_pair

    target, head = measurement_pair(head_dir, target_dir)
    by_kind = {kind: measure_eagle3(target, head, prompts, args.new_tokens, args.draft_len)[0]
               for kind, prompts in kinds.items()}
    small = None
    if not args.no_regression:
        small = measure_eagle3(target, head, heldout_prompts(tokenizer, REGRESSION_SET["prompts"],
                                                             REGRESSION_SET["prompt_tokens"]),
                               REGRESSION_SET["new_tokens"], REGRESSION_SET["draft_len"])[0]
    step = runner_step_seconds(eagle_cost_runner(str(head_dir), str(target_dir), 1, "eagle3"), repeats=args.repeats)
    return "eagle3", by_kind, small, step


def main(argv=None) -> int:
    import torch

    from duospec.engine.draft_vocab import read_draft_vocab
    from duospec.training.acceptance import decode_step_seconds, heldout_prompts, measure_lookups, measure_pair

    args = _parse(argv)
    torch.set_num_threads(1)
    step_s = {name: decode_step_seconds(path, repeats=args.repeats, draft=name == "draft")
              for name, path in (("target", args.target), ("draft", args.draft))}
    ratio = step_s["target"] / step_s["draft"]
    print(f"decode step (1 thread, fp32, duospec engine): target {step_s['target'] * 1e3:.3f} ms, "
          f"draft {step_s['draft'] * 1e3:.3f} ms, ratio {ratio:.2f}x")

    target, draft, tokenizer = load_pair(args.target, args.draft)
    draft_ids = read_draft_vocab(args.draft, draft.config.vocab_size)  # a trimmed draft guesses within it
    kinds = prompts_by_kind(tokenizer, args.prompts, args.prompt_tokens)
    if args.demo:
        kinds["demo"] = demo_prompts(tokenizer)
    by_kind = {}
    for kind, prompts in kinds.items():
        started = time.perf_counter()
        lookups = (False, True) if args.context_lookup else (False,)
        by_kind[kind], *looked = measure_lookups(target, draft, prompts, args.new_tokens, args.draft_len, draft_ids,
                                                 lookups)
        stats = by_kind[kind]
        print(f"{kind}: greedy, draft length {args.draft_len}, {len(prompts)} held-out prompts x {args.new_tokens} "
              f"tokens: mean accepted length {stats.mean_accepted_length:.3f} (accepted + 1 per target forward), "
              f"per-token agreement {stats.agreement:.3f}"
              + "".join(f"; with context lookup {s.mean_accepted_length:.3f}, agreement {s.agreement:.3f}"
                        for s in looked)
              + f"  [{time.perf_counter() - started:.0f}s]")
    regression = None
    if not args.no_regression:
        regression = measure_pair(target, draft, heldout_prompts(tokenizer, REGRESSION_SET["prompts"],
                                                                 REGRESSION_SET["prompt_tokens"]),
                                  REGRESSION_SET["new_tokens"], REGRESSION_SET["draft_len"], draft_ids)
        print(f"regression set {REGRESSION_SET}: mean accepted length {regression.mean_accepted_length:.3f}")
    heads = {}
    for head_dir in args.heads:
        method, head_kinds, small, step = measure_head_dir(target, tokenizer, head_dir, args.target, kinds, args)
        heads[method] = {"path": str(head_dir), "mean_accepted_length": round(head_kinds["code"], 4),
                         **({"decode_step_ms": round(step * 1e3, 4)} if step is not None else {}),
                         **{f"{k}_mean_accepted_length": round(v, 4) for k, v in head_kinds.items() if k != "code"},
                         **({"regression_set": round(small, 4)} if small is not None else {})}
        figures = ", ".join(f"{k} {v:.3f} (draft {by_kind[k].mean_accepted_length:.3f})"
                            for k, v in head_kinds.items())
        print(f"{method} head {head_dir}: mean accepted length on the same prompts: {figures}"
              + (f"; regression set {small:.3f}" if small is not None else "")
              + (f"; one draft step {step * 1e3:.3f} ms (1 thread, fp32, duospec engine)" if step is not None else ""))
    if args.record:
        code = by_kind["code"]
        record = {
            "decode_step_ms": {k: round(v * 1e3, 4) for k, v in step_s.items()},
            "cost_ratio": round(ratio, 3),
            "heldout": {"prompts": len(kinds["code"]), "prompt_tokens": args.prompt_tokens,
                        "new_tokens": args.new_tokens, "draft_len": args.draft_len,
                        "mean_accepted_length": round(code.mean_accepted_length, 4),
                        "agreement": round(code.agreement, 4),
                        **{f"{k}_mean_accepted_length": round(v.mean_accepted_length, 4)
                           for k, v in by_kind.items() if k != "code"}},
        }
        if regression is not None:
            record["regression_set"] = {**REGRESSION_SET,
                                        "mean_accepted_length": round(regression.mean_accepted_length, 4)}
        if heads:
            record["heads"] = heads
        args.record.write_text(json.dumps(record, indent=2) + "\n")
        print(f"recorded to {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
