"""From a `DraftSpec` to the Proposer that implements it (the only place that knows every method)."""

from __future__ import annotations

from duospec.draft_worker.proposer import DraftMethod, DraftSpec, Proposer


def build_proposer(spec: DraftSpec, target_path: str, *, device: str = "cpu", dtype: str = "auto",
                   max_slots: int = 16, max_context: int | None = None, runner=None,
                   prefill_chunk_tokens: int | None = None, kv=None) -> Proposer:
    """Loads what the method needs. `runner`: an already loaded draft ModelRunner (tests, benchmarks);
    `kv`: its KV pool (a duospec.engine.loader.KVOptions)."""
    if spec.method is DraftMethod.NGRAM:
        from duospec.draft_worker.ngram_proposer import NgramProposer

        return NgramProposer(spec.ngram)
    if spec.method is DraftMethod.MEDUSA:
        from duospec.draft_worker.medusa_proposer import MedusaProposer
        from duospec.engine import resolve_dtype
        from duospec.engine.heads import load_medusa
        from duospec.engine.loader import _resolve_device

        torch_device = _resolve_device(device)
        return MedusaProposer(load_medusa(spec.path, target_path, device=torch_device,
                                          dtype=resolve_dtype(dtype, torch_device)))
    if runner is None:
        runner = load_draft_runner(spec, target_path, device=device, dtype=dtype, max_slots=max_slots,
                                   max_context=max_context, kv=kv)
    chunking = {} if prefill_chunk_tokens is None else {"prefill_chunk_tokens": prefill_chunk_tokens}
    from duospec.draft_worker.context_lookup import ContextLookup
    from duospec.draft_worker.model_proposer import CPU_STOP_CONFIDENCE, ModelProposer

    stop = spec.stop_confidence
    if stop is None:
        stop = CPU_STOP_CONFIDENCE if str(getattr(runner, "device", device)).startswith("cpu") else 0.0
    chains = {"lookup": ContextLookup() if spec.context_lookup else None, "stop_below": stop, **chunking}
    if spec.method in (DraftMethod.EAGLE, DraftMethod.EAGLE3):
        from duospec.draft_worker.eagle_proposer import EagleProposer

        return EagleProposer(runner, spec.method, **chains)
    return ModelProposer(runner, spec.method, **chains)


def load_draft_runner(spec: DraftSpec, target_path: str, **kwargs):
    """The draft model of a `model`, `layers` or `eagle` spec (a fine-tuned shallow draft is a plain
    checkpoint; an EAGLE head also reads the target's embedding and LM head)."""
    from duospec.engine import load_model

    if spec.method in (DraftMethod.EAGLE, DraftMethod.EAGLE3):
        from duospec.engine import resolve_dtype
        from duospec.engine.eagle3 import load_eagle3
        from duospec.engine.heads import load_eagle
        from duospec.engine.loader import _resolve_device

        device = _resolve_device(kwargs.pop("device", "cpu"))
        dtype = resolve_dtype(kwargs.pop("dtype", "auto"), device)
        load = load_eagle3 if spec.method is DraftMethod.EAGLE3 else load_eagle
        return load(spec.path, target_path, device=device, dtype=dtype, **kwargs)
    if spec.method is DraftMethod.LAYERS and spec.path is None:
        return load_model(target_path, num_layers=spec.layers, drafter=True,
                          float16_products=spec.float16_products, **kwargs)
    return load_model(spec.checkpoint(target_path), drafter=True, float16_products=spec.float16_products, **kwargs)
