"""One context length everywhere: `models[].max_model_len` (default the model's
max_position_embeddings) is what validation, the coordinator, the drafter and the target all use."""

from __future__ import annotations

import grpc
import pytest
import torch

from duospec.coordinator.config import ConfigError, ModelConfig, parse_serve_config
from duospec.coordinator.models import ModelPairError, model_info
from duospec.engine import CheckpointError
from duospec.engine.kv_memory import check_kv_fits
from duospec.v1 import generation_pb2 as pb
from server_support import collect, running_server
from tiny_models import make_tiny_checkpoint
from exactness import reference_model

LONG = 5000  # past the engine's old silent cap of 4,096


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    target = make_tiny_checkpoint(root / "target", "llama", seed=31, hidden_size=64, num_layers=2,
                                  max_position_embeddings=LONG)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=32, hidden_size=32, num_layers=1,
                                 max_position_embeddings=LONG)
    return target, draft


def _config(long_pair, **kw):
    target, draft = long_pair
    return ModelConfig(name="long", target=str(target), draft=str(draft), device="cpu", dtype="float32", **kw)


async def test_a_request_past_position_4096_is_served_exactly(long_pair):
    from duospec.coordinator.local import LocalCoordinator

    target, _ = long_pair
    coordinator = LocalCoordinator([_config(long_pair)])
    assert coordinator.models()[0].max_context == LONG
    async with running_server(coordinator) as h:
        prompt = torch.randint(4, 384, (4090,), generator=torch.Generator().manual_seed(3)).tolist()
        for mode in (pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_OFF):
            req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                     stopping=pb.StoppingCriteria(max_new_tokens=20, ignore_eos=True),
                                     speculation=pb.SpeculationParams(mode=mode))
            got = [t for m in await collect(h.stub, req, timeout=120) for t in m.token_ids]
            model = reference_model(str(target))
            with torch.no_grad():
                want = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
            assert got == want, mode
        # Past the context: refused before any token, naming the limit.
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), stopping=pb.StoppingCriteria(
            max_new_tokens=LONG - len(prompt) + 1, ignore_eos=True))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(h.stub, req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(LONG) in info.value.details()


async def test_max_model_len_reaches_every_layer(long_pair):
    from duospec.coordinator.local import LocalCoordinator

    coordinator = LocalCoordinator([_config(long_pair, max_model_len=1024)])
    try:
        scheduler = await coordinator.entries["long"].get_scheduler()
        target_link, draft_link = scheduler.workers
        assert scheduler.info.max_context == 1024  # what requests are validated against
        assert target_link.verifier.runner.max_context == 1024
        assert draft_link.loop.drafter.proposer.max_context == 1024
    finally:
        await coordinator.close()


def test_max_model_len_above_the_model_is_refused(long_pair):
    with pytest.raises(ModelPairError, match=r"max_model_len 6000 is above what the model holds \(5000"):
        model_info(_config(long_pair, max_model_len=6000))
    with pytest.raises(ConfigError, match=r"models\[0\].max_model_len: 1 is out of range"):
        parse_serve_config({"models": [{"name": "m", "target": "t", "max_model_len": 1}]})
    assert parse_serve_config({"models": [{"name": "m", "target": "t", "max_model_len": 8192}]}).models[0].max_model_len \
        == 8192


def test_a_kv_cache_that_cannot_fit_is_a_clear_start_up_error():
    with pytest.raises(CheckpointError, match=r"\(16 sequences x 131072 positions\) needs .* GiB .*set "
                                              r"models\[\]\.kv_cache_memory_bytes lower"):
        check_kv_fits(1 << 60, torch.device("cpu"), "16 sequences x 131072 positions")
    check_kv_fits(1 << 20, torch.device("cpu"), "16 sequences x 1024 positions")  # a small one passes


def test_available_memory_counts_the_page_cache_the_kernel_can_drop(tmp_path):
    from duospec.engine.kv_memory import available_memory_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         2000000 kB\nMemAvailable:   21000000 kB\n")
    assert available_memory_bytes(str(meminfo)) == 21000000 * 1024  # not MemFree: a read cache is not in use
    assert available_memory_bytes(str(tmp_path / "absent")) is not None  # falls back to the free pages
