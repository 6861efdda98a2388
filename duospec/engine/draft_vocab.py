"""A draft model's trimmed output vocabulary (FR-Spec): the tokens the target emits most.

The draft's LM head is most of its step (a 49,152-token head over a 256-wide draft is ~80 % of its
multiply-adds); computing only the rows of the tokens the target actually emits makes each draft
step several times cheaper, and training it likewise. Greedy and sampled output stay exact: the
draft's q is zero outside the subset and the target verifies over its whole vocabulary, so a token
outside the subset still comes out, as the target's correction.

On disk, next to an ordinary checkpoint (which stays loadable by transformers with its full head):
`draft_vocab.safetensors` holding `token_ids`, int64, ascending, unique, within the model's vocabulary.
Only a drafter honours it (`load_model(..., drafter=True)`); a target never trims its output.
"""

from __future__ import annotations

import pathlib

import torch

from duospec.engine.errors import CheckpointError

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
TOKEN_IDS = "token_ids"


def read_draft_vocab(directory: str | pathlib.Path, vocab_size: int) -> torch.Tensor | None:
    """The checkpoint's draft vocabulary, or None when it has none; CheckpointError naming the file
    and the field when it is malformed."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = pathlib.Path(directory) / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: not a readable safetensors file ({err}); rewrite it with "
                              "duospec.engine.draft_vocab.write_draft_vocab or delete it") from err
    if TOKEN_IDS not in tensors:
        raise CheckpointError(f"{file}: no {TOKEN_IDS!r} tensor (it holds {sorted(tensors)})")
    ids = tensors[TOKEN_IDS]
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.numel() == 0:
        raise CheckpointError(f"{file}: {TOKEN_IDS} must be a non-empty 1-D integer tensor, got "
                              f"{ids.dtype} {list(ids.shape)}")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise CheckpointError(f"{file}: {TOKEN_IDS} holds ids outside the model's vocabulary of {vocab_size} "
                              f"(min {int(ids.min())}, max {int(ids.max())})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise CheckpointError(f"{file}: {TOKEN_IDS} must be ascending and unique")
    return ids


def write_draft_vocab(directory: str | pathlib.Path, token_ids: torch.Tensor) -> pathlib.Path:
    from safetensors.torch import save_file

    file = pathlib.Path(directory) / DRAFT_VOCAB_FILE
    save_file({TOKEN_IDS: token_ids.long().sort().values.contiguous()}, str(file))
    return file
