"""The paged KV cache, measured against the slot cache it replaced (issue 35). Three scenarios:

    python benchmarks/kv_paged.py capacity   # 256-token sequences held at once in one fixed KV budget
    python benchmarks/kv_paged.py ttft       # time to first token of a second request sharing a
                                             # 1,500-token system prompt (prefix cache), in-process
    python benchmarks/kv_paged.py decode     # decode tokens/s of pearl, 1 and 8 streams, blocks vs slots
    python benchmarks/kv_paged.py step       # one target forward (decode, verify), blocks vs slots

capacity: the bundled target (2,048 positions) and a tiny random Llama whose context is 32,768, each
given the memory of 16 (bundled) or 4 (32k) slots of its full context; sequences of 256 positions
are opened and prefilled until the pool is full. A slot cache holds exactly those 16 or 4.

ttft: the bundled pair on an in-process coordinator (the scheduler, both workers, chunked prefill
of 512 tokens per round), greedy pearl, prefix cache per tenant (the default). Per trial a fresh
1,500-token system prompt (the standard library's argparse.py): the first request with it and a 50-token
question, then a second with another question. Prints median TTFTs, their ratio, and the prompt positions each
worker read from its cache.

decode: the same in-process pipeline on the bundled pair and the bench's prompts (64 new tokens,
greedy, `--mode`, pearl by default), the target and draft runners either the slot cache of `--slots-commit` (loaded from
git; the last commit before blocks) or the paged cache — both in its default layout (a pool the size
of the slot cache: each sequence's blocks in order, read as views) and scattered (a pool a third
that size, so sequences page and every read gathers). Prefix caching is off (the same prompts run
again). Rounds interleave the variants; medians of tokens/s. The whole pipeline adapts to timing
(patience, the goodput guard), so on a busy machine these figures move by tens of percent.

step: the bundled target's forward alone, same three variants, 300 positions per sequence (grown
together, 20 at a time), decode (1 token) and verify (4 tokens) steps for 1 and 8 sequences,
interleaved; median milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
TARGET, DRAFT = REPO / "models" / "target", REPO / "models" / "draft"
SLOTS_COMMIT = "eb6df8f"  # the last commit with one slot per sequence (87a0fda introduced blocks)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=("capacity", "ttft", "decode", "step"))
    p.add_argument("--trials", type=int, default=3, help="ttft: system prompts; decode: rounds per variant")
    p.add_argument("--slots-commit", default=SLOTS_COMMIT)
    p.add_argument("--prompts", type=int, default=8, help="decode: requests per round")
    p.add_argument("--mode", default="pearl", choices=("pearl", "vanilla", "off"), help="decode: speculation mode")
    return p.parse_args()


def _tokens(n: int, seed: int, vocab: int = 4000) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- capacity ------------------------------------------------------------------------------------

def _position_bytes(path: pathlib.Path) -> int:
    """KV bytes of one position over all layers (float32 keys and values)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4


def _held_at_once(path: pathlib.Path, context: int, slots: int, length: int = 256) -> tuple[int, int]:
    """(sequences a slot cache of `slots` x `context` holds, `length`-position sequences the paged pool
    with the same memory holds)."""
    from duospec.engine import BlocksExhausted, SlotChunk, load_model
    from duospec.engine.loader import KVOptions

    runner = load_model(path, dtype="float32", max_slots=4096, max_context=context,
                        kv=KVOptions(kv_cache_memory_bytes=slots * context * _position_bytes(path)))
    held = 0
    while True:
        slot = runner.allocate_slot()
        try:
            runner.forward_last([SlotChunk(slot, 0, _tokens(length, held, runner.vocab_size - 10))])
        except BlocksExhausted:
            return slots, held
        held += 1


def capacity() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        long_model = pathlib.Path(tmp) / "llama-32k"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128,
                                     max_position_embeddings=32768)).save_pretrained(long_model)
        rows = [("bundled target", 2048, *_held_at_once(TARGET, 2048, 16)),
                ("tiny Llama, 32k context", 32768, *_held_at_once(long_model, 32768, 4))]
    print("| model | max_model_len | KV budget | slot cache: sequences | paged: 256-position sequences | ratio |")
    print("|---|---|---|---|---|---|")
    for name, context, slots, held in rows:
        print(f"| {name} | {context:,} | {slots} x {context:,} positions | {slots} | {held} | {held / slots:.1f}x |")


