"""Drafting with Medusa heads on the target's hidden state (duospec/engine/heads.py).

With tokens[:n] known, the target's feature of position n - 2 (its LM head there predicted token
n - 1, the newest verified token) gives every head's guess at once: head i proposes position
n - 1 + i. So a proposal is `heads` tokens from one feature, made as soon as the verdict's features
arrive, and then nothing until the next verdict (exhausted): Medusa cannot run ahead of the target.
Each head's runner-up is named as the position's alternative, so pearl's token trees verify it as a
sibling.

Greedy requests only: a head's guess ignores the token actually sampled at n - 1, and which positions
a proposal covers depends on when verdicts arrive, so a sampled request's seeded output would depend
on timing. Sampled requests go on target-only (the drafter declines them).
"""

from __future__ import annotations

import torch

from duospec.draft_worker.model_proposer import ALTERNATIVES
from duospec.draft_worker.proposer import DraftDeclined, DraftMethod, DraftState, Proposal, Proposer
from duospec.engine.heads import MedusaModel


class MedusaProposer(Proposer):
    method = DraftMethod.MEDUSA

    def __init__(self, model: MedusaModel):
        self.model = model
        self.proposals = 0

    def open(self, seq: DraftState) -> None:
        if not seq.sampling.greedy:
            raise DraftDeclined("the medusa drafter drafts greedy requests only")

    def propose(self, seqs: list[DraftState], budgets: list[int]) -> list[Proposal]:
        proposals: list[Proposal | None] = [None] * len(seqs)
        ready = []
        for i, seq in enumerate(seqs):
            source = seq.next_pos - 2  # the feature whose LM head predicted the newest token
            if seq.features.broken or source < 0:  # (a one-token prompt: the first verdict brings f[0])
                proposals[i] = Proposal(exhausted=True)
            elif source >= seq.features.known:
                # verified positions' features are on their way: wait; past them: the next verdict
                proposals[i] = Proposal(waiting=True) if source < seq.committed_len - 1 else Proposal(exhausted=True)
            else:
                ready.append((i, source))
        if ready:
            features = torch.stack([seqs[i].features.row(source) for i, source in ready])
            logits = self.model.logits(features)  # [heads, n, vocab]
            ranked = torch.topk(logits, min(ALTERNATIVES + 1, logits.shape[-1]), dim=-1).indices  # [heads, n, k]
            for row, (i, _) in enumerate(ready):
                picks = ranked[:, row].tolist()[: budgets[i]]
                tokens = [p[0] for p in picks]
                proposals[i] = Proposal(tokens, alternatives=[p[1:] for p in picks], exhausted=True)
                self.proposals += 1
        return proposals

    def stats(self) -> dict:
        return {"medusa_proposals": self.proposals}
