"""Training an EAGLE-3 head (duospec/engine/eagle3.py) on cached target features, with the
training-time test.

The head is trained as it drafts. Step 0: row j reads token t[j] and fc(F[j-1]) (the target's fused
features) and predicts p[j], the target's distribution of token j+1. Step k (1 .. ttt_steps - 1)
simulates drafting k tokens past the last verified position: row i reads t[i] and the head's own
output of step k-1 at row i-1, and attends to what the drafting head's KV cache would hold then: step
0's rows at positions <= i-k (verified, read the target's features) and step s's row at position
i-k+s for s = 1 .. k (its own run-ahead rows). Loss: cross-entropy against the target's p restricted
to the draft vocabulary (soft labels), weighted 0.8^k, on answer positions only.

Initialisation: the LM head is the target's own rows of the draft vocabulary and the final norm the
target's (the head need only learn to predict the target's next hidden state, not a vocabulary);
the layer's output projections start at zero (the layer starts as its residual, fc(F)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from duospec.engine.eagle3 import LAYER_WEIGHTS
from duospec.training.loop import mean_metrics

LOSS_DECAY = 0.8


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Eagle3TrainHead(torch.nn.Module):
    """The head as a training module; `export()` gives duospec's names (engine/eagle3.py)."""

    def __init__(self, config, draft_ids: torch.Tensor, n_features: int = 3):
        super().__init__()
        h = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.n_heads
        self.eps = config.rms_norm_eps
        inter = config.intermediate_size
        linear = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = linear(n_features * h, h)
        self.q_proj, self.k_proj = linear(2 * h, self.n_heads * self.head_dim), linear(2 * h, self.n_kv * self.head_dim)
        self.v_proj, self.o_proj = linear(2 * h, self.n_kv * self.head_dim), linear(self.n_heads * self.head_dim, h)
        self.gate_proj, self.up_proj, self.down_proj = linear(h, inter), linear(h, inter), linear(inter, h)
        self.input_layernorm = torch.nn.Parameter(torch.ones(h))
        self.hidden_norm = torch.nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = torch.nn.Parameter(torch.ones(h))
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.lm_head = linear(h, len(draft_ids))
        self.register_buffer("draft_ids", draft_ids.long().clone())
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(config, "rope_theta", 1e4)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim),
                             persistent=False)

    # ---- initialisation and export ---------------------------------------------------------------

    @torch.no_grad()
    def init_from_target(self, lm_head: torch.Tensor, final_norm: torch.Tensor) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj):
            torch.nn.init.normal_(proj.weight, std=0.02)
        torch.nn.init.zeros_(self.o_proj.weight)
        torch.nn.init.zeros_(self.down_proj.weight)
        self.lm_head.weight.copy_(lm_head[self.draft_ids].float())
        self.norm.copy_(final_norm.float())

    def export(self) -> dict[str, torch.Tensor]:
        layer = {"self_attn.q_proj.weight": self.q_proj.weight, "self_attn.k_proj.weight": self.k_proj.weight,
                 "self_attn.v_proj.weight": self.v_proj.weight, "self_attn.o_proj.weight": self.o_proj.weight,
                 "mlp.gate_proj.weight": self.gate_proj.weight, "mlp.up_proj.weight": self.up_proj.weight,
                 "mlp.down_proj.weight": self.down_proj.weight, "input_layernorm.weight": self.input_layernorm,
                 "hidden_norm.weight": self.hidden_norm, "post_attention_layernorm.weight": self.post_attention_layernorm}
        assert set(layer) == set(LAYER_WEIGHTS)
        weights = {f"model.layers.0.{k}": v.detach() for k, v in layer.items()}
        weights.update({"fc.weight": self.fc.weight.detach(), "model.norm.weight": self.norm.detach(),
                        "lm_head.weight": self.lm_head.weight.detach(),
                        "d2t": self.draft_ids - torch.arange(len(self.draft_ids))})
        return weights

    @torch.no_grad()
    def load_exported(self, weights: dict[str, torch.Tensor]) -> None:
        """The inverse of `export` (a shipped head's weights, to continue training from)."""
        for key, value in weights.items():
            if key == "d2t":
                continue
            name = key.removeprefix("model.layers.0.").removeprefix("self_attn.").removeprefix("mlp.")
            name = {"model.norm.weight": "norm"}.get(name, name).removesuffix(".weight")
            target = getattr(self, name)
            (target.weight if isinstance(target, torch.nn.Linear) else target).copy_(value.float())

    # ---- forward -----------------------------------------------------------------------------------

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([angles, angles], -1)
        return x * emb.cos().to(x.dtype) + _rotate_half(x) * emb.sin().to(x.dtype)

    def _qkv(self, embeds: torch.Tensor, g: torch.Tensor, positions: torch.Tensor):
        b, t, _ = g.shape
        x = torch.cat([_rms(embeds, self.input_layernorm, self.eps), _rms(g, self.hidden_norm, self.eps)], -1)
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return self._rope(q, positions), self._rope(k, positions), v

    def _finish(self, g: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attended.shape
        h = g + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        return h + self.down_proj(F.silu(self.gate_proj(_rms(h, self.post_attention_layernorm, self.eps)))
                                  * self.up_proj(_rms(h, self.post_attention_layernorm, self.eps)))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[.., H] layer outputs -> [.., draft_vocab] logits."""
        return self.lm_head(_rms(out, self.norm, self.eps))

    def unrolled(self, embeds: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The layer's outputs [B, T, H] of each training-time-test step (module docstring).
        `embeds` [B, T, H] of t[j]; `features` [B, T, 3H] the target's F[j - 1] at row j (zeros at row 0)."""
        _, t, _ = embeds.shape
        positions = torch.arange(t, device=embeds.device)
        g = self.fc(features)
        keys, values, outs = [], [], []
        rows = positions[:, None]
        for k in range(steps):
            q, key, value = self._qkv(embeds, g, positions)
            keys.append(key)
            values.append(value)
            cols = positions[None, :]
            blocks = [cols <= rows - k]  # step 0: verified rows up to i - k
            blocks += [cols == rows - k + s for s in range(1, k + 1)]  # step s: its row at i - k + s
            mask = torch.cat(blocks, dim=1)
            mask[:, 0] |= ~mask.any(dim=1)  # rows i < k have no valid keys (and no loss): keep them finite
            attended = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                                      enable_gqa=self.n_heads != self.n_kv)
            out = self._finish(g, attended)
            outs.append(out)
            g = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)  # row i reads row i - 1's output
        return outs