# ---- time to first token -------------------------------------------------------------------------

async def _ttft(coordinator, prompt: list[int], request_id: str) -> float:
    from duospec.coordinator.api import GenerationRequest, SpeculationMode, TokensEvent

    started = time.perf_counter()
    request = GenerationRequest(request_id, tuple(prompt), 8, mode=SpeculationMode.PEARL, model="m", ignore_eos=True)
    first = None
    async for event in coordinator.generate(request):
        if isinstance(event, TokensEvent) and first is None:
            first = time.perf_counter() - started
    return first


def _text_tokens() -> list[int]:
    """Python source from the standard library (what the bundled pair was trained on), tokenized: real
    text keeps the drafter's guesses good enough for the goodput guard to keep speculating."""
    import argparse as source

    from duospec.engine import load_tokenizer

    return load_tokenizer(TARGET)(pathlib.Path(source.__file__).read_text())["input_ids"]


async def _ttft_trials(trials: int) -> None:
    from duospec.coordinator.config import ModelConfig
    from duospec.coordinator.local import LocalCoordinator

    text = _text_tokens()
    coordinator = LocalCoordinator([ModelConfig(name="m", target=str(TARGET), draft=str(DRAFT), device="cpu")])
    try:
        await _ttft(coordinator, text[-20:], "warm-up")
        scheduler = await coordinator.entries["m"].get_scheduler()
        target, draft = (link.verifier.runner if i == 0 else link.loop.drafter.proposer.runner
                         for i, link in enumerate(scheduler.workers))
        firsts, seconds = [], []
        for trial in range(trials):
            at = 1600 * trial  # a system prompt of its own per trial, then two questions
            system, questions = text[at: at + 1500], (text[at + 1500: at + 1550], text[at + 1550: at + 1600])
            before = (target.cache_stats().hits, draft.cache_stats().hits)
            firsts.append(await _ttft(coordinator, system + questions[0], f"first-{trial}"))
            middle = (target.cache_stats().hits, draft.cache_stats().hits)
            seconds.append(await _ttft(coordinator, system + questions[1], f"second-{trial}"))
            after = (target.cache_stats().hits, draft.cache_stats().hits)
            print(f"trial {trial}: first {firsts[-1] * 1e3:.0f} ms (cached: target {middle[0] - before[0]}, "
                  f"draft {middle[1] - before[1]}), second {seconds[-1] * 1e3:.0f} ms (cached: target "
                  f"{after[0] - middle[0]}, draft {after[1] - middle[1]} of 1,550 prompt positions); speculating: "
                  f"{scheduler.guard.speculating}")
        first, second = statistics.median(firsts), statistics.median(seconds)
        print(f"median TTFT: first {first * 1e3:.0f} ms, second {second * 1e3:.0f} ms, ratio {second / first:.2f}")
    finally:
        await coordinator.close()


# ---- decode speed --------------------------------------------------------------------------------

