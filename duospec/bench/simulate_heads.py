"""`--simulate` for an EAGLE head (duospec/bench/simulate.py): its choices and its forward costs.

The replay drafter is a draft model whose continuation after every prefix of the target's greedy path
is what the EAGLE head drafts there in serving: the target's features for the verified positions
(all but the last token of the prefix), then its own predicted features — so running ahead in pearl
replays the head's own-feature drafts. The cost of a head step is measured on the real head (the
numbers in its feature inputs do not change its cost). Medusa cannot run ahead of the target, which
a replayed draft model would, so it is not simulated.
"""

from __future__ import annotations

from collections.abc import Sequence


def record_head_continuations(target_dir: str, head_dir: str, prompts: Sequence[Sequence[int]],
                              greedy: Sequence[Sequence[int]], depth: int, progress: bool = True):
    """(drafts, seconds) as record_tables stores them: per prompt, the head's `depth`-token
    continuation after prompt + greedy[:j] and its second choice at the first of those positions."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from duospec.training.heads import draft_tokens, load_trained_head

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    method, head = load_trained_head(head_dir, target_dir)
    if method != "eagle":
        raise ValueError(f"{head_dir}: a {method} head; --simulate replays EAGLE heads only")
    drafts, seconds = [], []
    with torch.no_grad():
        for prompt, path in tqdm(list(zip(prompts, greedy)), desc="recording EAGLE continuations",
                                 disable=not progress, leave=False):
            sequence = torch.tensor([list(prompt) + list(path)])
            features = target.model(input_ids=sequence, use_cache=False).last_hidden_state
            row_drafts, row_seconds = [], []
            for j in range(len(path) + 1):
                tokens, second = draft_tokens(target, head, "eagle", sequence, features, len(prompt) + j, depth,
                                              with_second=True)
                row_drafts.append(tuple(tokens))
                row_seconds.append(second)
            drafts.append(row_drafts)
            seconds.append(row_seconds)
    return drafts, seconds


class _ZeroFeatures:
    """An EagleRunner seen as a plain draft runner (forward_last over chunks) for measure_costs."""

    def __init__(self, runner):
        self.runner = runner

    def allocate_slot(self) -> int:
        return self.runner.allocate_slot()

    def free_slot(self, slot: int) -> None:
        self.runner.free_slot(slot)

    def forward_last(self, chunks):
        import torch

        rows = sum(len(c.token_ids) for c in chunks)
        return self.runner.forward_eagle(chunks, torch.zeros(rows, self.runner.config.hidden_size))[0]


def eagle_cost_runner(head_dir: str, target_dir: str, max_slots: int, method: str = "eagle"):
    """An EAGLE (or, `method` eagle3, EAGLE-3) head as a plain runner, for its step cost."""
    import torch

    from duospec.engine.eagle3 import load_eagle3
    from duospec.engine.heads import load_eagle

    load = load_eagle3 if method == "eagle3" else load_eagle
    return _ZeroFeatures(load(head_dir, target_dir, dtype=torch.float32, max_slots=max_slots, max_context=1024))
