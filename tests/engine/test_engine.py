"""Engine parity with transformers on tiny random-weight checkpoints, and slot bookkeeping.

The reference is the transformers model run on the whole sequence at once (no cache); the engine is
driven through prefills, ragged batched steps, rollbacks and re-extensions. fp32 logits must agree
within 1e-4 (docs/design.md#engine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from duospec.engine import CheckpointError, SlotChunk, SlotsExhausted, load_checkpoint, load_model
from tiny_models import make_tiny_checkpoint, tiny_tokenizer

MODELS = Path(__file__).resolve().parents[2] / "models"

TOL = 1e-4
SEQ_LEN = 48

# name -> (family, make_tiny_checkpoint kwargs)
CONFIGS = {
    "llama": ("llama", {}),
    "llama-tied-mha-bias": ("llama", {"tie_embeddings": True, "num_kv_heads": 4, "attention_bias": True}),
    "llama3-scaling": ("llama3", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_embeddings": True, "num_kv_heads": 1}),
    "mistral-window": ("mistral", {"config_overrides": {"sliding_window": 8}}),
    "qwen3": ("qwen3", {}),
    "qwen3-bias-tied": ("qwen3", {"attention_bias": True, "tie_embeddings": True,
                                  "config_overrides": {"head_dim": 24}}),
    # Gemma: weights large enough (init_std) that its tanh GELU and an exact one differ past TOL; local
    # layers with a window SEQ_LEN crosses, a query scale that is not 1/sqrt(head_dim).
    "gemma3-window": ("gemma3", {"init_std": 0.05, "config_overrides": {"sliding_window": 8,
                                                                         "query_pre_attn_scalar": 10}}),
    "gemma3-softcap-tied": ("gemma3", {"init_std": 0.05, "tie_embeddings": True, "num_kv_heads": 1,
                                       "config_overrides": {"head_dim": 24, "final_logit_softcapping": 1.0,
                                                            "sliding_window": 16}}),
}


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_ckpts")
    return {name: make_tiny_checkpoint(root / name, fam, seed=3, **kw) for name, (fam, kw) in CONFIGS.items()}


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(11)
    return torch.randint(3, 384, (3, SEQ_LEN), generator=gen)


_REFERENCE: dict[str, torch.Tensor] = {}


def reference_logits(path, sequences) -> torch.Tensor:
    """[n_seq, SEQ_LEN, vocab]: transformers, whole sequences, no cache (memoised per path)."""
    from transformers import AutoModelForCausalLM

    if str(path) not in _REFERENCE:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            _REFERENCE[str(path)] = model(sequences).logits
    return _REFERENCE[str(path)]


def chunk(slot, seq, start, end):
    return SlotChunk(slot, start, seq[start:end].tolist())


def assert_close(got, want, what):
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff:.3g} > {TOL}"


def drive_scenario(runner, seqs, ref):
    """Prefill, ragged steps, rollback + re-extension; every logit checked against ``ref``."""
    a, b, c = (runner.allocate_slot() for _ in range(3))
    s2 = seqs[2].tolist()

    # 1. Ragged prefill: three prompt lengths in one forward.
    out = runner.forward([chunk(a, seqs[0], 0, 10), chunk(b, seqs[1], 0, 3), chunk(c, seqs[2], 0, 17)])
    assert [o.shape for o in out] == [(10, runner.vocab_size), (3, runner.vocab_size), (17, runner.vocab_size)]
    assert all(o.dtype == torch.float32 and o.device.type == "cpu" for o in out)
    assert not any(o.is_inference() for o in out)  # callers may scale logits in place
    for o, i, n in zip(out, range(3), (10, 3, 17)):
        assert_close(o, ref[i, :n], f"prefill seq {i}")

    # 2. Ragged step, slots out of order, different start positions and chunk lengths.
    out = runner.forward([chunk(c, seqs[2], 17, 18), chunk(a, seqs[0], 10, 14), chunk(b, seqs[1], 3, 20)])
    assert_close(out[0], ref[2, 17:18], "step seq 2")
    assert_close(out[1], ref[0, 10:14], "step seq 0")
    assert_close(out[2], ref[1, 3:20], "step seq 1")
    assert [runner.slot_length(s) for s in (a, b, c)] == [14, 20, 18]

    # 3. Speculate garbage on a and c, roll back (truncate / start_pos before the end), re-extend.
    runner.forward([SlotChunk(a, 14, [5, 6, 7, 8, 9]), SlotChunk(c, 18, [s2[30]] * 6)])
    runner.truncate(a, 12)
    last = runner.forward_last([chunk(a, seqs[0], 12, 30), chunk(c, seqs[2], 18, 20), chunk(b, seqs[1], 20, 21)])
    assert last.shape == (3, runner.vocab_size)
    assert_close(last[0], ref[0, 29], "re-extended seq 0")
    assert_close(last[1], ref[2, 19], "rolled back via start_pos, seq 2")
    assert_close(last[2], ref[1, 20], "step seq 1")

    # 4. Run every sequence to the end; a rolled-back run equals one that never went astray.
    out = runner.forward([chunk(a, seqs[0], 30, SEQ_LEN), chunk(b, seqs[1], 21, SEQ_LEN), chunk(c, seqs[2], 20, SEQ_LEN)])
    for o, i, start in zip(out, range(3), (30, 21, 20)):
        assert_close(o, ref[i, start:], f"tail seq {i}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lean_matches_transformers(name, ckpt_dirs, sequences, test_device):
    runner = load_model(ckpt_dirs[name], max_slots=4, max_context=64, device=test_device)
    assert runner.backend == "lean"
    drive_scenario(runner, sequences, reference_logits(ckpt_dirs[name], sequences))


@pytest.mark.parametrize("name", ["llama3-scaling", "qwen2-bias", "mistral-window", "gemma3-window"])
def test_hf_fallback_matches_transformers(name, ckpt_dirs, sequences):
    runner = load_model(ckpt_dirs[name], max_slots=4, max_context=64, backend="hf")
    assert runner.backend == "hf"
    drive_scenario(runner, sequences, reference_logits(ckpt_dirs[name], sequences))


def test_other_architecture_falls_back_to_hf(tmp_path, sequences):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=384, n_positions=64, n_embd=32, n_layer=2, n_head=2)).save_pretrained(tmp_path)
    runner = load_model(tmp_path, max_slots=4)
    assert runner.backend == "hf"
    drive_scenario(runner, sequences, reference_logits(tmp_path, sequences))


@pytest.mark.parametrize("family, kw, reason", [
    ("gemma3", {"config_overrides": {"attn_logit_softcapping": 50.0}}, "attn_logit_softcapping is set"),
    ("gemma3", {"config_overrides": {"hidden_activation": "gelu"}}, "MLP activation 'gelu'"),
    ("qwen3", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
])
def test_what_the_lean_forward_does_not_implement_runs_on_transformers(tmp_path, sequences, family, kw, reason):
    path = make_tiny_checkpoint(tmp_path / "m", family, seed=3, **kw)
    with pytest.raises(CheckpointError, match=f"backend='lean' cannot run this model .*{reason}"):
        load_model(path, backend="lean", max_slots=4, max_context=64)
    runner = load_model(path, max_slots=4, max_context=64)
    assert runner.backend == "hf"
    drive_scenario(runner, sequences, reference_logits(path, sequences))


def test_rope_per_layer_type_needs_layer_types():
    # What a Llama-shaped layer copied from a Gemma 3 config gets (the EAGLE head's, heads.py): a
    # reason, not an AttributeError at load.
    from transformers import LlamaConfig

    from duospec.engine.llama import lean_unsupported_reason

    config = LlamaConfig(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    assert "no layer_types" in lean_unsupported_reason(config)


@pytest.mark.parametrize("name", ["mistral-window", "gemma3-window"])
def test_sliding_window_changes_logits_beyond_the_window(name, ckpt_dirs, sequences, tmp_path):
    # Same seed and shapes as `name`, no window: identical weights, so any logit difference comes
    # from the window (guards against a mask that silently ignores it; Gemma: on its local layers).
    family, kw = CONFIGS[name]
    overrides = dict(kw["config_overrides"])
    window = overrides.pop("sliding_window")
    plain = make_tiny_checkpoint(tmp_path / "plain", family, seed=3, **{**kw, "config_overrides": overrides})
    windowed = load_model(ckpt_dirs[name], max_context=64)
    full = load_model(plain, max_context=64)
    chunks = [SlotChunk(r.allocate_slot(), 0, sequences[0].tolist()) for r in (windowed, full)]
    got_w, got_f = windowed.forward(chunks[:1])[0], full.forward(chunks[1:])[0]
    assert_close(got_w[:window], got_f[:window], "inside the window")
    assert (got_w[window:] - got_f[window:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3-window"])
def test_decode_one_token_at_a_time_matches(name, ckpt_dirs, sequences):
    runner = load_model(ckpt_dirs[name], max_slots=2, max_context=64)
    ref = reference_logits(ckpt_dirs[name], sequences)
    slots = [runner.allocate_slot(), runner.allocate_slot()]
    runner.forward([chunk(slots[0], sequences[0], 0, 5), chunk(slots[1], sequences[1], 0, 9)])
    for step in range(12):
        last = runner.forward_last([chunk(slots[0], sequences[0], 5 + step, 6 + step),
                                    chunk(slots[1], sequences[1], 9 + step, 10 + step)])
        assert_close(last[0], ref[0, 5 + step], f"decode step {step} seq 0")
        assert_close(last[1], ref[1, 9 + step], f"decode step {step} seq 1")


def test_logits_can_stay_on_device(ckpt_dirs):
    runner = load_model(ckpt_dirs["llama"], max_slots=1, max_context=16)
    slot = runner.allocate_slot()
    out = runner.forward([SlotChunk(slot, 0, [4, 5, 6])], to_cpu=False)[0]
    assert out.dtype == torch.float32 and out.device == runner.device and out.shape == (3, runner.vocab_size)


def test_bfloat16_runs_close_to_float32(ckpt_dirs, sequences):
    fp32 = load_model(ckpt_dirs["qwen2-bias"], max_slots=1, max_context=64)
    bf16 = load_model(ckpt_dirs["qwen2-bias"], max_slots=1, max_context=64, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    chunks = [SlotChunk(r.allocate_slot(), 0, sequences[0, :20].tolist()) for r in (fp32, bf16)]
    a, b = fp32.forward(chunks[:1])[0], bf16.forward(chunks[1:])[0]
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()


@pytest.mark.parametrize("name", ["qwen3", "gemma3-window"])
def test_bfloat16_rounds_where_transformers_does(name, ckpt_dirs, sequences):
    """In bfloat16 a whole-sequence prefill lands within two bf16 steps of transformers' own bf16
    logits (bit-equal on the machine this was written on). float32 parity cannot see the order of rounding:
    Gemma's norms scale by float32 (1 + w) before the cast, Llama's after it; Gemma's tiny model in
    Llama's order lands 7 steps off."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(ckpt_dirs[name], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = reference(sequences[:2]).logits.float()
    runner = load_model(ckpt_dirs[name], max_slots=2, max_context=64, dtype="bfloat16")
    got = torch.stack(runner.forward([SlotChunk(runner.allocate_slot(), 0, s.tolist()) for s in sequences[:2]]))
    step = 2.0 ** (torch.floor(torch.log2(want.abs().max())).item() - 7)  # bf16's spacing at the largest logit
    diff = (got - want).abs().max().item()
    assert diff <= 2 * step, f"max abs diff {diff:.3g} > two bf16 steps ({2 * step:.3g})"


