"""In-process coordinator: both models in this process, each on its own thread.

The same scheduler, policies and worker code as the Ray pipeline, with in-process links instead of
gRPC streams. Used by tests, benchmarks (the "in-process" column) and `duospec serve --backend local`.
"""

from __future__ import annotations

from duospec.coordinator.links import LocalDraftLink, LocalTargetLink
from duospec.coordinator.models import model_info, worker_kv
from duospec.coordinator.router import ModelEntry, ModelRouter, scheduler_config
from duospec.coordinator.scheduler import Scheduler
from duospec.cluster.worker import resolve_device
from duospec.draft_worker.drafter import Drafter
from duospec.draft_worker.methods import build_proposer
from duospec.draft_worker.proposer import DraftMethod, DraftSpec, Proposer
from duospec.target_worker.verifier import Verifier


def load_runner(path: str, model_config, max_slots: int, max_context: int | None = None):
    from duospec.engine import load_model

    return load_model(
        path,
        device=resolve_device(getattr(model_config, "device", "auto")),
        dtype=getattr(model_config, "dtype", "auto"),
        max_slots=max_slots,
        max_context=max_context,
        kv=worker_kv(model_config, "target"),
    )


class LocalCoordinator(ModelRouter):
    def __init__(self, models: list, *, runners: dict | None = None):
        """`models`: coordinator.config.ModelConfig list. `runners` ({name: (target, draft)}) lets
        tests and benchmarks pass already-loaded ModelRunners (draft: a ModelRunner, a Proposer or None)."""
        super().__init__()
        for config in models:
            info = model_info(config)
            spec = getattr(config, "draft", None)
            preloaded = (runners or {}).get(config.name)
            if preloaded is None:  # load now: health turns SERVING only once the models are in memory
                max_slots = scheduler_config(config).max_num_seqs
                proposer = None
                if spec is not None:
                    proposer = build_proposer(spec, info.target_path, device=resolve_device(config.device),
                                              dtype=config.dtype, max_slots=max_slots, max_context=info.max_context,
                                              prefill_chunk_tokens=config.prefill_chunk_tokens,
                                              kv=worker_kv(config, "draft"))
                preloaded = (load_runner(info.target_path, config, max_slots, info.max_context), proposer)
            else:
                target_runner, draft = preloaded
                if draft is not None and not isinstance(draft, Proposer):
                    draft = build_proposer(spec or DraftSpec(DraftMethod.MODEL), info.target_path, runner=draft)
                preloaded = (target_runner, draft)
            self.add_model(ModelEntry(info, config, self._opener(info, config, preloaded)))

    @staticmethod
    def _opener(info, config, preloaded):
        async def open_scheduler() -> Scheduler:
            sched_config = scheduler_config(config)
            target_runner, proposer = preloaded
            target = LocalTargetLink(Verifier(target_runner))
            draft = LocalDraftLink(Drafter(proposer)) if proposer is not None else None
            scheduler = Scheduler(info, target, draft, sched_config)
            scheduler.workers = (target, draft)
            await scheduler.start()
            return scheduler

        return open_scheduler

    async def worker_stats(self) -> dict:
        """What each in-process worker holds: {model: {role: {"live_sequences": n, "free_slots": n}}}."""
        out = {}
        for name, entry in self.entries.items():
            out[name] = {}
            if entry.scheduler is None:
                continue
            target, draft = entry.scheduler.workers
            out[name]["target"] = {
                "live_sequences": len(target.verifier.slots),
                "free_slots": target.verifier.runner.free_slots,
            }
            if draft is not None:
                out[name]["draft"] = draft.loop.drafter.stats()
        return out
