"""In-process coordinator: both models in this process, each on its own thread.

The same scheduler, policies and worker code as the Ray pipeline, with in-process links instead of
gRPC streams. Used by tests, benchmarks (the "in-process" column) and `duospec serve --backend local`.
models[].replicas loads that many pairs of a model here; tensor parallelism needs processes (Ray).
"""

from __future__ import annotations

from duospec.cluster.actors import replica_label
from duospec.coordinator.config import ConfigError
from duospec.coordinator.scheduling.links import LocalDraftLink, LocalTargetLink
from duospec.coordinator.models import model_info, worker_kv
from duospec.coordinator.scheduling.router import ModelEntry, ModelRouter, scheduler_config
from duospec.coordinator.scheduling.scheduler import Scheduler
from duospec.cluster.worker import resolve_device
from duospec.draft_worker.drafter import Drafter
from duospec.draft_worker.methods import build_proposer
from duospec.draft_worker.proposer import DraftMethod, DraftSpec, Proposer
from duospec.target_worker.verifier import Verifier


def load_runner(path: str, model_config, max_slots: int, max_context: int | None = None):
    from duospec.engine import load_model

    return load_model(
        path,
        device=resolve_device(model_config.device),
        dtype=model_config.dtype,
        max_slots=max_slots,
        max_context=max_context,
        kv=worker_kv(model_config, "target"),
    )


class LocalCoordinator(ModelRouter):
    def __init__(self, models: list, *, runners: dict | None = None):
        """`models`: coordinator.config.ModelConfig list. `runners` ({name: (target, draft)}) lets
        tests and benchmarks pass already-loaded ModelRunners (draft: a ModelRunner, a Proposer or None)
        for a model's first replica."""
        super().__init__()
        for config in models:
            spec = config.draft
            sizes = (config.tensor_parallel_size, spec.tensor_parallel_size if spec else 1)
            if max(sizes) > 1:
                raise ConfigError(f"model {config.name}: tensor_parallel_size {max(sizes)} runs a process per rank, which "
                                  "the in-process backend cannot; serve it on Ray (duospec serve --backend ray)")
            info = model_info(config)
            for replica in range(config.replicas):
                preloaded = (runners or {}).get(config.name) if replica == 0 else None
                opener = self._opener(info, config, self._runners(info, config, spec, preloaded))
                if replica == 0:
                    self.add_model(ModelEntry(info, config, opener))
                else:
                    self.entries[config.name].add_replica(opener)

    @staticmethod
    def _runners(info, config, spec, preloaded):
        """(target runner, drafter's Proposer or None) of one replica: loaded now unless `preloaded`
        (then a draft ModelRunner is wrapped in its Proposer)."""
        if preloaded is not None:
            target_runner, draft = preloaded
            if draft is not None and not isinstance(draft, Proposer):
                draft = build_proposer(spec or DraftSpec(DraftMethod.MODEL), info.target_path, runner=draft)
            return _tap_features(target_runner, spec, info), draft
        # loaded now: health turns SERVING only once the models are in memory
        max_slots = scheduler_config(config).max_num_seqs
        proposer = None
        if spec is not None:
            proposer = build_proposer(spec, info.target_path, device=resolve_device(config.device),
                                      dtype=config.dtype, max_slots=max_slots, max_context=info.max_context,
                                      prefill_chunk_tokens=config.prefill_chunk_tokens,
                                      kv=worker_kv(config, "draft"))
        return _tap_features(load_runner(info.target_path, config, max_slots, info.max_context), spec, info), proposer

    @staticmethod
    def _opener(info, config, preloaded):
        async def open_scheduler() -> Scheduler:
            sched_config = scheduler_config(config)
            target_runner, proposer = preloaded
            target = LocalTargetLink(Verifier(target_runner, tokenizer_path=info.target_path))
            draft = LocalDraftLink(Drafter(proposer, tokenizer_path=info.target_path)) if proposer is not None else None
            scheduler = Scheduler(info, target, draft, sched_config)
            await scheduler.start()
            return scheduler

        return open_scheduler

    async def worker_stats(self) -> dict:
        """What each in-process worker holds: {model: {role: {"live_sequences": n, "free_slots": n}}}, a
        model's further replicas under their replica_label."""
        out = {}
        for name, entry in self.entries.items():
            for replica in entry.replicas.replicas:
                workers = out[replica_label(name, replica.index)] = {}
                if replica.scheduler is None:
                    continue
                target, draft = replica.scheduler.workers
                workers["target"] = {
                    "live_sequences": len(target.verifier.slots),
                    "free_slots": target.verifier.runner.free_slots,
                }
                if draft is not None:
                    workers["draft"] = draft.loop.drafter.stats()
        return out


def _tap_features(target_runner, spec: DraftSpec | None, info):
    """The target runner, sending the features its drafter reads (an EAGLE-3 head's three layers)."""
    from duospec.engine.eagle3 import tap_features

    return tap_features(target_runner, spec.feature_layers(info.target_path) if spec is not None else ())
