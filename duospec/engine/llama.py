"""duospec's own forward for the Llama family (Llama incl. llama3 rope scaling, Qwen2, Mistral, Qwen3,
Gemma 3 text) over a paged KV cache.

KV cache: per layer ``k_cache``/``v_cache`` of shape ``[n_kv_heads, num_blocks * block_size, head_dim]``,
one pool preallocated at load (sized by duospec/engine/kv_memory.py); ``self.kv`` (blocks.py) maps
each slot's positions to blocks. A forward writes each chunk's keys/values at their blocks' rows and
gathers each sequence's rows ``0 .. K-1`` into ``[B, n_kv_heads, K, head_dim]``, the layout the slot
cache had, so attention computes exactly what it did. Rollback is the slot length in ``ModelRunner``
(stale positions are masked out and overwritten later).

One forward = one ragged batch: projections and MLPs run on the ``N`` flattened tokens; attention is
one SDPA call per layer over ``[B, heads, T, K]`` (``T`` = longest chunk, ``K`` = longest context)
with a boolean mask for causality, ragged lengths and sliding windows. Math follows transformers'
modeling_llama / modeling_qwen2 / modeling_mistral / modeling_qwen3 / modeling_gemma3 so the logits match
on the same weights. What the families add to Llama's layer: Qwen3 and Gemma 3 an RMSNorm over each
query and key head before rope; Gemma 3 besides: its (1 + w) RMSNorm computed in float32, norms after
attention and after the MLP (before each residual add), a GeGLU MLP, embeddings scaled by
sqrt(hidden_size), an attention scale from ``query_pre_attn_scalar``, local and global layers each with
its own rope, and optional final-logit softcapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, chain

import torch
import torch.nn.functional as F

from duospec.engine.blocks import BlockTables
from duospec.engine.cpu_linear import CpuLinear
from duospec.engine.errors import CheckpointError
from duospec.engine.kv_memory import DEFAULT_BLOCK_SIZE, pool_blocks
from duospec.engine.tensor_parallel import TensorParallel
from duospec.engine.runner import ModelRunner, SlotChunk

__all__ = ["LEAN_MODEL_TYPES", "LeanLlamaRunner", "lean_unsupported_reason"]

LEAN_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "gemma3_text")
# MLP activations by transformers' name (ACT2FN): gelu_pytorch_tanh is Gemma's GeGLU.
_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
# Rope variants whose frequencies are fixed at load time; "dynamic"/"longrope" depend on the
# sequence length at run time and go to the HF fallback.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_per_layer_type(config) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return "sliding_attention" in params or "full_attention" in params


def _rope_kinds(config) -> list[str | None]:
    """Per layer, the key of its rope parameters: the layer type where each type has its own (Gemma 3:
    local and global layers), else None (one rope for every layer)."""
    if _rope_per_layer_type(config):
        return list(config.layer_types)
    return [None] * config.num_hidden_layers


def _rope_params(config, kind: str | None = None) -> dict:
    if kind is not None:
        return dict(config.rope_parameters.get(kind) or {})
    # transformers 5 keeps everything in `rope_parameters`; 4.x had `rope_scaling` + `rope_theta`.
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def _rope_type(config, kind: str | None = None) -> str:
    params = _rope_params(config, kind)
    return params.get("rope_type", params.get("type", "default"))


def _activation_name(config) -> str:
    # Gemma's MLP reads `hidden_activation`; the others `hidden_act`.
    if config.model_type == "gemma3_text":
        return config.hidden_activation
    return getattr(config, "hidden_act", "silu")


def lean_unsupported_reason(config) -> str | None:
    """Why the lean forward cannot run this config (None = it can)."""
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {LEAN_MODEL_TYPES}"
    if _activation_name(config) not in _ACTIVATIONS:
        return f"MLP activation {_activation_name(config)!r} (supported: {tuple(_ACTIVATIONS)})"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias=True"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if not layer_types <= {"sliding_attention", "full_attention"}:
        return f"layer types {sorted(layer_types)} (supported: sliding_attention, full_attention)"
    if _rope_per_layer_type(config) and not layer_types:
        return "rope parameters per layer type, but no layer_types say which layer is which"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attn_logit_softcapping is set"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True"
    for kind in dict.fromkeys(_rope_kinds(config)):
        where = f" for {kind} layers" if kind else ""
        rope_type = _rope_type(config, kind)
        if rope_type not in _STATIC_ROPE_TYPES:
            return f"rope type {rope_type!r}{where} (supported: {_STATIC_ROPE_TYPES})"
        if _rope_params(config, kind).get("partial_rotary_factor",
                                          getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
            return f"partial_rotary_factor != 1{where}"
    return None


def _inv_freq(config, kind: str | None = None) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies and the cos/sin scale of the layers whose rope is `kind`
    (`_rope_kinds`), computed by transformers' own functions so every scaling variant matches it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = _rope_type(config, kind)
    if rope_type in ROPE_INIT_FUNCTIONS:
        extra = {"layer_type": kind} if kind is not None else {}
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
        return inv_freq.float(), float(scale)
    # transformers 5 moved "default" into each model's rotary class; this is its formula.
    params = _rope_params(config, kind)
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _layer_windows(config) -> list[int | None]:
    """Sliding-window size per layer (None = full attention), the way each family declares it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type in ("qwen2", "qwen3"):
        if not getattr(config, "use_sliding_window", False):
            return [None] * n
        if layer_types is None:  # transformers 4.x: layers from max_window_layers on slide
            first = getattr(config, "max_window_layers", n)
            return [window if i >= first else None for i in range(n)]
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * n


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: CpuLinear  # [(n_heads + 2 * n_kv_heads) * head_dim, hidden]
    o: CpuLinear  # [hidden, n_heads * head_dim]
    post_norm: torch.Tensor  # [hidden] before the MLP (Gemma: pre_feedforward_layernorm)
    gate_up: CpuLinear  # [2 * intermediate, hidden]
    down: CpuLinear  # [hidden, intermediate]
    window: int | None
    k_cache: torch.Tensor  # [n_kv_heads, num_blocks * block_size, head_dim]
    v_cache: torch.Tensor
    rope: str | None = None  # which of the runner's ropes (`_rope_kinds`)
    q_norm: torch.Tensor | None = None  # [head_dim] Qwen3, Gemma 3: over each query head, before rope
    k_norm: torch.Tensor | None = None  # [head_dim] ... and each key head
    attn_out_norm: torch.Tensor | None = None  # [hidden] Gemma 3: the attention's output, before the residual add
    mlp_out_norm: torch.Tensor | None = None  # [hidden] Gemma 3: the MLP's output, before the residual add


