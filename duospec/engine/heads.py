"""Draft heads that read the target's own hidden states: EAGLE and Medusa.

Both heads work on *features*: the target's final hidden states (after its final norm, the rows its
LM head reads), one per position; ``f[j]`` is what the target computed at position ``j`` and its LM
head turns into the distribution of token ``j + 1``. The heads keep the target's embedding and LM
head (copied from the target checkpoint at load time, never trained, never stored with the head).

EAGLE (Li et al., 2024): one Llama decoder layer over a slot KV cache of its own. Row ``j`` reads
``fc([embed(t[j]); f[j - 1]])`` (``f[-1]`` = zeros) and predicts ``f[j]`` (its final norm's output);
the LM head on that prediction drafts token ``j + 1``. Past the last position the target has
verified, the head feeds its own predicted features back in, so it runs ahead of the target:
row ``j`` then reads ``g[j - 1]``, the head's output at row ``j - 1``. Rows sit at the sequence's
positions (RoPE), exactly like the target's, so hedges copy a KV prefix and trees work unchanged.

Medusa (Cai et al., 2024): ``heads`` residual blocks on one feature. Head ``i`` (1-based) maps
``f[j]`` to ``f[j] + SiLU(W_i f[j] + b_i)``; the LM head on it predicts token ``j + 1 + i`` (the
target's own LM head predicts ``j + 1``). No KV cache; a proposal needs the feature of the position
before the last verified token.

A head directory holds ``head.json`` (format, method, shape, the target's fingerprint, a model card)
and ``model.safetensors``. `duospec train-heads` writes them (duospec/training/heads.py); the drafter
loads them with `load_eagle` / `load_medusa`, which check that the target is the one the head was
trained for: same hidden size and vocabulary and the same embedding and LM head (`fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from duospec.engine.errors import CheckpointError
from duospec.engine.llama import LeanLlamaRunner
from duospec.engine.loader import KVOptions

HEAD_FILE = "head.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "duospec-head/1"
METHODS = ("eagle", "eagle3", "medusa")  # eagle3: duospec/engine/eagle3.py
FINGERPRINT_ROWS = 1024  # embedding/LM-head rows hashed (evenly spaced): cheap for 150k vocabularies


def fingerprint(embed: torch.Tensor, lm_head: torch.Tensor) -> str:
    """A short hash of the target's embedding and LM head (shape + evenly spaced rows, fp16 bytes):
    a head trained for one checkpoint must not run on another that merely has the same shape."""
    digest = hashlib.sha256()
    for weight in (embed, lm_head):
        rows = torch.linspace(0, weight.shape[0] - 1, min(FINGERPRINT_ROWS, weight.shape[0])).long()
        digest.update(repr(tuple(weight.shape)).encode())
        digest.update(weight.detach()[rows].to(torch.float16).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class TargetIO:
    """What a head borrows from its target: the config, the embedding and the LM head."""

    config: object
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.embed, self.lm_head)


def read_target_io(target_path: str | pathlib.Path) -> TargetIO:
    """The target's config, embedding and LM head, read from its safetensors without the layers."""
    from safetensors import safe_open
    from transformers import AutoConfig

    path = pathlib.Path(target_path)
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as err:
        raise CheckpointError(f"{path}: not a model directory ({err})") from err
    wanted = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: head drafters need the target's weights as *.safetensors")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in wanted:
                if name in handle.keys():
                    wanted[name] = handle.get_tensor(name).float()
    embed = wanted["model.embed_tokens.weight"]
    if embed is None:
        raise CheckpointError(f"{path}: no model.embed_tokens.weight in its safetensors (not a Llama-family model?)")
    tied = getattr(config, "tie_word_embeddings", False) or wanted["lm_head.weight"] is None
    return TargetIO(config, embed, embed if tied else wanted["lm_head.weight"])


def eagle_layer_config(target_config):
    """The EAGLE head's decoder layer: one Llama layer of the target's width, heads and rope."""
    from transformers import LlamaConfig

    heads = target_config.num_attention_heads
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=dict(getattr(target_config, "rope_parameters", None)
                             or {"rope_type": "default", "rope_theta": getattr(target_config, "rope_theta", 10000.0)}),
        tie_word_embeddings=getattr(target_config, "tie_word_embeddings", False),
        attention_bias=False,
        mlp_bias=False,
    )


class MedusaHeads(torch.nn.Module):
    """`heads` residual blocks on a feature (training and serving share this module)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(heads))
        for block in self.blocks:  # start as the identity: head i first predicts what the LM head does
            torch.nn.init.zeros_(block.weight)
            torch.nn.init.zeros_(block.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [heads, ..., hidden]."""
        return torch.stack([features + F.silu(block(features)) for block in self.blocks])


# ---- head directories ------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadInfo:
    method: str
    path: pathlib.Path
    hidden_size: int
    vocab_size: int
    target_fingerprint: str
    medusa_heads: int = 0
    card: dict | None = None


