"""`duospec bench --simulate`: the pipeline timed as if the draft and the target each had a device.

On a small CPU machine the draft actor, the target actor and the coordinator compete for the same few
cores, so pearl's premise (two devices working at once) is not there to measure. The simulation keeps
everything real except the model arithmetic:

1. record the real pair's greedy choices on the benchmark prompts (the target's greedy path, and the
   draft's continuation after every prefix of it) — so acceptance is exactly the trained pair's;
2. measure what one forward costs (one torch thread, this machine) as a function of the batch's
   tokens, on the models the scenario names (``SCENARIOS``): `devices` the real pair itself;
   `large-target` a random-weight target of ``LARGE_TARGET`` size with the real draft; `large-pair`
   random-weight models of ``LARGE_TARGET`` and ``LARGE_DRAFT`` size;
3. write two replay checkpoints (duospec/engine/replay.py) and run the bench on them: every actor,
   gRPC stream, scheduler decision and verify rule runs; a forward sleeps for its measured cost.

With ``acceptance=α`` the draft's recorded choices are replaced by a synthetic drafter that agrees
with the target's greedy token with probability α at every position, independently (the textbook
model of speculative decoding): it shows what the pipeline does with a better-matched pair.

Reports built this way say so in their title and setup (``setup.simulation``).
"""

from __future__ import annotations

import logging
import pathlib
import shutil
import statistics
import time
from collections.abc import Sequence

from duospec.draft_worker.proposer import DraftSpec
from duospec.engine.replay import CostModel, ReplayEntry, write_replay_table

log = logging.getLogger(__name__)

SCENARIOS = ("devices", "large-target", "large-pair")
# Points of the cost curve: decode-sized batches densely, prefill sizes sparsely.
COST_TOKEN_POINTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64, 128, 256)
COST_BATCH_POINTS = (2, 4, 8)
COST_CONTEXT = 128  # positions already cached when a decode-sized chunk is timed
# Random-weight stand-ins whose forward times the large-* scenarios use: same vocabulary as the pair,
# Llama layout. ~91 M parameters (GPT-2-small-like) and ~14 M.
LARGE_TARGET = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
                "num_key_value_heads": 12, "head_dim": 64}
LARGE_DRAFT = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6,
               "num_key_value_heads": 6, "head_dim": 64}
# Files a replay checkpoint copies from the real one (everything but the weights).
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")


def table_depth(max_draft_tokens: int, max_lookahead: int, gamma: int = 0) -> int:
    """How many draft tokens past the last committed one the table records: the drafter never runs
    further ahead than pearl's lookahead (coordinator/scheduling/policies.py), plus the drafts of a verify in
    flight (pearl's cap), nor than vanilla's γ; margin for the rest."""
    from duospec.coordinator.api import SpeculationMode
    from duospec.coordinator.scheduling.policies import SpeculationPolicy

    lookahead = SpeculationPolicy(SpeculationMode.PEARL, max_draft_tokens, max_lookahead).lookahead()
    return max(lookahead + max_draft_tokens, gamma) + 4


