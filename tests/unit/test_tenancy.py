"""Tenants file, key hashing, and admission (token buckets, stream limits, weighted slot queue)."""

from __future__ import annotations

import asyncio

import pytest

from duospec.coordinator.tenants.admission import Admission, AdmissionError
from duospec.coordinator.tenants.quota import TokenBucket
from duospec.coordinator.tenants.tenancy import (
    AuthError, Tenant, TenantLimits, TenantRegistry, TenantsFileError, hash_api_key, load_tenants, new_api_key,
    parse_tenants, save_tenants,
)


def test_keys_are_random_and_only_hashes_are_saved(tmp_path):
    key = new_api_key()
    assert key.startswith("ds_") and len(key) > 40 and key != new_api_key()
    path = tmp_path / "tenants.yaml"
    save_tenants(path, [Tenant("a", key_hashes=(hash_api_key(key),), priority_weight=2.0,
                               limits=TenantLimits(tokens_per_minute=100))])
    assert key not in path.read_text()
    assert (path.stat().st_mode & 0o077) == 0
    [tenant] = load_tenants(path)
    assert tenant.priority_weight == 2.0 and tenant.limits.tokens_per_minute == 100
    assert TenantRegistry([tenant]).authenticate(f"Bearer {key}").name == "a"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Basic abc", "Bearer wrong-key", "ds_abc"])
def test_bad_or_missing_keys_are_unauthenticated(header):
    registry = TenantRegistry([Tenant("a", key_hashes=(hash_api_key(new_api_key()),))])
    with pytest.raises(AuthError) as info:
        registry.authenticate(header)
    assert info.value.code == "UNAUTHENTICATED"


@pytest.mark.parametrize("raw, where", [
    ({"tenants": [{"name": "a", "key_hashes": ["plaintext-key"]}]}, "tenants[0].key_hashes[0]"),
    ({"tenants": [{"name": "a", "priority_weight": 0}]}, "tenants[0].priority_weight"),
    ({"tenants": [{"name": "a", "limits": {"rpm": 5}}]}, "tenants[0].limits.rpm"),
    ({"tenants": [{"name": "a", "limits": {"tokens_per_minute": -1}}]}, "tenants[0].limits.tokens_per_minute"),
    ({"tenants": [{"name": "a"}, {"name": "a"}]}, "tenants[1].name"),
    ({"tenants": [{"name": "bad name!"}]}, "tenants[0].name"),
    ({"tenant": []}, "tenant"),
])
def test_malformed_tenants_file_names_the_field(raw, where):
    with pytest.raises(TenantsFileError) as info:
        parse_tenants(raw, source="t.yaml")
    assert where in str(info.value)


def test_token_bucket_refills_at_its_rate():
    now = [0.0]
    bucket = TokenBucket(60, clock=lambda: now[0])  # 1 per second
    assert bucket.try_take(60) == 0.0
    assert bucket.try_take(1) == pytest.approx(1.0)
    now[0] = 2.5
    assert bucket.try_take(2) == 0.0
    assert bucket.try_take(1) == pytest.approx(0.5)
    assert bucket.try_take(61) == float("inf")


async def test_tokens_per_minute_reserves_and_refunds():
    now = [0.0]
    admission = Admission(8, 8, clock=lambda: now[0])
    tenant = Tenant("a", limits=TenantLimits(tokens_per_minute=100))
    ticket = await admission.admit(tenant, 80)
    with pytest.raises(AdmissionError) as info:
        await admission.admit(tenant, 30)
    assert info.value.code == "RESOURCE_EXHAUSTED" and info.value.retry_after_s == pytest.approx(6.0)
    admission.release(ticket, used_tokens=20)  # 60 of the 80 reserved come back
    await admission.admit(tenant, 30)


async def test_concurrent_stream_and_request_rate_limits():
    admission = Admission(8, 8)
    tenant = Tenant("a", limits=TenantLimits(max_concurrent_streams=2, requests_per_minute=3))
    t1 = await admission.admit(tenant, 1)
    await admission.admit(tenant, 1)
    with pytest.raises(AdmissionError, match="open streams") as info:
        await admission.admit(tenant, 1)
    assert info.value.retry_after_s
    admission.release(t1, 1)
    await admission.admit(tenant, 1)
    admission.release(t1, 1)  # double release is a no-op
    for _ in range(3):  # charged before validation: requests later rejected count too
        await admission.charge_request(tenant)
    with pytest.raises(AdmissionError, match="requests_per_minute"):
        await admission.charge_request(tenant)