def test_slots_allocate_free_exhaust(ckpt_dirs):
    runner = load_model(ckpt_dirs["llama"], max_slots=3, max_context=32)
    slots = [runner.allocate_slot() for _ in range(3)]
    assert slots == [0, 1, 2] and runner.free_slots == 0
    with pytest.raises(SlotsExhausted, match="all 3 KV-cache slots are in use"):
        runner.allocate_slot()
    runner.forward([SlotChunk(1, 0, [7, 8, 9])])
    assert runner.slot_length(1) == 3
    runner.free_slot(1)
    with pytest.raises(ValueError, match="slot=1: not allocated"):
        runner.slot_length(1)
    with pytest.raises(ValueError, match="not allocated"):
        runner.free_slot(1)
    assert runner.allocate_slot() == 1 and runner.slot_length(1) == 0
    with pytest.raises(ValueError, match="not a slot index"):
        runner.free_slot(7)


def test_truncate_bounds(ckpt_dirs):
    runner = load_model(ckpt_dirs["llama"], max_slots=1, max_context=32)
    slot = runner.allocate_slot()
    runner.forward([SlotChunk(slot, 0, [3, 4, 5, 6])])
    runner.truncate(slot, 2)
    assert runner.slot_length(slot) == 2
    with pytest.raises(ValueError, match=r"length must be in \[0, 2\]"):
        runner.truncate(slot, 3)


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([], "chunks is empty"),
        ([SlotChunk(0, 0, [])], "token_ids is empty"),
        ([SlotChunk(0, 3, [5])], r"start_pos=3 but the slot holds 2 positions"),
        ([SlotChunk(0, 2, [5]), SlotChunk(0, 3, [6])], "appears twice"),
        ([SlotChunk(0, 0, [5] * 33)], "exceed max_context=32"),
        ([SlotChunk(0, 2, [384])], r"token id 384 outside \[0, 384\)"),
        ([SlotChunk(0, 2, [-1])], "token id -1"),
        ([SlotChunk(1, 0, [5])], "slot=1: not allocated"),
    ],
)
def test_bad_chunks_are_rejected_without_side_effects(ckpt_dirs, chunks, message):
    runner = load_model(ckpt_dirs["llama"], max_slots=2, max_context=32)
    slot = runner.allocate_slot()
    runner.forward([SlotChunk(slot, 0, [3, 4])])
    with pytest.raises(ValueError, match=message):
        runner.forward(chunks)
    assert runner.slot_length(slot) == 2


