"""EAGLE-3 heads (Li et al., 2025): one decoder layer over features fused from three target layers,
with an LM head over a draft vocabulary.

Features: the target's residual stream entering three of its layers (low, middle, high; by default
``2, N // 2, N - 3`` as the EAGLE-3 authors and vLLM pick them), concatenated: ``F[j]`` is
``[3 * hidden]`` at position ``j``. The target computes them during verification
(`LeanLlamaRunner.set_feature_layers`) and sends them with each verdict, as it sends EAGLE's.

Head row ``j`` reads token ``t[j]`` and a feature ``g`` of position ``j - 1``: ``fc(F[j - 1])`` where
the target has verified that position, else the head's own output at row ``j - 1`` (zeros at row 0).
The layer attends over ``[input_norm(embed(t[j])); hidden_norm(g)]`` (width ``2 * hidden``) with
``g`` as its residual; its output ``o[j]`` (before the final norm) is the feature the next row reads
when it runs ahead, and ``lm_head(norm(o[j]))`` drafts token ``j + 1`` over the draft vocabulary.
Draft id ``i`` is target token ``i + d2t[i]``; the logits are scattered into the target's vocabulary
(``-inf`` elsewhere), so q is zero outside the draft vocabulary and the target still corrects with
any token (docs/design.md, "Exactness").

Two layouts load into the one runner (`load_eagle3`):

- duospec's: ``head.json`` (method ``eagle3``, the target's fingerprint, the feature layers, a model
  card) + ``model.safetensors`` under the engine's names (``model.layers.0.*``, ``model.norm.weight``);
- the published one (the EAGLE-3 authors', SpecForge, vLLM): ``config.json`` (a Llama config with
  ``draft_vocab_size``; ``eagle_config.eagle_aux_hidden_state_layer_ids`` optional) + safetensors with
  ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``. `PUBLISHED_NAMES` is the one table
  between the two; `duospec train-heads --layout published` writes it.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from duospec.engine.errors import CheckpointError
from duospec.engine.heads import HEAD_FILE, WEIGHTS_FILE, TargetIO, _check_target, eagle_layer_config, read_head
from duospec.engine.llama import LeanLlamaRunner
from duospec.engine.loader import KVOptions

CONFIG_FILE = "config.json"  # the published layout's
PUBLISHED_ARCHITECTURE = "LlamaForCausalLMEagle3"
# published name prefix -> duospec's (the engine's Llama names); everything else keeps its name
PUBLISHED_NAMES = {"midlayer.": "model.layers.0.", "norm.weight": "model.norm.weight"}
LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high: the layers the EAGLE-3 authors and vLLM read by default (2, N // 2,
    N - 3); for shallow targets where those coincide, the first, middle and last; all of them below 3."""
    if num_layers < 3:
        return tuple(range(num_layers))
    picks = (2, num_layers // 2, num_layers - 3)
    return picks if len(set(picks)) == 3 and picks[0] < picks[1] < picks[2] else (0, num_layers // 2, num_layers - 1)


@dataclass(frozen=True)
class Eagle3Info:
    """What a head directory declares, in either layout."""

    path: pathlib.Path
    layout: str  # "duospec" | "published"
    feature_layers: tuple[int, ...]
    draft_vocab_size: int
    hidden_size: int
    vocab_size: int  # the target's
    target_fingerprint: str | None  # duospec's layout only
    card: dict | None = None


def is_published(path: str | pathlib.Path) -> bool:
    path = pathlib.Path(path)
    return (path / CONFIG_FILE).is_file() and not (path / HEAD_FILE).is_file()


def _weights_file(path: pathlib.Path) -> pathlib.Path:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors with the head's weights")
    if len(files) > 1:
        raise CheckpointError(f"{path}: {len(files)} safetensors files; an EAGLE-3 head is one file")
    return files[0]


def read_eagle3(path: str | pathlib.Path, target_config) -> Eagle3Info:
    """The head's declaration, validated against nothing but itself and the target's depth."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (an EAGLE-3 head is a folder with {HEAD_FILE} or {CONFIG_FILE})")
    if not is_published(path):
        info = read_head(path, "eagle3")
        meta = json.loads((path / HEAD_FILE).read_text()).get("eagle3", {})
        layers = tuple(meta.get("feature_layers") or default_feature_layers(target_config.num_hidden_layers))
        return Eagle3Info(path, "duospec", layers, int(meta.get("draft_vocab_size", info.vocab_size)),
                          info.hidden_size, info.vocab_size, info.target_fingerprint, info.card)
    config_file = path / CONFIG_FILE
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{config_file}: unreadable ({err})") from err
    for field in ("hidden_size", "vocab_size"):
        if not isinstance(config.get(field), int):
            raise CheckpointError(f"{config_file}: field {field!r} missing or not an integer")
    eagle = config.get("eagle_config") or {}
    layers = eagle.get("eagle_aux_hidden_state_layer_ids") or default_feature_layers(target_config.num_hidden_layers)
    return Eagle3Info(path, "published", tuple(int(i) for i in layers),
                      int(config.get("draft_vocab_size") or config["vocab_size"]), config["hidden_size"],
                      config["vocab_size"], None)


def _published_to_duospec(name: str) -> str:
    for published, ours in PUBLISHED_NAMES.items():
        if name.startswith(published):
            return ours + name[len(published):]
    return name


def _duospec_to_published(name: str) -> str:
    for published, ours in PUBLISHED_NAMES.items():
        if name.startswith(ours):
            return published + name[len(ours):]
    return name


def _check_weights(info: Eagle3Info, weights: dict[str, torch.Tensor], io: TargetIO, file: pathlib.Path) -> torch.Tensor:
    """Shapes against the target; returns the draft -> target token map [draft_vocab] (long)."""
    hidden, vocab = io.config.hidden_size, io.config.vocab_size
    if info.hidden_size != hidden:
        raise CheckpointError(f"{info.path}: hidden_size {info.hidden_size}, but the target's is {hidden}")
    if info.vocab_size != vocab:
        raise CheckpointError(f"{info.path}: vocab_size {info.vocab_size}, but the target's vocabulary is {vocab}")
    layers, depth = list(info.feature_layers), io.config.num_hidden_layers
    if not layers or layers != sorted(set(layers)) or not all(0 <= i < depth for i in layers):
        raise CheckpointError(f"{info.path}: feature layers {layers}; an EAGLE-3 head reads distinct ascending "
                              f"layers of the target's {depth}")
    needed = ["fc.weight", "lm_head.weight", "model.norm.weight", "d2t",
              *(f"model.layers.0.{name}" for name in LAYER_WEIGHTS)]
    for name in needed:
        if name not in weights:
            shown = _duospec_to_published(name) if info.layout == "published" else name
            raise CheckpointError(f"{file}: tensor {shown!r} missing (an EAGLE-3 head needs {shown})")
    fc = weights["fc.weight"]
    width = len(layers) * hidden
    if tuple(fc.shape) != (hidden, width):
        raise CheckpointError(f"{file}: fc.weight is {list(fc.shape)}, expected [{hidden}, {width}] for "
                              f"{len(layers)} feature layers of this target")
    d2t = weights["d2t"].long()
    head = weights["lm_head.weight"]
    if d2t.dim() != 1 or d2t.shape[0] != head.shape[0] or head.shape[0] != info.draft_vocab_size:
        raise CheckpointError(f"{file}: d2t has {list(d2t.shape)} entries and lm_head.weight {list(head.shape)} rows; "
                              f"both must equal draft_vocab_size {info.draft_vocab_size}")
    ids = torch.arange(d2t.shape[0]) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
        raise CheckpointError(f"{file}: d2t maps draft ids outside the target's vocabulary of {vocab} "
                              "or onto one token twice")
    return ids


class Eagle3Runner(LeanLlamaRunner):
    """An EAGLE-3 head on duospec's lean engine: a one-layer Llama whose rows are
    [embedding; feature] (2 * hidden wide), whose features are its pre-norm outputs, and whose LM
    head covers the draft vocabulary. Slots, rollback, branches and trees are the engine's."""

    features_before_norm = True

    def __init__(self, config, state_dict, *, fc: torch.Tensor, hidden_norm: torch.Tensor,
                 draft_ids: torch.Tensor, feature_layers: tuple[int, ...], **kwargs):
        super().__init__(config, state_dict, draft_ids=draft_ids, **kwargs)  # draft id i is target token draft_ids[i]
        self.fc = fc.to(device=self.device, dtype=self.dtype)
        self.hidden_norm = hidden_norm.to(device=self.device, dtype=self.dtype)
        self.target_feature_layers = feature_layers  # what the target sends (its set_feature_layers)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [n, layers * hidden] -> the rows the layer reads [n, hidden]."""
        return F.linear(features.to(device=self.device, dtype=self.dtype), self.fc)

    def _inputs(self, batch, features):
        if features is None or features.shape[0] != batch.tokens.shape[0]:
            raise ValueError("the EAGLE-3 head needs one feature row per token")
        return torch.cat([F.embedding(batch.tokens, self.embed), features.to(device=self.device, dtype=self.dtype)], -1)

    def _attention(self, layer, h, cos, sin, batch, normed=None):
        embeds, features = h.split(self.config.hidden_size, dim=-1)
        normed = torch.cat([self._norm(embeds, layer.input_norm), self._norm(features, self.hidden_norm)], -1)
        return super()._attention(layer, features, cos, sin, batch, normed=normed)

    def forward_eagle(self, chunks, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As EagleRunner.forward_eagle: `features` [N, hidden] are already projected (`project`) or
        the head's own outputs; returns the last rows' logits over the target's vocabulary and every
        row's output feature [N, hidden] (float32, CPU)."""
        self._validate(chunks)
        return self._run(chunks, last_only=True, to_cpu=False, hidden=True, features=features, all_hidden=True)


def load_eagle3_weights(info: Eagle3Info) -> tuple[dict[str, torch.Tensor], pathlib.Path]:
    """The head's tensors under duospec's names (float32), and the file they came from."""
    from safetensors.torch import load_file

    file = info.path / WEIGHTS_FILE if info.layout == "duospec" else _weights_file(info.path)
    if not file.is_file():
        raise CheckpointError(f"{info.path}: no {file.name}")
    raw = load_file(str(file))
    if info.layout == "published":
        raw = {_published_to_duospec(k): v for k, v in raw.items() if k not in ("t2d", "embed_tokens.weight")}
    return {k: (v if k == "d2t" else v.float()) for k, v in raw.items()}, file


def load_eagle3(path, target_path, *, device="cpu", dtype=torch.float32, max_slots: int = 16,
                max_context: int | None = None, io: TargetIO | None = None, kv: KVOptions | None = None) -> Eagle3Runner:
    """Either layout; refused (CheckpointError naming the file and the field) when it does not fit the target."""
    from duospec.engine.heads import read_target_io

    io = io or read_target_io(target_path)
    info = read_eagle3(path, io.config)
    if info.layout == "duospec":
        _check_target(read_head(path, "eagle3"), io)
    weights, file = load_eagle3_weights(info)
    draft_ids = _check_weights(info, weights, io, file)
    config = eagle_layer_config(io.config)
    config.tie_word_embeddings = False
    state = {k: v for k, v in weights.items() if k.startswith("model.") and "hidden_norm" not in k}
    state["model.embed_tokens.weight"] = io.embed
    state["lm_head.weight"] = weights["lm_head.weight"]
    return Eagle3Runner(config, state, fc=weights["fc.weight"], hidden_norm=weights["model.layers.0.hidden_norm.weight"],
                        draft_ids=draft_ids, feature_layers=info.feature_layers, device=torch.device(device),
                        dtype=dtype, max_slots=max_slots, max_context=max_context or config.max_position_embeddings,
                        **(kv.kwargs() if kv is not None else {}))


def head_feature_layers(path, target_path) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads (what the target worker taps), from its declaration."""
    from transformers import AutoConfig

    return read_eagle3(path, AutoConfig.from_pretrained(str(target_path))).feature_layers


def write_published(out: pathlib.Path, io: TargetIO, weights: dict[str, torch.Tensor],
                    feature_layers: tuple[int, ...]) -> None:
    """The head in the published layout (config.json + model.safetensors), as vLLM and SGLang load it."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    d2t = weights["d2t"].long()
    t2d = torch.zeros(io.config.vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.shape[0]) + d2t] = True
    tensors = {_duospec_to_published(k): (v.to(torch.float16) if v.is_floating_point() else v).contiguous()
               for k, v in weights.items()}
    tensors["t2d"] = t2d
    save_file(tensors, str(out / WEIGHTS_FILE))
    layer = eagle_layer_config(io.config).to_dict()
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters", "vocab_size", "hidden_act")
    config = {"architectures": [PUBLISHED_ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
              **{k: layer[k] for k in keep if k in layer}, "draft_vocab_size": int(d2t.shape[0]),
              "tie_word_embeddings": False, "torch_dtype": "float16",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(feature_layers)}}
    theta = (layer.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        config["rope_theta"] = theta  # older readers look for it at the top level
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def tap_features(target_runner, layers: tuple[int, ...]):
    """Make `target_runner` send the features an EAGLE-3 drafter reads (`layers`; () leaves it as it is)."""
    if layers:
        if not hasattr(target_runner, "set_feature_layers"):
            raise CheckpointError("an EAGLE-3 drafter reads three of the target's layers: the target needs the "
                                  "lean backend (backend: lean)")
        target_runner.set_feature_layers(layers)
    return target_runner
