"""Loading checkpoints into runners: path and option validation, backend choice, tokenizer fit.

A checkpoint is an ordinary Hugging Face directory (config.json, *.safetensors or pytorch_model*.bin,
tokenizer files). A name that is not a local path is handed to transformers as a hub id (works only
where the machine has network; never in tests).
"""

from __future__ import annotations

import copy
import logging
import pathlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from duospec.engine.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab
from duospec.engine.errors import CheckpointError
from duospec.engine.tensor_parallel import TensorParallel, check_tp_size, shard_config, shard_state_dict
from duospec.engine.kv_memory import DEFAULT_BLOCK_SIZE
from duospec.engine.replay import REPLAY_FILE, load_replay_runner
from duospec.engine.runner import ModelRunner

__all__ = ["KVOptions", "LoadedCheckpoint", "end_token_ids", "load_checkpoint", "load_model", "load_tokenizer", "resolve_dtype"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "lean", "hf")
# Cap on the default context so a long-context model does not preallocate an enormous cache.
DEFAULT_MAX_CONTEXT_CAP = 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True)
class KVOptions:
    """A paged runner's KV pool and prefix cache (duospec/engine/kv_memory.py says how the pool is sized;
    the serve config's models[] fields of the same names fill these)."""

    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    prefix_caching: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE

    def kwargs(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LoadedCheckpoint:
    runner: ModelRunner
    tokenizer: Any  # PreTrainedTokenizerBase
    config: Any  # transformers PretrainedConfig
    path: str
    # ids that end a generation: generation_config.json's eos_token_id, else the tokenizer's
    eos_token_ids: tuple[int, ...]


def _checkpoint_ref(path: str | pathlib.Path) -> str:
    """Validate a local checkpoint dir; pass anything that is not a local path through as a hub id."""
    p = pathlib.Path(path).expanduser()
    looks_local = p.exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1
    if not looks_local:
        return str(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such checkpoint directory; pass a directory holding config.json and weights")
    if not (p / "config.json").is_file():
        raise CheckpointError(
            f"{p}: not a checkpoint directory (no config.json); pass a Hugging Face model directory "
            f"with config.json, *.safetensors and tokenizer files"
        )
    if not (p / REPLAY_FILE).is_file() and not any(any(p.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        raise CheckpointError(
            f"{p}: config.json but no weights (*.safetensors or pytorch_model*.bin); copy the model's "
            f"weight files into the directory"
        )
    return str(p)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' = float32 on CPU, bfloat16 on an accelerator."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise CheckpointError(f"dtype={dtype!r} is not supported; use 'auto', {', '.join(map(repr, _DTYPES))}")


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(f"device={device!r} is not a torch device ('cpu', 'cuda', 'cuda:1')") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    return dev


def _load_config(ref: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(ref)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError depending on the problem
        raise CheckpointError(
            f"{ref}: transformers cannot load a config from it ({exc}); pass a local checkpoint "
            f"directory, or a hub id on a machine with network access"
        ) from exc


def _max_context(ref: str, config, max_context: int | None) -> int:
    limit = getattr(config, "max_position_embeddings", None)
    if max_context is None:
        return min(limit or DEFAULT_MAX_CONTEXT_CAP, DEFAULT_MAX_CONTEXT_CAP)
    if max_context < 1:
        raise CheckpointError(f"max_context={max_context}: must be >= 1")
    if limit is not None and max_context > limit:
        raise CheckpointError(
            f"{ref}: max_context={max_context} exceeds the model's max_position_embeddings={limit}; "
            f"pass max_context <= {limit}"
        )
    return max_context


def load_model(path: str | pathlib.Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype = "auto",
               max_slots: int = 16, max_context: int | None = None, backend: str = "auto",
               num_layers: int | None = None, kv: KVOptions | None = None,
               tp: TensorParallel | None = None, drafter: bool = False,
               float16_products: bool = False) -> ModelRunner:
    """Load a causal LM checkpoint into a ``ModelRunner``.

    backend: "lean" = duospec's paged-KV forward (Llama/Qwen2/Mistral/Qwen3/Gemma 3 text; error
    otherwise), "hf" = the transformers model one sequence at a time, "auto" = lean where supported,
    else hf.
    max_slots: sequences open at once; max_context: positions of one sequence, default
    min(max_position_embeddings, 4096); kv: the lean backend's KV pool (kv_memory.py).
    num_layers: keep only the first K decoder layers (plus the final norm and LM head): the
    shallow-layer draft of a target (only those layers' weights are loaded).
    A directory holding ``replay.json`` loads a ``ReplayRunner`` (benchmark simulation; see replay.py).
    tp: this process's rank in a tensor-parallel group (tensor_parallel.py): it loads its shard only.
    drafter: a drafter's load: honour the checkpoint's trimmed output vocabulary (draft_vocab.py);
    with float16_products (`draft.float16_products`) also let its products run in float16 where that
    measures faster here (cpu_linear.py).
    """
    if backend not in BACKENDS:
        raise CheckpointError(f"backend={backend!r} is not one of {BACKENDS}")
    ref = _checkpoint_ref(path)
    dev = _resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    config = _load_config(ref)
    if num_layers is not None:
        config = shallow_config(ref, config, num_layers)
    context = _max_context(ref, config, max_context)
    if max_slots < 1:
        raise CheckpointError(f"max_slots={max_slots}: must be >= 1")
    if (pathlib.Path(ref) / REPLAY_FILE).is_file():
        return load_replay_runner(pathlib.Path(ref), config, max_slots=max_slots, max_context=context)

    from duospec.engine.llama import LeanLlamaRunner, lean_unsupported_reason

    reason = lean_unsupported_reason(config)
    if backend == "lean" and reason is not None:
        raise CheckpointError(f"{ref}: backend='lean' cannot run this model ({reason}); use backend='hf' or 'auto'")
    use_lean = backend == "lean" or (backend == "auto" and reason is None)
    sharded = tp is not None and tp.world > 1
    if sharded:
        if not use_lean:
            raise CheckpointError(f"{ref}: tensor_parallel_size={tp.world} needs duospec's own forward, which cannot "
                                  f"run this model ({reason or 'backend=hf'}); the transformers fallback runs on one "
                                  "device: set tensor_parallel_size: 1")
        check_tp_size(config, tp.world, ref)  # before the weights are read
    if backend == "auto" and reason is not None:
        log.info("%s: using the transformers fallback backend (%s)", ref, reason)
    draft_ids = read_draft_vocab(ref, config.vocab_size) if drafter else None
    if draft_ids is not None and not use_lean:
        raise CheckpointError(f"{ref}: a draft vocabulary ({DRAFT_VOCAB_FILE}) needs duospec's own forward, which "
                              f"cannot run this model ({reason or 'backend=hf'}); use backend: auto or lean")
    model = _load_hf_model(ref, torch_dtype, config if num_layers is not None else None)
    if use_lean:
        config, state = model.config, model.state_dict()
        if sharded:
            config, state = shard_config(config, tp.world), shard_state_dict(config, state, tp.rank, tp.world)
        runner: ModelRunner = LeanLlamaRunner(config, state, device=dev, dtype=torch_dtype, max_slots=max_slots,
                                              max_context=context, tp=tp if sharded else None, draft_ids=draft_ids,
                                              approximate=drafter and float16_products, **(kv or KVOptions()).kwargs())
        del model
        return runner
    from duospec.engine.hf_runner import HFRunner

    return HFRunner(model.to(dev), max_slots=max_slots, max_context=context)


def shallow_config(ref: str, config, num_layers: int):
    """A copy of ``config`` with only the first ``num_layers`` decoder layers."""
    total = getattr(config, "num_hidden_layers", None)
    if total is None:
        raise CheckpointError(f"{ref}: the config has no num_hidden_layers; a shallow-layer draft needs a decoder LM")
    if not 1 <= num_layers < total:
        raise CheckpointError(
            f"{ref}: a shallow-layer draft of {num_layers} layers needs 1 <= layers < {total} (the target's "
            f"layer count); pick fewer layers"
        )
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = num_layers
    if isinstance(getattr(shallow, "layer_types", None), list):  # per-layer attention kinds (Qwen2, Gemma)
        shallow.layer_types = shallow.layer_types[:num_layers]
    return shallow


def _load_hf_model(ref: str, dtype: torch.dtype, config=None):
    from transformers import AutoModelForCausalLM

    kwargs = {"config": config} if config is not None else {}
    try:
        return AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, **kwargs)
    except Exception as exc:  # corrupt or mismatched weights surface as many exception types
        raise CheckpointError(f"{ref}: transformers cannot load the weights: {exc}") from exc


def load_tokenizer(path: str | pathlib.Path):
    """The checkpoint's tokenizer (``AutoTokenizer``), with a clear error when it has none."""
    from transformers import AutoTokenizer

    ref = _checkpoint_ref(path)
    try:
        return AutoTokenizer.from_pretrained(ref)
    except Exception as exc:  # missing/corrupt tokenizer files raise OSError, ValueError, TypeError...
        raise CheckpointError(
            f"{ref}: no usable tokenizer ({exc}); copy the model's tokenizer files (tokenizer.json, "
            f"tokenizer_config.json) into the directory"
        ) from exc


def end_token_ids(ref: str, tokenizer) -> tuple[int, ...]:
    """Every id that ends a generation: generation_config.json's eos_token_id (an int or a list),
    else the tokenizer's EOS."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(ref).eos_token_id
    except Exception:  # no generation_config.json is normal; fall back to the tokenizer
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def load_checkpoint(path: str | pathlib.Path, **kwargs) -> LoadedCheckpoint:
    """Runner + tokenizer + config of one checkpoint; ``kwargs`` go to ``load_model``.

    Raises CheckpointError when the tokenizer has more tokens than the model's vocabulary (it would
    produce ids the model has no embedding for).
    """
    ref = _checkpoint_ref(path)
    config = _load_config(ref)
    tokenizer = load_tokenizer(ref)
    if len(tokenizer) > config.vocab_size:
        raise CheckpointError(
            f"{ref}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{config.vocab_size}; the tokenizer does not belong to this model — use the tokenizer "
            f"the model was trained with"
        )
    runner = load_model(ref, **kwargs)
    return LoadedCheckpoint(runner=runner, tokenizer=tokenizer, config=runner.config, path=ref,
                            eos_token_ids=end_token_ids(ref, tokenizer))