def record_tables(target_dir: str, draft_dir: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  depth: int, progress: bool = True, draft_method: str = "model") -> list[ReplayEntry]:
    """The target's greedy continuation of every prompt (max_new_tokens + depth tokens) and the draft's
    greedy continuation (depth tokens) after every prefix of it; one batched forward per step.
    `draft_method` "eagle": `draft_dir` is an EAGLE head, recorded by duospec/bench/simulate_heads.py."""
    import torch
    from tqdm import tqdm

    from duospec.engine import SlotChunk, load_model

    n_greedy = max_new_tokens + depth
    longest = max(len(p) for p in prompts) + n_greedy + depth + 1
    greedy: list[list[int]] = []
    target = load_model(target_dir, dtype=torch.float32, max_slots=len(prompts), max_context=longest)
    with torch.inference_mode():
        slots = [target.allocate_slot() for _ in prompts]
        seqs = [list(p) for p in prompts]
        fed = [0] * len(prompts)
        for _ in range(n_greedy):
            logits = target.forward_last([SlotChunk(s, f, q[f:]) for s, f, q in zip(slots, fed, seqs)])
            for i, token in enumerate(logits.argmax(-1).tolist()):
                fed[i] = len(seqs[i])
                seqs[i].append(token)
        greedy = [q[len(p):] for q, p in zip(seqs, prompts)]
        del target
        if draft_method == "eagle":
            from duospec.bench.simulate_heads import record_head_continuations

            drafts, seconds = record_head_continuations(target_dir, draft_dir, prompts, greedy, depth, progress)
            return [ReplayEntry(tuple(p), tuple(g), tuple(d), tuple(s))
                    for p, g, d, s in zip(prompts, greedy, drafts, seconds)]

        draft = load_model(draft_dir, dtype=torch.float32, max_slots=len(prompts), max_context=longest, drafter=True,
                           float16_products=DraftSpec.float16_products)
        slots = [draft.allocate_slot() for _ in prompts]
        drafts: list[list[tuple[int, ...]]] = [[] for _ in prompts]
        seconds: list[list[int]] = [[] for _ in prompts]
        fed = [0] * len(prompts)
        for j in tqdm(range(n_greedy + 1), desc="recording draft continuations", disable=not progress, leave=False):
            prefixes = [list(p) + g[:j] for p, g in zip(prompts, greedy)]
            chunks = [SlotChunk(s, f, x[f:]) for s, f, x in zip(slots, fed, prefixes)]
            fed = [len(x) for x in prefixes]  # the next prefix extends this one
            continuation: list[list[int]] = [[] for _ in prompts]
            for k in range(depth):
                logits = draft.forward_last(chunks)
                tokens = logits.argmax(-1).tolist()
                if k == 0:  # the second choice where a hedge can be hit: right after accepted tokens
                    for i, top in enumerate(torch.topk(logits, 2, dim=-1).indices.tolist()):
                        seconds[i].append(top[1] if top[0] == tokens[i] else top[0])
                for i, token in enumerate(tokens):
                    continuation[i].append(token)
                chunks = [SlotChunk(s, len(x) + k, [t]) for s, x, t in zip(slots, prefixes, tokens)]
            for i, c in enumerate(continuation):
                drafts[i].append(tuple(c))
    return [ReplayEntry(tuple(p), tuple(g), tuple(d), tuple(s)) for p, g, d, s in zip(prompts, greedy, drafts, seconds)]


def second_choice_hit_rate(entries: Sequence[ReplayEntry]) -> float | None:
    """Of the positions where the draft's first choice is not the target's token, the share where its
    second choice is: how often a hedge on the draft's next-best token can be hit."""
    wrong = hits = 0
    for e in entries:
        for j, target_token in enumerate(e.greedy):
            if j < len(e.drafts) and j < len(e.seconds) and e.drafts[j] and e.drafts[j][0] != target_token:
                wrong += 1
                hits += e.seconds[j] == target_token
    return hits / wrong if wrong else None


def synthetic_drafts(entries: Sequence[ReplayEntry], acceptance: float, depth: int, vocab_size: int,
                     seed: int = 0, second_hit_rate: float = 0.0) -> list[ReplayEntry]:
    """The same entries with a drafter that proposes greedy[j] with probability `acceptance` at each
    position j, else another token; after a wrong token it keeps proposing wrong ones (never used).
    Where it is wrong, its second choice is greedy[j] with probability `second_hit_rate` (pass the
    real pair's `second_choice_hit_rate`), else yet another token."""
    import random

    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"--acceptance {acceptance}: must be in [0, 1]")
    rng = random.Random(seed)
    out = []
    for entry in entries:
        greedy = entry.greedy
        agrees = [rng.random() < acceptance for _ in greedy]
        wrong = [(g + 1 + rng.randrange(vocab_size - 1)) % vocab_size for g in greedy]  # never == g
        drafts: list[tuple[int, ...]] = [()] * (len(greedy) + 1)
        drafts[len(greedy)] = tuple(wrong[-1:] * depth)
        for j in range(len(greedy) - 1, -1, -1):  # drafts[j] continues drafts[j + 1] while it agrees
            drafts[j] = ((greedy[j],) + drafts[j + 1])[:depth] if agrees[j] else (wrong[j],) * depth
        seconds = []
        for j, target_token in enumerate(greedy):
            other = (wrong[j] + 1) % vocab_size  # neither the first choice nor the target's token
            other = (other + 1) % vocab_size if other == target_token else other
            seconds.append(wrong[j] if agrees[j] else target_token if rng.random() < second_hit_rate else other)
        out.append(ReplayEntry(entry.prompt, greedy, tuple(drafts), tuple(seconds)))
    return out


