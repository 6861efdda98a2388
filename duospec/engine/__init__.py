"""The model engine: checkpoints in, a ``ModelRunner`` (a KV cache per sequence slot) out.

    ckpt = load_checkpoint("models/target", device="cpu", max_slots=8)
    slot = ckpt.runner.allocate_slot()
    logits = ckpt.runner.forward([SlotChunk(slot, 0, prompt_ids)])[0]   # [n, vocab] float32, CPU
    ckpt.runner.truncate(slot, n_accepted)                               # rollback

Files: runner.py (interface + slot bookkeeping), llama.py (lean Llama/Qwen2/Mistral/Qwen3/Gemma 3
forward over a paged KV cache), blocks.py (its block tables and prefix cache), kv_memory.py (the pool's
size), cpu_linear.py (its float32 CPU projections, through the GEMM kernel measured fastest here), heads.py
(EAGLE/Medusa heads), replay.py (bench --simulate), hf_runner.py (transformers fallback), loader.py
(paths, options, backend choice), errors.py.
"""

from duospec.engine.errors import BlocksExhausted, CheckpointError, SlotsExhausted
from duospec.engine.loader import LoadedCheckpoint, load_checkpoint, load_model, load_tokenizer, resolve_dtype
from duospec.engine.runner import ModelRunner, SlotChunk

__all__ = [
    "BlocksExhausted",
    "CheckpointError",
    "LoadedCheckpoint",
    "ModelRunner",
    "SlotChunk",
    "SlotsExhausted",
    "load_checkpoint",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
]