@dataclass
class _Batch:
    """Index tensors for one ragged forward, built once and shared by every layer."""

    tokens: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] rotary position of each token
    write_rows: torch.Tensor  # [N] pool row of each token's keys/values (its cache index's block row)
    # [B * K] pool row of each chunk's cache indices 0 .. K-1 (past its blocks: row 0, masked out), or
    # (first block, spacing) when they can be read as a view (`_read_rows`)
    read_rows: torch.Tensor | tuple[int, int]
    pad_index: torch.Tensor | None  # [N] row in the padded [B*T] layout; None when all chunks are T long
    masks: dict[int | None, torch.Tensor | None]  # window -> [B, 1, T, K] bool (True = attend)
    last_rows: torch.Tensor  # [B] row of each chunk's last token
    sizes: list[int]  # [B]
    n_chunks: int
    max_len: int  # T
    max_ctx: int  # K


class LeanLlamaRunner(ModelRunner):
    backend = "lean"
    supports_trees = True
    supports_hidden = True
    features_before_norm = False  # EAGLE-3 heads: a row's feature is the layer output before the final norm
    feature_layers: tuple[int, ...] = ()  # set_feature_layers

    def __init__(self, config, state_dict: dict[str, torch.Tensor], *, device: torch.device,
                 dtype: torch.dtype, max_slots: int, max_context: int, kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 prefix_caching: bool = True, tp: TensorParallel | None = None,
                 draft_ids: torch.Tensor | None = None, approximate: bool = False) -> None:
        """`max_slots`: sequences open at once (a slot costs nothing until it holds positions);
        `max_context`: positions of one sequence; the pool's size: kv_memory.pool_blocks.
        `draft_ids`: a draft's output vocabulary (ascending target ids; duospec/engine/draft_vocab.py):
        its LM head computes those rows only and every other token gets -inf, so q is zero outside
        them and the target, verifying over its whole vocabulary, still produces any token.
        `approximate`: a drafter's runner, whose products may run in float16 where that is faster
        (cpu_linear.py; a draft's logits only decide what is proposed, never what is output)."""
        super().__init__(max_slots, max_context)
        reason = lean_unsupported_reason(config)
        if reason is not None:
            raise CheckpointError(f"the lean backend cannot run this model: {reason}; use backend='hf'")
        self.config = config
        self.tp = tp  # None: one process holds the whole model
        self.device = torch.device(device)
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        if draft_ids is not None and tp is not None:
            raise CheckpointError("a draft vocabulary runs on one device: set the drafter's tensor_parallel_size: 1")
        self.draft_ids = None if draft_ids is None else draft_ids.to(self.device)
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps = config.rms_norm_eps
        self.block_size = block_size
        gemma = config.model_type == "gemma3_text"
        self.gemma_norm = gemma  # RMSNorm by (1 + w), both in float32 (`_norm`; weights stored so at load)
        self.act = _ACTIVATIONS[_activation_name(config)]
        self.attn_scale = config.query_pre_attn_scalar ** -0.5 if gemma else None  # None: 1/sqrt(head_dim)
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)
        with torch.no_grad():
            self._load_weights(config, state_dict, approximate)
            self._build_rope(config)
            self._allocate_pool(kv_cache_memory_bytes, gpu_memory_utilization, prefix_caching)

    # ---- load --------------------------------------------------------------------------------

    def _load_weights(self, config, sd: dict[str, torch.Tensor], approximate: bool) -> None:
        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise CheckpointError(f"weight {name!r} missing from the checkpoint's state dict")
            return sd[name].to(device=self.device, dtype=self.dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in sd else None

        def norm(name: str) -> torch.Tensor:
            # Gemma's norms multiply by 1 + w in float32 (transformers' Gemma3RMSNorm): kept that way.
            return 1.0 + take(name).float() if self.gemma_norm else take(name)

        gemma, qk_norm = config.model_type == "gemma3_text", config.model_type in ("qwen3", "gemma3_text")
        self.embed = take("model.embed_tokens.weight")
        # Gemma multiplies the embeddings by sqrt(hidden_size) rounded to the model dtype, as transformers does.
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(self.device, self.dtype) if gemma else None
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in sd
        head = self.embed if tied else take("lm_head.weight")
        if self.draft_ids is not None and head.shape[0] == config.vocab_size:  # a whole-vocabulary head, cut
            head = head[self.draft_ids]
        measure = self.device.type == "cpu" and self.dtype == torch.float32
        # What one forward multiplies by (float32 bytes): the layers' weights and the LM head, not the
        # embedding (a forward gathers a few of its rows) unless it is the head.
        weight_bytes = 4 * (head.numel() + sum(t.numel() for name, t in sd.items()
                                               if t.dim() == 2 and name.startswith("model.layers.")))

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> CpuLinear:
            return CpuLinear(weight, bias, measure=measure, model_weight_bytes=weight_bytes, approximate=approximate)

        self.lm_head = linear(head)
        self.final_norm = norm("model.norm.weight")
        self.layers: list[_Layer] = []
        for i, (window, rope) in enumerate(zip(_layer_windows(config), _rope_kinds(config))):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            biases = [maybe(a + f"{x}_proj.bias") for x in "qkv"]
            self.layers.append(_Layer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=linear(torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"]),
                           torch.cat(biases) if all(b is not None for b in biases) else None),
                o=linear(take(a + "o_proj.weight"), maybe(a + "o_proj.bias")),
                post_norm=norm(p + ("pre_feedforward" if gemma else "post_attention") + "_layernorm.weight"),
                gate_up=linear(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                down=linear(take(p + "mlp.down_proj.weight")),
                window=window if window is not None and window < self.max_context else None,
                k_cache=torch.empty(0), v_cache=torch.empty(0),  # _allocate_pool, once the weights are in
                rope=rope,
                q_norm=norm(a + "q_norm.weight") if qk_norm else None,
                k_norm=norm(a + "k_norm.weight") if qk_norm else None,
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
            ))
        self._windows = sorted({layer.window for layer in self.layers}, key=lambda w: w or 0)

    def _allocate_pool(self, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None,
                       prefix_caching: bool) -> None:
        row_bytes = 2 * len(self.layers) * self.n_kv_heads * self.head_dim * self.embed.element_size()
        num_blocks = pool_blocks(block_bytes=row_bytes * self.block_size, block_size=self.block_size,
                                 max_slots=self.max_slots, max_context=self.max_context, device=self.device,
                                 kv_cache_memory_bytes=kv_cache_memory_bytes,
                                 gpu_memory_utilization=gpu_memory_utilization)
        if self.tp is not None:  # each rank sized its own pool: all take the smallest, so block tables agree
            num_blocks = self.tp.agree_min(num_blocks)
        per_sequence = -(-self.max_context // self.block_size)
        # A pool sized like a slot cache is laid out like one (BlockTables: homes); a smaller one pages.
        homes = per_sequence if num_blocks >= self.max_slots * per_sequence else 0
        self.kv = BlockTables(num_blocks, self.block_size, prefix_caching=prefix_caching, home_blocks=homes)
        shape = (self.n_kv_heads, num_blocks * self.block_size, self.head_dim)
        for layer in self.layers:
            # zeros: a masked-out row still enters attention multiplied by 0, so it must be finite
            layer.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
            layer.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _build_rope(self, config) -> None:
        """``self.rope``: per rope kind the layers use (`_rope_kinds`), cos and sin [max_context, head_dim]."""
        self.rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for kind in dict.fromkeys(layer.rope for layer in self.layers):
            inv_freq, scale = _inv_freq(config, kind)
            if inv_freq.numel() * 2 != self.head_dim:
                raise CheckpointError(f"rotary dim {inv_freq.numel() * 2} != head_dim {self.head_dim}")
            # Same arithmetic as transformers' rotary embedding: fp32 angles, then cast to the model dtype.
            freqs = torch.arange(self.max_context, dtype=torch.float)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.rope[kind] = ((emb.cos() * scale).to(device=self.device, dtype=self.dtype),
                               (emb.sin() * scale).to(device=self.device, dtype=self.dtype))

    def _rows(self, blocks: list[int], cache_indices) -> list[int]:
        """Pool rows of a slot's cache indices."""
        bs = self.block_size
        return [blocks[i // bs] * bs + i % bs for i in cache_indices]

    def _move_positions(self, slot: int, src: list[int], dst: list[int]) -> None:
        blocks = self.kv.blocks(slot)
        self._copy_rows(self._rows(blocks, src), self._rows(blocks, dst))

    def _copy_rows(self, src: list[int], dst: list[int]) -> None:
        src_t = torch.tensor(src, device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        for layer in self.layers:  # the gather copies first, so overlapping moves are safe
            layer.k_cache[:, dst_t] = layer.k_cache[:, src_t]
            layer.v_cache[:, dst_t] = layer.v_cache[:, src_t]

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, copy) block's rows into the copy."""
        bs = self.block_size
        self._copy_rows([s * bs + i for s, _ in pairs for i in range(bs)],
                        [d * bs + i for _, d in pairs for i in range(bs)])

    # ---- forward -----------------------------------------------------------------------------

    def _forward(self, chunks: Sequence[SlotChunk], *, last_only: bool, to_cpu: bool):
        logits, _ = self._run(chunks, last_only=last_only, to_cpu=to_cpu)
        return logits

    def forward_with_hidden(self, chunks: Sequence[SlotChunk]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        self._validate(chunks)
        return self._run(chunks, last_only=False, to_cpu=True, hidden=True)

    def _forward_rows(self, chunks: Sequence[SlotChunk], first_rows: Sequence[int],
                      hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        offsets = [0, *accumulate(len(c.token_ids) for c in chunks)]
        keep = list(chain.from_iterable(range(o + f, o + len(c.token_ids))
                                        for o, f, c in zip(offsets, first_rows, chunks)))
        return self._run(chunks, last_only=False, to_cpu=False, hidden=hidden, keep_rows=keep)

    @property
    def _features_are_normed(self) -> bool:
        return not self.feature_layers and not self.features_before_norm

    def set_feature_layers(self, layers) -> None:
        """Make the features (`forward_with_hidden`, `forward_for_verify(hidden=True)`) the residual
        stream entering each of `layers`, concatenated [N, len(layers) * hidden] (what an EAGLE-3 head
        reads), instead of the final norm's output; None or () restores that."""
        layers = tuple(layers or ())
        bad = [i for i in layers if not 0 <= i < len(self.layers)]
        if bad:
            raise CheckpointError(f"feature layers {list(bad)} out of range: the model has {len(self.layers)} layers")
        if list(layers) != sorted(set(layers)):  # taps are collected in layer order
            raise CheckpointError(f"feature layers {list(layers)} must be distinct and ascending")
        self.feature_layers = layers

    def _features(self, h: torch.Tensor, taps: list[torch.Tensor]) -> torch.Tensor:
        """Every row's feature: the taps (feature_layers), the last layer's output (a head that feeds
        its own pre-norm output back, EAGLE-3) or the final norm's output (what the LM head reads)."""
        if self.feature_layers:
            return torch.cat(taps, dim=-1)
        return h if self.features_before_norm else self._norm(h, self.final_norm)

    def _inputs(self, batch: _Batch, features: torch.Tensor | None) -> torch.Tensor:
        """[N, hidden] the first layer's input rows (the EAGLE head mixes in features here)."""
        rows = F.embedding(batch.tokens, self.embed)
        return rows if self.embed_scale is None else rows * self.embed_scale

    def _run(self, chunks: Sequence[SlotChunk], *, last_only: bool, to_cpu: bool, hidden: bool = False,
             features: torch.Tensor | None = None, all_hidden: bool = False, keep_rows: list[int] | None = None):
        """(logits, hidden states or None): logits as `forward`/`forward_last` return them; with
        `hidden`, the features (`_features`: by default the final-norm outputs, what the LM head
        reads) of the same rows, float32, CPU; with `all_hidden` (and last_only), those of every row,
        flat [N, feature width].

        `keep_rows` (flat row indices; `forward_for_verify`): the LM head runs on those rows only and
        both results stay on the device, flat: logits [len(keep_rows), V], hidden states of every row."""
        all_hidden = all_hidden or (keep_rows is not None and hidden)
        with torch.inference_mode():
            batch = self._prepare(chunks)
            h = self._inputs(batch, features)  # [N, hidden]
            ropes = {kind: (cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1))  # [N, 1, head_dim]
                     for kind, (cos, sin) in self.rope.items()}
            taps = []  # the residual stream entering each of `feature_layers` (EAGLE-3's features)
            for i, layer in enumerate(self.layers):
                if i in self.feature_layers:
                    taps.append(h)
                h = self._attention(layer, h, *ropes[layer.rope], batch)
                h = self._mlp(layer, h)
            keep = batch.last_rows if last_only else None
            if keep_rows is not None:
                keep = torch.tensor(keep_rows, dtype=torch.long).to(self.device, non_blocking=True)
            every = self._features(h, taps) if hidden or all_hidden else None  # [N, feature width]
            if every is not None and self._features_are_normed:
                h = every if keep is None else every[keep]  # the LM head reads the features: one norm
            else:
                h = self._norm(h if keep is None else h[keep], self.final_norm)
        # The LM head runs outside inference mode so the logits are ordinary tensors: callers
        # (temperature, top-k) may modify them in place without a copy.
        with torch.no_grad():
            logits = self._lm_head(h).float()
            if keep_rows is not None:
                self._commit_lengths(chunks)
                return logits, every.float() if hidden else None
            if to_cpu:
                logits = logits.cpu()
            if every is not None and keep is not None and not all_hidden:
                every = every[keep]
            states = every.float().cpu() if hidden else None
        self._commit_lengths(chunks)
        if last_only:
            return logits, states
        return list(logits.split(batch.sizes)), list(states.split(batch.sizes)) if hidden else None

    def _prepare(self, chunks: Sequence[SlotChunk]) -> _Batch:
        sizes = [len(c.token_ids) for c in chunks]
        starts = [c.start_pos for c in chunks]
        # Blocks first: it raises BlocksExhausted before anything changes when the pool is short.
        copies = self.kv.prepare_writes([(c.slot, s, s + n) for c, s, n in zip(chunks, starts, sizes)])
        if copies:
            self._copy_blocks(copies)
        tables = [self.kv.blocks(c.slot) for c in chunks]
        n_chunks, max_len = len(chunks), max(sizes)
        contexts = [s + n for s, n in zip(starts, sizes)]
        max_ctx = max(contexts)
        cache_index = list(chain.from_iterable(range(s, s + n) for s, n in zip(starts, sizes)))
        trees = [(b, c) for b, c in enumerate(chunks) if c.parents is not None]
        depths = [c.depths() for c in chunks] if trees else None  # chains: position == cache index
        positions = cache_index if not trees else list(
            chain.from_iterable([s + d for d in ds] for s, ds in zip(starts, depths)))
        write_rows = list(chain.from_iterable(self._rows(t, range(s, s + n)) for t, s, n in zip(tables, starts, sizes)))
        tokens = list(chain.from_iterable(c.token_ids for c in chunks))
        # One host->device copy for all per-token indices.
        flat = torch.tensor([tokens, positions, write_rows], dtype=torch.long).to(self.device, non_blocking=True)
        uniform = all(n == max_len for n in sizes)
        pad_index = None
        if not uniform:
            pad_index = torch.tensor(
                list(chain.from_iterable(range(b * max_len, b * max_len + n) for b, n in enumerate(sizes))),
                dtype=torch.long).to(self.device, non_blocking=True)
        last = [end - 1 for end in accumulate(sizes)]
        masks = {w: self._mask(starts, sizes, contexts, max_len, max_ctx, w, depths, trees) for w in self._windows}
        return _Batch(tokens=flat[0], positions=flat[1], write_rows=flat[2], read_rows=self._read_rows(tables, max_ctx),
                      pad_index=pad_index, masks=masks,
                      last_rows=torch.tensor(last, dtype=torch.long).to(self.device, non_blocking=True),
                      sizes=sizes, n_chunks=n_chunks, max_len=max_len, max_ctx=max_ctx)

    def _read_rows(self, tables: list[list[int]], max_ctx: int) -> torch.Tensor | tuple[int, int]:
        """What `_attention` reads: (first block, spacing in blocks) when every chunk's blocks for
        indices 0 .. K-1 lie in order and the chunks' first blocks are evenly spaced (a view of the pool,
        no copy), else the pool rows of each chunk's indices, flat [B * K]."""
        bs = self.block_size
        n = -(-max_ctx // bs)
        firsts = [t[0] for t in tables]
        spacing = firsts[1] - firsts[0] if len(tables) > 1 else 1
        if spacing > 0 and all(t[:n] == list(range(f, f + n)) and f == firsts[0] + b * spacing
                               for b, (t, f) in enumerate(zip(tables, firsts))):
            return firsts[0], spacing
        # Block ids to the device (B x n), rows computed there: B x K indices never cross the bus.
        padded = torch.tensor([t[:n] + [0] * (n - len(t[:n])) for t in tables], dtype=torch.long)
        padded = padded.to(self.device, non_blocking=True)
        rows = padded[:, :, None] * bs + torch.arange(bs, device=self.device)
        return rows.view(len(tables), n * bs)[:, :max_ctx].reshape(-1)

    def _mask(self, starts, sizes, contexts, max_len, max_ctx, window, depths, trees) -> torch.Tensor | None:
        """[B, 1, T, K] bool, True = attend. None when every query may see every gathered key."""
        if max_len == 1 and all(c == max_ctx for c in contexts) and (window is None or max_ctx <= window):
            return None
        start = torch.tensor(starts, dtype=torch.long)[:, None]
        last = torch.tensor(sizes, dtype=torch.long)[:, None] - 1
        # Padded query rows repeat the chunk's last real row, so no row is fully masked (NaN-free);
        # their outputs are dropped.
        rows = torch.arange(max_len)[None, :].clamp(max=last)  # [B, T]
        offsets = rows if not trees else torch.tensor([ds + [ds[-1]] * (max_len - len(ds)) for ds in depths])
        q_pos = start + offsets  # [B, T] the query's position
        k_pos = torch.arange(max_ctx)[None, None, :]  # [1, 1, K] a cached key's index = its position ...
        mask = k_pos <= q_pos[:, :, None]
        if window is not None:
            mask &= k_pos > q_pos[:, :, None] - window
        for b, chunk in trees:  # ... except inside a tree, where a node sees its ancestors only
            n, s = len(chunk.token_ids), chunk.start_pos
            if window is not None and n >= window:
                raise ValueError(f"a token tree of {n} nodes does not fit the sliding window of {window}")
            seen = torch.zeros(n, n, dtype=torch.bool)
            for i, parent in enumerate(chunk.parents):
                if parent >= 0:
                    seen[i] = seen[parent]
                seen[i, i] = True
            mask[b, :n, s : s + n] = seen
            mask[b, n:, s : s + n] = seen[-1]
        return mask.unsqueeze(1).to(self.device, non_blocking=True)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: each rank holds a partial sum (tensor_parallel.py)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the rows in `h`; under tensor parallelism each rank's vocabulary slice, gathered."""
        logits = self.lm_head(h)
        logits = logits if self.tp is None else self.tp.gather_vocab(logits, self.vocab_size)
        if self.logit_softcap is not None:  # Gemma: c * tanh(logits / c), in the model dtype as transformers
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        if self.draft_ids is not None:  # [n, draft vocabulary] -> the target's vocabulary, -inf elsewhere
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            logits = full.index_copy_(1, self.draft_ids, logits)
        return logits

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        # transformers' order for half types: normalise in fp32, cast back, then scale; Gemma scales by
        # its float32 (1 + w) before the cast.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * weight).to(x.dtype) if self.gemma_norm else weight * xf.to(x.dtype)

    def _attention(self, layer: _Layer, h: torch.Tensor, cos, sin, batch: _Batch,
                   normed: torch.Tensor | None = None) -> torch.Tensor:
        """h + the attention block's output; `normed`: its input rows when they are not
        input_norm(h) (an EAGLE-3 head reads [embedding; feature], each normed, beside residual h)."""
        n_tok = h.shape[0]
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = layer.qkv(self._norm(h, layer.input_norm) if normed is None else normed)
        qk = qkv[:, : (nh + nkv) * hd].view(n_tok, nh + nkv, hd)
        if layer.q_norm is not None:
            qk = torch.cat((self._norm(qk[:, :nh], layer.q_norm), self._norm(qk[:, nh:], layer.k_norm)), dim=1)
        qk = qk * cos + _rotate_half(qk) * sin  # rope on queries and keys in one go
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, (nh + nkv) * hd:].view(n_tok, nkv, hd)
        layer.k_cache[:, batch.write_rows] = k.transpose(0, 1)
        layer.v_cache[:, batch.write_rows] = v.transpose(0, 1)
        b, t = batch.n_chunks, batch.max_len
        if isinstance(batch.read_rows, tuple):  # [B, nkv, K, hd] views: sequence b starts `spacing` blocks on
            first, spacing = batch.read_rows
            view = ((b, nkv, batch.max_ctx, hd), (spacing * self.block_size * hd, layer.k_cache.stride(0), hd, 1),
                    first * self.block_size * hd)
            keys, values = layer.k_cache.as_strided(*view), layer.v_cache.as_strided(*view)
        else:  # [nkv, B*K, hd] -> [B, nkv, K, hd]: each (sequence, head) is K contiguous rows, as in a slot
            keys = layer.k_cache.index_select(1, batch.read_rows).view(nkv, b, batch.max_ctx, hd).transpose(0, 1)
            values = layer.v_cache.index_select(1, batch.read_rows).view(nkv, b, batch.max_ctx, hd).transpose(0, 1)
        if batch.pad_index is None:
            q_pad = q.reshape(b, t, nh, hd)
        else:
            q_pad = q.new_zeros(b * t, nh, hd).index_copy_(0, batch.pad_index, q).view(b, t, nh, hd)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys, values, attn_mask=batch.masks[layer.window], enable_gqa=nh != nkv,
            scale=self.attn_scale,
        )  # [B, nh, T, hd]
        out = out.transpose(1, 2).reshape(b * t, nh * hd)
        if batch.pad_index is not None:
            out = out.index_select(0, batch.pad_index)
        return h + self._out_norm(self._reduce(layer.o(out)), layer.attn_out_norm)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(self._norm(h, layer.post_norm)).chunk(2, dim=-1)
        return h + self._out_norm(self._reduce(layer.down(self.act(gate) * up)), layer.mlp_out_norm)

    def _out_norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """A block's output as the residual adds it: Gemma normalises it first (after the all-reduce:
        the norm needs the whole sum)."""
        return x if weight is None else self._norm(x, weight)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
