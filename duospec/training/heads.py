"""`duospec train-heads`: an EAGLE or Medusa head for a Llama-family target, trained on text files.

The target is frozen; every step runs it once over a batch of windows (its final hidden states are
the features, its logits the teacher) and trains only the head:

- EAGLE: row j reads fc([embed(t[j]); f[j-1]]) and predicts f[j]. Loss = smooth-L1(g, f) +
  `KL_WEIGHT` · KL(p_target || LM(g)), twice: once from the target's features, once from the head's
  own (detached) predictions one row back — the head drafts on its own features past the last
  verified position, so it is trained to (a cheap form of EAGLE-3's "training-time test").
- Medusa: head i on f[j] predicts token j+1+i; loss = Σ_i KL(p_target(row j+i) || LM(head_i(f[j]))).

Layout of `--out`: `head.json` + `model.safetensors` (duospec/engine/heads.py), and `.train-heads/`
with `run.json`, `checkpoint.pt`, the token cache and `log.txt`. Rerunning the same command resumes.
At the end the held-out mean accepted length (greedy, draft length 4, exact simulation against the
target's greedy continuation) is measured by kind, as `duospec distill` measures a draft, printed and
written to the model card in `head.json`: code on the held-out stdlib files when the data includes
`stdlib`, chat on held-out instruction prompts when the target has a chat template, else the data's
held-out tail.

`--data stdlib` means the training split of the Python standard library (duospec/training/corpus.py),
the bundled models' corpus.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from duospec.training.data import STDLIB, DataError, collect_data_files
from duospec.training.head_options import HeadOptions, HeadTrainingError  # noqa: F401 (re-exported)
from duospec.training.loop import mean_metrics

STATE_DIR = ".train-heads"
KL_WEIGHT = 0.5
FEATURE_WEIGHT = 1.0


class EagleTrainHead(torch.nn.Module):
    """The EAGLE head for training (transformers' Llama layer); exported under the names the lean
    engine's EagleRunner loads (`fc.weight`, `model.layers.0.*`, `model.norm.weight`)."""

    def __init__(self, layer_config):
        from transformers import LlamaModel

        super().__init__()
        hidden = layer_config.hidden_size
        config = type(layer_config).from_dict(layer_config.to_dict())
        config.vocab_size = 1  # the embedding is the target's, passed in
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.model = LlamaModel(config)

    def forward(self, embeds: torch.Tensor, prev_features: torch.Tensor) -> torch.Tensor:
        """[B, T, H] embeddings of t[j] and features f[j-1] -> [B, T, H] predicted f[j]."""
        x = self.fc(torch.cat([embeds, prev_features], dim=-1))
        return self.model(inputs_embeds=x, use_cache=False).last_hidden_state

    def export(self) -> dict[str, torch.Tensor]:
        weights = {"fc.weight": self.fc.weight}
        weights.update({f"model.{k}": v for k, v in self.model.state_dict().items() if not k.startswith("embed")})
        return weights


def _shift(features: torch.Tensor) -> torch.Tensor:
    """f[j-1] for every row j (zeros at row 0)."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    vocab = student_logits.shape[-1]
    log_q = F.log_softmax(student_logits.float().reshape(-1, vocab), dim=-1)
    log_p = F.log_softmax(teacher_logits.float().reshape(-1, vocab), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


class _HeadObjective:
    """Shared by both heads: the frozen target's features and logits for a batch."""

    def __init__(self, target, head, device):
        self.target, self.head, self.device = target, head, device
        self.target.eval()
        self.target.requires_grad_(False)

    def trainable(self) -> dict:
        return {"head": self.head}

    @torch.no_grad()
    def _teacher(self, batch):
        inputs = batch[:, :-1].to(self.device)
        features = self.target.model(input_ids=inputs, use_cache=False).last_hidden_state
        return inputs, features, self.target.lm_head(features)

    def lm(self, hidden):
        return self.target.lm_head(hidden)

    def evaluate(self, batches) -> dict:
        return mean_metrics(self, batches)


class EagleObjective(_HeadObjective):
    def loss(self, batch):
        inputs, features, teacher = self._teacher(batch)
        embeds = self.target.model.embed_tokens(inputs)
        total, metrics, prev = 0.0, {}, _shift(features)
        for depth in (1, 2):
            predicted = self.head(embeds, prev)
            logits = self.lm(predicted)
            feature_loss = F.smooth_l1_loss(predicted.float(), features.float())
            kl = _kl(logits, teacher)
            total = total + FEATURE_WEIGHT * feature_loss + KL_WEIGHT * kl
            agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean()
            metrics[f"kl{depth}"], metrics[f"agree{depth}"] = kl.item(), agree.item()
            prev = _shift(predicted.detach())  # depth 2: the head's own features one row back
        return total, metrics


class MedusaObjective(_HeadObjective):
    def loss(self, batch):
        _, features, teacher = self._teacher(batch)
        hidden = self.head(features)  # [K, B, T, H]
        total, metrics = 0.0, {}
        for i in range(hidden.shape[0]):
            shift = i + 1  # head i+1 at row j predicts the token the target predicts at row j + i + 1
            if shift >= features.shape[1]:
                break
            logits = self.lm(hidden[i][:, :-shift])
            target_logits = teacher[:, shift:]
            total = total + _kl(logits, target_logits)
            metrics[f"agree{i + 1}"] = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
        return total, metrics


# ---- exact greedy acceptance -----------------------------------------------------------------


@torch.no_grad()
def measure_head(target, head, method: str, prompts: list[list[int]], new_tokens: int,
                 draft_len: int = 4) -> tuple[float, int]:
    """(mean accepted length, rounds): greedy speculation with the head against the target's greedy
    continuation, simulated exactly — each round starts after the committed text, the head drafts
    `draft_len` tokens (EAGLE on the target's features of the verified positions, then its own),
    the round commits the matching prefix plus one token."""
    from duospec.training.acceptance import greedy_continuation

    rounds = committed = 0
    for prompt in prompts:
        continuation = greedy_continuation(target, prompt, new_tokens)
        sequence = torch.tensor([prompt + continuation])
        features = target.model(input_ids=sequence, use_cache=False).last_hidden_state  # [1, L, H]
        c = len(prompt) + 1  # the first generated token comes from the prefill
        end = len(prompt) + len(continuation)
        while c < end:
            drafts = draft_tokens(target, head, method, sequence, features, c, draft_len)
            accepted = 0
            while accepted < len(drafts) and c + accepted < end and drafts[accepted] == sequence[0, c + accepted]:
                accepted += 1
            step = min(accepted + 1, end - c)
            rounds, committed, c = rounds + 1, committed + step, c + step
    return committed / max(rounds, 1), rounds


def draft_tokens(target, head, method, sequence, features, c: int, draft_len: int, with_second: bool = False):
    """Greedy drafts for positions c, c+1, ... given tokens[:c] and the features of positions < c - 1
    (row j reads f[j - 1], so rows 0 .. c - 1 read true features); with `with_second`, also the
    head's second choice at position c: (drafts, second)."""
    if method == "medusa":
        hidden = head(features[0, c - 2])  # [K, H]: head i predicts position c - 1 + i
        ranked = target.lm_head(hidden).topk(2, dim=-1).indices
        drafts = ranked[:, 0].tolist()[:draft_len]
        return (drafts, int(ranked[0, 1])) if with_second else drafts
    tokens = sequence[0, :c].tolist()
    prev = _shift(features[:, :c])
    drafts, second = [], None
    embed = target.model.embed_tokens
    for _ in range(draft_len):
        n = len(tokens)
        rows = torch.tensor([tokens])
        if prev.shape[1] < n:  # the newest row reads the head's own prediction of the previous row
            prev = torch.cat([prev, predicted[:, -1:]], dim=1)
        predicted = head(embed(rows), prev)
        top = target.lm_head(predicted[0, -1]).topk(2).indices.tolist()
        second = top[1] if second is None else second
        drafts.append(top[0])
        tokens.append(top[0])
    return (drafts, second) if with_second else drafts


def load_trained_head(head_dir, target_dir) -> tuple[str, torch.nn.Module]:
    """(method, the head as a training module in eval mode) from a head directory: what
    `measure_head` runs (serving loads heads with duospec.engine.heads.load_eagle / load_medusa)."""
    from safetensors.torch import load_file

    from duospec.engine.heads import MedusaHeads, WEIGHTS_FILE, eagle_layer_config, read_head, read_target_io

    info = read_head(head_dir)
    weights = {k: v.float() for k, v in load_file(str(Path(head_dir) / WEIGHTS_FILE)).items()}
    if info.method == "eagle":
        head = EagleTrainHead(eagle_layer_config(read_target_io(target_dir).config))
        head.fc.weight.data.copy_(weights.pop("fc.weight"))
        missing, unexpected = head.model.load_state_dict({k[len("model."):]: v for k, v in weights.items()},
                                                          strict=False)
        if unexpected or [k for k in missing if not k.startswith("embed")]:
            raise ValueError(f"{head_dir}: weights do not fit an EAGLE head ({missing}, {unexpected})")
    else:
        head = MedusaHeads(info.hidden_size, info.medusa_heads)
        head.load_state_dict(weights)
    return info.method, head.eval()


# ---- the command ------------------------------------------------------------------------------


def _files(options: HeadOptions) -> list[Path]:
    try:
        return collect_data_files(options.data)
    except DataError as err:
        raise HeadTrainingError(str(err)) from err


def _eval_prompts(options: HeadOptions, tokenizer, heldout_tokens) -> dict[str, list[list[int]]]:
    """Held-out prompts by kind, as `duospec distill`'s card measures them (code from the held-out
    stdlib files, chat from held-out instructions when the target has a chat template, else the data's
    held-out tail)."""
    from duospec.training.acceptance import prompt_sets

    return prompt_sets(tokenizer, options.data, heldout_tokens, options.eval_prompts, 64)


def train_heads(options: HeadOptions) -> Path:
    """Validate, train (or resume) the head, measure it, write it to `options.out`."""
    from transformers import AutoModelForCausalLM

    from duospec.engine.heads import MedusaHeads, eagle_layer_config, read_target_io, write_head
    from duospec.training.distill import DistillError, _load_tokenizer, _resolve_device, _token_sources
    from duospec.training.loop import Logger, LoopConfig, run_loop
    from duospec.training.models import SUPPORTED_TARGET_TYPES

    options.validate()
    if options.method == "eagle3":
        raise HeadTrainingError("--method eagle3 trains with duospec.training.eagle3_run.train_eagle3")
    try:
        io = read_target_io(options.target)
    except Exception as err:
        raise HeadTrainingError(f"--target {options.target}: {err}") from err
    if io.config.model_type not in SUPPORTED_TARGET_TYPES:
        raise HeadTrainingError(f"--target {options.target}: model_type {io.config.model_type!r}; heads are "
                                f"trained for {sorted(SUPPORTED_TARGET_TYPES)}")
    try:
        tokenizer = _load_tokenizer(options.target)
        device = _resolve_device(options.device)
    except DistillError as err:
        raise HeadTrainingError(str(err)) from err
    files = _files(options)
    identity = {"method": options.method, "target_fingerprint": io.fingerprint, "data": list(options.data),
                "seq_len": options.seq_len, "batch_size": options.batch_size, "lr": options.lr,
                "seed": options.seed, "medusa_heads": options.medusa_heads if options.method == "medusa" else 0}
    state_dir = options.out / STATE_DIR
    run_json = state_dir / "run.json"
    if run_json.is_file():
        saved = json.loads(run_json.read_text())
        changed = sorted(k for k in identity if saved.get(k) != identity[k])
        if changed:
            raise HeadTrainingError(f"--out {options.out}: holds a run with different {', '.join(changed)}; "
                                    "rerun with the same options to resume, or pass a new --out")
        if not options.resume:
            raise HeadTrainingError(f"--out {options.out}: already holds this run; drop --no-resume to continue it")
    elif (options.out / "head.json").exists():
        raise HeadTrainingError(f"--out {options.out}: holds a head this command did not start; pass a new --out")
    state_dir.mkdir(parents=True, exist_ok=True)
    run_json.write_text(json.dumps(identity, indent=2))
    log = Logger(state_dir / "log.txt")

    class _Opts:  # what _token_sources reads
        seq_len, seed, batch_size = options.seq_len, options.seed, options.batch_size

    try:
        source, heldout = _token_sources(_Opts, files, tokenizer, io.config.vocab_size, state_dir)
    except DistillError as err:
        raise HeadTrainingError(str(err)) from err
    log(f"data: {len(files)} files, {len(source.tokens)} training tokens")

    target = AutoModelForCausalLM.from_pretrained(str(options.target), dtype=torch.float32).to(device)
    torch.manual_seed(options.seed)
    if options.method == "eagle":
        head = EagleTrainHead(eagle_layer_config(io.config)).to(device)
        objective = EagleObjective(target, head, device)
    else:
        head = MedusaHeads(io.config.hidden_size, options.medusa_heads).to(device)
        objective = MedusaObjective(target, head, device)
    log(f"{options.method} head: {sum(p.numel() for p in head.parameters()):,} params, device {device}")
    cfg = LoopConfig(batch_size=options.batch_size, lr=options.lr, max_steps=options.steps,
                     max_seconds=options.minutes * 60 if options.minutes else None,
                     warmup_steps=50, seed=options.seed, eval_every_s=300.0, checkpoint_every_s=120.0,
                     bf16_autocast=options.bf16 or device.type == "cuda")
    started = time.time()
    state = run_loop(objective, source, heldout, cfg, state_dir / "checkpoint.pt", log, phase=options.method)

    head.eval()
    heldout_tokens = source.tokens[-1:]  # placeholder, replaced below when the held-out tail exists
    if heldout:
        heldout_tokens = torch.cat([b[:, :-1].reshape(-1) for b in heldout]).numpy()
    by_kind, committed, rounds = {}, 0.0, 0
    for kind, prompts in _eval_prompts(options, tokenizer, heldout_tokens).items():
        kind_len, kind_rounds = measure_head(target.cpu(), head.cpu(), options.method, prompts, new_tokens=64)
        by_kind[kind] = {"mean_accepted_length": round(kind_len, 3), "prompts": len(prompts), "rounds": kind_rounds}
        committed, rounds = committed + kind_len * kind_rounds, rounds + kind_rounds
        log(f"held-out {kind}: mean accepted length {kind_len:.3f} (greedy, draft length 4, {len(prompts)} "
            f"prompts, {kind_rounds} rounds)")
    mean_len = committed / rounds if rounds else None  # pooled over the kinds; None: no held-out prompts
    card = {"params": sum(p.numel() for p in head.parameters()), "data": list(options.data),
            "train_tokens": state.step * options.batch_size * options.seq_len, "steps": state.step,
            "train_seconds": round(state.elapsed_s), "heldout_mean_accepted_length": mean_len and round(mean_len, 3),
            "heldout_acceptance": by_kind, "last_eval": state.last_eval, "options": {
                k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}}
    weights = head.export() if options.method == "eagle" else head.state_dict()
    write_head(options.out, options.method, io, weights,
               medusa_heads=options.medusa_heads if options.method == "medusa" else 0, card=card)
    log(f"head written to {options.out} ({time.time() - started:.0f}s this run)")
    return options.out
