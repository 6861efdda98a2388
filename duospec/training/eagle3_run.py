"""`duospec train-heads --method eagle3`: cache the target's features, choose the draft vocabulary,
train with the training-time test (duospec/training/eagle3.py), measure, write the head.

`--data`: folders written by `duospec distill-data` (the target's own answers) and/or `stdlib`
(raw code windows of the standard library's training split, `--stdlib-tokens` of them). Layout of
`--out`: the head (duospec's layout, or the published one with `--layout published`) and
`.train-heads/` with `run.json`, `features/` (the cache, duospec/training/features.py),
`checkpoint.pt` and `log.txt`. Rerunning the same command resumes to the step; `--init DIR` starts
from a written head's weights instead of the target-derived initialisation (how a later run continues
from a shipped head).

The card's acceptance is exact: greedy, draft length 4, on the engine (the lean target sending the
three layers' features, the head's runner drafting from them and then from its own outputs, as the
drafter does), on held-out prompts by kind (code: held-out stdlib files; chat: held-out instructions).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from duospec.training.data import STDLIB


@torch.no_grad()
def measure_eagle3(target_runner, head_runner, prompts: list[list[int]], new_tokens: int,
                   draft_len: int = 4) -> tuple[float, int]:
    """(mean accepted length, rounds): greedy rounds simulated exactly on the engine. Each round the
    head's rows up to the committed length read the target's features, then it drafts `draft_len`
    tokens on its own outputs; the round commits the matching prefix plus the target's token."""
    from duospec.engine import SlotChunk

    rounds = committed = 0
    for prompt in prompts:
        slot = target_runner.allocate_slot()
        tokens = list(prompt)
        try:
            logits, feats = target_runner.forward_with_hidden([SlotChunk(slot, 0, tokens)])
            features = [feats[0]]
            tokens.append(int(logits[0][-1].argmax()))
            for _ in range(new_tokens - 1):  # the target's greedy continuation, its features with it
                logits, feats = target_runner.forward_with_hidden([SlotChunk(slot, len(tokens) - 1, tokens[-1:])])
                features.append(feats[0])
                tokens.append(int(logits[0][-1].argmax()))
        finally:
            target_runner.free_slot(slot)
        features = torch.cat(features)  # [len(tokens) - 1, 3H]: position j's feature
        projected = head_runner.project(features).float().cpu()
        head_slot = head_runner.allocate_slot()
        try:
            c, fed, end = len(prompt) + 1, 0, len(tokens)
            while c < end:
                head_runner.truncate(head_slot, fed)
                rows = torch.cat([torch.zeros(1, projected.shape[1]), projected[: c - 1]])[fed:c]
                logits, out = head_runner.forward_eagle([SlotChunk(head_slot, fed, tokens[fed:c])], rows)
                fed, drafts, last = c, [], out[-1:]
                for _ in range(draft_len):
                    drafts.append(int(logits[0].argmax()))
                    if len(drafts) == draft_len:
                        break
                    logits, last = head_runner.forward_eagle(
                        [SlotChunk(head_slot, c + len(drafts) - 1, drafts[-1:])], last)
                accepted = 0
                while accepted < len(drafts) and c + accepted < end and drafts[accepted] == tokens[c + accepted]:
                    accepted += 1
                step = min(accepted + 1, end - c)
                rounds, committed, c = rounds + 1, committed + step, c + step
        finally:
            head_runner.free_slot(head_slot)
    return committed / max(rounds, 1), rounds


def measurement_pair(head_dir, target_dir):
    """(target runner sending the head's features, head runner): what `measure_eagle3` runs."""
    from duospec.engine import load_checkpoint
    from duospec.engine.eagle3 import load_eagle3, tap_features

    head = load_eagle3(head_dir, target_dir, max_slots=2)
    target = load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=2).runner
    return tap_features(target, head.target_feature_layers), head


def acceptance_by_kind(options, target_dir: Path, head_dir: Path, tokenizer, log) -> dict:
    from duospec.training.acceptance import prompt_sets

    target, head = measurement_pair(head_dir, target_dir)
    by_kind = {}
    for kind, prompts in prompt_sets(tokenizer, (STDLIB,), [], options.eval_prompts, 64).items():
        length, rounds = measure_eagle3(target, head, prompts, new_tokens=64)
        by_kind[kind] = {"mean_accepted_length": round(length, 3), "prompts": len(prompts), "rounds": rounds}
        log(f"held-out {kind}: mean accepted length {length:.3f} (greedy, draft length 4, {len(prompts)} prompts)")
    return by_kind


def train_eagle3(options) -> Path:
    """HeadOptions with method eagle3 -> the written head directory (HeadTrainingError for bad input)."""
    from duospec.training.head_options import HeadTrainingError

    options.validate()
    try:
        return _train(options)
    except HeadTrainingError:
        raise
    except (OSError, ValueError) as err:
        raise HeadTrainingError(str(err)) from err