def _slot_runner_class(commit: str):
    """The lean runner as of `commit` (its llama.py, imported under another name)."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:duospec/engine/llama.py"],
                            check=True, capture_output=True, text=True).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "slot_llama.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("slot_llama", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["slot_llama"] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module.LeanLlamaRunner


def _runners(variant: str, slot_class, slots: int = 16, context: int = 2048):
    from transformers import AutoModelForCausalLM

    from duospec.engine import load_model
    from duospec.engine.loader import KVOptions

    out = []
    for path in (TARGET, DRAFT):
        if variant == "slots":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            out.append(slot_class(model.config, model.state_dict(), device=torch.device("cpu"), dtype=torch.float32,
                                  max_slots=slots, max_context=context))
            continue
        runner = load_model(path, dtype="float32", max_slots=slots, max_context=context,
                            kv=KVOptions(prefix_caching=False))
        if variant == "blocks, scattered":
            budget = slots * context * _position_bytes(path) // 3
            runner = load_model(path, dtype="float32", max_slots=slots, max_context=context,
                                kv=KVOptions(prefix_caching=False, kv_cache_memory_bytes=budget))
        out.append(runner)
    return tuple(out)


async def _decode_round(coordinator, prompts, streams: int, tag: str, mode: str) -> float:
    from duospec.coordinator.api import GenerationRequest, SpeculationMode, TokensEvent

    async def one(i: int, prompt) -> int:
        request = GenerationRequest(f"{tag}-{i}", tuple(prompt), 64, mode=SpeculationMode(mode), model="m",
                                    ignore_eos=True)
        return sum([len(e.token_ids) async for e in coordinator.generate(request) if isinstance(e, TokensEvent)])

    started = time.perf_counter()
    produced = 0
    for first in range(0, len(prompts), streams):
        produced += sum(await asyncio.gather(*(one(first + i, p) for i, p in enumerate(prompts[first:first + streams]))))
    return produced / (time.perf_counter() - started)


async def _decode(trials: int, n_prompts: int, commit: str, mode: str) -> None:
    from duospec.bench.prompts import load_prompts
    from duospec.coordinator.config import ModelConfig
    from duospec.coordinator.local import LocalCoordinator
    from duospec.engine import load_tokenizer

    tokenizer = load_tokenizer(TARGET)
    prompts = [tokenizer(p.text)["input_ids"][:256] for p in load_prompts(limit=n_prompts)]
    slot_class = _slot_runner_class(commit)
    variants = ("slots", "blocks", "blocks, scattered")
    config = ModelConfig(name="m", target=str(TARGET), draft=str(DRAFT), device="cpu", dtype="float32")
    coordinators = {v: LocalCoordinator([config], runners={"m": _runners(v, slot_class)}) for v in variants}
    rates = {(v, s): [] for v in variants for s in (1, 8)}
    try:
        for coordinator in coordinators.values():
            await _decode_round(coordinator, prompts[:2], 2, "warm-up", mode)
        for trial in range(trials):
            for streams in (1, 8):
                for variant, coordinator in coordinators.items():
                    rates[variant, streams].append(await _decode_round(coordinator, prompts, streams, f"t{trial}", mode))
    finally:
        for coordinator in coordinators.values():
            await coordinator.close()
    print(f"{mode}, greedy, {len(prompts)} bench prompts x 64 new tokens, bundled pair in-process; median of "
          f"{trials} interleaved rounds (tokens/s); slots = the runner of {commit}")
    print("| streams | " + " | ".join(variants) + " | blocks / slots | scattered / slots |")
    print("|---|" + "---|" * (len(variants) + 2))
    for streams in (1, 8):
        med = [statistics.median(rates[v, streams]) for v in variants]
        print(f"| {streams} | " + " | ".join(f"{m:.1f}" for m in med) + f" | {med[1] / med[0]:.3f} | {med[2] / med[0]:.3f} |")


def _step(repeats: int, commit: str, live: int = 300) -> None:
    from duospec.engine import SlotChunk

    variants = ("slots", "blocks", "blocks, scattered")
    slot_class = _slot_runner_class(commit)
    runners = {v: _runners(v, slot_class)[0] for v in variants}
    for runner in runners.values():
        slots = [runner.allocate_slot() for _ in range(16)]
        for pos in range(0, live, 20):  # grown together: a paged pool interleaves their blocks
            runner.forward([SlotChunk(s, pos, _tokens(20, pos)) for s in slots])
    print(f"bundled target, one forward at {live} positions per sequence, median of {repeats} (ms)")
    print("| sequences | tokens | " + " | ".join(variants) + " | blocks / slots | scattered / slots |")
    print("|---|---|" + "---|" * (len(variants) + 2))
    for batch in (1, 8):
        for tokens in (1, 4):
            times = {v: [] for v in variants}
            for _ in range(repeats):
                for variant, runner in runners.items():
                    chunks = [SlotChunk(s, live, [7] * tokens) for s in range(batch)]
                    started = time.perf_counter()
                    runner.forward_last(chunks) if tokens == 1 else runner.forward(chunks)
                    times[variant].append(time.perf_counter() - started)
                    for s in range(batch):
                        runner.truncate(s, live)
            med = [statistics.median(times[v]) * 1e3 for v in variants]
            print(f"| {batch} | {tokens} | " + " | ".join(f"{m:.2f}" for m in med)
                  + f" | {med[1] / med[0]:.3f} | {med[2] / med[0]:.3f} |")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    if args.scenario == "capacity":
        capacity()
    elif args.scenario == "ttft":
        asyncio.run(_ttft_trials(args.trials))
    elif args.scenario == "step":
        _step(20 * args.trials, args.slots_commit)
    else:
        asyncio.run(_decode(args.trials, args.prompts, args.slots_commit, args.mode))


if __name__ == "__main__":
    main()
