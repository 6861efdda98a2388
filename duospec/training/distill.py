"""`duospec distill`: a small Llama draft for any Llama-family target, trained on text files.

Everything that can be wrong with the input is checked before the target's weights are loaded:
the target's architecture, the draft's shape, the data paths, and what `--out` already holds.

Layout of `--out`: the draft checkpoint itself (config.json, model.safetensors, tokenizer files,
generation_config.json) plus `.distill/` with `run.json` (what run this is), `checkpoint.pt`,
the token cache and `log.txt`. Rerunning the same command resumes from `checkpoint.pt`; a larger
`--steps` extends a finished run (the learning-rate schedule stretches to the new length).

Held-out evaluation uses the last 1/20 of the token stream (files are tokenized in sorted path
order), when it holds at least one window; training windows come from the rest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from duospec.training.data import DataError, WindowSource, build_token_cache, collect_data_files, files_fingerprint
from duospec.training.models import SUPPORTED_TARGET_TYPES, ModelShape, llama_config

STATE_DIR = ".distill"
HELDOUT_FRACTION = 20  # the last 1/20 of the tokens
CARD_FILE = "model_card.json"  # next to the weights: data, steps, minutes, held-out acceptance
ACCEPTANCE_NEW_TOKENS = 64
ACCEPTANCE_DRAFT_LEN = 4


class DistillError(ValueError):
    """Bad input to `duospec distill`; the message names the option or path and the fix."""


@dataclass(frozen=True)
class DistillOptions:
    target: Path
    data: tuple[Path, ...]
    out: Path
    draft_layers: int = 2
    draft_hidden: int = 256
    draft_heads: int = 4
    steps: int | None = 2000  # None: --minutes alone
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    device: str = "auto"
    seed: int = 0
    resume: bool = True
    # K: the draft starts as the target's first K layers (+ its final norm and LM head) and keeps that
    # shape (--draft-layers/--draft-hidden/--draft-heads do not apply): the `layers` drafter, fine-tuned
    init_layers: int | None = None
    # held-out prompts per kind for the acceptance figure in the model card (0 = none measured)
    eval_prompts: int = 16
    minutes: float | None = None  # a time budget (with or instead of steps; the first reached ends the run)
    # N: the draft's LM head covers the N tokens the target emits most, trained on the target's cached
    # outputs (duospec/training/distill_vocab.py; --data: distill-data folders and/or stdlib)
    draft_vocab: int | None = None
    init: Path | None = None  # --draft-vocab: start from this draft checkpoint (continue a shipped draft)
    add_layers: int = 0  # --init: this many identity-initialised layers spread among the init's (models.deepen)
    mlp_width: int | None = None  # --init: widen its MLPs to this many units, the new ones silent (models.widen_mlp)
    init_share: float = 0.0  # --init: the written draft averages the trained weights with the init's (models.blend_weights)
    stdlib_tokens: int = 200_000  # --draft-vocab with --data stdlib: raw code tokens cached
    bf16: bool = False  # bf16 autocast on CPU too (always on with cuda)

    @classmethod
    def from_args(cls, args) -> DistillOptions:
        minutes = getattr(args, "minutes", None)
        steps = args.steps if args.steps is not None else (None if minutes else cls.steps)
        optional = {name: getattr(args, name) for name in ("eval_prompts", "draft_vocab", "stdlib_tokens", "bf16",
                                                                  "add_layers", "mlp_width", "init_share")
                    if getattr(args, name, None) is not None}
        init = getattr(args, "init", None)
        return cls(target=Path(args.target), data=tuple(Path(p) for p in args.data), out=Path(args.out),
                   draft_layers=args.draft_layers, draft_hidden=args.draft_hidden,
                   draft_heads=args.draft_heads, steps=steps, batch_size=args.batch_size,
                   seq_len=args.seq_len, lr=args.lr, device=args.device, seed=args.seed,
                   resume=args.resume, init_layers=getattr(args, "init_layers", None), minutes=minutes,
                   init=None if init is None else Path(init), **optional)

    def validate(self) -> None:
        for name in ("draft_layers", "draft_hidden", "draft_heads", "steps", "batch_size", "seq_len", "draft_vocab"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise DistillError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.steps is None and not self.minutes:
            raise DistillError("give a budget: --steps N and/or --minutes M")
        if self.minutes is not None and self.minutes <= 0:
            raise DistillError(f"--minutes must be positive, got {self.minutes}")
        if self.minutes is not None and self.draft_vocab is None:
            raise DistillError("--minutes needs --draft-vocab (the time-budgeted run on the target's cached "
                               "outputs); without it give --steps")
        if self.init is not None and self.draft_vocab is None:
            raise DistillError("--init needs --draft-vocab; to start from the target's own layers use --init-layers")
        if self.add_layers < 0:
            raise DistillError(f"--add-layers must be >= 0, got {self.add_layers}")
        if (self.add_layers or self.mlp_width is not None) and self.init is None:
            raise DistillError("--add-layers and --mlp-width grow the --init draft; a fresh draft takes its shape "
                               "from --draft-layers/--draft-hidden")
        if not 0.0 <= self.init_share <= 1.0:
            raise DistillError(f"--init-share must be within [0, 1], got {self.init_share}")
        if self.init_share and (self.init is None or self.add_layers or self.mlp_width is not None):
            raise DistillError("--init-share averages the trained draft with its --init, so it needs --init and the "
                               "init's own shape (no --add-layers or --mlp-width)")
        if self.draft_vocab is not None and self.init_layers is not None:
            raise DistillError("--draft-vocab and --init-layers do not combine: a shallow copy of the target keeps "
                               "its whole LM head; pass one of them")
        if self.eval_prompts < 0:
            raise DistillError(f"--eval-prompts must be >= 0, got {self.eval_prompts}")
        if self.init_layers is not None and self.init_layers < 1:
            raise DistillError(f"--init-layers must be >= 1, got {self.init_layers}")
        if self.lr <= 0:
            raise DistillError(f"--lr must be positive, got {self.lr}")
        head_dim, rest = divmod(self.draft_hidden, self.draft_heads)
        if rest or head_dim % 2:
            raise DistillError(
                f"--draft-hidden {self.draft_hidden} / --draft-heads {self.draft_heads} must give an even "
                "whole head size (RoPE rotates pairs); e.g. --draft-hidden 256 --draft-heads 4"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise DistillError(f"--device must be auto, cpu or cuda, got {self.device!r}")


def load_target_config(target: Path):
    """The target's transformers config, or DistillError if it is missing or not Llama-family."""
    from transformers import AutoConfig

    if not (target / "config.json").is_file():
        raise DistillError(f"--target {target}: no config.json; pass a Hugging Face checkpoint directory")
    try:
        config = AutoConfig.from_pretrained(str(target))
    except Exception as err:  # unknown model_type and malformed JSON raise different types
        raise DistillError(f"--target {target}: transformers cannot read config.json ({err})") from err
    if config.model_type not in SUPPORTED_TARGET_TYPES:
        raise DistillError(
            f"--target {target}: model_type {config.model_type!r} is not supported; the draft is a "
            f"Llama model and needs a Llama-family target ({', '.join(sorted(SUPPORTED_TARGET_TYPES))})"
        )
    return config


