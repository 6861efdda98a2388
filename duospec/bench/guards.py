"""One goodput guard per speculation variant, for a benchmark that interleaves variants on one server.

A server runs one variant, and its guard (coordinator/scheduling/guard.py) learns once, then holds steady. A
benchmark runs pearl, pearl without the tree, ... in turn on the same workers; sharing one guard, each
variant would inherit another's choices, and a fresh guard per run would measure only the learning.
So each variant keeps its own guard per scheduler, put in place (ModelRouter.swap_guards) before its
runs and set aside after, and continues from what it learned itself.
"""

from __future__ import annotations

import weakref

from duospec.coordinator.scheduling.guard import GoodputGuard


class GuardsPerVariant:
    """The guards of one coordinator's schedulers, by variant."""

    def __init__(self) -> None:
        self.variant: str | None = None  # whose guards are in place
        self._kept: dict[tuple, GoodputGuard] = {}  # (variant, model, replica) -> its guard, when not in place

    def use(self, coordinator, variant: str) -> None:
        """Puts `variant`'s guards in place on `coordinator` (a ModelRouter; nothing may be in flight):
        the running variant's go aside, and `variant` continues from its own (fresh ones the first time)."""

        def swap(key: tuple[str, int], current: GoodputGuard) -> GoodputGuard:
            if self.variant is not None:
                self._kept[(self.variant, *key)] = current
            return self._kept.get((variant, *key)) or GoodputGuard()

        coordinator.swap_guards(swap)
        self.variant = variant


# The in-process runs and the served ones (with their round-overhead run) share a coordinator: one
# record per coordinator, gone with it.
_PER_COORDINATOR: "weakref.WeakKeyDictionary[object, GuardsPerVariant]" = weakref.WeakKeyDictionary()


def use_speculation_choices(coordinator, variant: str) -> None:
    """Runs what follows on `coordinator` with `variant`'s goodput guards (GuardsPerVariant.use)."""
    guards = _PER_COORDINATOR.get(coordinator)
    if guards is None:
        guards = _PER_COORDINATOR[coordinator] = GuardsPerVariant()
    guards.use(coordinator, variant)
