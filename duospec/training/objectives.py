"""What one training step optimises. The loop in `loop.py` is shared; these objects differ.

- `JointObjective`: trains the target on next-token cross-entropy and, on the same batch, the draft
  towards the target's (detached) distribution. The target's logits are computed anyway, so online
  distillation costs only the draft's own forward/backward.
- `DistillObjective`: the target is frozen (no gradients, eval mode); only the draft learns. This is
  `duospec distill` and the final phase of `duospec train-tiny`.

Draft loss = kd_weight * KL(p_target || q_draft) + ce_weight * CE(q_draft, data)
            + argmax_weight * CE(q_draft, argmax p_target).
Forward KL makes the draft cover the target's mass, which the sampled acceptance rule rewards. The
argmax term targets greedy acceptance directly (a draft token survives greedy verification only if
it is the target's argmax). While the target is still learning (joint phase) the data term keeps the
draft useful; against a finished target the data term only pulls the draft away from the target,
so distillation uses `DISTILL_WEIGHTS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DraftLossWeights:
    kd_weight: float = 1.0
    ce_weight: float = 0.25
    argmax_weight: float = 0.0


JOINT_WEIGHTS = DraftLossWeights(kd_weight=1.0, ce_weight=0.25, argmax_weight=0.0)
DISTILL_WEIGHTS = DraftLossWeights(kd_weight=1.0, ce_weight=0.0, argmax_weight=0.5)


def _logits(model, inputs: torch.Tensor) -> torch.Tensor:
    # [batch, seq, vocab]; fp32 for the losses even under autocast.
    return model(input_ids=inputs, use_cache=False).logits.float()


def draft_losses(draft_logits, target_logits, labels, weights: DraftLossWeights):
    """(total, kl, ce, agreement) for the draft; target_logits must already be detached."""
    vocab = draft_logits.shape[-1]
    log_q = F.log_softmax(draft_logits.reshape(-1, vocab), dim=-1)
    log_p = F.log_softmax(target_logits.reshape(-1, vocab), dim=-1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    ce = F.nll_loss(log_q, labels.reshape(-1))
    target_argmax = log_p.argmax(-1)
    total = weights.kd_weight * kl + weights.ce_weight * ce
    if weights.argmax_weight:
        total = total + weights.argmax_weight * F.nll_loss(log_q, target_argmax)
    agreement = (log_q.argmax(-1) == target_argmax).float().mean()
    return total, kl, ce, agreement


def _split(batch: torch.Tensor, device):
    batch = batch.to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


class JointObjective:
    def __init__(self, target, draft, weights: DraftLossWeights, device):
        self.target, self.draft, self.weights, self.device = target, draft, weights, device

    def trainable(self) -> dict:
        return {"target": self.target, "draft": self.draft}

    def loss(self, batch):
        inputs, labels = _split(batch, self.device)
        target_logits = _logits(self.target, inputs)
        target_ce = F.cross_entropy(target_logits.reshape(-1, target_logits.shape[-1]), labels.reshape(-1))
        draft_total, kl, ce, agreement = draft_losses(
            _logits(self.draft, inputs), target_logits.detach(), labels, self.weights
        )
        metrics = {"target_ce": target_ce.item(), "draft_kl": kl.item(), "draft_ce": ce.item(),
                   "agree": agreement.item()}
        return target_ce + draft_total, metrics

    @torch.no_grad()
    def evaluate(self, batches) -> dict:
        return _evaluate(self.target, self.draft, batches, self.weights, self.device)


class DistillObjective:
    def __init__(self, target, draft, weights: DraftLossWeights, device):
        self.target, self.draft, self.weights, self.device = target, draft, weights, device
        self.target.eval()
        self.target.requires_grad_(False)

    def trainable(self) -> dict:
        return {"draft": self.draft}

    def loss(self, batch):
        inputs, labels = _split(batch, self.device)
        with torch.no_grad():
            target_logits = _logits(self.target, inputs)
        total, kl, ce, agreement = draft_losses(_logits(self.draft, inputs), target_logits, labels, self.weights)
        return total, {"draft_kl": kl.item(), "draft_ce": ce.item(), "agree": agreement.item()}

    @torch.no_grad()
    def evaluate(self, batches) -> dict:
        return _evaluate(self.target, self.draft, batches, self.weights, self.device)


def _evaluate(target, draft, batches, weights, device) -> dict:
    """Held-out losses: target CE, draft CE and KL, teacher-forced greedy agreement."""
    was_training = target.training, draft.training
    target.eval()
    draft.eval()
    sums = {"target_ce": 0.0, "draft_ce": 0.0, "draft_kl": 0.0, "agree": 0.0}
    for batch in batches:
        inputs, labels = _split(batch, device)
        target_logits = _logits(target, inputs)
        draft_logits = _logits(draft, inputs)
        sums["target_ce"] += F.cross_entropy(
            target_logits.reshape(-1, target_logits.shape[-1]), labels.reshape(-1)).item()
        _, kl, ce, agreement = draft_losses(draft_logits, target_logits, labels, weights)
        sums["draft_kl"] += kl.item()
        sums["draft_ce"] += ce.item()
        sums["agree"] += agreement.item()
    target.train(was_training[0])
    draft.train(was_training[1])
    return {key: value / max(len(batches), 1) for key, value in sums.items()}
