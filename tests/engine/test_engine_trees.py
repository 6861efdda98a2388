"""Token trees in the lean engine: a tree-masked forward equals running each root-to-leaf path as its
own chain, and after `keep_path` the slot is the slot that only ever saw that path (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch

from duospec.engine import SlotChunk, load_model
from tiny_models import make_tiny_checkpoint, scattered_runner

TOL = 1e-4
CONFIGS = {
    "llama": ("llama", {}),
    "qwen2-gqa": ("qwen2", {"num_kv_heads": 1}),
    "mistral-window": ("mistral", {"config_overrides": {"sliding_window": 24}}),
    "qwen3": ("qwen3", {}),
    # the 30-token prefix crosses the local layers' window; a tree fits inside it
    "gemma3-window": ("gemma3", {"init_std": 0.05, "config_overrides": {"sliding_window": 24,
                                                                         "query_pre_attn_scalar": 10}}),
}
# A tree below a prefix: node i's parent is PARENTS[i] (-1: the prefix's last token).
#   0 ─ 1 ─ 2          (the main chain)
#   ├── 3 ─ 4          (a sibling of 1 with a child)
#   5                  (a sibling of 0)
#   6 under 2          (a leaf one deeper)
PARENTS = [-1, 0, 1, 0, 3, -1, 2]
TOKENS = [11, 12, 13, 21, 22, 31, 14]


def _paths(parents):
    """Every root-to-node path, as node-index lists."""
    out = []
    for i in range(len(parents)):
        path, node = [], i
        while node >= 0:
            path.append(node)
            node = parents[node]
        out.append(path[::-1])
    return out


@pytest.fixture(scope="module", params=[(name, layout) for name in CONFIGS for layout in ("slots", "scattered")],
                ids=lambda p: "-".join(p))
def runner(request, tmp_path_factory):
    """Each config on a pool laid out like one region per slot, and on a small pool of 4-position
    blocks in random order (trees, their kept paths and the probes cross block boundaries)."""
    name, layout = request.param
    family, kw = CONFIGS[name]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("trees") / name, family, seed=4, **kw)
    if layout == "scattered":
        return scattered_runner(path, max_context=128, blocks=48, block_size=4)
    return load_model(path, dtype=torch.float32, max_slots=4, max_context=128)


def _prefix(n=30):
    gen = torch.Generator().manual_seed(2)
    return torch.randint(3, 384, (n,), generator=gen).tolist()


def test_a_tree_forward_equals_each_path_as_a_chain(runner):
    prefix = _prefix()
    tree_slot, chain_slot = runner.allocate_slot(), runner.allocate_slot()
    # The tree arrives with the last prefix token in front (as a verify chunk: context, then drafts).
    runner.forward([SlotChunk(tree_slot, 0, prefix[:-1]), SlotChunk(chain_slot, 0, prefix[:-1])])
    chunk_parents = [-1] + [p + 1 for p in PARENTS]  # node i is chunk token i + 1; -1 -> the context token
    tree_logits = runner.forward([SlotChunk(tree_slot, len(prefix) - 1, [prefix[-1], *TOKENS], chunk_parents)])[0]
    for path in _paths(PARENTS):
        runner.truncate(chain_slot, len(prefix) - 1)
        chain = runner.forward([SlotChunk(chain_slot, len(prefix) - 1, [prefix[-1], *(TOKENS[i] for i in path)])])[0]
        diff = (tree_logits[[0] + [i + 1 for i in path]] - chain).abs().max().item()
        assert diff <= TOL, f"path {path}: max abs diff {diff:.3g}"
    for slot in (tree_slot, chain_slot):
        runner.free_slot(slot)


@pytest.mark.parametrize("path", [[0, 3, 4], [5], [0, 1, 2, 6], []])
def test_keep_path_leaves_the_slot_of_a_sequence_that_only_saw_the_path(runner, path):
    prefix = _prefix()
    tree_slot, plain_slot = runner.allocate_slot(), runner.allocate_slot()
    start = len(prefix)
    runner.forward([SlotChunk(tree_slot, 0, prefix), SlotChunk(plain_slot, 0, prefix + [TOKENS[i] for i in path])])
    runner.forward([SlotChunk(tree_slot, start, TOKENS, PARENTS)])
    runner.keep_path(tree_slot, start, path)
    assert runner.slot_length(tree_slot) == start + len(path)
    probe = [7, 8, 9]  # what comes next must see exactly prefix + path
    at = start + len(path)
    got, want = runner.forward([SlotChunk(tree_slot, at, probe), SlotChunk(plain_slot, at, probe)])
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"path {path}: max abs diff {diff:.3g}"
    for slot in (tree_slot, plain_slot):
        runner.free_slot(slot)


def test_bad_trees_are_refused(runner):
    slot = runner.allocate_slot()
    with pytest.raises(ValueError, match="parents"):
        runner.forward([SlotChunk(slot, 0, [5, 6, 7], [-1, 1, 0])])  # a parent after its child
    runner.forward([SlotChunk(slot, 0, [5, 6, 7], [-1, 0, 0])])
    with pytest.raises(ValueError, match="indices must increase"):
        runner.keep_path(slot, 0, [2, 1])
    runner.free_slot(slot)


def test_the_hf_backend_refuses_trees_clearly(tmp_path):
    from duospec.engine import load_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "llama", seed=1)
    runner = load_checkpoint(path, backend="hf", max_slots=1).runner
    slot = runner.allocate_slot()
    with pytest.raises(ValueError, match="chains only"):
        runner.forward([SlotChunk(slot, 0, [5, 6], [-1, -1])])



def test_a_target_without_trees_verifies_a_trees_main_chain(tmp_path):
    """The verifier cuts a tree down to its main chain on a backend without trees (hf): the verdict is
    the chain's, with no path, even where a branch held the target's token."""
    from duospec.engine import load_checkpoint
    from duospec.internal.sampling_wire import sampling_to_proto
    from duospec.internal.v1 import pearl_pb2 as pb
    from duospec.sampling import SamplingParams
    from duospec.target_worker.verifier import Verifier

    runner = load_checkpoint(make_tiny_checkpoint(tmp_path / "m", "llama", seed=1), backend="hf", max_slots=3).runner
    assert not runner.supports_trees
    verifier = Verifier(runner)

    def verify(seq_id, tokens, parents=()):
        item = pb.VerifyItem(seq_id=seq_id, start_pos=0, context=[5, 17, 42, 9], draft_tokens=tokens,
                             draft_parents=parents, sampling=sampling_to_proto(SamplingParams()),
                             bonus=pb.BONUS_POLICY_SAMPLE)
        out = verifier.run(pb.VerifyBatch(batch_id=seq_id, items=[item]))
        assert not out.errors, out.errors
        return out.verdicts[0]

    probe = verify(1, [3])
    if probe.kind == pb.NEXT_TOKEN_KIND_RECOVERED:  # the target's token after the context, and a wrong one
        target_token, wrong = probe.next_token, 3
    else:
        target_token, wrong = 3, 4
    chain = verify(2, [wrong])
    assert (chain.n_accepted, chain.kind, chain.next_token) == (0, pb.NEXT_TOKEN_KIND_RECOVERED, target_token)
    tree = verify(3, [wrong, 8, target_token], [-1, 0, -1])  # the target's token as a sibling of the wrong draft
    assert (tree.n_accepted, tree.kind, tree.next_token, list(tree.path)) == \
        (0, pb.NEXT_TOKEN_KIND_RECOVERED, target_token, [])
