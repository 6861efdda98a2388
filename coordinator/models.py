"""Reading a model pair's facts (vocabulary, context, EOS) and checking the pair can work together,
before any worker is started; what KV memory each worker gets."""

from __future__ import annotations

import pathlib

from duospec.coordinator.api import ModelInfo


class ModelPairError(ValueError):
    """The draft and target cannot be used together; the message says why and what to do."""


def _tokenizer(path: str):
    from duospec.engine import load_tokenizer

    return load_tokenizer(path)


def _max_context(config) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 2048)


def check_pair(target_path: str, draft_path: str | None) -> None:
    """Raises ModelPairError if the drafter's tokenizer differs from the target's."""
    if draft_path is None:
        return
    target_vocab = _tokenizer(target_path).get_vocab()
    draft_vocab = _tokenizer(draft_path).get_vocab()
    if target_vocab != draft_vocab:
        diff = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        raise ModelPairError(
            f"draft {draft_path} and target {target_path} have different tokenizers ({len(draft_vocab)} vs "
            f"{len(target_vocab)} tokens, {diff} entries differ); speculative decoding needs the same "
            f"vocabulary: distill a draft for this target with `duospec distill`"
        )


FEATURES_MESSAGE_BUDGET = 32 << 20  # bytes of hidden states per verdict batch; the streams allow 64 MB


def model_info(model_config, max_context: int | None = None) -> ModelInfo:
    """The facts a request is validated against, read from the checkpoints' configs."""
    from transformers import AutoConfig

    from duospec.engine import CheckpointError
    from duospec.engine.loader import end_token_ids

    target = str(model_config.target)
    spec = model_config.draft
    draft = spec.checkpoint(target) if spec is not None else None
    if draft == target:  # the target's own first layers: same tokenizer and context by construction
        draft = None
    head, feature_rows = None, 1  # feature_rows: hidden-size rows a position's features take on the wire
    if spec is not None and spec.method.reads_features:  # a head: the target's tokenizer and context
        from duospec.engine.heads import HeadInfo, read_head

        if spec.method.value == "eagle3":  # either layout (duospec/engine/eagle3.py)
            from duospec.engine.eagle3 import read_eagle3

            info = read_eagle3(draft, AutoConfig.from_pretrained(target))
            head = HeadInfo("eagle3", info.path, info.hidden_size, info.vocab_size, info.target_fingerprint or "")
            feature_rows = len(info.feature_layers)
        else:
            head = read_head(draft, spec.method.value)
        draft = None
    for path in filter(None, (target, draft)):
        if not (pathlib.Path(path) / "config.json").is_file():
            raise CheckpointError(f"{path}: not a checkpoint directory (no config.json)")
    check_pair(target, draft)
    target_cfg = AutoConfig.from_pretrained(target)
    if head is not None and (head.hidden_size, head.vocab_size) != (target_cfg.hidden_size, target_cfg.vocab_size):
        raise ModelPairError(f"draft: the {head.method} head {head.path} was trained for a target with hidden size "
                             f"{head.hidden_size} and vocabulary {head.vocab_size}; {target} has "
                             f"{target_cfg.hidden_size} and {target_cfg.vocab_size}")
    if head is not None:  # a prefill chunk's hidden states travel in one verdict (and one drafter command)
        chunk = int(model_config.prefill_chunk_tokens)
        row_bytes = 2 * target_cfg.hidden_size * feature_rows
        fits = FEATURES_MESSAGE_BUDGET // row_bytes
        if chunk > fits:
            raise ModelPairError(f"models[].prefill_chunk_tokens {chunk}: with the {head.method} drafter a chunk's "
                                 f"hidden states ({row_bytes} bytes per token) must stay under "
                                 f"{FEATURES_MESSAGE_BUDGET >> 20} MiB per message; use at most {fits}")
    if spec is not None and spec.layers is not None and spec.path is None:
        from duospec.engine.loader import shallow_config

        try:  # the loader's own rule, checked before any worker loads the weights
            shallow_config(f"draft: layers {spec.layers} of target {target}", target_cfg, spec.layers)
        except CheckpointError as exc:
            raise ModelPairError(str(exc)) from None
    _check_tensor_parallel("models[].tensor_parallel_size", target, target_cfg,
                           int(model_config.tensor_parallel_size))
    if spec is not None and spec.tensor_parallel_size > 1:
        _check_tensor_parallel("draft.tensor_parallel_size", draft, AutoConfig.from_pretrained(draft),
                               spec.tensor_parallel_size)
    tokenizer = _tokenizer(target)
    context = _max_context(target_cfg)
    if draft is not None:
        context = min(context, _max_context(AutoConfig.from_pretrained(draft)))
    limit = model_config.max_model_len
    if limit is not None:
        if limit > context:
            raise ModelPairError(
                f"models[].max_model_len {limit} is above what the model holds ({context} positions: "
                f"max_position_embeddings of the target{' and draft' if draft else ''}); lower it"
            )
        context = limit
    if max_context:
        context = min(context, max_context)
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(target_cfg, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    end_ids = end_token_ids(target, tokenizer)
    return ModelInfo(
        name=model_config.name,
        target_path=target,
        draft_path=str(head.path) if head is not None else draft,
        draft_method=spec.method.value if spec is not None else None,
        vocab_size=min(len(tokenizer), int(target_cfg.vocab_size)),
        max_context=context,
        eos_token_id=eos,
        eos_token_ids=end_ids or ((eos,) if eos is not None else ()),
        # every replica's scheduler holds max_num_seqs
        max_num_seqs=int(model_config.max_num_seqs) * int(model_config.replicas),
        max_draft_tokens=model_config.speculation.request_cap,
        prefix_cache=model_config.prefix_cache,
    )


def _check_tensor_parallel(field: str, path: str, config, size: int) -> None:
    """A group of `size` ranks needs duospec's own forward and a size that divides the model: refused
    before any worker is placed, naming what works."""
    if size == 1:
        return
    from duospec.engine import CheckpointError
    from duospec.engine.llama import lean_unsupported_reason
    from duospec.engine.tensor_parallel import check_tp_size

    reason = lean_unsupported_reason(config)
    if reason is not None:
        raise ModelPairError(f"{field} {size}: tensor parallelism needs duospec's own forward, which cannot run "
                             f"{path} ({reason}); the transformers fallback runs on one device: set it to 1")
    try:
        check_tp_size(config, size, path)
    except CheckpointError as exc:
        raise ModelPairError(f"{field}: {exc}") from None


def worker_kv(model_config, role: str):
    """The KV pool of a model's `role` ("target" or "draft") worker (a duospec.engine.loader.KVOptions):
    models[].kv_cache_memory_bytes, or the draft's own draft.kv_cache_memory_bytes; without a byte
    count, gpu_memory_utilization on CUDA (cluster/actors.py drops it for a draft that shares the
    target's GPU); prefix caching unless models[].prefix_cache is off."""
    from duospec.engine.loader import KVOptions

    spec = model_config.draft
    memory = model_config.kv_cache_memory_bytes
    if role == "draft" and spec is not None and spec.kv_cache_memory_bytes is not None:
        memory = spec.kv_cache_memory_bytes
    utilization = model_config.gpu_memory_utilization
    return KVOptions(kv_cache_memory_bytes=memory, gpu_memory_utilization=utilization,
                     prefix_caching=model_config.prefix_cache != "off")