def draft_config_for(target_config, options: DistillOptions):
    """A LlamaConfig sharing the target's vocabulary, special ids, positions and RoPE; with
    --init-layers K, the target's own config cut to K layers."""
    if options.init_layers is not None:
        from duospec.engine import CheckpointError
        from duospec.engine.loader import shallow_config

        try:
            return shallow_config(f"--target {options.target}", target_config, options.init_layers)
        except CheckpointError as err:
            raise DistillError(str(err).replace("layers <", "--init-layers <")) from None
    shape = ModelShape(hidden=options.draft_hidden, layers=options.draft_layers, heads=options.draft_heads,
                       kv_heads=options.draft_heads, intermediate=_intermediate_for(options.draft_hidden))
    return llama_config(
        shape, vocab_size=target_config.vocab_size, bos_id=target_config.bos_token_id,
        eos_id=target_config.eos_token_id, max_positions=target_config.max_position_embeddings,
        rope_parameters=getattr(target_config, "rope_parameters", None),
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
    )


def _intermediate_for(hidden: int) -> int:
    # The usual SwiGLU width (8/3 x hidden), rounded up to a multiple of 64.
    return -(-(8 * hidden // 3) // 64) * 64


def _comparable(config_dict: dict) -> dict:
    volatile = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"}
    return {k: v for k, v in sorted(config_dict.items()) if k not in volatile}


def run_identity(options: DistillOptions, target_config, draft_config) -> dict:
    """What makes two invocations the same run (a checkpoint may only be resumed by the same run)."""
    target_sha = hashlib.sha1(json.dumps(_comparable(target_config.to_dict()), sort_keys=True,
                                         default=str).encode()).hexdigest()
    return {
        "target_config_sha1": target_sha,
        "draft_config": json.loads(json.dumps(_comparable(draft_config.to_dict()), default=str)),
        "seq_len": options.seq_len,
        "batch_size": options.batch_size,
        "lr": options.lr,
        "seed": options.seed,
    }


def check_out_dir(out: Path, identity: dict, resume: bool) -> None:
    """Refuse an --out that holds another model or another run; allow resuming this run."""
    run_json = out / STATE_DIR / "run.json"
    if run_json.is_file():
        saved = json.loads(run_json.read_text())
        if saved.get("target_config_sha1") != identity["target_config_sha1"]:
            raise DistillError(f"--out {out}: holds a draft distilled from a different target; "
                               "pass a new --out (or delete it to start over)")
        if saved.get("draft_config") != identity["draft_config"]:
            raise DistillError(f"--out {out}: holds a draft with a different configuration "
                               "(--draft-layers/--draft-hidden/--draft-heads); pass a new --out or the same options")
        changed = sorted(k for k in identity if saved.get(k) != identity[k])
        if changed:
            raise DistillError(f"--out {out}: this run was started with different "
                               f"{', '.join('--' + k.replace('_', '-') for k in changed)}; rerun with the "
                               "same values to resume, or pass a new --out")
        if not resume:
            raise DistillError(f"--out {out}: already holds this run; drop --no-resume to continue it, "
                               "or pass a new --out")
        return
    if (out / "config.json").exists() or any(out.glob("*.safetensors")):
        raise DistillError(f"--out {out}: already holds a model that `duospec distill` did not write; "
                           "pass an empty or new directory")


def _resolve_device(name: str):
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise DistillError("--device cuda: no CUDA device is available; use --device cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _load_tokenizer(target: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target))
    except Exception as err:  # missing files and corrupt JSON raise different types
        raise DistillError(f"--target {target}: no usable tokenizer ({err}); the draft copies the "
                           "target's tokenizer, so the target directory must include it") from err


def _token_sources(options: DistillOptions, files: list[Path], tokenizer, vocab_size: int, state_dir: Path):
    """(training windows, held-out batches) from the data files, via the token cache."""
    from duospec.training.corpus import read_text

    def texts():
        for path in files:
            text = read_text(path)
            if text:
                yield text

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    fingerprint = files_fingerprint(files, tokenizer.name_or_path + str(len(tokenizer)))
    try:
        tokens = build_token_cache(texts(), encode, vocab_size, tokenizer.bos_token_id,
                                   tokenizer.eos_token_id, state_dir / "tokens.bin", fingerprint)
    except DataError as err:
        raise DistillError(f"--data: {err}") from err
    cut = len(tokens) - len(tokens) // HELDOUT_FRACTION
    heldout_part = tokens[cut:]
    if len(heldout_part) >= options.seq_len + 2:
        train_part = tokens[:cut]
        heldout = WindowSource(heldout_part, options.seq_len, options.seed).fixed_batches(4, options.batch_size)
    else:
        train_part, heldout = tokens, []  # too little text to spare a held-out window
    try:
        return WindowSource(train_part, options.seq_len, options.seed), heldout
    except DataError as err:
        raise DistillError(f"--data: {err}") from err


def distill(options: DistillOptions) -> Path:
    """Validate everything, then train (or resume) the draft and write it to `options.out`. (With
    `draft_vocab` set the run is duospec/training/distill_vocab.py's `distill_trimmed`.)"""
    if options.draft_vocab is not None:
        raise DistillError("--draft-vocab runs train on the target's cached outputs: call distill_trimmed")
    import torch
    from transformers import AutoModelForCausalLM

    from duospec.training.export import export_checkpoint
    from duospec.training.loop import Logger, LoopConfig, run_loop
    from duospec.training.models import build_model, count_parameters
    from duospec.training.objectives import DISTILL_WEIGHTS, DistillObjective

    # 1. Input checks, cheapest first; nothing is written before they all pass.
    options.validate()
    target_config = load_target_config(options.target)
    tokenizer = _load_tokenizer(options.target)
    try:
        files = collect_data_files(options.data)
    except DataError as err:
        raise DistillError(str(err)) from err
    draft_config = draft_config_for(target_config, options)
    identity = run_identity(options, target_config, draft_config)
    check_out_dir(options.out, identity, options.resume)
    device = _resolve_device(options.device)

    # 2. Run state and data.
    state_dir = options.out / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "run.json").write_text(json.dumps(identity, indent=2))
    log = Logger(state_dir / "log.txt")
    source, heldout = _token_sources(options, files, tokenizer, target_config.vocab_size, state_dir)
    log(f"data: {len(files)} files, {len(source.tokens)} training tokens, "
        f"{sum(b.numel() for b in heldout)} held-out window tokens")

    # 3. Models: the frozen target (bf16 on GPU); a fresh draft, or the target's first layers.
    target_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(str(options.target), dtype=target_dtype).to(device)
    if options.init_layers is not None:
        draft = AutoModelForCausalLM.from_pretrained(str(options.target), config=draft_config,
                                                     dtype=torch.float32).to(device)
    else:
        draft = build_model(draft_config, seed=options.seed).to(device)
    log(f"target {count_parameters(target):,} params ({target_config.model_type}), "
        f"draft {count_parameters(draft):,} params, device {device}")

    # 4. The shared loop, then export.
    cfg = LoopConfig(batch_size=options.batch_size, lr=options.lr, max_steps=options.steps,
                     warmup_steps=min(100, max(options.steps // 10, 1)), seed=options.seed,
                     bf16_autocast=device.type == "cuda")
    state = run_loop(DistillObjective(target, draft, DISTILL_WEIGHTS, device), source, heldout, cfg,
                     state_dir / "checkpoint.pt", log, phase="distill")
    draft, target = draft.float().cpu().eval(), target.float().cpu().eval()
    export_checkpoint(draft, tokenizer, options.out)

    # 5. The model card, with the held-out acceptance the draft will show when serving.
    write_card(options, model_card(options, target, draft, tokenizer, heldout, state, count_parameters(draft)), log)
    return options.out


def write_card(options: DistillOptions, card: dict, log) -> None:
    (options.out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    for kind, figure in card["heldout_acceptance"].items():
        log(f"held-out {kind}: mean accepted length {figure['mean_accepted_length']:.3f} (greedy, draft length "
            f"{ACCEPTANCE_DRAFT_LEN}, {figure['prompts']} prompts), agreement {figure['agreement']:.3f}")
    log(f"draft written to {options.out} after {card['steps']} steps")


def model_card(options: DistillOptions, target, draft, tokenizer, heldout, state, params: int,
               draft_ids=None) -> dict:
    """What the draft is and how it was trained, and its greedy acceptance on held-out prompts of each
    kind the data covers (duospec/training/acceptance.py: exact simulation against the target)."""
    import numpy as np
    import torch

    from duospec.training.acceptance import measure_pair, prompt_sets

    tail = torch.cat([b[:, :-1].reshape(-1) for b in heldout]).numpy() if heldout else np.zeros(0, np.int64)
    figures = {}
    if options.eval_prompts:
        for kind, prompts in prompt_sets(tokenizer, options.data, tail, options.eval_prompts).items():
            stats = measure_pair(target, draft, prompts, ACCEPTANCE_NEW_TOKENS, ACCEPTANCE_DRAFT_LEN, draft_ids)
            figures[kind] = {"mean_accepted_length": round(stats.mean_accepted_length, 3),
                             "agreement": round(stats.agreement, 3), "prompts": len(prompts)}
    return {
        "params": params, "data": [str(d) for d in options.data], "steps": state.step,
        "train_tokens": state.step * options.batch_size * options.seq_len, "train_minutes": round(state.elapsed_s / 60, 1),
        "heldout_acceptance": figures, "last_eval": state.last_eval,
        "options": {k: [str(x) for x in v] if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v
                    for k, v in asdict(options).items()} | {
            # the shape trained, which an --init checkpoint (or --init-layers) decides whatever the flags said
            "draft_layers": draft.config.num_hidden_layers, "draft_hidden": draft.config.hidden_size,
            "draft_heads": draft.config.num_attention_heads},
    }
