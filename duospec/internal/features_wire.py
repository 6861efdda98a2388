"""The target's hidden states on the wire (`Features` in pearl.proto): float16 rows, row-major."""

from __future__ import annotations

import numpy as np
import torch

from duospec.internal.v1 import pearl_pb2 as pb


def features_to_proto(start_pos: int, rows: torch.Tensor) -> pb.Features:
    """[n, hidden] float rows at positions start_pos .. start_pos + n - 1."""
    data = rows.detach().to(torch.float16).cpu().numpy().astype("<f2", copy=False)
    return pb.Features(start_pos=start_pos, hidden_size=rows.shape[-1], fp16=data.tobytes())


def features_from_proto(msg: pb.Features) -> tuple[int, torch.Tensor]:
    """(start_pos, [n, hidden] float32)."""
    if not msg.hidden_size or len(msg.fp16) % (2 * msg.hidden_size):
        raise ValueError(f"features: {len(msg.fp16)} bytes is not a whole number of {msg.hidden_size}-wide fp16 rows")
    rows = np.frombuffer(msg.fp16, dtype="<f2").reshape(-1, msg.hidden_size)
    return msg.start_pos, torch.from_numpy(rows.astype(np.float32))
