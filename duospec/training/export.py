"""Writing trained models as standard Hugging Face checkpoint directories."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# fp16 keeps 3 more mantissa bits than bf16, and these small models' weights are far inside its
# range; the engine upcasts to fp32 on CPU.
EXPORT_DTYPE = torch.float16


def export_checkpoint(model, tokenizer, out_dir: Path, max_new_tokens: int = 256) -> None:
    """Save `model` (16-bit safetensors), its config, generation config and `tokenizer` to `out_dir`."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to(EXPORT_DTYPE).eval()
    half.config.dtype = "float16"
    half.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    half.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
