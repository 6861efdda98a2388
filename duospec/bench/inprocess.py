"""Runs in this process: our three modes on a LocalCoordinator (draft and target on two threads) and
transformers `generate` (target alone, and assisted generation with the draft as assistant_model).

Every request is greedy, ignores EOS (fixed-length outputs, so tokens/s compare like for like) and
asks for the same number of new tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from duospec.bench.guards import use_speculation_choices
from duospec.bench.records import RequestRecord, Run, request_mode, window

MODEL_NAME = "bench"


@dataclass(frozen=True)
class BenchPair:
    target: str
    draft: str  # the draft checkpoint ("" when the method loads none of its own)
    device: str = "cpu"
    draft_method: str = "model"  # --draft-method: model | ngram | layers:K
    placement: str = "auto"  # --placement: auto | separate | colocated (the server runs)
    tensor_parallel_size: int = 1  # the target's (benchmarks/tensor_parallel.py)
    kv_cache_memory_bytes: int | None = None  # each worker's KV pool (None: every slot at full length)
    draft_options: tuple[tuple[str, object], ...] = ()  # other `draft:` keys, e.g. (("context_lookup", False),)

    def draft_spec(self):
        import dataclasses

        from duospec.coordinator.config import draft_from_flag

        return dataclasses.replace(draft_from_flag(self.draft_method, self.draft or None), **dict(self.draft_options))


@dataclass(frozen=True)
class EncodedPrompt:
    id: str
    token_ids: tuple[int, ...]


def model_config(pair: BenchPair, speculation, name: str = MODEL_NAME):
    """The served model: `speculation` (coordinator.config.SpeculationDefaults) holds vanilla's γ and
    pearl's draft cap; the benchmark's requests leave both to it, as a user's would."""
    from duospec.coordinator.config import ModelConfig

    return ModelConfig(name=name, target=pair.target, draft=pair.draft_spec(), device=pair.device,
                       placement=pair.placement, speculation=speculation,
                       tensor_parallel_size=pair.tensor_parallel_size, kv_cache_memory_bytes=pair.kv_cache_memory_bytes)


def request_for(prompt: EncodedPrompt, mode: str, max_new_tokens: int, tag: str):
    from duospec.coordinator.api import GenerationRequest, SpeculationMode

    mode, cache, tree = request_mode(mode)
    return GenerationRequest(request_id=f"bench-{tag}-{prompt.id}", prompt_token_ids=prompt.token_ids,
                             max_new_tokens=max_new_tokens, mode=SpeculationMode(mode),
                             speculation_cache=cache, speculation_tree=tree, ignore_eos=True, model=MODEL_NAME)


async def timed_request(coordinator, request, prompt_id: str) -> RequestRecord:
    """One request through `coordinator.generate`, with first-token and per-token timings
    (RequestRecord.streamed; every TokensEvent carries at least one token)."""
    from duospec.coordinator.api import FinishEvent

    tokens: list[int] = []
    arrivals: list[tuple[float, int]] = []
    started = time.perf_counter()
    final = None
    async for event in coordinator.generate(request):
        if isinstance(event, FinishEvent):
            final = event.stats
            break
        arrivals.append((time.perf_counter(), len(event.token_ids)))
        tokens.extend(event.token_ids)
    record = RequestRecord.streamed(prompt_id, tokens, started, time.perf_counter(), arrivals)
    if final is not None:
        record.take_counts(final)
    return record


def _no_tick() -> None:
    pass


async def run_coordinator_mode(coordinator, prompts: list[EncodedPrompt], mode: str, max_new_tokens: int,
                               path: str, tag: str, tick: Callable[[], None] = _no_tick,
                               variant: str | None = None) -> Run:
    """Every prompt once, one request at a time, through a LocalCoordinator or PipelineCoordinator.
    `variant`: whose goodput guard runs it (default `mode`; a warm-up passes its own, so that the timed
    runs' guard starts from scratch)."""
    use_speculation_choices(coordinator, variant or mode)  # each pearl variant learns on its own, once
    before = await coordinator.stats()
    started = time.perf_counter()
    records = []
    for i, p in enumerate(prompts):
        records.append(await timed_request(coordinator, request_for(p, mode, max_new_tokens, f"{tag}-{i}"), p.id))
        tick()
    wall = time.perf_counter() - started
    return Run(mode, path, wall, records, window(before, await coordinator.stats(), MODEL_NAME))