def measure_costs(runner, *, last_only: bool, source: str, repeats: int = 7, passes: int = 3) -> CostModel:
    """Seconds of one forward of `runner` by the batch's tokens, and per extra sequence.

    Each point is the median of `repeats` forwards; the whole curve is measured `passes` times and
    each point keeps its lowest median, so a burst of other work on the machine (a Ray cluster still
    shutting down, say) does not end up in the model's cost."""
    import torch

    from duospec.engine import SlotChunk

    run = runner.forward_last if last_only else runner.forward
    slots = [runner.allocate_slot() for _ in range(max(COST_BATCH_POINTS))]
    with torch.inference_mode():
        for slot in slots:  # every slot holds COST_CONTEXT positions of context
            run([SlotChunk(slot, 0, [1] * COST_CONTEXT)])

        def timed(chunks) -> float:
            times = []
            for _ in range(repeats + 1):
                started = time.perf_counter()
                run(chunks)
                times.append(time.perf_counter() - started)
            return statistics.median(times[1:])  # the first run warms caches

        def curve() -> list[float]:
            points = [timed([SlotChunk(slots[0], COST_CONTEXT, [1] * n)]) for n in COST_TOKEN_POINTS]
            for b in COST_BATCH_POINTS:
                points.append(timed([SlotChunk(s, COST_CONTEXT, [1]) for s in slots[:b]]))
            return points

        best = [min(values) for values in zip(*(curve() for _ in range(passes)))]
    for slot in slots:
        runner.free_slot(slot)
    seconds = best[: len(COST_TOKEN_POINTS)]
    by_tokens = dict(zip(COST_TOKEN_POINTS, seconds))
    # b sequences of one token vs one sequence of b tokens: the cost of each extra sequence.
    extra = [max(0.0, (batched - by_tokens[b]) / (b - 1))
             for b, batched in zip(COST_BATCH_POINTS, best[len(COST_TOKEN_POINTS):])]
    return CostModel(COST_TOKEN_POINTS, tuple(seconds), statistics.median(extra), source)


def _random_runner(vocab_size: int, layout: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from duospec.engine.llama import LeanLlamaRunner

    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=1024, tie_word_embeddings=False, **layout)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())
    runner = LeanLlamaRunner(config, model.state_dict(), device=torch.device("cpu"), dtype=torch.float32,
                             max_slots=max(COST_BATCH_POINTS), max_context=1024)
    return runner, params


