"""Offline, on a replay table (`…/replay-devices/draft/replay.json`): how often the draft model's first draft is the
target's token, and how often a prompt lookup (coordinator/lookup.py's TextLookup, at least MIN_N tokens matched)
after the target's own text proposes the right next token, where it proposes at all.

    python lookup_precision.py DRAFT_REPLAY_JSON
"""
import json, sys

from duospec.coordinator.lookup import TextLookup

table = json.load(open(sys.argv[1]))["entries"]
model = [0, 0]
for e in table:
    for j, drafts in enumerate(e["drafts"][: len(e["greedy"])]):
        if drafts:
            model[0] += 1
            model[1] += drafts[0] == e["greedy"][j]
print(f"draft model: first draft right {model[1] / model[0]:.3f} of {model[0]} positions")
for min_n in (2, 3, 4, 6):
    proposed = right = run = offered = 0
    for e in table:
        prompt, greedy = e["prompt"], e["greedy"]
        text = list(prompt) + list(greedy)
        for j in range(len(greedy) - 1):
            proposal = TextLookup(min_ngram=min_n, max_ngram=max(min_n, 8)).propose(text[: len(prompt) + j + 1], 4)
            if proposal:
                proposed += 1
                right += proposal[0] == greedy[j + 1]
                offered += len(proposal)
                for a, b in zip(proposal, greedy[j + 1:]):
                    if a != b:
                        break
                    run += 1
    print(f"lookup, >= {min_n} tokens matched: proposes at {proposed} positions, first token right {right / proposed:.3f}, "
          f"accepted run {run / offered:.3f} of the tokens proposed")
