"""`duospec train-tiny`: the bundled tokenizer, target and draft, trained on the Python stdlib.

Phases, each resumable from files in the run directory:

1. tokenizer: byte-level BPE on the training split (`tokenizer/`).
2. token caches for the training and held-out splits (`tokens_train.bin`, `tokens_heldout.bin`).
3. joint: the target learns next-token prediction; the draft is distilled online from the target's
   logits on the same batches (`joint.pt`). Budget: `joint_minutes` of training time.
4. distill: the target is frozen and the draft keeps learning from it (`distill.pt`), the same loop
   as `duospec distill`. Budget: `distill_minutes`.
5. export to `out/target` and `out/draft` (fp16 safetensors, tokenizer, configs).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from duospec.training import corpus
from duospec.training.data import WindowSource, build_token_cache, files_fingerprint
from duospec.training.loop import Logger, LoopConfig, run_loop
from duospec.training.models import TINY_DRAFT, TINY_TARGET, build_model, count_parameters, llama_config


@dataclass(frozen=True)
class TinyRecipe:
    vocab_size: int = 4096
    # 512 positions so generations of a few hundred tokens stay inside the trained range;
    # 8 x 512 keeps 4096 tokens per step.
    seq_len: int = 512
    batch_size: int = 8
    joint_minutes: float = 60.0
    distill_minutes: float = 15.0
    target_lr: float = 2e-3
    distill_lr: float = 1e-3
    max_positions: int = 2048
    seed: int = 0
    threads: int = 2
    bf16_autocast: bool = True  # ~1.5x faster on CPUs with AVX512-BF16 (fp32 where the CPU lacks it: loop.py)


def _texts(files):
    for item in files:
        text = corpus.read_text(item.path)
        if text is not None:
            yield text


def prepare_data(recipe: TinyRecipe, run_dir: Path, log: Logger):
    """Tokenizer and token caches (reused when present). Returns (tokenizer, train, heldout)."""
    from transformers import AutoTokenizer

    from duospec.training.tokenizer import train_bpe_tokenizer

    train_files, heldout_files = corpus.split_files(corpus.stdlib_files())
    tok_dir = run_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    else:
        log(f"training BPE tokenizer (vocab {recipe.vocab_size}) on {len(train_files)} stdlib files")
        tokenizer = train_bpe_tokenizer(_texts(train_files), recipe.vocab_size, tok_dir)

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    caches = []
    for name, files in (("train", train_files), ("heldout", heldout_files)):
        fingerprint = files_fingerprint([f.path for f in files], str(tok_dir / "tokenizer.json"))
        tokens = build_token_cache(_texts(files), encode, recipe.vocab_size, tokenizer.bos_token_id,
                                   tokenizer.eos_token_id, run_dir / f"tokens_{name}.bin", fingerprint)
        caches.append(tokens)
        log(f"{name} split: {len(files)} files, {len(tokens)} tokens")
    return tokenizer, caches[0], caches[1]


def build_pair(recipe: TinyRecipe, tokenizer):
    common = dict(vocab_size=len(tokenizer), bos_id=tokenizer.bos_token_id,
                  eos_id=tokenizer.eos_token_id, max_positions=recipe.max_positions)
    target = build_model(llama_config(TINY_TARGET, **common), seed=recipe.seed)
    draft = build_model(llama_config(TINY_DRAFT, **common), seed=recipe.seed + 1)
    return target, draft


def train_tiny(recipe: TinyRecipe, run_dir: Path, out_dir: Path) -> dict:
    """Run (or resume) every phase and export the pair; returns a summary for the model card."""
    import torch

    from duospec.training.export import export_checkpoint
    from duospec.training.objectives import DISTILL_WEIGHTS, JOINT_WEIGHTS, DistillObjective, JointObjective

    torch.set_num_threads(recipe.threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = Logger(run_dir / "log.txt")
    _check_recipe_matches(recipe, run_dir)
    tokenizer, train_tokens, heldout_tokens = prepare_data(recipe, run_dir, log)
    target, draft = build_pair(recipe, tokenizer)
    log(f"target {count_parameters(target):,} params, draft {count_parameters(draft):,} params")
    source = WindowSource(train_tokens, recipe.seq_len, recipe.seed)
    heldout = WindowSource(heldout_tokens, recipe.seq_len, recipe.seed).fixed_batches(8, recipe.batch_size)
    device = torch.device("cpu")

    joint_cfg = LoopConfig(batch_size=recipe.batch_size, lr=recipe.target_lr, warmup_steps=100,
                           max_seconds=recipe.joint_minutes * 60, seed=recipe.seed,
                           bf16_autocast=recipe.bf16_autocast)
    joint = run_loop(JointObjective(target, draft, JOINT_WEIGHTS, device), source, heldout, joint_cfg,
                     run_dir / "joint.pt", log, phase="joint")
    distill_cfg = LoopConfig(batch_size=recipe.batch_size, lr=recipe.distill_lr, warmup_steps=20,
                             max_seconds=recipe.distill_minutes * 60, seed=recipe.seed + 1,
                             bf16_autocast=recipe.bf16_autocast)
    distill = run_loop(DistillObjective(target, draft, DISTILL_WEIGHTS, device), source, heldout, distill_cfg,
                       run_dir / "distill.pt", log, phase="distill")

    export_checkpoint(target, tokenizer, out_dir / "target")
    export_checkpoint(draft, tokenizer, out_dir / "draft")
    summary = {
        "recipe": asdict(recipe),
        "target_params": count_parameters(target),
        "draft_params": count_parameters(draft),
        "joint": {"steps": joint.step, "seconds": round(joint.elapsed_s), "heldout": joint.last_eval},
        "distill": {"steps": distill.step, "seconds": round(distill.elapsed_s), "heldout": distill.last_eval},
        "heldout_tokens": int(len(heldout_tokens)),
        "train_tokens": int(len(train_tokens)),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"exported target and draft to {out_dir}")
    return summary


def _check_recipe_matches(recipe: TinyRecipe, run_dir: Path) -> None:
    """A run directory belongs to one recipe: resuming with different settings would mix runs."""
    path = run_dir / "recipe.json"
    current = asdict(recipe)
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != current:
            changed = sorted(k for k in current if saved.get(k) != current[k])
            raise ValueError(
                f"{path}: this run directory was started with different settings ({', '.join(changed)}); "
                "rerun with the same options to resume, or pass a new --run-dir"
            )
    else:
        path.write_text(json.dumps(current, indent=2))