def write_replay_checkpoint(directory: pathlib.Path, source_dir: str, role: str, cost: CostModel,
                            entries: Sequence[ReplayEntry]) -> pathlib.Path:
    """A replay checkpoint of `source_dir`: its config and tokenizer files, and the replay table."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        if (pathlib.Path(source_dir) / name).is_file():
            shutil.copy(pathlib.Path(source_dir) / name, directory / name)
    write_replay_table(directory, role, cost, entries)
    return directory


def build_replay_pair(out_dir: pathlib.Path, target_dir: str, draft_dir: str, prompts: Sequence[Sequence[int]], *,
                      scenario: str, max_new_tokens: int, max_draft_tokens: int, gamma: int, max_lookahead: int,
                      acceptance: float | None = None, progress: bool = True,
                      draft_method: str = "model") -> tuple[pathlib.Path, pathlib.Path, dict]:
    """Writes out_dir/target and out_dir/draft (replay checkpoints); returns them and a description.
    `draft_method` "eagle": the draft's choices and forward costs are an EAGLE head's (`draft_dir`)."""
    import torch

    from duospec.engine import load_model

    if scenario not in SCENARIOS:
        raise ValueError(f"--simulate {scenario!r}: choose from {', '.join(SCENARIOS)}")
    from transformers import AutoConfig

    from duospec.engine import load_tokenizer
    from duospec.engine.replay import check_prompts_distinct

    check_prompts_distinct(prompts)  # before minutes of recording, not when the actors load the tables
    vocab_size = AutoConfig.from_pretrained(target_dir).vocab_size
    # Synthetic draft ids must be ids both models and the tokenizer have.
    head = draft_method == "eagle"
    if head and scenario != "devices":
        raise ValueError(f"--simulate {scenario} with an EAGLE head: only `devices` (the real pair's costs) is simulated")
    draft_files = target_dir if head else draft_dir  # a head has the target's tokenizer and no config of its own
    synthetic_vocab = min(vocab_size, AutoConfig.from_pretrained(draft_files).vocab_size, len(load_tokenizer(target_dir)))
    depth = table_depth(max_draft_tokens, max_lookahead, gamma)
    entries = record_tables(target_dir, draft_dir, prompts, max_new_tokens, depth, progress, draft_method)
    second_hits = second_choice_hit_rate(entries)
    if acceptance is not None:
        entries = synthetic_drafts(entries, acceptance, depth, synthetic_vocab, second_hit_rate=second_hits or 0.0)
    layouts = {"devices": (None, None), "large-target": (LARGE_TARGET, None),
               "large-pair": (LARGE_TARGET, LARGE_DRAFT)}[scenario]
    costs, labels = [], []
    for role, path, layout in zip(("target", "draft"), (target_dir, draft_dir), layouts):
        if layout is None and head and role == "draft":
            from duospec.bench.simulate_heads import eagle_cost_runner

            runner = eagle_cost_runner(path, target_dir, max(COST_BATCH_POINTS))
            source = f"the real EAGLE head's ({path}; its inputs' features are zeros)"
        elif layout is None:
            runner = load_model(path, dtype=torch.float32, max_slots=max(COST_BATCH_POINTS), drafter=role == "draft",
                                float16_products=DraftSpec.float16_products)
            source = f"the real {role}'s ({path})"
        else:
            runner, params = _random_runner(vocab_size, layout)
            source = f"a {params / 1e6:.0f} M-parameter random-weight Llama's ({layout})"
        costs.append(measure_costs(runner, last_only=role == "draft",
                                   source=f"measured: {source}, float32, 1 torch thread"))
        labels.append(f"{role}: {source} forward time")
        del runner
    target_cost, draft_cost = costs
    paths = [write_replay_checkpoint(out_dir / role, source, role, cost, entries)
             for role, source, cost in (("target", target_dir, target_cost), ("draft", draft_files, draft_cost))]
    description = {
        "scenario": scenario,
        "what": (f"SIMULATED devices: tokens are the real pair's greedy choices (replayed)"
                 + (", the draft's being an EAGLE head's (on the target's features up to each prefix, its own "
                    "after; the features' transfer is not simulated, see benchmarks/head_features.py)" if head else "")
                 + (f", except the draft's: a synthetic drafter that agrees with the target with probability "
                    f"{acceptance} per token" if acceptance is not None else "")
                 + f"; every forward sleeps for its measured cost instead of computing — {'; '.join(labels)}. "
                 f"Actors, gRPC streams, coordinator and verify rule run for real."),
        "acceptance": acceptance,
        "target_cost": target_cost.to_json(),
        "draft_cost": draft_cost.to_json(),
        "cost_ratio_1_token": round(target_cost.seconds_for(1) / draft_cost.seconds_for(1), 2),
        "table_depth": depth,
        # the real draft's second choice is the target's token at this share of its first-choice misses
        # (what a hedge can hit; the synthetic drafter of --acceptance uses the same share)
        "second_choice_hit_rate": second_hits,
    }
    return paths[0], paths[1], description