def read_head(path: str | pathlib.Path, method: str | None = None) -> HeadInfo:
    """`head.json` of a head directory, validated (CheckpointError naming the problem)."""
    path = pathlib.Path(path)
    meta_file = path / HEAD_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: no {HEAD_FILE}; a head directory is written by `duospec train-heads`")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{meta_file}: unreadable ({err})") from err
    if meta.get("format") != FORMAT or meta.get("method") not in METHODS:
        raise CheckpointError(f"{meta_file}: format {meta.get('format')!r}, method {meta.get('method')!r}; "
                              f"expected {FORMAT!r} and one of {METHODS}")
    if method is not None and meta["method"] != method:
        raise CheckpointError(f"{path}: holds a {meta['method']} head, but the config asks for method {method!r}")
    if not (path / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{path}: no {WEIGHTS_FILE}")
    target = meta.get("target", {})
    return HeadInfo(method=meta["method"], path=path, hidden_size=int(target["hidden_size"]),
                    vocab_size=int(target["vocab_size"]), target_fingerprint=str(target["fingerprint"]),
                    medusa_heads=int(meta.get("medusa_heads", 0)), card=meta.get("card"))


def write_head(out: pathlib.Path, method: str, io: TargetIO, weights: dict[str, torch.Tensor], *,
               medusa_heads: int = 0, card: dict | None = None, extra: dict | None = None) -> None:
    """`extra`: more keys of head.json (an EAGLE-3 head's `eagle3`: feature layers, draft vocabulary)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.detach().to(torch.float16) if v.is_floating_point() else v).contiguous().cpu()
               for k, v in weights.items()},
              str(out / WEIGHTS_FILE))
    meta = {"format": FORMAT, "method": method,
            "target": {"hidden_size": io.config.hidden_size, "vocab_size": io.config.vocab_size,
                       "fingerprint": io.fingerprint},
            "medusa_heads": medusa_heads, **(extra or {}), "card": card or {}}
    (out / HEAD_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def _check_target(info: HeadInfo, io: TargetIO) -> None:
    hidden, vocab = io.config.hidden_size, io.config.vocab_size
    if (info.hidden_size, info.vocab_size) != (hidden, vocab):
        raise CheckpointError(f"{info.path}: trained for a target with hidden size {info.hidden_size} and "
                              f"vocabulary {info.vocab_size}; this target has {hidden} and {vocab}")
    if info.target_fingerprint != io.fingerprint:
        raise CheckpointError(f"{info.path}: trained for another checkpoint (the target's embedding/LM head "
                              f"fingerprint is {io.fingerprint}, the head's {info.target_fingerprint}); "
                              f"train a head for this target with `duospec train-heads`")


def _load_weights(info: HeadInfo) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(info.path / WEIGHTS_FILE))


class EagleRunner(LeanLlamaRunner):
    """The EAGLE head on duospec's lean engine: a one-layer Llama whose input rows mix each token's
    embedding with the feature before it. Slots, rollback, branches and trees are the engine's."""

    def __init__(self, config, state_dict, fc: torch.Tensor, **kwargs):
        super().__init__(config, state_dict, **kwargs)
        self.fc = fc.to(device=self.device, dtype=self.dtype)

    def _inputs(self, batch, features):
        if features is None or features.shape[0] != batch.tokens.shape[0]:
            raise ValueError("the EAGLE head needs one feature row per token")
        embeds = F.embedding(batch.tokens, self.embed)
        return F.linear(torch.cat([embeds, features.to(device=self.device, dtype=self.dtype)], -1), self.fc)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as the head's rows read them: as they are (EAGLE-3 fuses its own)."""
        return features

    def forward_eagle(self, chunks, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `chunks` with `features` [N tokens over all chunks, hidden] (row j's feature is that of
        position j - 1); returns each chunk's last row's logits [len(chunks), vocab] (float32, on the
        head's device) and every row's predicted feature [N, hidden] (float32, on the CPU)."""
        self._validate(chunks)
        return self._run(chunks, last_only=True, to_cpu=False, hidden=True, features=features, all_hidden=True)


def load_eagle(path, target_path, *, device="cpu", dtype=torch.float32, max_slots: int = 16,
               max_context: int | None = None, io: TargetIO | None = None, kv: KVOptions | None = None) -> EagleRunner:
    """`kv`: the head's KV pool (default: as many positions as `max_slots` sequences of `max_context`)."""
    info = read_head(path, "eagle")
    io = io or read_target_io(target_path)
    _check_target(info, io)
    weights = _load_weights(info)
    config = eagle_layer_config(io.config)
    state = {k: v for k, v in weights.items() if k.startswith("model.")}
    state["model.embed_tokens.weight"] = io.embed
    state["lm_head.weight"] = io.lm_head
    config.tie_word_embeddings = io.lm_head is io.embed
    return EagleRunner(config, state, weights["fc.weight"], device=torch.device(device), dtype=dtype,
                       max_slots=max_slots, max_context=max_context or config.max_position_embeddings,
                       **(kv.kwargs() if kv is not None else {}))


@dataclass
class MedusaModel:
    heads: MedusaHeads
    lm_head: torch.Tensor  # [vocab, hidden]

    @torch.no_grad()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[n, hidden] features -> [heads, n, vocab] float32."""
        hidden = self.heads(features.to(self.lm_head.dtype))
        return F.linear(hidden, self.lm_head).float()


def load_medusa(path, target_path, *, device="cpu", dtype=torch.float32, io: TargetIO | None = None) -> MedusaModel:
    info = read_head(path, "medusa")
    io = io or read_target_io(target_path)
    _check_target(info, io)
    heads = MedusaHeads(info.hidden_size, info.medusa_heads)
    heads.load_state_dict({k: v.float() for k, v in _load_weights(info).items()})
    heads = heads.to(device=device, dtype=dtype).eval()
    return MedusaModel(heads, io.lm_head.to(device=device, dtype=dtype))
