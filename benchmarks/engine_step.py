"""Micro-benchmark: one decode/verify step of duospec's engine vs the transformers forward with its
KV cache, same weights, one torch thread.

    .venv/bin/python benchmarks/engine_step.py                 # random Llama, hidden 384, 6 layers
    .venv/bin/python benchmarks/engine_step.py --model models/target --context 128

Each step feeds k tokens (k = 1: drafting, only the last logits; k = 4: verifying, all logits) on top
of a prefilled context of --context tokens, then rolls back so every step sees the same context.
Only the forward is timed (the engine's rollback is an integer; transformers' crop is not counted).
Rows with --batch > 1 run that many sequences: the engine in one ragged forward, transformers one
sequence per forward (as the fallback does).
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import statistics
import tempfile
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=pathlib.Path, help="checkpoint dir (default: a random Llama built here)")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--context", type=int, default=256, help="prefilled positions before each step")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="tokens per step")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="sequences per step")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    return p.parse_args()


def random_llama(out: pathlib.Path, args: argparse.Namespace) -> pathlib.Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         intermediate_size=args.intermediate, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def median_ms(step, reset, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        step()
        elapsed = time.perf_counter() - t0
        reset()
        if i >= warmup:
            times.append(elapsed)
    return 1e3 * statistics.median(times)


def bench_engine(path, prompts: torch.Tensor, k: int, args) -> float:
    from duospec.engine import SlotChunk, load_model

    runner = load_model(path, max_slots=len(prompts), max_context=args.context + k, backend="lean")
    slots = [runner.allocate_slot() for _ in prompts]
    runner.forward_last([SlotChunk(s, 0, p.tolist()) for s, p in zip(slots, prompts)])
    step_chunks = [SlotChunk(s, args.context, list(range(3, 3 + k))) for s in slots]

    def step():
        if k == 1:
            runner.forward_last(step_chunks)
        else:
            runner.forward(step_chunks)

    def reset():
        for s in slots:
            runner.truncate(s, args.context)

    return median_ms(step, reset, args.repeats, args.warmup)


def bench_transformers(model, prompts: torch.Tensor, k: int, args) -> float:
    # transformers 5 calls the KV cache `cache`; 4.x `past_key_values`.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    caches = []
    with torch.inference_mode():
        for p in prompts:
            out = model(input_ids=p[None], use_cache=True)
            caches.append(out.cache if getattr(out, "cache", None) is not None else out.past_key_values)
    step_ids = torch.arange(3, 3 + k)[None]

    def step():
        with torch.inference_mode():
            for cache in caches:
                logits = model(input_ids=step_ids, use_cache=True, **{cache_arg: cache}).logits
                logits[0, -1 if k == 1 else slice(None)].float()

    def reset():
        for cache in caches:
            cache.crop(-k)

    return median_ms(step, reset, args.repeats, args.warmup)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or random_llama(pathlib.Path(tmp) / "llama", args)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cfg = model.config
        print(f"model: {path if args.model else 'random llama'} hidden={cfg.hidden_size} "
              f"layers={cfg.num_hidden_layers} heads={cfg.num_attention_heads}/{cfg.num_key_value_heads} "
              f"vocab={cfg.vocab_size}; context={args.context}; fp32, 1 thread, median of {args.repeats}")
        print(f"{'batch':>5} {'tokens':>6} {'engine ms':>10} {'hf ms':>9} {'hf/engine':>9}")
        gen = torch.Generator().manual_seed(0)
        for batch in args.batch:
            prompts = torch.randint(3, cfg.vocab_size, (batch, args.context), generator=gen)
            for k in args.tokens:
                ours = bench_engine(path, prompts, k, args)
                theirs = bench_transformers(model, prompts, k, args)
                print(f"{batch:>5} {k:>6} {ours:>10.2f} {theirs:>9.2f} {theirs / ours:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