def test_tensor_token_ids_get_a_clear_error(ckpt_dirs):
    runner = load_model(ckpt_dirs["llama"], max_slots=1, max_context=16)
    slot = runner.allocate_slot()
    with pytest.raises(TypeError, match=r"token_ids is a Tensor; pass a list of ints"):
        runner.forward([SlotChunk(slot, 0, torch.tensor([3, 4]))])


def test_load_checkpoint_bundles_runner_and_tokenizer(ckpt_dirs):
    ckpt = load_checkpoint(ckpt_dirs["qwen2-bias"], max_slots=2, max_context=32)
    assert ckpt.runner.backend == "lean" and ckpt.config.model_type == "qwen2"
    assert len(ckpt.tokenizer) <= ckpt.runner.vocab_size
    assert ckpt.eos_token_ids == (ckpt.tokenizer.eos_token_id,)
    ids = ckpt.tokenizer("def f(x): return x")["input_ids"]
    slot = ckpt.runner.allocate_slot()
    assert ckpt.runner.forward_last([SlotChunk(slot, 0, ids)]).shape == (1, ckpt.runner.vocab_size)


def test_tiny_checkpoints_are_deterministic_and_cached(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tok")
    one = make_tiny_checkpoint(tmp_path / "one", "qwen2", seed=4, tokenizer_dir=tok)
    two = make_tiny_checkpoint(tmp_path / "two", "qwen2", seed=4)
    other = make_tiny_checkpoint(tmp_path / "other", "qwen2", seed=5)
    weights = [(p / "model.safetensors").read_bytes() for p in (one, two, other)]
    assert weights[0] == weights[1] != weights[2]
    assert (one / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    mtime = (one / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_checkpoint(tmp_path / "one", "qwen2", seed=4, tokenizer_dir=tok) == one
    assert (one / "model.safetensors").stat().st_mtime_ns == mtime


def assert_same_product(got, x, weight, bias):
    """`got` is F.linear(x, weight, bias) up to summation order: kernels add the 1024 products of a row
    in different blocks, so an element may differ by a few float32 ulps of the sum of the products'
    magnitudes (an output near 0 that cancels large terms has a large relative error; the AMD EPYC
    VM's oneDNN differed by 1.3e-4 on an element whose terms summed to ~650 in magnitude)."""
    want = torch.nn.functional.linear(x, weight, bias)
    magnitude = x.abs() @ weight.abs().T + (bias.abs() if bias is not None else 0)
    bound = 8 * torch.finfo(torch.float32).eps * magnitude
    excess = ((got - want).abs() - bound).max().item()
    assert excess <= 0, f"a kernel's product differs from F.linear by more than reordering explains ({excess:.3g} over)"


@pytest.mark.parametrize("rows", [1, 2, 5, 40])
@pytest.mark.parametrize("shape", [(64, 32), (1024, 256), (4096, 160), (1536, 1024)])
def test_measured_cpu_linear_matches_f_linear(shape, rows):
    # Whichever kernel the load-time measurement picks computes what F.linear does, for 1 row (the
    # drafter) and for verify/prefill-sized batches; small weights stay plain.
    from duospec.engine.cpu_linear import CpuLinear, Kernel, packed_linear_works

    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(shape, generator=gen), torch.randn(shape[0], generator=gen)
    x = torch.randn(rows, shape[1], generator=gen)
    linear = CpuLinear(weight, bias, measure=packed_linear_works(), model_weight_bytes=8 << 20)
    assert_same_product(linear(x), x, weight, bias)
    if weight.numel() < 1 << 14:
        assert set(linear.choices) == {Kernel.PLAIN}


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("kernels", [("PLAIN",) * 5, ("TRANSPOSED",) * 5, ("ONEDNN",) * 5,
                                     ("TRANSPOSED", "ONEDNN", "ONEDNN", "PLAIN", "ONEDNN")])
def test_each_kernel_choice_computes_f_linear(monkeypatch, kernels, with_bias):
    """Whatever the load-time measurement picks for each row count, every row count gives F.linear's
    result (with and without a bias), runs the kernel chosen for it, and only the layouts those
    kernels read are kept; the plain layout is the weight itself (a tied LM head is no copy)."""
    from duospec.engine import cpu_linear
    from duospec.engine.cpu_linear import Kernel

    if not cpu_linear.packed_linear_works():
        pytest.skip("no oneDNN packed linear in this torch build")
    choices = tuple(Kernel[k] for k in kernels)
    monkeypatch.setattr(cpu_linear, "kernel_choices", lambda *shape: choices)
    gen = torch.Generator().manual_seed(len(set(kernels)))
    for out_features in (1024, 2048):  # 2048x1024 is big enough to pad oneDNN's 1-3 rows
        weight = torch.randn(out_features, 1024, generator=gen)
        bias = torch.randn(out_features, generator=gen) if with_bias else None
        linear = cpu_linear.CpuLinear(weight, bias, measure=True)
        assert set(linear.weights) == set(choices)
        if Kernel.PLAIN in choices:
            assert linear.weights[Kernel.PLAIN] is weight
        for rows, want_kernel in ((1, 0), (2, 1), (3, 1), (4, 2), (5, 2), (9, 3), (16, 4), (40, 4)):
            assert linear.kernel(rows) is choices[want_kernel]
            x = torch.randn(rows, 1024, generator=gen)
            assert_same_product(linear(x), x, weight, bias)


def test_the_measured_choice_is_a_kernel_per_row_count():
    from duospec.engine import cpu_linear
    from duospec.engine.cpu_linear import CALIBRATE_ROWS, Kernel

    choices = cpu_linear.kernel_choices(768, 256, 4)
    assert len(choices) == len(CALIBRATE_ROWS) and set(choices) <= set(cpu_linear.available_kernels())
    assert len(set(choices)) <= 2  # never a third layout of the weight
    # Without oneDNN (a build lacking it, or DUOSPEC_PACKED_LINEAR=0) both MKL products still compete.
    assert set(cpu_linear.kernel_choices(768, 256, 2, (Kernel.PLAIN, Kernel.TRANSPOSED))) <= {
        Kernel.PLAIN, Kernel.TRANSPOSED}
    # too big to measure: oneDNN for every row count (plain F.linear without it)
    assert cpu_linear.kernel_choices(1 << 12, 1 << 12, 1, (Kernel.PLAIN, Kernel.ONEDNN)) == (Kernel.ONEDNN,) * 5
    assert cpu_linear.kernel_choices(1 << 12, 1 << 12, 1, (Kernel.PLAIN,)) == (Kernel.PLAIN,) * 5
    # the kernels' copies together make the model's working set, at least one each, capped
    assert cpu_linear.copies_for(1 << 20, 24 << 20, 3) == 8 and cpu_linear.copies_for(1 << 20, 0) == 1
    assert cpu_linear.copies_for(1 << 20, 1 << 40, 2) == 32


def test_the_working_set_counts_what_a_forward_multiplies_by(monkeypatch):
    # The bundled target's layers and its tied LM head, each once; not the embedding a second time.
    from duospec.engine import cpu_linear, load_model

    seen = []
    monkeypatch.setattr(cpu_linear, "copies_for", lambda w, model, n=3: seen.append(model) or 1)
    load_model(MODELS / "target", max_slots=1, max_context=64, backend="lean", dtype="float32")
    config = json.loads((MODELS / "target" / "config.json").read_text())
    h, layers, inter, vocab = (config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                   "vocab_size"))
    per_layer = 4 * h * h + 3 * h * inter  # q, k, v, o (4 heads x 64 = hidden) + gate, up, down
    assert set(seen) == {4 * (layers * per_layer + vocab * h)}


def test_packed_linear_can_be_switched_off(monkeypatch):
    from duospec.engine import cpu_linear

    cpu_linear.packed_linear_works.cache_clear()
    monkeypatch.setenv(cpu_linear.PACKED_LINEAR_ENV, "0")
    try:
        assert not cpu_linear.packed_linear_works()
    finally:
        cpu_linear.packed_linear_works.cache_clear()


@pytest.mark.parametrize("with_bias", [True, False])
def test_the_half_kernel_is_a_drafters_only(monkeypatch, with_bias):
    """The float16 product is offered to a drafter's weights only, stays within float16's rounding of
    F.linear, keeps a float32 result, and an input beyond float16's range gives finite outputs."""
    from duospec.engine import cpu_linear
    from duospec.engine.cpu_linear import Kernel

    if not cpu_linear.half_linear_works():
        pytest.skip("no float16 GEMM in this torch build")
    assert Kernel.HALF not in cpu_linear.available_kernels()
    assert Kernel.HALF in cpu_linear.available_kernels(approximate=True)
    monkeypatch.setattr(cpu_linear, "kernel_choices", lambda *shape: (Kernel.HALF,) * 5)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(512, 256, generator=gen) / 16
    bias = torch.randn(512, generator=gen) if with_bias else None
    linear = cpu_linear.CpuLinear(weight, bias, measure=True, approximate=True)
    assert linear.weights[Kernel.HALF].dtype == torch.float16
    for rows in (1, 3, 16):
        x = torch.randn(rows, 256, generator=gen)
        got = linear(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=2e-2, atol=2e-2)
    # beyond float16's range in and out: computed on the scaled-down input, finite and still close
    outlier = torch.randn(1, 256, generator=gen) * 1e6
    torch.testing.assert_close(linear(outlier), torch.nn.functional.linear(outlier, weight, bias), rtol=2e-2,
                               atol=2e-2 * 1e6)


def test_only_a_drafters_runner_may_multiply_in_half(monkeypatch):
    # A target's linears are measured among the exact kernels; the same checkpoint loaded as a drafter
    # with float16_products also offers the float16 one (the bundled target's weights are big enough
    # to be measured), and without it does not.
    from duospec.engine import cpu_linear

    offered = []
    real = cpu_linear.kernel_choices
    monkeypatch.setattr(cpu_linear, "kernel_choices",
                        lambda out, inp, copies=1, kernels=None: offered.append(kernels) or real(out, inp, 1, kernels, 1))
    load_model(MODELS / "target", max_slots=1, max_context=64, backend="lean", dtype="float32")
    assert offered and all(cpu_linear.Kernel.HALF not in k for k in offered)
    offered.clear()
    load_model(MODELS / "target", max_slots=1, max_context=64, backend="lean", dtype="float32", drafter=True)
    assert offered and all(cpu_linear.Kernel.HALF not in k for k in offered)
    offered.clear()
    load_model(MODELS / "target", max_slots=1, max_context=64, backend="lean", dtype="float32", drafter=True,
               float16_products=True)
    assert offered and all((cpu_linear.Kernel.HALF in k) == cpu_linear.half_linear_works() for k in offered)


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "mistral-window", "qwen3", "gemma3-window"])
def test_shallow_layers_match_transformers_truncated(ckpt_dirs, sequences, name):
    """`num_layers=K` (the `layers` drafter) = the target's first K layers + its final norm and head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from duospec.engine.loader import shallow_config

    path = ckpt_dirs[name]
    config = shallow_config(str(path), AutoConfig.from_pretrained(path), 1)
    reference = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(sequences[:1]).logits[0]
    runner = load_model(path, device="cpu", dtype="float32", max_slots=1, num_layers=1)
    assert len(runner.layers) == 1 and runner.config.num_hidden_layers == 1
    slot = runner.allocate_slot()
    got = runner.forward([chunk(slot, sequences[0], 0, SEQ_LEN)])[0]
    assert_close(got, want, f"{name} first layer")
    with pytest.raises(Exception, match=r"1 <= layers < 2"):
        load_model(path, device="cpu", max_slots=1, num_layers=2)
