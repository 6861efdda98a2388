"""From a `DraftSpec` to the Proposer that implements it (the only place that knows every method)."""

from __future__ import annotations

from duospec.draft_worker.proposer import DraftMethod, DraftSpec, Proposer


def build_proposer(spec: DraftSpec, target_path: str, *, device: str = "cpu", dtype: str = "auto",
                   max_slots: int = 16, max_context: int | None = None, runner=None,
                   prefill_chunk_tokens: int | None = None) -> Proposer:
    """Loads what the method needs. `runner`: an already loaded draft ModelRunner (tests, benchmarks)."""
    if spec.method is DraftMethod.NGRAM:
        from duospec.draft_worker.ngram_proposer import NgramProposer

        return NgramProposer(spec.ngram)
    from duospec.draft_worker.model_proposer import ModelProposer

    if runner is None:
        runner = load_draft_runner(spec, target_path, device=device, dtype=dtype, max_slots=max_slots,
                                   max_context=max_context)
    if prefill_chunk_tokens is None:
        return ModelProposer(runner, spec.method)
    return ModelProposer(runner, spec.method, prefill_chunk_tokens=prefill_chunk_tokens)


def load_draft_runner(spec: DraftSpec, target_path: str, **kwargs):
    """The draft model of a `model` or `layers` spec (a fine-tuned shallow draft is a plain checkpoint)."""
    from duospec.engine import load_model

    if spec.method is DraftMethod.LAYERS and spec.path is None:
        return load_model(target_path, num_layers=spec.layers, **kwargs)
    return load_model(spec.checkpoint(target_path), **kwargs)