def open_local_coordinator(pair: BenchPair, speculation):
    from duospec.coordinator.local import LocalCoordinator

    return LocalCoordinator([model_config(pair, speculation)])


class HFGenerate:
    """transformers `generate` on the same checkpoints (the baselines users already have). `hf-assisted`
    is assisted generation with the same drafter: the draft model as `assistant_model`, the target's
    first K layers as one (layers:K), or prompt lookup decoding (`prompt_lookup_num_tokens`, ngram)."""

    def __init__(self, pair: BenchPair):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from duospec.draft_worker.proposer import DraftMethod
        from duospec.engine.loader import shallow_config

        self.torch = torch
        self.device = torch.device(pair.device)
        self.target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).to(self.device).eval()
        spec = pair.draft_spec()
        self.prompt_lookup = spec.method is DraftMethod.NGRAM
        self.draft = None
        if spec.method is not DraftMethod.NGRAM and not spec.method.reads_features:
            kwargs = {}
            if spec.method is DraftMethod.LAYERS and spec.path is None:
                kwargs["config"] = shallow_config(pair.target, AutoConfig.from_pretrained(pair.target), spec.layers)
            source = spec.checkpoint(pair.target)
            self.draft = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs).to(self.device).eval()
            _keep_draft_vocab(self.draft, source)


    def _config(self, max_new_tokens: int, gamma: int | None):
        from transformers import GenerationConfig

        # eos_token_id=None: never stop early, like ignore_eos in our requests.
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=self.target.config.pad_token_id or 0)
        if gamma is not None and not self.prompt_lookup:
            config.num_assistant_tokens = gamma
            config.num_assistant_tokens_schedule = "constant"  # a fixed γ, like our vanilla mode
            config.assistant_confidence_threshold = 0.0  # no early stop inside a draft round
        return config

    def generate(self, prompt: EncodedPrompt, max_new_tokens: int, gamma: int | None) -> RequestRecord:
        torch = self.torch
        ids = torch.tensor([prompt.token_ids], device=self.device)
        kwargs = {}
        if gamma is not None:
            kwargs = {"prompt_lookup_num_tokens": gamma} if self.prompt_lookup else {"assistant_model": self.draft}
        started = time.perf_counter()
        with torch.no_grad():
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids),
                                       generation_config=self._config(max_new_tokens, gamma), **kwargs)
        wall = time.perf_counter() - started
        return RequestRecord(prompt.id, out[0, ids.shape[1]:].tolist(), wall)

    def run(self, prompts: list[EncodedPrompt], mode: str, max_new_tokens: int, gamma: int,
            tick: Callable[[], None] = _no_tick) -> Run:
        use_gamma = gamma if mode == "hf-assisted" else None
        started = time.perf_counter()
        records = []
        for p in prompts:
            records.append(self.generate(p, max_new_tokens, use_gamma))
            tick()
        return Run(mode, "in-process", time.perf_counter() - started, records)


def _keep_draft_vocab(draft, checkpoint) -> None:
    """A draft trained with a trimmed output vocabulary (duospec/engine/draft_vocab.py) proposes only those
    tokens in our engine; transformers would read its whole head, whose other rows were never trained.
    Its LM head gets -inf outside them here too, so `hf-assisted` runs the draft the way it was trained."""
    import torch

    from duospec.engine.draft_vocab import read_draft_vocab

    ids = read_draft_vocab(checkpoint, draft.config.vocab_size)
    if ids is None:
        return
    outside = torch.full((draft.config.vocab_size,), float("-inf"), device=draft.device)
    outside[torch.as_tensor(ids, device=draft.device)] = 0.0
    draft.get_output_embeddings().register_forward_hook(lambda module, args, logits: logits + outside)


def encode_prompts(tokenizer, prompts, max_prompt_tokens: int) -> list[EncodedPrompt]:
    """Token ids of each prompt, keeping its last `max_prompt_tokens` tokens (the context must hold
    prompt + new tokens)."""
    encoded = []
    for prompt in prompts:
        ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {prompt.id!r} encodes to no tokens")
        encoded.append(EncodedPrompt(prompt.id, tuple(ids[-max_prompt_tokens:])))
    return encoded

