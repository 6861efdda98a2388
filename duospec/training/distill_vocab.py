"""`duospec distill --draft-vocab N`: a draft model whose LM head covers only the N tokens the target
emits most (duospec/engine/draft_vocab.py), trained on the target's outputs cached once on disk.

Plain `duospec distill` runs the target on every step, and the draft's whole-vocabulary head is
most of the draft's own cost, so a CPU-hour buys ~0.3 M tokens. Here the target runs once over the
data (`duospec distill-data` folders and/or `stdlib`, the same feature cache `train-heads --method
eagle3` builds: duospec/training/features.py, only its final hidden states are read), and each step
computes the target's distribution over the draft vocabulary from them (576 x N multiply-adds a
token instead of a 30-layer forward). The loss: KL(p || q) over the draft vocabulary plus
`argmax_weight` x CE against the target's favourite there (objectives.DISTILL_WEIGHTS).

`--init DIR` starts from a written draft (its shape; its draft vocabulary when it has one), which is
how a later run continues from a shipped draft; `--mlp-width N` and `--add-layers K` grow it first, the
new units and layers silent at the start (models.widen_mlp, models.deepen), for a draft whose agreement
has stopped rising at its size. Layout of `--out`: the checkpoint (config.json,
model.safetensors, tokenizer, draft_vocab.safetensors, model_card.json) and `.distill/` (run.json,
features/, checkpoint.pt, log.txt). Rerunning the same command resumes to the step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from duospec.training.loop import mean_metrics
from duospec.training.objectives import DraftLossWeights


class TrimmedDistillObjective:
    """Loss over windows of a FeatureCache for a draft whose output is `draft_ids` (loop.py calls `loss`)."""

    def __init__(self, draft, target_lm_head: torch.Tensor, draft_ids: torch.Tensor, weights: DraftLossWeights,
                 device: torch.device):
        self.draft, self.weights, self.device = draft, weights, device
        self.draft_ids = draft_ids.to(device)
        self.teacher_head = target_lm_head.float()[draft_ids].to(device)  # soft labels need these rows only
        self.full_head = target_lm_head.float().to(device)  # the target's own argmax, for held-out agreement

    def trainable(self) -> dict:
        return {"draft": self.draft}

    def loss(self, batch):
        tokens, _, final, mask = (x.to(self.device) for x in batch)
        hidden = self.draft.model(input_ids=tokens, use_cache=False).last_hidden_state
        # the draft's head over its vocabulary only: the rows of its (tied) output weight it keeps
        logits = F.linear(hidden[mask], self.draft.lm_head.weight[self.draft_ids]).float()
        log_q = F.log_softmax(logits, -1)
        with torch.no_grad():
            teacher = F.linear(final[mask].float(), self.teacher_head)
            log_p = F.log_softmax(teacher, -1)
            # the target's token: over its whole vocabulary in evaluation; while training, its favourite
            # in the draft vocabulary (the full head would cost more than the draft's step for a metric)
            target_top = (self.draft_ids[teacher.argmax(-1)] if self.draft.training
                          else F.linear(final[mask].float(), self.full_head).argmax(-1))
        kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
        total = self.weights.kd_weight * kl + self.weights.argmax_weight * F.nll_loss(log_q, teacher.argmax(-1))
        agree = (self.draft_ids[logits.argmax(-1)] == target_top).float().mean()
        return total, {"kl": kl.item(), "agree": agree.item(), "loss": total.item()}

    def evaluate(self, batches) -> dict:
        return mean_metrics(self, batches)


def distill_trimmed(options) -> Path:
    """DistillOptions with draft_vocab set -> the written draft directory (DistillError for bad input)."""
    from duospec.training.distill import DistillError

    try:
        return _distill(options)
    except DistillError:
        raise
    except (OSError, ValueError) as err:
        raise DistillError(str(err)) from err


def _draft_model(options, target_config):
    """(draft config, model): from --init, or fresh in the shape options."""
    from transformers import AutoModelForCausalLM

    from duospec.training.distill import DistillError, draft_config_for
    from duospec.training.models import build_model, deepen, widen_mlp

    if options.init is None:
        config = draft_config_for(target_config, options)
        return config, build_model(config, seed=options.seed)
    if not (options.init / "config.json").is_file():
        raise DistillError(f"--init {options.init}: not a draft checkpoint directory (no config.json)")
    draft = AutoModelForCausalLM.from_pretrained(str(options.init), dtype=torch.float32)
    if draft.config.vocab_size != target_config.vocab_size:
        raise DistillError(f"--init {options.init}: its vocabulary has {draft.config.vocab_size} tokens, the "
                           f"target's {target_config.vocab_size}; a draft shares the target's tokenizer")
    try:  # wider first, so that new layers are as wide as the old
        if options.mlp_width is not None:
            widen_mlp(draft, options.mlp_width, options.seed)
        if options.add_layers:
            deepen(draft, options.add_layers, options.seed)
    except ValueError as err:
        raise DistillError(f"--init {options.init}: {err}") from None
    return draft.config, draft


def _distill(options) -> Path:
    from duospec.engine.draft_vocab import read_draft_vocab, write_draft_vocab
    from duospec.engine.heads import read_target_io
    from duospec.training.distill import (STATE_DIR, DistillError, _load_tokenizer, _resolve_device, check_out_dir,
                                          load_target_config, model_card, run_identity, write_card)
    from duospec.training.eagle3 import CacheBatches, choose_draft_vocab, coverage, end_tokens
    from duospec.training.export import export_checkpoint
    from duospec.training.features import build_feature_cache, cache_sources, training_sequences
    from duospec.training.loop import Logger, LoopConfig, run_loop
    from duospec.training.models import blend_weights
    from duospec.training.objectives import DISTILL_WEIGHTS

    options.validate()
    target_config = load_target_config(options.target)
    tokenizer = _load_tokenizer(options.target)
    sources = cache_sources(options.data, options.stdlib_tokens)
    draft_config, draft = _draft_model(options, target_config)
    identity = {**run_identity(options, target_config, draft_config), "draft_vocab": options.draft_vocab,
                "data": [str(d) for d in options.data], "init": str(options.init or "")}
    check_out_dir(options.out, identity, options.resume)
    device = _resolve_device(options.device)
    io = read_target_io(options.target)

    state_dir = options.out / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "run.json").write_text(json.dumps(identity, indent=2))
    log = Logger(state_dir / "log.txt")
    sequences = training_sequences(tokenizer, sources, options.stdlib_tokens, options.seq_len)
    log(f"data: {len(sequences)} sequences, {sum(len(s[2]) for s in sequences)} tokens; caching the target's "
        "final hidden states")
    cache = build_feature_cache(options.target, state_dir / "features", sequences, None,
                                fingerprint=io.fingerprint, log=log)
    counts = cache.emitted_token_weights(target_config.vocab_size)
    kept = read_draft_vocab(options.init, target_config.vocab_size) if options.init is not None else None
    if kept is not None and len(kept) > options.draft_vocab:
        raise DistillError(f"--init {options.init}: its draft vocabulary has {len(kept)} tokens, --draft-vocab asks "
                           f"for {options.draft_vocab}; a draft vocabulary grows, never shrinks: pass --draft-vocab "
                           f"{len(kept)} or more")
    if kept is not None and len(kept) == options.draft_vocab:
        draft_ids, how = kept, f"; kept from {options.init}"
    else:
        # A larger vocabulary than the init's keeps all of the init's tokens and adds the ones this data's
        # target emits most. The draft's output weight is tied to its embedding, so the added tokens start
        # from their embedding rows. (The shipped 8,192 were chosen on code-heavy data: they covered 84 % of
        # the target's tokens in everyday answers, 99 % in code answers.)
        always = end_tokens(tokenizer, target_config.vocab_size) + (kept.tolist() if kept is not None else [])
        draft_ids = choose_draft_vocab(counts, options.draft_vocab, always)
        how = "" if kept is None else f"; {len(kept)} kept from {options.init}, {len(draft_ids) - len(kept)} added"
    log(f"draft vocabulary: {len(draft_ids)} tokens cover {coverage(counts, draft_ids):.1%} of the training tokens"
        + how)

    draft = draft.to(device)
    objective = TrimmedDistillObjective(draft, io.lm_head, draft_ids, DISTILL_WEIGHTS, device)
    source = CacheBatches(cache, cache.split(False), options.seq_len, options.seed)
    heldout = CacheBatches(cache, cache.split(True), options.seq_len, options.seed).fixed_batches(4, options.batch_size) \
        if cache.split(True) else []
    log(f"draft {sum(p.numel() for p in draft.parameters()):,} params, device {device}")
    cfg = LoopConfig(batch_size=options.batch_size, lr=options.lr, max_steps=options.steps,
                     max_seconds=options.minutes * 60 if options.minutes else None, warmup_steps=30,
                     seed=options.seed, weight_decay=0.0, eval_every_s=300.0, checkpoint_every_s=120.0,
                     bf16_autocast=options.bf16 or device.type == "cuda")
    state = run_loop(objective, source, heldout, cfg, state_dir / "checkpoint.pt", log, phase="distill")

    draft = draft.float().cpu().eval()
    if options.init_share:
        blend_weights(draft, _hf_target(options.init).state_dict(), options.init_share)
        log(f"written: the trained weights averaged with {options.init}'s, the init holding {options.init_share:.0%}")
    export_checkpoint(draft, tokenizer, options.out)
    write_draft_vocab(options.out, draft_ids)
    target = _hf_target(options.target)
    card = model_card(options, target, draft, tokenizer, [], state, sum(p.numel() for p in draft.parameters()),
                      draft_ids=draft_ids)
    card.update(cached_tokens=cache.index["tokens"], draft_vocab=len(draft_ids),
                draft_vocab_coverage=round(coverage(counts, draft_ids), 4))
    write_card(options, card, log)
    return options.out


def _hf_target(path: Path):  # a target or a draft checkpoint, in fp32
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
