"""`duospec train-heads`' options, typed and validated, without torch (the CLI reads their defaults
when it builds its parser, which an SDK-only install does too)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class HeadTrainingError(ValueError):
    """Bad input to `duospec train-heads`; the message names the option and the fix."""


@dataclass(frozen=True)
class HeadOptions:
    target: Path
    method: str
    data: tuple[str, ...]
    out: Path
    steps: int | None = None
    minutes: float | None = None
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    medusa_heads: int = 4
    device: str = "auto"
    seed: int = 0
    resume: bool = True
    eval_prompts: int = 24
    bf16: bool = False  # autocast on CPU too; CUDA always (not part of the run's identity: a resume may switch)
    # eagle3 (duospec/training/eagle3_run.py)
    draft_vocab: int = 8192  # the draft LM head's tokens: the ones the target emits most
    ttt_steps: int = 4  # training-time-test steps: the head learns to draft this far on its own outputs
    stdlib_tokens: int = 200_000  # raw-code tokens cached when --data names stdlib
    layout: str = "duospec"  # published: also write OUT/published (config.json + safetensors, vLLM/SGLang)
    init: Path | None = None  # start from this head's weights (continue a shipped head)

    def validate(self) -> None:
        if self.method not in ("eagle", "eagle3", "medusa"):
            raise HeadTrainingError(f"--method must be eagle, eagle3 or medusa, got {self.method!r}")
        if self.layout not in ("duospec", "published"):
            raise HeadTrainingError(f"--layout must be duospec or published, got {self.layout!r}")
        if self.init is not None and not self.init.is_dir():
            raise HeadTrainingError(f"--init {self.init}: not a head directory")
        if self.steps is None and self.minutes is None:
            raise HeadTrainingError("give a budget: --steps N or --minutes M")
        for name in ("steps", "minutes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise HeadTrainingError(f"--{name} must be positive, got {value}")
        for name in ("batch_size", "seq_len", "medusa_heads", "draft_vocab", "ttt_steps"):
            if getattr(self, name) < 1:
                raise HeadTrainingError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise HeadTrainingError(f"--lr must be positive, got {self.lr}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise HeadTrainingError(f"--device must be auto, cpu or cuda, got {self.device!r}")