class Eagle3Objective:
    """Loss over windows of a FeatureCache (`loss(batch)`: what duospec/training/loop.py calls)."""

    def __init__(self, head: Eagle3TrainHead, embed: torch.Tensor, target_lm_head: torch.Tensor, ttt_steps: int,
                 device: torch.device):
        self.head, self.device, self.ttt_steps = head, device, ttt_steps
        self.embed = embed.float().to(device)
        # the target's LM head over the draft vocabulary only: soft labels need nothing else
        self.teacher_head = target_lm_head.float()[head.draft_ids.cpu()].to(device)
        self.full_head = target_lm_head.float().to(device)  # the target's argmax, for agreement

    def trainable(self) -> dict:
        return {"head": self.head}

    def _forward(self, batch):
        tokens, taps, final, mask = (x.to(self.device) for x in batch)
        embeds = F.embedding(tokens, self.embed)
        taps = taps.float()
        features = torch.cat([torch.zeros_like(taps[:, :1]), taps[:, :-1]], dim=1)
        outs = self.head.unrolled(embeds, features, self.ttt_steps)
        with torch.no_grad():
            teacher = F.softmax(F.linear(final.float(), self.teacher_head), dim=-1)  # [B, T, Vd]
            # [B, T] the target's token: over its whole vocabulary in evaluation; while training, its
            # favourite in the draft vocabulary (the full LM head would cost 13 % of a step for a metric)
            target_top = (self.head.draft_ids[teacher.argmax(-1)] if self.head.training
                          else F.linear(final.float(), self.full_head).argmax(-1))
        return outs, teacher, target_top, mask

    def loss(self, batch):
        outs, teacher, target_top, mask = self._forward(batch)
        total, metrics, weights = 0.0, {}, 0.0
        for k, out in enumerate(outs):
            valid = mask.clone()
            valid[:, :k] = False  # step k's rows start at position k
            logits = self.head.logits(out)[valid].float()
            ce = -(teacher[valid] * F.log_softmax(logits, -1)).sum(-1).mean()
            total = total + LOSS_DECAY ** k * ce
            weights += LOSS_DECAY ** k
            drafted = self.head.draft_ids[logits.argmax(-1)]
            metrics[f"agree{k}"] = (drafted == target_top[valid]).float().mean().item()
        metrics["loss"] = total.item() / weights
        return total / weights, metrics

    def evaluate(self, batches) -> dict:
        return mean_metrics(self, batches)


