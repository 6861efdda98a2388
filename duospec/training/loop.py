"""The one training loop: schedule, optimiser, held-out evaluation, checkpoints, resume.

A run stops at a step budget, a wall-clock budget, or whichever comes first. Progress is
`max(step / max_steps, elapsed / max_seconds)`, and the learning rate is a linear warmup followed by
a cosine decay to `min_lr_ratio * lr` over that progress, so a time-budgeted run still ends its
schedule when its time ends. Elapsed time is saved in the checkpoint, so a resumed run continues
the same schedule instead of restarting it.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class LoopConfig:
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int | None = None
    max_seconds: float | None = None
    eval_every_s: float = 300.0
    eval_batches: int = 8
    checkpoint_every_s: float = 180.0
    seed: int = 0
    # bf16 autocast for the training forward (fp32 master weights); evaluation stays fp32.
    bf16_autocast: bool = False

    def __post_init__(self):
        if self.max_steps is None and self.max_seconds is None:
            raise ValueError("LoopConfig: set max_steps or max_seconds (the run needs a budget)")


@dataclass
class LoopState:
    step: int = 0
    elapsed_s: float = 0.0
    finished: bool = False
    last_eval: dict | None = None


def progress(cfg: LoopConfig, state: LoopState) -> float:
    parts = []
    if cfg.max_steps is not None:
        parts.append(state.step / max(cfg.max_steps, 1))
    if cfg.max_seconds is not None:
        parts.append(state.elapsed_s / max(cfg.max_seconds, 1e-9))
    return max(parts)


def learning_rate(cfg: LoopConfig, state: LoopState) -> float:
    if state.step < cfg.warmup_steps:
        return cfg.lr * (state.step + 1) / cfg.warmup_steps
    frac = min(progress(cfg, state), 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _make_optimizer(models: dict, cfg: LoopConfig) -> torch.optim.Optimizer:
    # Norm gains and the (tied) embedding are not decayed; matrices inside blocks are.
    decay, no_decay, seen = [], [], set()
    for model in models.values():
        for name, param in model.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (decay if param.ndim >= 2 and "embed" not in name else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


class Logger:
    """Appends lines to `log.txt` in the run directory and echoes them to stderr."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, message: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
        with self.path.open("a") as handle:
            handle.write(line + "\n")
        print(line, file=sys.stderr, flush=True)


def save_checkpoint(path: Path, objective, optimizer, state: LoopState, extra: dict) -> None:
    payload = {
        "models": {name: model.state_dict() for name, model in objective.trainable().items()},
        "optimizer": optimizer.state_dict(),
        "state": asdict(state),
        "extra": extra,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)  # never leave a half-written checkpoint behind


def load_checkpoint(path: Path, objective, optimizer) -> LoopState:
    payload = torch.load(path, map_location="cpu", weights_only=False)
    for name, model in objective.trainable().items():
        model.load_state_dict(payload["models"][name])
    optimizer.load_state_dict(payload["optimizer"])
    return LoopState(**payload["state"])


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). Without it torch emulates
    bf16, and autocast makes a training step slower, not faster (a 256 x 1,536 linear's forward and
    backward measured 27x slower than fp32 on an AVX2-only EPYC)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _autocast(cfg: LoopConfig, device_type: str, log: Logger, phase: str) -> bool:
    """bf16 autocast as asked, except on a CPU that would only emulate it: fp32 then, said once."""
    if not cfg.bf16_autocast or device_type == "cuda" or cpu_has_native_bf16():
        return cfg.bf16_autocast
    log(f"[{phase}] bf16 autocast off: this CPU has no native bfloat16 (AVX512-BF16 or AMX), where emulated "
        f"bf16 trains many times slower than fp32; training in fp32 (the weights are fp32 either way)")
    return False


