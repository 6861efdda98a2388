"""`duospec train-tiny` (the bundled pair), `duospec distill` (a draft for any Llama-family target),
`duospec train-heads` (an EAGLE or Medusa head for one) and `duospec distill-data` (the target's own
answers to instruction prompts, to train them on)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers) -> None:
    tiny = subparsers.add_parser(
        "train-tiny",
        help="train the bundled tokenizer, target and draft on the Python standard library",
        description="Train the bundled tokenizer, target and draft on this interpreter's standard "
                    "library source. Rerunning the same command resumes from the run directory.",
    )
    tiny.add_argument("--out", type=Path, default=Path("models"), help="writes OUT/target and OUT/draft")
    tiny.add_argument("--run-dir", type=Path, default=Path("runs/tiny"),
                      help="checkpoints, token caches and log.txt (default: runs/tiny)")
    tiny.add_argument("--minutes", type=float, default=75.0,
                      help="total training time; 80%% joint target+draft, 20%% draft-only distillation")
    tiny.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast (fp32 anyway on a CPU "
                                                             "without native bf16)")
    tiny.set_defaults(func=_train_tiny)

    _register_distill(subparsers)
    _register_heads(subparsers)
    _register_answers(subparsers)


def _train_tiny(args: argparse.Namespace) -> int:
    if args.minutes <= 0:
        print(f"duospec train-tiny: --minutes must be positive, got {args.minutes}", file=sys.stderr)
        return 2
    from duospec.training.recipe import TinyRecipe, train_tiny

    recipe = TinyRecipe(joint_minutes=round(args.minutes * 0.8, 3),
                        distill_minutes=round(args.minutes * 0.2, 3), seed=args.seed,
                        threads=args.threads, bf16_autocast=not args.no_bf16)
    try:
        summary = train_tiny(recipe, args.run_dir, args.out)
    except ValueError as err:
        print(f"duospec train-tiny: {err}", file=sys.stderr)
        return 2
    print(f"target: {summary['target_params']:,} params, draft: {summary['draft_params']:,} params; "
          f"written to {args.out}/target and {args.out}/draft")
    return 0


def _register_distill(subparsers) -> None:
    parser = subparsers.add_parser(
        "distill",
        help="distill a small draft model from a Llama-family target",
        description="Distill a draft (LlamaForCausalLM, the target's tokenizer and vocabulary) from a "
                    "Llama/Qwen2/Mistral target on text files. Rerunning with the same --out resumes.",
    )
    parser.add_argument("--target", type=Path, required=True, help="target checkpoint directory")
    parser.add_argument("--data", nargs="+", required=True, metavar="PATH",
                        help="text files, or directories walked recursively for text files (binary files are "
                             "skipped); 'stdlib' = the training split of the Python standard library")
    parser.add_argument("--out", type=Path, required=True, help="draft checkpoint directory to write")
    parser.add_argument("--draft-layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--draft-hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--draft-heads", type=int, default=4,
                        help="attention heads; hidden/heads must be even (default 4)")
    parser.add_argument("--steps", type=int,
                        help="optimizer steps; raising it on a finished run extends it (default 2000 unless --minutes)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto = cuda when available (bf16 autocast there), else cpu")
    parser.add_argument("--init-layers", type=int, metavar="K",
                        help="start from the target's first K layers (+ its final norm and LM head) instead of a "
                             "fresh draft; the shape options do not apply. Serve the result as "
                             "{method: layers, layers: K, path: OUT}")
    # No default here: importing DistillOptions needs numpy, and a client-only install builds this help.
    parser.add_argument("--eval-prompts", type=int,
                        help="held-out prompts per kind (code, chat) for the acceptance figure in OUT/model_card.json "
                             "(0 = none; default 16, DistillOptions.eval_prompts)")
    parser.add_argument("--seed", type=int, default=0, help="draft init and batch order (default 0)")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                        help="continue from OUT's checkpoint if it belongs to the same run (default)")
    trimmed = parser.add_argument_group(
        "trimmed vocabulary (the draft's LM head covers the N tokens the target emits most; trained on the "
        "target's outputs cached once; --data: `duospec distill-data` folders, FOLDER:N for a folder's first N "
        "answers, and/or stdlib)")
    trimmed.add_argument("--draft-vocab", type=int, metavar="N",
                         help="draft vocabulary size, e.g. 16384; with --init at least the init's (a larger N keeps "
                              "the init's tokens and adds those the target emits most in --data)")
    trimmed.add_argument("--init", type=Path, metavar="DIR",
                         help="start from this draft checkpoint (its shape and draft vocabulary): continue a shipped draft")
    trimmed.add_argument("--add-layers", type=int, metavar="K",
                         help="with --init: deepen it by K layers that start as the identity (the deeper draft "
                              "drafts what the init did, then training uses the new capacity)")
    trimmed.add_argument("--mlp-width", type=int, metavar="N",
                         help="with --init: widen each layer's MLP to N units, the new ones starting silent "
                              "(on a CPU, width costs a draft step less per parameter than --add-layers)")
    trimmed.add_argument("--init-share", type=float, metavar="S",
                         help="with --init: write the average of the trained weights and the init's, the init "
                              "holding share S in [0, 1] (default 0: the trained weights). A continuation on new "
                              "data then keeps more of what the init drafted well; rerunning a finished run with "
                              "another S only rewrites the draft")
    trimmed.add_argument("--minutes", type=float, help="minutes of training (with or instead of --steps)")
    trimmed.add_argument("--stdlib-tokens", type=int,
                         help="raw stdlib code tokens each `stdlib` in --data caches; naming it again takes the next "
                              "ones (default 200000, DistillOptions.stdlib_tokens)")
    trimmed.add_argument("--bf16", action="store_true", default=None,
                         help="bf16 autocast on CPU too (fp32 master weights), where the CPU has native bf16 (AVX512-BF16 "
                              "or AMX; elsewhere fp32, said in the log); always on with cuda")
    parser.set_defaults(func=_distill)


def _distill(args: argparse.Namespace) -> int:
    from duospec.training.distill import DistillError, DistillOptions, distill

    try:
        options = DistillOptions.from_args(args)
        if options.draft_vocab is not None:  # the draft model over the target's cached outputs
            from duospec.training.distill_vocab import distill_trimmed

            result = distill_trimmed(options)
        else:
            result = distill(options)
    except DistillError as err:
        print(f"duospec distill: {err}", file=sys.stderr)
        return 2
    print(f"draft written to {result}")
    return 0


def _register_heads(subparsers) -> None:
    from duospec.training.head_options import HeadOptions

    parser = subparsers.add_parser(
        "train-heads",
        help="train an EAGLE or Medusa draft head on a Llama-family target's hidden states",
        description="Train a draft head (EAGLE: one decoder layer over the target's features; Medusa: "
                    "residual heads predicting tokens t+2, t+3, ...) for a frozen target on text files. "
                    "Serve it as {method: eagle|medusa, path: OUT}. Rerunning with the same --out resumes.",
    )
    parser.add_argument("--target", type=Path, required=True, help="target checkpoint directory")
    parser.add_argument("--method", choices=["eagle", "eagle3", "medusa"], required=True)
    parser.add_argument("--data", nargs="+", required=True, metavar="PATH",
                        help="text files or directories; 'stdlib' = the training split of the Python standard "
                             "library (the bundled models' corpus); eagle3: `duospec distill-data` folders "
                             "(FOLDER:N: its first N answers) and/or stdlib")
    parser.add_argument("--out", type=Path, required=True, help="head directory to write")
    budget = parser.add_argument_group("budget (one or both; the first reached ends the run)")
    budget.add_argument("--steps", type=int, help="optimizer steps")
    budget.add_argument("--minutes", type=float, help="minutes of training")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--medusa-heads", type=int, default=4, help="Medusa heads: tokens t+2 .. (default 4)")
    parser.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts for the acceptance figure")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 autocast for the forwards on CPU too (fp32 master weights): about 2x faster "
                             "matmuls on CPUs with AVX512-BF16 or AMX; on others fp32, said in the log (always on with cuda)")
    eagle3 = parser.add_argument_group("eagle3")
    eagle3.add_argument("--draft-vocab", type=int, default=HeadOptions.draft_vocab,
                        help=f"draft vocabulary: the tokens the target emits most (default {HeadOptions.draft_vocab})")
    eagle3.add_argument("--ttt-steps", type=int, default=HeadOptions.ttt_steps,
                        help=f"training-time-test steps (default {HeadOptions.ttt_steps})")
    eagle3.add_argument("--stdlib-tokens", type=int, default=HeadOptions.stdlib_tokens,
                        help="raw stdlib code tokens each `stdlib` in --data caches; naming it again takes the next "
                             f"ones (default {HeadOptions.stdlib_tokens})")
    eagle3.add_argument("--layout", choices=["duospec", "published"], default=HeadOptions.layout,
                        help="published: also write OUT/published in the EAGLE-3 layout vLLM and SGLang load")
    eagle3.add_argument("--init", type=Path, help="start from this eagle3 head's weights (continue a shipped head)")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                        help="continue from OUT's checkpoint if it belongs to the same run (default)")
    parser.set_defaults(func=_train_heads)


def _train_heads(args: argparse.Namespace) -> int:
    from duospec.training.eagle3_run import train_eagle3
    from duospec.training.head_options import HeadOptions, HeadTrainingError
    from duospec.training.heads import train_heads

    options = HeadOptions(target=args.target, method=args.method, data=tuple(str(p) for p in args.data),
                          out=args.out, steps=args.steps, minutes=args.minutes, batch_size=args.batch_size,
                          seq_len=args.seq_len, lr=args.lr, medusa_heads=args.medusa_heads, device=args.device,
                          seed=args.seed, resume=args.resume, eval_prompts=args.eval_prompts, bf16=args.bf16,
                          draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps, stdlib_tokens=args.stdlib_tokens,
                          layout=args.layout, init=args.init)
    try:
        result = (train_eagle3 if options.method == "eagle3" else train_heads)(options)
    except HeadTrainingError as err:
        print(f"duospec train-heads: {err}", file=sys.stderr)
        return 2
    print(f"head written to {result}")
    return 0


def _register_answers(subparsers) -> None:
    from duospec.training.answers import AnswerOptions

    parser = subparsers.add_parser(
        "distill-data",
        help="generate the target's own answers to instruction prompts (self-distillation data)",
        description="Greedy answers of the target (duospec's engine, batched) to chat and coding prompts built "
                    "from the standard library's training split; writes OUT/answers.jsonl and "
                    "OUT/conversations.txt (pass it to distill/train-heads --data). Rerunning continues.",
    )
    parser.add_argument("--target", type=Path, required=True, help="target checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (or continue)")
    parser.add_argument("--count", type=int, default=AnswerOptions.count, help="prompts to answer in all")
    parser.add_argument("--max-new-tokens", type=int, default=AnswerOptions.max_new_tokens,
                        help="longest answer in tokens")
    parser.add_argument("--batch-size", type=int, default=AnswerOptions.batch_size,
                        help="answers generated together")
    parser.add_argument("--kinds", default=",".join(AnswerOptions.kinds),
                        help="which prompts, comma-separated (code: write a function; explain: explain one; chat: "
                             "questions on fixed subjects; open: broader everyday requests); default all, in that order")
    parser.add_argument("--skip-answered", type=Path, nargs="+", default=(), metavar="DIR",
                        help="distill-data folders whose prompts count toward --count but are not answered again: "
                             "OUT then holds only the new answers, a source to append after them in --data (so a "
                             "feature cache built on them extends instead of rebuilding)")
    parser.add_argument("--skip-first", type=int, default=AnswerOptions.skip_first, metavar="N",
                        help="leave the first N of the --count prompts unanswered (answered in a folder not at hand): "
                             "OUT holds answers to prompts N+1 .. --count only")
    parser.set_defaults(func=_distill_data)


def _distill_data(args: argparse.Namespace) -> int:
    from duospec.engine import CheckpointError
    from duospec.training.answers import AnswerOptions, generate_answers

    options = AnswerOptions(count=args.count, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                            kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()),
                            skip_answered=tuple(args.skip_answered), skip_first=args.skip_first)
    try:
        options.validate()
        total = generate_answers(args.target, args.out, options,
                                 log=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, CheckpointError) as err:
        print(f"duospec distill-data: {err}", file=sys.stderr)
        return 2
    print(f"{total} answers in {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run these sub-commands without the rest of the CLI (`python -m duospec.cli.train ...`), so a
    long training run does not depend on unrelated command modules importing cleanly."""
    parser = argparse.ArgumentParser(prog="python -m duospec.cli.train")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