class CacheBatches:
    """Seeded windows of a FeatureCache's training sequences: `batch(step, size)` is a function of
    (seed, step) alone, so a resumed run sees the batches an uninterrupted one would."""

    def __init__(self, cache, sequences, seq_len: int, seed: int):
        self.cache, self.sequences, self.seq_len, self.seed = cache, sequences, seq_len, seed
        if not sequences:
            raise ValueError("the feature cache holds no training sequences")

    def batch(self, step: int, batch_size: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        picks = torch.randint(len(self.sequences), (batch_size,), generator=gen).tolist()
        windows = []
        for i in picks:
            seq = self.sequences[i]
            spare = max(seq.length - self.seq_len, 0)
            offset = int(torch.randint(spare + 1, (1,), generator=gen)) if spare else 0
            windows.append(self.cache.window(seq, self.seq_len, offset))
        return collate(windows)

    def fixed_batches(self, n_batches: int, batch_size: int):
        windows = [self.cache.window(seq, self.seq_len) for seq in self.sequences[: n_batches * batch_size]]
        return [collate(windows[i: i + batch_size]) for i in range(0, len(windows), batch_size)]


def collate(windows):
    """Right-padded [B, T] tokens, [B, T, 3H] taps, [B, T, H] final, [B, T] loss mask."""
    t = max(w[0].shape[0] for w in windows)
    tokens = torch.zeros(len(windows), t, dtype=torch.long)
    taps = torch.zeros(len(windows), t, windows[0][1].shape[1], dtype=torch.float16)
    final = torch.zeros(len(windows), t, windows[0][2].shape[1], dtype=torch.float16)
    mask = torch.zeros(len(windows), t, dtype=torch.bool)
    for row, (tok, tap, fin, m) in enumerate(windows):
        n = tok.shape[0]
        tokens[row, :n], taps[row, :n], final[row, :n], mask[row, :n] = tok, tap, fin, m
    return tokens, taps, final, mask


def end_tokens(tokenizer, vocab_size: int) -> list[int]:
    """The tokens that end a turn (EOS, `<|im_end|>`): a draft vocabulary always keeps them."""
    return [t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
            if isinstance(t, int) and 0 <= t < vocab_size]


def choose_draft_vocab(counts, size: int, always: list[int]) -> torch.Tensor:
    """The `size` tokens the target emits most (plus `always`: its end tokens), ascending ids."""
    counts = torch.as_tensor(counts, dtype=torch.float64).clone()
    for token in always:
        counts[token] = counts.max() + 1
    size = min(size, counts.shape[0])
    return counts.topk(size).indices.sort().values


def coverage(counts, draft_ids: torch.Tensor) -> float:
    counts = torch.as_tensor(counts, dtype=torch.float64)
    return float(counts[draft_ids].sum()) / max(float(counts.sum()), 1.0)

