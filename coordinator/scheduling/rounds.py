"""The scheduler's sizes and what it tracks of each verify round (coordinator/scheduling/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from duospec.coordinator.config import ModelConfig
from duospec.internal.v1 import pearl_pb2 as pb


@dataclass
class InFlightVerify:
    """The one verify batch the target is working on."""

    batch_id: int
    seq_ids: list[int]
    sent_at: float
    n_tokens: int  # tokens fed to the target in this batch (for the verify cost model)
    # Every item feeds one committed token (plus drafts): a decode round, what the cost model is
    # about. Prompts and re-prefills are left out: their hundreds of tokens would tilt the line
    # fitted to 2-40-token rounds.
    decode_only: bool = True


@dataclass
class WorkerTimes:
    busy_s: float = 0.0
    idle_s: float = 0.0
    messages: int = 0
    # the target's decode-only batches and the rows they fed (drafts + 1 per sequence; no prompt)
    decode_batches: int = 0
    decode_rows: int = 0
    # constrained sequences' grammar masks, the worker's reports summed (add_grammar_work)
    grammar: pb.GrammarWork = field(default_factory=pb.GrammarWork)

    def grammar_report(self) -> dict:
        return {"grammar_mask_seconds": self.grammar.mask_seconds, "grammar_mask_rows": self.grammar.mask_rows,
                "grammar_forced_tokens": self.grammar.forced_tokens}


@dataclass
class SchedulerConfig:
    max_batch_size: int = ModelConfig.max_batch_size  # sequences per verify batch
    max_num_seqs: int = ModelConfig.max_num_seqs  # live sequences
    # Prompt tokens fed to the target per verify batch, over all its sequences: a long prompt is
    # prefilled in chunks that share rounds with the others' decode instead of stalling them.
    prefill_chunk_tokens: int = ModelConfig.prefill_chunk_tokens
    hang_timeout_s: float = ModelConfig.hang_timeout_s  # when a silent worker counts as hung (recovery.py)
    stats_window: list = field(default_factory=list)