def run_loop(objective, source, heldout_batches, cfg: LoopConfig, checkpoint_path: Path,
             log: Logger, extra: dict | None = None, phase: str = "train") -> LoopState:
    """Train `objective` until the budget is spent; resume from `checkpoint_path` if it exists."""
    from tqdm import tqdm

    extra = extra or {}
    optimizer = _make_optimizer(objective.trainable(), cfg)
    state = LoopState()
    if checkpoint_path.exists():
        state = load_checkpoint(checkpoint_path, objective, optimizer)
        log(f"[{phase}] resumed from {checkpoint_path} at step {state.step}, {state.elapsed_s:.0f}s")
    if progress(cfg, state) >= 1.0:
        return state  # already done; a larger step budget than last time would continue instead
    for model in objective.trainable().values():
        model.train()
    bar = tqdm(total=_bar_total(cfg), initial=_bar_position(cfg, state), desc=phase,
               unit="step" if cfg.max_steps is not None else "s",
               mininterval=5.0 if sys.stderr.isatty() else 60.0, file=sys.stderr)
    last_ckpt = last_eval = state.elapsed_s
    tokens_per_step = cfg.batch_size * (source.seq_len)
    device_type = "cuda" if objective.device.type == "cuda" else "cpu"
    autocast = _autocast(cfg, device_type, log, phase)
    window_start, window_tokens = time.perf_counter(), 0
    while progress(cfg, state) < 1.0:
        tick = time.perf_counter()
        lr = learning_rate(cfg, state)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            loss, metrics = objective.loss(source.batch(state.step, cfg.batch_size))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        state.step += 1
        state.elapsed_s += time.perf_counter() - tick
        window_tokens += tokens_per_step
        bar.n = _bar_position(cfg, state)
        held = {f"held_{k}": v for k, v in (state.last_eval or {}).items() if k.startswith("agree")}
        bar.set_postfix({k: f"{v:.3f}" for k, v in {**metrics, **held}.items()}, refresh=False)
        bar.update(0)
        if state.elapsed_s - last_eval >= cfg.eval_every_s and heldout_batches:
            rate = window_tokens / (time.perf_counter() - window_start)
            _log_eval(log, phase, objective, heldout_batches, state, metrics, lr, rate)
            window_start, window_tokens, last_eval = time.perf_counter(), 0, state.elapsed_s
        if state.elapsed_s - last_ckpt >= cfg.checkpoint_every_s:
            save_checkpoint(checkpoint_path, objective, optimizer, state, extra)
            last_ckpt = state.elapsed_s
    bar.close()
    if heldout_batches:
        rate = window_tokens / max(time.perf_counter() - window_start, 1e-9)
        _log_eval(log, phase, objective, heldout_batches, state, metrics, lr, rate)
    state.finished = True
    save_checkpoint(checkpoint_path, objective, optimizer, state, extra)
    log(f"[{phase}] finished at step {state.step} after {state.elapsed_s:.0f}s of training")
    return state


@torch.no_grad()
def mean_metrics(objective, batches) -> dict:
    """An objective's metrics averaged over held-out batches, its trained models in eval mode meanwhile."""
    models = list(objective.trainable().values())
    for model in models:
        model.eval()
    sums: dict[str, float] = {}
    for batch in batches:
        _, metrics = objective.loss(batch)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    for model in models:
        model.train()
    return {k: v / max(len(batches), 1) for k, v in sums.items()}


def _bar_total(cfg: LoopConfig) -> int:
    return cfg.max_steps if cfg.max_steps is not None else int(cfg.max_seconds)


def _bar_position(cfg: LoopConfig, state: LoopState) -> int:
    # Steps when the budget is in steps, seconds when it is in time; capped at the bar's end.
    position = state.step if cfg.max_steps is not None else int(state.elapsed_s)
    return min(position, _bar_total(cfg))


def _log_eval(log, phase, objective, heldout_batches, state, metrics, lr, rate) -> None:
    state.last_eval = objective.evaluate(heldout_batches)
    train = " ".join(f"{k}={v:.3f}" for k, v in metrics.items())
    held = " ".join(f"{k}={v:.3f}" for k, v in state.last_eval.items())
    log(f"[{phase}] step {state.step} t={state.elapsed_s:.0f}s lr={lr:.2e} tok/s={rate:.0f} "
        f"train: {train} | heldout: {held}")
