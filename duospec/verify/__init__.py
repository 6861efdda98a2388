"""The verify rule: which drafts the target keeps and which token follows them.

- `rule.py`: the specification — one item on the host (`verify` for a chain, `verify_tree` for a
  tree; a chain goes through the tree walk), with its glossary.
- `batch.py`: the same decisions for a whole batch as tensor code where the logits are (a GPU).
- `items.py`: what both check about an item before deciding it.

Both read probabilities from `duospec.sampling.probs_from_logits` and trees from `duospec.trees`.
"""

from duospec.verify.rule import (
    NextTokenKind,
    TreeVerdict,
    Verdict,
    acceptance_probability,
    residual_distribution,
    verify,
    verify_tree,
)

__all__ = ["NextTokenKind", "TreeVerdict", "Verdict", "acceptance_probability", "residual_distribution", "verify",
           "verify_tree"]
