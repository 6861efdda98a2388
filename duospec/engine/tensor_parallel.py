"""Tensor parallelism for duospec's own forward: one process per rank, joined by torch.distributed.

Megatron's split, on the checkpoint's own tensors (docs/design.md#engine):

- attention: q, k and v column-parallel by head (rank r holds heads r·h/R .. (r+1)·h/R − 1 and the
  matching KV heads), o row-parallel (its input columns of those heads), one all-reduce after o;
- MLP: gate and up column-parallel, down row-parallel, one all-reduce after down;
- LM head vocabulary-parallel: each rank computes the logits of its slice of the vocabulary (padded to
  equal slices), and only the rows the caller asked for are gathered;
- embedding, norms (q/k norms included) and biases of row-parallel layers replicated (the latter on
  rank 0 only, so the all-reduce adds them once).

Each rank holds its share of the KV cache (its KV heads), in a pool of the same number of blocks
(`agree_min` at load). The runner on every rank sees the same calls in the same order
(`TensorParallelRunner` sends rank 0's to the others), so block tables and lengths stay identical and
the collectives inside a forward pair up.
"""

from __future__ import annotations

import collections.abc
import copy
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from duospec.engine.errors import CheckpointError, SlotsExhausted

__all__ = ["TensorParallel", "TensorParallelRunner", "check_tp_size", "follow", "shard_config", "shard_state_dict",
           "working_tp_sizes"]


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (the default torch.distributed group unless
    `group` says otherwise). `control_group`: where the runner calls and load-time agreements travel,
    when not in `group` — a gloo group beside NCCL, since they are Python objects and CPU integers."""

    rank: int
    world: int
    group: Any = None
    control_group: Any = None

    @property
    def control(self):
        """The group the runner calls and load-time agreements travel in."""
        return self.group if self.control_group is None else self.control_group

    def agree_min(self, n: int) -> int:
        """The smallest `n` over the ranks (every rank must call it)."""
        import torch.distributed as dist

        value = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.control)
        return int(value.item())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[N, V/R]`` slices from every rank → ``[N, V]`` (the padding past the vocabulary dropped)."""
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


