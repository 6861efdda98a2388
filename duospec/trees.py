"""Token trees as parent indices: the shape the engine's tree mask, the verify rule and the scheduler
share. Node i's parent is `parents[i]` (-1: a root, one position after the context), with
`parents[i] < i`; a chain of k drafts is the tree `[-1, 0, 1, ..., k-2]`."""

from __future__ import annotations

from collections.abc import Sequence


def chain_parents(k: int) -> list[int]:
    """The parents of a chain of k nodes: each node's parent is the one before it."""
    return list(range(-1, k - 1))


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (-1: a root at depth 0)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def tree_children(parents: Sequence[int]) -> dict[int, list[int]]:
    """node -> its children in index order (-1: the roots)."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    return children


def check_parents(parents: Sequence[int], k: int) -> None:
    if len(parents) != k or any(not -1 <= int(p) < i for i, p in enumerate(parents)):
        raise ValueError(f"parents {list(parents)}: need one per draft token, each in [-1, its own index)")
