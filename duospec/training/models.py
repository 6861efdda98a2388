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


def count_parameters(model) -> int:
    # Tied embeddings are one tensor; parameters() already deduplicates shared tensors.
    return sum(p.numel() for p in model.parameters())
