"""Model shapes for the bundled pair and for drafts distilled from any Llama-family target."""

from __future__ import annotations

from dataclasses import dataclass

# Architectures whose configs map onto the Llama layer (RMSNorm, RoPE, SwiGLU, GQA); the draft is
# always written as a LlamaForCausalLM so duospec's lean engine can run it.
SUPPORTED_TARGET_TYPES = {"llama", "qwen2", "mistral"}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


# The bundled pair. The target is deep enough that one decode step costs several draft steps even
# when per-layer overhead dominates (the draft has two layers: the fewest that can form induction heads, which copy identifiers); widths keep head_dim = 64.
TINY_TARGET = ModelShape(hidden=256, layers=6, heads=4, kv_heads=4, intermediate=704)
TINY_DRAFT = ModelShape(hidden=128, layers=2, heads=2, kv_heads=2, intermediate=384)


def llama_config(shape: ModelShape, vocab_size: int, bos_id, eos_id, max_positions: int,
                 rope_parameters: dict | None = None, rms_norm_eps: float = 1e-5):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=rms_norm_eps,
        rope_parameters=dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}),
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
        attention_bias=False,
        mlp_bias=False,
    )


def build_model(config, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model


def deepen(model, extra: int, seed: int):
    """Insert `extra` decoder layers into a Llama-family model, spread among its own, each starting as
    the identity: its attention and MLP output projections are zero, so the residual stream passes
    through untouched and the deeper model computes exactly what the shallower one did. Training then
    spends the new capacity from where the old model stood (a draft that has stopped improving at its
    size keeps its agreement instead of starting over). Returns the model, its config updated."""
    import torch

    layers = list(model.model.layers)
    if extra < 1 or not layers:
        raise ValueError(f"deepen: need at least one layer to add to a model with layers, got {extra}")
    config = model.config
    layer_class = type(layers[0])
    generator = torch.Generator().manual_seed(seed)
    old, grown = len(layers), []
    # new layer j goes after old layer (j + 1) * old // extra - 1: evenly spread, the last after the top
    # (several after one old layer when there are more new than old)
    after = [max((j + 1) * old // extra - 1, 0) for j in range(extra)]
    order = [i for i in range(old) for _ in range(1 + after.count(i))]  # the old layer each grown slot follows
    types = getattr(config, "layer_types", None)
    if types is not None:  # read by each layer's constructor; a new layer takes its predecessor's type
        config.layer_types = [types[i] for i in order]
    config.num_hidden_layers = len(order)
    for slot, i in enumerate(order):
        if slot and order[slot - 1] == i:  # the second slot of old layer i: a new layer
            fresh = layer_class(config, slot)  # built and drawn on the CPU (the generator's), then moved
            with torch.no_grad():
                for name, param in fresh.named_parameters():
                    if name.endswith(("o_proj.weight", "down_proj.weight")):
                        param.zero_()
                    elif param.dim() == 2:
                        param.normal_(0.0, config.initializer_range, generator=generator)
            grown.append(fresh.to(layers[i].self_attn.o_proj.weight))  # the old layers' device and dtype
        else:
            grown.append(layers[i])
            layers[i].self_attn.layer_idx = slot  # the KV cache is indexed by layer
    model.model.layers = torch.nn.ModuleList(grown)
    return model


def widen_mlp(model, intermediate: int, seed: int):
    """Widen every decoder layer's SwiGLU MLP to `intermediate` units; the new units' output weights
    (down_proj columns) are zero, so the model computes what it did, up to rounding (at batch 1 on a
    CPU, width costs less per parameter than depth: each layer has a fixed cost of its own). Returns
    the model."""
    import torch

    config = model.config
    if intermediate <= config.intermediate_size:
        raise ValueError(f"widen_mlp: {intermediate} units is not wider than the model's {config.intermediate_size}")
    generator = torch.Generator().manual_seed(seed)
    extra = intermediate - config.intermediate_size
    for layer in model.model.layers:
        mlp = layer.mlp
        for name in ("gate_proj", "up_proj"):  # [units, hidden]: new rows
            old = getattr(mlp, name).weight
            rows = torch.empty(extra, old.shape[1]).normal_(0.0, config.initializer_range, generator=generator)
            setattr(mlp, name, _linear(torch.cat([old.detach(), rows.to(old)])))
        old = mlp.down_proj.weight  # [hidden, units]: new columns, zero
        mlp.down_proj = _linear(torch.cat([old.detach(), old.new_zeros(old.shape[0], extra)], dim=1))
        mlp.intermediate_size = intermediate
    config.intermediate_size = intermediate
    return model


def blend_weights(model, init_state: dict, init_share: float) -> None:
    """In place: every weight becomes (1 - init_share) * trained + init_share * init (weight-space
    averaging, as WiSE-FT does). A continuation trained on new data drifts from what the init
    already did well; the average keeps much of both, and no draft step costs more."""
    import torch

    if not 0.0 <= init_share <= 1.0:
        raise ValueError(f"the init's share must be within [0, 1], got {init_share}")
    with torch.no_grad():
        for name, tensor in model.named_parameters():  # a tied LM head is listed (and averaged) once
            init = init_state.get(name)
            if init is None or init.shape != tensor.shape:
                found = "missing" if init is None else f"shaped {tuple(init.shape)}"
                raise ValueError(f"weight {name} is {found} in the init, {tuple(tensor.shape)} in the trained model; "
                                 "only a draft of the init's own shape can be averaged with it")
            tensor.lerp_(init.to(tensor.dtype), init_share)


def _linear(weight):
    import torch

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight.contiguous())
    return linear


def count_parameters(model) -> int:
    # Tied embeddings are one tensor; parameters() already deduplicates shared tensors.
    return sum(p.numel() for p in model.parameters())
