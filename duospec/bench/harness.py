"""The benchmark run: every mode on the same prompts and models, repeated, summarised with medians.

    report = run_bench(BenchConfig(target="models/target", draft="models/draft", out=Path("bench-out")))

Order: all repeats of the in-process modes (interleaved, so slow drift of a shared machine hits every
mode alike), then the same through the server, the round-overhead measurement and the concurrency
sweep. The returned report is what report.py writes as JSON, Markdown and PNG.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
import platform
import time
from dataclasses import asdict, dataclass, field

from duospec.bench.inprocess import BenchPair, HFGenerate, encode_prompts, open_local_coordinator, run_coordinator_mode
from duospec.bench.records import ALL_MODES, HF_MODES, OFF_THREADS, OFF_TWO_THREADS, OUR_MODES, Run
from duospec.coordinator.api import SpeculationMode
from duospec.coordinator.config import MAX_DRAFT_TOKENS, SpeculationDefaults

WARMUP_TOKENS = 8
RANDOM_DRAFT = "random"  # --draft-method random


def random_draft(draft: str, out: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A random-weight copy of the `draft` checkpoint's architecture and tokenizer (it agrees with the
    target only by chance): the drafter a "never slower" guard must catch."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(draft), dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(draft).save_pretrained(str(out))
    return out


@dataclass
class BenchConfig:
    target: str
    draft: str  # the draft checkpoint (method model); "" for a method that loads none of its own
    out: pathlib.Path
    prompts: pathlib.Path | None = None  # None: benchmarks/prompts/prompts.jsonl
    prompt_limit: int | None = None  # first N prompts only
    max_new_tokens: int = 128
    repeats: int = 3
    modes: tuple[str, ...] = ALL_MODES
    skip_server: bool = False
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    sweep_requests_per_stream: int = 2
    device: str = "cpu"
    placement: str = "auto"  # the server runs' draft/target placement (cluster/placement.py)
    gamma: int = SpeculationDefaults.gamma  # drafts per verify of vanilla and HF assisted generation (γ)
    max_draft_tokens: int = SpeculationDefaults.max_draft_tokens  # pearl's most per verify (it adapts)
    max_lookahead: int = 9
    max_prompt_tokens: int = 256
    ray_address: str | None = None
    models_label: str = ""  # what the models are, for the report (e.g. "bundled pair")
    progress: bool = True
    simulate: str | None = None  # a duospec.bench.simulate scenario: replayed tokens, slept forward times
    acceptance: float | None = None  # with simulate: a synthetic drafter with this per-token acceptance
    draft_method: str = "model"  # model | ngram | layers:K (coordinator.config.draft_from_flag) | random

    def speculation(self) -> SpeculationDefaults:
        """The served model's defaults: the benchmark's requests leave their draft counts to them."""
        return SpeculationDefaults(mode=SpeculationMode.PEARL, max_draft_tokens=self.max_draft_tokens,
                                   gamma=self.gamma, max_lookahead=self.max_lookahead)

    def validate(self) -> None:
        unknown = [m for m in self.modes if m not in ALL_MODES]
        if unknown:
            raise ValueError(f"--modes: {', '.join(unknown)} unknown; choose from {', '.join(ALL_MODES)}")
        for name in ("max_new_tokens", "repeats", "gamma", "max_draft_tokens", "sweep_requests_per_stream"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)}: must be >= 1")
        for name in ("gamma", "max_draft_tokens"):
            if getattr(self, name) > MAX_DRAFT_TOKENS:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)}: must be <= {MAX_DRAFT_TOKENS}")
        if self.simulate is not None:
            from duospec.bench.simulate import SCENARIOS

            if self.simulate not in SCENARIOS:
                raise ValueError(f"--simulate {self.simulate!r}: choose from {', '.join(SCENARIOS)}")
            if self.device != "cpu":
                raise ValueError("--simulate measures forward costs on this machine's CPU; drop --device "
                                 f"{self.device} (or run the real benchmark on the device without --simulate)")
            if self.acceptance is not None and not 0.0 <= self.acceptance <= 1.0:
                raise ValueError(f"--acceptance {self.acceptance}: must be in [0, 1]")
            if not any(m in OUR_MODES for m in self.modes):
                raise ValueError("--simulate runs our modes only (off, vanilla, pearl); --modes names none of them")
        if self.acceptance is not None and self.simulate is None:
            raise ValueError("--acceptance goes with --simulate (it replaces the draft's choices in the replay)")
        from duospec.coordinator.config import draft_from_flag

        from duospec.draft_worker.proposer import DraftMethod

        # random: the adversarial case, a random-weight draft of the --draft checkpoint's shape
        spec = draft_from_flag("model" if self.draft_method == RANDOM_DRAFT else self.draft_method, self.draft or None)
        if self.simulate is not None and spec.method not in (DraftMethod.MODEL, DraftMethod.EAGLE):
            raise ValueError(f"--simulate replays a draft model's (or an EAGLE head's) choices; drop --draft-method "
                             f"{self.draft_method} (or benchmark it without --simulate)")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency {list(self.concurrency)}: stream counts must be >= 1")
        roles = ("target", "draft") if spec.method.value == "model" else ("target",)
        if spec.method is DraftMethod.EAGLE3:
            from duospec.engine.eagle3 import head_feature_layers

            head_feature_layers(self.draft, self.target)  # either layout (CheckpointError says what is wrong)
        elif spec.method.reads_features:
            from duospec.engine.heads import read_head

            read_head(self.draft, spec.method.value)  # a head directory (CheckpointError says what is wrong)
        for role in roles:
            if not (pathlib.Path(getattr(self, role)) / "config.json").is_file():
                raise FileNotFoundError(f"--{role} {getattr(self, role)}: no checkpoint there (config.json); "
                                        "pass --models DIR holding target/ and draft/, or --target and --draft")


@dataclass
class Collected:
    runs: list[Run] = field(default_factory=list)
    overhead: list[dict] = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)
    kv: dict = field(default_factory=dict)  # summary.kv_counters of the served run


class _Progress:
    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", desc="duospec bench", disable=not enabled, dynamic_ncols=True)

    def tick(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _planned_requests(config: BenchConfig, n_prompts: int) -> int:
    per_pass = n_prompts * config.repeats
    total = per_pass * len(config.modes) + n_prompts  # + in-process overhead pass
    if not config.skip_server:
        total += per_pass * len([m for m in config.modes if m in OUR_MODES]) + n_prompts
        total += sum(c * config.sweep_requests_per_stream for c in config.concurrency) * 2 * config.repeats
    return total


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to n for the block (process-wide: the in-process target's forward)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


async def _in_process(config: BenchConfig, pair: BenchPair, prompts, hf: HFGenerate | None, progress, out: Collected):
    from duospec.bench.served import round_overhead

    coordinator = open_local_coordinator(pair, config.speculation())
    try:
        ours = [m for m in config.modes if m in OUR_MODES]
        for mode in ours:  # warm-up: first-call allocations and caches, untimed
            await run_coordinator_mode(coordinator, prompts[:1], mode, WARMUP_TOKENS, "warmup", "warmup",
                                       variant=f"warmup-{mode}")
        for rep in range(config.repeats):
            for mode in config.modes:
                if mode in HF_MODES:
                    out.runs.append(hf.run(prompts, mode, config.max_new_tokens, config.gamma, progress.tick))
                elif mode == OFF_TWO_THREADS:
                    with torch_threads(OFF_THREADS):
                        out.runs.append(await run_coordinator_mode(coordinator, prompts, mode, config.max_new_tokens,
                                                                   "in-process", f"r{rep}", progress.tick))
                else:
                    out.runs.append(await run_coordinator_mode(coordinator, prompts, mode, config.max_new_tokens,
                                                               "in-process", f"r{rep}", progress.tick))
        out.overhead.append(await round_overhead(coordinator, prompts, config.max_new_tokens, "in-process",
                                                 progress.tick))
    finally:
        await coordinator.close()


async def _through_server(config: BenchConfig, pair: BenchPair, prompts, progress, out: Collected):
    from duospec.bench.served import round_overhead, run_client_mode, served_pipeline, sweep_point
    from duospec.bench.summary import kv_counters

    ours = [m for m in config.modes if m in OUR_MODES]
    async with served_pipeline(pair, config.speculation(), config.ray_address) as served:
        for mode in ours:
            await run_client_mode(served, prompts[:1], mode, WARMUP_TOKENS, lambda: None,
                                  variant=f"warmup-{mode}")
        for _ in range(config.repeats):
            for mode in ours:
                out.runs.append(await run_client_mode(served, prompts, mode, config.max_new_tokens,
                                                      progress.tick))
        out.overhead.append(await round_overhead(served.coordinator, prompts, config.max_new_tokens, "pipeline",
                                                 progress.tick))
        # The sweep is repeated like the runs above, pearl and off interleaved, and reported as medians:
        # one pass at 8 streams lasts a few seconds, and single passes on a shared VM differed by ±10 %.
        for repeat in range(config.repeats):
            for streams in config.concurrency:
                for mode in ("pearl", "off"):
                    point = await sweep_point(served, prompts, mode, streams, config.sweep_requests_per_stream,
                                              config.max_new_tokens, progress.tick)
                    out.sweep.append({**point, "repeat": repeat})
        out.kv = kv_counters(await served.coordinator.stats())


def run_bench(config: BenchConfig) -> dict:
    import torch

    from duospec.bench.prompts import DEFAULT_PROMPTS, load_prompts
    from duospec.bench.summary import summarise
    from duospec.engine import load_tokenizer

    from transformers.utils import logging as hf_logging

    config.validate()
    torch.set_num_threads(1)  # one thread per model: the draft and target threads each get one core
    hf_logging.disable_progress_bar()  # per-checkpoint "Loading weights" bars would break up ours
    if config.draft_method == RANDOM_DRAFT:
        pair = BenchPair(str(config.target), str(random_draft(config.draft, config.out / "random-draft")),
                         config.device, "model", config.placement)
    else:
        pair = BenchPair(str(config.target), str(config.draft), config.device, config.draft_method, config.placement)
    heads = pair.draft_spec().method.reads_features
    if heads and "hf-assisted" in config.modes:
        # transformers' assisted generation takes a draft model, not a head on the target's features
        config = dataclasses.replace(config, modes=[m for m in config.modes if m != "hf-assisted"])
    prompt_path = config.prompts or DEFAULT_PROMPTS
    prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(prompt_path, config.prompt_limit),
                             config.max_prompt_tokens)
    simulation = None
    if config.simulate is not None:
        pair, config, simulation = _simulated_pair(config, pair, prompts)
    hf = HFGenerate(pair) if any(m in HF_MODES for m in config.modes) else None
    collected = Collected()
    progress = _Progress(_planned_requests(config, len(prompts)), config.progress)
    started = time.time()
    try:
        asyncio.run(_in_process(config, pair, prompts, hf, progress, collected))
        if not config.skip_server:
            asyncio.run(_through_server(config, pair, prompts, progress, collected))
    finally:
        progress.close()
    report = summarise(collected, prompts)
    report["setup"] = _setup(config, prompt_path, len(prompts), time.time() - started)
    report["setup"]["simulation"] = simulation
    if heads:  # what the target's hidden states cost on the wire
        from transformers import AutoConfig

        rows = max(1, len(pair.draft_spec().feature_layers(pair.target)))  # EAGLE-3: its layers' rows
        report["setup"]["features_bytes_per_token"] = 2 * rows * AutoConfig.from_pretrained(pair.target).hidden_size
    return report


def _simulated_pair(config: BenchConfig, pair: BenchPair, prompts) -> tuple[BenchPair, BenchConfig, dict]:
    """Replay checkpoints of `pair` (duospec/bench/simulate.py); the transformers modes cannot replay."""
    import dataclasses

    from duospec.bench.simulate import build_replay_pair

    target, draft, simulation = build_replay_pair(
        config.out / f"replay-{config.simulate}", pair.target, pair.draft, [p.token_ids for p in prompts],
        scenario=config.simulate, max_new_tokens=config.max_new_tokens, max_draft_tokens=config.max_draft_tokens,
        gamma=config.gamma, max_lookahead=config.max_lookahead, acceptance=config.acceptance, progress=config.progress,
        draft_method=config.draft_method)
    simulation["modes_not_simulated"] = [m for m in config.modes if m in HF_MODES]
    config = dataclasses.replace(config, modes=tuple(m for m in config.modes if m in OUR_MODES))
    return BenchPair(str(target), str(draft), "cpu"), config, simulation


def _setup(config: BenchConfig, prompt_path, n_prompts: int, elapsed_s: float) -> dict:
    import os

    import torch

    settings = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in asdict(config).items()}
    return {
        "config": settings,
        "prompts_file": str(prompt_path),
        "prompts": n_prompts,
        "hardware": {
            "machine": platform.machine(),
            "processor": platform.processor() or _cpu_model(),
            "cpu_count": os.cpu_count(),
            "device": config.device,
            "placement": config.placement,
            "gpu": torch.cuda.get_device_name(0) if config.device == "cuda" and torch.cuda.is_available() else None,
            "torch_threads_per_model": 1,
        },
        "software": {"python": platform.python_version(), "torch": torch.__version__},
        "elapsed_s": round(elapsed_s, 1),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - elapsed_s)),
    }


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