def _sizes(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, config.intermediate_size


def working_tp_sizes(config) -> list[int]:
    """Every tensor-parallel size that divides the attention heads, KV heads and MLP width."""
    heads, kv_heads, inter = _sizes(config)
    g = math.gcd(math.gcd(heads, kv_heads), inter)
    return [n for n in range(1, g + 1) if g % n == 0]


def check_tp_size(config, world: int, what: str = "the model") -> None:
    """A start-up error naming the sizes that work when `world` does not divide the model."""
    if world < 1:
        raise CheckpointError(f"tensor_parallel_size={world}: must be >= 1")
    heads, kv_heads, inter = _sizes(config)
    if heads % world or kv_heads % world or inter % world:
        raise CheckpointError(
            f"tensor_parallel_size={world} does not divide {what} ({heads} attention heads, {kv_heads} KV heads, "
            f"MLP width {inter}); sizes that work: {', '.join(map(str, working_tp_sizes(config)))}")


def shard_config(config, world: int):
    """The config one rank's runner sees: its share of the heads and the MLP, the head size kept, the
    LM head untied (each rank holds its vocabulary slice apart from the replicated embedding)."""
    check_tp_size(config, world)
    heads, kv_heads, inter = _sizes(config)
    sharded = copy.deepcopy(config)
    sharded.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    sharded.num_attention_heads = heads // world
    sharded.num_key_value_heads = kv_heads // world
    sharded.intermediate_size = inter // world
    sharded.tie_word_embeddings = False
    return sharded


def shard_state_dict(config, state_dict: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of a Llama-family state dict (transformers' names)."""
    check_tp_size(config, world)
    heads, kv_heads, _ = _sizes(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    def rows(t: torch.Tensor) -> torch.Tensor:  # this rank's share of dim 0
        size = t.shape[0] // world
        return t[rank * size:(rank + 1) * size].clone()

    def cols(t: torch.Tensor) -> torch.Tensor:  # this rank's share of dim 1
        size = t.shape[1] // world
        return t[:, rank * size:(rank + 1) * size].clone()

    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        leaf = name.rsplit(".", 2)[-2:]
        layer_part = ".".join(leaf)
        if ".self_attn." in name and leaf[0] in ("q_proj", "k_proj", "v_proj"):
            n_heads = heads if leaf[0] == "q_proj" else kv_heads
            if t.shape[0] != n_heads * head_dim:
                raise CheckpointError(f"{name}: {t.shape[0]} rows, expected {n_heads} heads x {head_dim}")
            out[name] = rows(t)
        elif ".mlp." in name and leaf[0] in ("gate_proj", "up_proj"):
            out[name] = rows(t)
        elif layer_part in ("o_proj.weight", "down_proj.weight"):
            out[name] = cols(t)
        elif layer_part in ("o_proj.bias", "down_proj.bias"):
            out[name] = t.clone() if rank == 0 else torch.zeros_like(t)
        else:  # embedding, norms, q/k norms: replicated
            out[name] = t
    tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in state_dict
    head = state_dict["model.embed_tokens.weight" if tied else "lm_head.weight"]
    vocab = head.shape[0]
    size = -(-vocab // world)
    padded = torch.zeros(size * world, head.shape[1], dtype=head.dtype)
    padded[:vocab] = head
    out["lm_head.weight"] = padded[rank * size:(rank + 1) * size].clone()
    return out


# What a runner call raises on every rank alike, before any collective (a refused allocation, a bad
# argument): the group stays in step. Anything else leaves it out of step.
SAME_ON_EVERY_RANK = (ValueError, SlotsExhausted)

# The runner calls that run the model (collectives inside): every rank makes them together.
FORWARD_CALLS = frozenset({"forward", "forward_last", "forward_with_hidden", "forward_for_verify"})
# The runner calls that change a rank's state or run the model: every rank must make them, in order.
MIRRORED_CALLS = FORWARD_CALLS | {"allocate_slot", "free_slot", "truncate", "copy_prefix", "commit", "match_prefix",
                                  "keep_path"}


class TensorParallelRunner:
    """Rank 0's view of a tensor-parallel runner: the worker uses it as its ModelRunner. Each call in
    MIRRORED_CALLS is made on the other ranks too (which run `follow`), in the same order, so every
    rank's block tables and lengths stay the same and the collectives inside a forward pair up; what
    only reads (sizes, free slots, stats) is answered by rank 0's runner alone. Mirrored calls from
    several threads go one at a time, so the order they are sent in is the order they run in.

    Only a forward needs the other ranks at once. The bookkeeping calls before it (a verify round's
    truncate and commit per sequence, allocations, prefix matches: each is decided on rank 0 alone, and
    every rank's runner computes the same answer from the same calls) run here at once and travel
    with the next forward, in one broadcast: a broadcast costs two collectives, and on CPU each one
    costs about as much as a small forward's matmuls (docs/benchmarks.md#tensor-parallelism-and-replicas).

    `on_broken(exc)`: called when a mirrored call fails otherwise than SAME_ON_EVERY_RANK (a rank died,
    a collective failed): the ranks may be out of step, so the group must not serve on. A Ray group
    ends rank 0's process there (cluster/tp_group.py); by default the error is raised."""

    def __init__(self, runner, tp: TensorParallel, on_broken: Callable[[BaseException], None] | None = None) -> None:
        if tp.rank != 0:
            raise ValueError(f"rank {tp.rank}: only rank 0 drives the group; the others run follow()")
        self._runner = runner
        self._tp = tp
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._pending: list[tuple] = []  # bookkeeping calls made here, not yet sent to the other ranks

    def __getattr__(self, name: str):
        attr = getattr(self._runner, name)
        if name not in MIRRORED_CALLS:
            return attr

        def mirrored(*args, **kwargs):
            with self._lock:
                try:
                    # (copied now: the caller may change a list it passed before the call is sent)
                    self._pending.append((name, tuple(map(_picklable, args)),
                                          {k: _picklable(v) for k, v in kwargs.items()}))
                    if name in FORWARD_CALLS:
                        calls, self._pending = self._pending, []
                        _broadcast(self._tp, calls)
                    return attr(*args, **kwargs)
                except SAME_ON_EVERY_RANK:
                    raise
                except BaseException as exc:
                    if self._on_broken is not None:
                        self._on_broken(exc)
                    raise

        return mirrored

    def close(self) -> None:
        """Tell the other ranks to return from `follow`."""
        with self._lock:
            calls, self._pending = self._pending, []
            _broadcast(self._tp, calls + [None])


def follow(runner, tp: TensorParallel) -> None:
    """Ranks 1 .. R-1: make rank 0's calls on this rank's runner, as they arrive with each forward,
    until rank 0 closes the group (a None call). A call that fails fails alike on every rank (the
    checks come before any collective), so it is skipped."""
    while True:
        for call in _broadcast(tp, None):
            if call is None:
                return
            name, args, kwargs = call
            try:
                getattr(runner, name)(*args, **kwargs)
            except SAME_ON_EVERY_RANK:  # rank 0 raised the same and answered its caller
                continue


def _picklable(value):
    """A list, or a sequence a caller passed as another container (a protobuf repeated field), as a
    list of its own (sent later, so a copy); anything else as it is."""
    if isinstance(value, collections.abc.Sequence) and not isinstance(value, (str, bytes, tuple)):
        return list(value)
    return value


def _broadcast(tp: TensorParallel, message):
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    return box[0]
