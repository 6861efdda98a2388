"""Does a decode step cost more when the KV cache is sized for longer sequences? (issue 18)

    .venv/bin/python benchmarks/kv_context.py                       # 1,024 vs 8,192 positions
    .venv/bin/python benchmarks/kv_context.py --max-model-len 1024 32768 --live 256

Two engines with the same random Llama weights, one sized for each `--max-model-len`, run the same
steps at the same live lengths, interleaved (so drift on a noisy machine hits both alike): decode
(k = 1) and verify (k = 4) steps for 1, 4 and 8 sequences, in consecutive slots (the batch reads
views of the cache) and in scattered slots (it gathers the positions in use). Prints the median step
time of each and the ratio to the smallest size; a cache that is read in proportion to what is used
gives ratios near 1.00.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-model-len", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--live", type=int, default=256, help="positions each sequence holds before a step")
    p.add_argument("--slots", type=int, default=16, help="KV slots per engine")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--device", default="cpu")
    return p.parse_args()


def build(out: pathlib.Path, args: argparse.Namespace) -> pathlib.Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=6, num_key_value_heads=2, intermediate_size=1024,
                         max_position_embeddings=max(args.max_model_len))
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def main() -> None:
    from duospec.engine import SlotChunk, load_model

    args = parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(pathlib.Path(tmp) / "llama", args)
        engines = {n: load_model(path, max_slots=args.slots, max_context=n, device=args.device)
                   for n in args.max_model_len}
    for engine in engines.values():
        slots = [engine.allocate_slot() for _ in range(args.slots)]
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(3, 4000, (args.live,), generator=gen).tolist()
        for slot in slots:  # every slot holds `live` positions
            engine.forward([SlotChunk(slot, 0, prompt)])
    print(f"decode/verify step, {args.layers} layers, hidden {args.hidden}, {args.live} live positions per "
          f"sequence, {args.slots} slots, device {args.device}; median of {args.repeats} (ms)")
    header = "| sequences | slots | tokens | " + " | ".join(f"{n:,} positions" for n in args.max_model_len)
    print(header + " | " + " | ".join(f"ratio {n:,}/{args.max_model_len[0]:,}" for n in args.max_model_len[1:]) + " |")
    print("|" + "---|" * (3 + 2 * len(args.max_model_len) - 1))
    for batch in (1, 4, 8):
        for layout, slots in (("consecutive", list(range(batch))), ("scattered", list(range(0, 2 * batch, 2)))):
            if layout == "scattered" and batch == 1:
                continue
            for tokens in (1, 4):
                times = {n: [] for n in engines}
                for _ in range(args.repeats):
                    for n, engine in engines.items():
                        chunks = [SlotChunk(s, args.live, [7] * tokens) for s in slots]
                        t0 = time.perf_counter()
                        if tokens == 1:
                            engine.forward_last(chunks)
                        else:
                            engine.forward(chunks)
                        if args.device != "cpu":
                            torch.cuda.synchronize()
                        times[n].append(time.perf_counter() - t0)
                        for s in slots:
                            engine.truncate(s, args.live)
                medians = {n: statistics.median(t) * 1e3 for n, t in times.items()}
                base = medians[args.max_model_len[0]]
                print(f"| {batch} | {layout} | {tokens} | " + " | ".join(f"{m:.3f}" for m in medians.values())
                      + " | " + " | ".join(f"{medians[n] / base:.2f}" for n in args.max_model_len[1:]) + " |")


if __name__ == "__main__":
    main()