def _train(options) -> Path:
    from safetensors.torch import load_file

    from duospec.engine.eagle3 import default_feature_layers, write_published
    from duospec.engine.heads import WEIGHTS_FILE, eagle_layer_config, read_target_io, write_head
    from duospec.training.distill import _load_tokenizer, _resolve_device
    from duospec.training.eagle3 import (CacheBatches, Eagle3Objective, Eagle3TrainHead, choose_draft_vocab, coverage,
                                         end_tokens)
    from duospec.training.features import build_feature_cache, cache_sources, training_sequences
    from duospec.training.head_options import HeadTrainingError
    from duospec.training.heads import STATE_DIR
    from duospec.training.loop import Logger, LoopConfig, run_loop

    io = read_target_io(options.target)
    tokenizer = _load_tokenizer(options.target)
    device = _resolve_device(options.device)
    sources = cache_sources(options.data, options.stdlib_tokens)
    layers = default_feature_layers(io.config.num_hidden_layers)
    identity = {"method": "eagle3", "target_fingerprint": io.fingerprint, "data": list(options.data),
                "seq_len": options.seq_len, "batch_size": options.batch_size, "lr": options.lr, "seed": options.seed,
                "draft_vocab": options.draft_vocab, "ttt_steps": options.ttt_steps, "init": str(options.init or "")}
    state_dir = options.out / STATE_DIR
    run_json = state_dir / "run.json"
    if run_json.is_file():
        changed = sorted(k for k, v in json.loads(run_json.read_text()).items() if identity.get(k) != v)
        if changed:
            raise HeadTrainingError(f"--out {options.out}: holds a run with different {', '.join(changed)}; rerun "
                                    "with the same options to resume, or pass a new --out")
    state_dir.mkdir(parents=True, exist_ok=True)
    run_json.write_text(json.dumps(identity, indent=2))
    log = Logger(state_dir / "log.txt")

    sequences = training_sequences(tokenizer, sources, options.stdlib_tokens, options.seq_len)
    log(f"data: {len(sequences)} sequences, {sum(len(s[2]) for s in sequences)} tokens; caching the target's "
        f"features at layers {list(layers)}")
    cache = build_feature_cache(options.target, state_dir / "features", sequences, layers,
                                fingerprint=io.fingerprint, log=log)
    counts = cache.emitted_token_weights(io.config.vocab_size)
    ends = end_tokens(tokenizer, io.config.vocab_size)
    init_weights = None
    if options.init is not None:  # continuing a head keeps its draft vocabulary, whatever the data now
        from duospec.engine.eagle3 import load_eagle3_weights, read_eagle3

        init_weights, _ = load_eagle3_weights(read_eagle3(options.init, io.config))
        d2t = init_weights["d2t"].long()
        draft_ids = torch.arange(d2t.shape[0]) + d2t
        if len(draft_ids) != options.draft_vocab:
            raise HeadTrainingError(f"--init {options.init}: its draft vocabulary has {len(draft_ids)} tokens, "
                                    f"--draft-vocab asks for {options.draft_vocab}; pass --draft-vocab {len(draft_ids)}")
    else:
        draft_ids = choose_draft_vocab(counts, options.draft_vocab, ends)
    log(f"draft vocabulary: {len(draft_ids)} tokens cover {coverage(counts, draft_ids):.1%} of the training tokens "
        "(each kind of data weighing the same)" + (f"; kept from {options.init}" if options.init else ""))

    torch.manual_seed(options.seed)
    head = Eagle3TrainHead(eagle_layer_config(io.config), draft_ids, n_features=len(layers))
    final_norm = load_file(str(sorted(Path(options.target).glob("*.safetensors"))[0]))["model.norm.weight"]
    head.init_from_target(io.lm_head, final_norm)
    if init_weights is not None:
        head.load_exported(init_weights)
        log(f"initialised from {options.init}")
    head = head.to(device)
    objective = Eagle3Objective(head, io.embed, io.lm_head, options.ttt_steps, device)
    source = CacheBatches(cache, cache.split(False), options.seq_len, options.seed)
    heldout = CacheBatches(cache, cache.split(True), options.seq_len, options.seed).fixed_batches(4, options.batch_size) \
        if cache.split(True) else []
    log(f"eagle3 head: {sum(p.numel() for p in head.parameters()):,} params, {options.ttt_steps} test-time steps, "
        f"device {device}")
    cfg = LoopConfig(batch_size=options.batch_size, lr=options.lr, max_steps=options.steps,
                     max_seconds=options.minutes * 60 if options.minutes else None, warmup_steps=30,
                     seed=options.seed, eval_every_s=300.0, checkpoint_every_s=120.0,
                     bf16_autocast=options.bf16 or device.type == "cuda")
    started = time.time()
    state = run_loop(objective, source, heldout, cfg, state_dir / "checkpoint.pt", log, phase="eagle3")

    head = head.cpu().eval()
    card = {"params": sum(p.numel() for p in head.parameters()), "data": list(options.data),
            "train_tokens": state.step * options.batch_size * options.seq_len, "steps": state.step,
            "train_seconds": round(state.elapsed_s), "cached_tokens": cache.index["tokens"],
            "draft_vocab": len(draft_ids), "draft_vocab_coverage": round(coverage(counts, draft_ids), 4),
            "feature_layers": list(layers), "ttt_steps": options.ttt_steps, "last_eval": state.last_eval,
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}}
    extra = {"eagle3": {"feature_layers": list(layers), "draft_vocab_size": len(draft_ids)}}
    write_head(options.out, "eagle3", io, head.export(), card=card, extra=extra)
    by_kind = acceptance_by_kind(options, options.target, options.out, tokenizer, log)
    rounds = sum(k["rounds"] for k in by_kind.values())
    card["heldout_acceptance"] = by_kind
    card["heldout_mean_accepted_length"] = round(sum(k["mean_accepted_length"] * k["rounds"] for k in by_kind.values())
                                                 / rounds, 3) if rounds else None
    write_head(options.out, "eagle3", io, head.export(), card=card, extra=extra)
    if options.layout == "published":
        published = options.out / "published"
        write_published(published, io, head.export(), layers)
        log(f"published layout written to {published}")
    log(f"head written to {options.out} ({time.time() - started:.0f}s this run); weights {WEIGHTS_FILE}")
    return options.out
