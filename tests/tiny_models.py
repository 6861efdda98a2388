"""Tiny random-weight Hugging Face checkpoints on disk, for tests.

Every test that needs "a model" builds one here: a few hundred KB, written in well under a second,
deterministic for a given seed, loadable by ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` with no network.

    tok_dir = tiny_tokenizer(tmp_path / "tok")
    ckpt = make_tiny_checkpoint(tmp_path / "llama", "llama", seed=1)
    ckpt_q = make_tiny_checkpoint(tmp_path / "qwen", "qwen2", tie_embeddings=True)

Both functions are cached per output directory: calling them again on a directory they already
filled (with the same arguments) returns at once, so a fixture shared by the whole test run can share one directory.
"""

from __future__ import annotations

import functools
import json
import pathlib
import random
import shutil
from typing import Any

__all__ = ["FAMILIES", "BOS_TOKEN", "EOS_TOKEN", "PAD_TOKEN", "UNK_TOKEN", "make_tiny_checkpoint", "scattered_runner",
           "tiny_tokenizer"]

FAMILIES = ("llama", "llama3", "qwen2", "mistral", "qwen3", "gemma3")
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
# Never produced by the byte-level BPE, but declared: some tokenizer classes (Qwen2Tokenizer) add an
# "<|endoftext|>" unk token of their own when none is set, which would grow the vocabulary by one.
UNK_TOKEN = "<unk>"
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TOKENIZER_VOCAB_SIZE = 384
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_STAMP = "tiny_model_args.json"

# The training text is generated, not read from the repo, so the tokenizer never changes when the
# repo's files do. Python-ish words, because the bundled models and most prompts are Python source.
_WORDS = (
    "def class return import from self None True False if elif else for while in not and or "
    "with as try except finally raise yield lambda pass break continue print len range list "
    "dict set tuple str int float value name path data result args kwargs token model draft "
    "target verify accept reject slot cache batch chunk epoch position logits tensor shape"
).split()
_PUNCT = ("(", ")", ":", ",", ".", "=", "[", "]", " == ", " + ", "_", "\n", "\n    ", "    ", "'", '"')


