"""Greedy exactness checks shared by the decoder, pipeline and server tests (docs/design.md#exactness).

A mismatch with the reference is acceptable only at a genuine near-tie: where the reference's two
best logits are within 1e-4 (relative). Such a case is reported with its margin, never hidden.
"""

from __future__ import annotations

import warnings
import weakref

import torch

NEAR_TIE_RTOL = 1e-4


def reference_model(path):
    """transformers' model of the checkpoint at `path`, in float32 (the engine's dtype on CPU): left to
    transformers' dtype="auto" a checkpoint saved in float16 (the bundled pair) would load as float16,
    a coarser reference and, on CPU, a far slower one."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# {model: {(prompt, max_new_tokens): output}}: the tests check every mode (and drafter) against the
# same reference, which generate() would otherwise recompute for each; weak keys end with the model.
_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """transformers generate(do_sample=False) of the target alone, EOS ignored (computed once per model,
    prompt and length)."""
    known = _REFERENCES.setdefault(model, {})
    key = (tuple(prompt_ids), max_new_tokens)
    if key not in known:
        known[key] = _generate_greedy(model, prompt_ids, max_new_tokens)
    return list(known[key])


def _generate_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    ids = torch.tensor([list(prompt_ids)])
    # No EOS at all (not min_new_tokens, which would mask the EOS logit and change the argmax). A
    # None in a passed config falls back to the model's default, so the default is cleared instead.
    model.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    out = model.generate(ids, generation_config=config)
    return out[0, ids.shape[1] :].tolist()


def top2_margin(model, context: list[int]) -> float:
    """Relative gap between the two largest next-token logits after `context`."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float((top[0] - top[1]).abs() / top[0].abs().clamp_min(1e-6))


def assert_greedy_equal(model, prompt_ids, got: list[int], want: list[int]) -> None:
    """Token-for-token equality, except a first divergence at a near-tie (reported as a warning)."""
    if got == want:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if first < min(len(got), len(want)):
        margin = top2_margin(model, list(prompt_ids) + want[:first])
        if margin < NEAR_TIE_RTOL:
            warnings.warn(f"greedy divergence at new token {first} is a near-tie (top-2 margin {margin:.2e})")
            return
        raise AssertionError(
            f"greedy output diverges from the target alone at new token {first} (top-2 margin {margin:.2e}, "
            f"not a near-tie): got {got[first:first + 5]}..., want {want[first:first + 5]}..."
        )
    raise AssertionError(f"length differs: got {len(got)} tokens, want {len(want)}")


def chi_square_pvalue(joint: dict, counts, n: int) -> float:
    """p-value of observed outcome `counts` (n draws) against exact probabilities `joint`; cells with
    fewer than 5 expected draws are merged (the chi-square approximation needs it)."""
    import numpy as np
    from scipy import stats

    cells = sorted(joint)
    expected = np.array([joint[c] for c in cells]) * n
    observed = np.array([counts.get(c, 0) for c in cells])
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)