async def test_a_reload_gives_changed_limits_new_buckets_and_keeps_the_stream_counts():
    admission = Admission(8, 8, tenants=[Tenant("a", limits=TenantLimits(requests_per_minute=1))])
    await admission.charge_request(Tenant("a", limits=TenantLimits(requests_per_minute=1)))
    with pytest.raises(AdmissionError):
        await admission.charge_request(Tenant("a", limits=TenantLimits(requests_per_minute=1)))
    raised = Tenant("a", limits=TenantLimits(requests_per_minute=5), priority_weight=4.0)
    admission.set_tenants([raised, Tenant("b")])
    await admission.charge_request(raised)
    assert admission.queue_share(raised) == 6  # 8 * 4 / (4 + 1)


async def test_draining_refuses_with_unavailable():
    admission = Admission(8, 8)
    admission.draining = True
    with pytest.raises(AdmissionError) as info:
        await admission.admit(Tenant("a"), 1)
    assert info.value.code == "UNAVAILABLE"


async def test_waiting_slots_go_to_tenants_by_weight():
    admission = Admission(max_concurrent=4, max_queued=100)
    heavy, light = Tenant("heavy", priority_weight=3.0), Tenant("light", priority_weight=1.0)
    blockers = [await admission.admit(light, 1) for _ in range(4)]
    waiters = [asyncio.ensure_future(admission.admit(t, 1)) for t in [light] * 10 + [heavy] * 10]
    await asyncio.sleep(0)
    for b in blockers:
        admission.release(b, 1)
    await asyncio.sleep(0)
    granted = [w.result().tenant.name for w in waiters if w.done()]
    assert sorted(granted) == ["heavy", "heavy", "heavy", "light"]
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_queue_bound_and_cancelled_waiter_returns_nothing():
    admission = Admission(max_concurrent=1, max_queued=1)
    t = Tenant("a", limits=TenantLimits(tokens_per_minute=100))
    first = await admission.admit(t, 10)
    waiter = asyncio.ensure_future(admission.admit(t, 10))
    await asyncio.sleep(0)
    with pytest.raises(AdmissionError, match="capacity"):
        await admission.admit(t, 10)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert admission.waiting == 0
    admission.release(first, 10)
    assert admission.running == 0
    await admission.admit(t, 90)  # the cancelled waiter's 10 tokens were refunded


async def test_model_slots_are_handed_out_by_weight_and_a_full_model_blocks_only_itself():
    admission = Admission(max_concurrent=64, max_queued=100, model_slots={"big": 2, "small": 4})
    heavy, light = Tenant("heavy", priority_weight=3.0), Tenant("light", priority_weight=1.0)
    holders = [await admission.admit(light, 1, "big") for _ in range(2)]
    waiters = [asyncio.ensure_future(admission.admit(t, 1, "big")) for t in [light] * 4 + [heavy] * 4]
    await asyncio.sleep(0)
    assert admission.waiting == 8 and not any(w.done() for w in waiters)
    other = await asyncio.wait_for(admission.admit(light, 1, "small"), 1.0)  # "small" has room: no wait
    for h in holders:
        admission.release(h, 1)
    await asyncio.sleep(0)
    assert sorted(w.result().tenant.name for w in waiters if w.done()) == ["heavy", "heavy"]
    admission.release(other, 1)
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert admission.waiting == 0


async def test_each_tenant_queues_at_most_its_weighted_share():
    heavy, light, flood = Tenant("heavy", priority_weight=3.0), Tenant("light"), Tenant("flood")
    admission = Admission(max_concurrent=1, max_queued=10, tenants=[heavy, light, flood])
    assert [admission.queue_share(t) for t in (heavy, light, flood)] == [6, 2, 2]
    holder = await admission.admit(flood, 1)
    flooders = [asyncio.ensure_future(admission.admit(flood, 1)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(AdmissionError, match="share of the queue"):
        await admission.admit(flood, 1)
    others = [asyncio.ensure_future(admission.admit(t, 1)) for t in [light] * 2 + [heavy] * 6]
    await asyncio.sleep(0)
    assert admission.waiting == 10 and not any(o.done() for o in others)  # all queued, none refused
    admission.release(holder, 1)
    for w in flooders + others:
        w.cancel()
    await asyncio.gather(*flooders, *others, return_exceptions=True)