def _training_text(n_lines: int = 400) -> str:
    rng = random.Random(20240611)
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(3, 10)):
            parts.append(_WORDS[rng.randrange(len(_WORDS))])
            parts.append(_PUNCT[rng.randrange(len(_PUNCT))] if rng.random() < 0.4 else " ")
        parts.append(str(rng.randrange(1000)))
        lines.append("".join(parts))
    return "\n".join(lines) + "\nThe quick brown fox jumps over the lazy dog. Hello, world!\n"


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Train the byte-level BPE once per process; the JSON is what gets written to each dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # The same normalizer and pre-tokenizer transformers' Qwen2Tokenizer rebuilds for itself, so the
    # tokenizer encodes identically whichever class AutoTokenizer picks for the model type.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_training_text()], trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(out_dir: str | pathlib.Path) -> pathlib.Path:
    """Write a small byte-level BPE tokenizer (~384 tokens, ids 0/1/2/3 = bos/eos/pad/unk) to ``out_dir``.

    Saved as a ``PreTrainedTokenizerFast`` directory; returns ``out_dir``. Any text round-trips
    (byte-level), and no BOS is added automatically, so token ids are exactly what the text encodes.
    Cached: if ``out_dir`` already holds a tokenizer.json, nothing is rewritten.
    """
    out = pathlib.Path(out_dir)
    if (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    return out


def _family_config(family: str, common: dict[str, Any], rope_scaling, attention_bias):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if family == "llama3":
        # original_max_position_embeddings well below the model's max, so the scaling changes the
        # low frequencies that a tiny head_dim actually has.
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    if rope_scaling is not None:
        rope = {"rope_theta": 10000.0, **rope_scaling}
        rope.setdefault("rope_type", rope.pop("type", "default"))
    if family == "gemma3":
        if rope_scaling is not None:
            raise ValueError("family='gemma3': its rope is per layer type; leave rope_scaling=None")
        # Gemma 3's own layout: local layers at one RoPE base, global layers at another with linear
        # scaling (as its 4B+ checkpoints), so a forward that used one rope for both would not match.
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}
    common = {**common, "rope_parameters": rope}
    if family in ("qwen3", "gemma3"):  # their configs default to head_dim 128/256; keep tests tiny
        common = {"head_dim": common["hidden_size"] // common["num_attention_heads"], **common}
    if family in ("llama", "llama3"):
        return LlamaConfig(**common, attention_bias=bool(attention_bias))
    if family == "qwen2":
        if attention_bias is False:
            raise ValueError("family='qwen2': Qwen2 always has q/k/v bias; leave attention_bias=None")
        return Qwen2Config(**common)
    if family == "mistral":
        if attention_bias:
            raise ValueError("family='mistral': Mistral has no attention bias; leave attention_bias=None")
        # No window by default (contexts in tests stay short); config_overrides can set one.
        return MistralConfig(**{"sliding_window": None, **common})
    if family == "qwen3":
        return Qwen3Config(**common, attention_bias=bool(attention_bias))
    if family == "gemma3":
        # Every second layer global, the rest sliding (Gemma 3 ships 5 local : 1 global); the window
        # is transformers' default unless config_overrides sets one a test's context crosses.
        layer_types = ["full_attention" if i % 2 else "sliding_attention" for i in range(common["num_hidden_layers"])]
        return Gemma3TextConfig(**{"layer_types": layer_types, "query_pre_attn_scalar": common["head_dim"], **common},
                                attention_bias=bool(attention_bias))
    raise ValueError(f"family={family!r} is not one of {FAMILIES}")


# A minimal chat template (role: content lines), for checkpoints that should look like chat models.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tiny_checkpoint(
    out_dir: str | pathlib.Path,
    family: str = "llama",
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_embeddings: bool = False,
    max_position_embeddings: int = 512,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
    attention_bias: bool | None = None,
    tokenizer_dir: str | pathlib.Path | None = None,
    init_std: float = 0.02,
    config_overrides: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Write a random-weight causal LM checkpoint of ``family`` to ``out_dir`` and return the path.

    family: "llama" | "llama3" (llama3 rope scaling) | "qwen2" (q/k/v bias) | "mistral" | "qwen3" (q/k norm)
        | "gemma3" (Gemma 3 text: sandwich norms, GeGLU, local/global layers with their own RoPE).
    vocab_size: defaults to the tokenizer's length; pass more to pad like real models do, or less
        to build a deliberately broken checkpoint (tokenizer larger than the model).
    rope_scaling: a rope parameter dict (e.g. {"rope_type": "linear", "factor": 2.0}) replacing the
        family default. attention_bias: None = the family's default (only llama takes True).
    tokenizer_dir: copy this tokenizer instead of the default ``tiny_tokenizer``.
    init_std: std of the random weights (HF ``initializer_range``).
    config_overrides: extra config fields (e.g. {"sliding_window": 8} for mistral).

    Deterministic for a given seed and arguments. Cached: a directory already written with the same
    arguments is returned untouched.
    """
    out = pathlib.Path(out_dir)
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {FAMILIES}")
    args = dict(family=family, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                tie_embeddings=tie_embeddings, max_position_embeddings=max_position_embeddings, seed=seed,
                rope_scaling=rope_scaling, attention_bias=attention_bias, init_std=init_std,
                tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None,
                config_overrides=config_overrides)
    stamp = out / _STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == json.loads(json.dumps(args)):
        return out

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    src_tok = pathlib.Path(tokenizer_dir) if tokenizer_dir else tiny_tokenizer(out)
    if src_tok.resolve() != out.resolve():
        for name in _TOKENIZER_FILES:
            if (src_tok / name).is_file():
                shutil.copyfile(src_tok / name, out / name)
    tok = AutoTokenizer.from_pretrained(str(out))
    common = dict(
        vocab_size=vocab_size or len(tok), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_embeddings, initializer_range=init_std, rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        **(config_overrides or {}),
    )
    config = _family_config(family, common, rope_scaling, attention_bias)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_norms(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(str(out))
    stamp.write_text(json.dumps(args, sort_keys=True))
    return out


def _perturb_norms(model, seed: int) -> None:
    """HF initialises RMSNorm weights (and biases) to exactly 1 (0); randomise them a little so a
    forward that skipped a norm or a bias would not still match the reference."""
    import torch

    gen = torch.Generator().manual_seed(seed + 7919)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))



def scattered_runner(path: str | pathlib.Path, *, max_context: int, blocks: int, block_size: int = 4,
                     max_slots: int = 8, seed: int = 0, **kw):
    """A lean runner (float32, CPU) whose KV pool holds `blocks` blocks of `block_size` positions (too
    few for a block region per slot, so sequences page) with its free blocks in a random order: each
    sequence's blocks end up scattered over the pool. Through the public API only: a one-token
    sequence in every block, freed in a shuffled order."""
    import torch
    from transformers import AutoConfig

    from duospec.engine import SlotChunk, load_model
    from duospec.engine.loader import KVOptions

    config = AutoConfig.from_pretrained(str(path))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4 * block_size
    runner = load_model(path, device="cpu", dtype=torch.float32, max_slots=max(max_slots, blocks),
                        max_context=max_context,
                        kv=KVOptions(block_size=block_size, kv_cache_memory_bytes=blocks * block_bytes), **kw)
    filler = [runner.allocate_slot() for _ in range(blocks)]
    runner.forward([SlotChunk(slot, 0, [3]) for slot in filler])
    random.Random(seed).shuffle(filler)
    for slot in filler:
        runner.free_slot(slot)
    return runner
