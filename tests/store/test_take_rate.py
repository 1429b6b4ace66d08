"""take_rate.lua through ``Scripts.take_rate`` on a real server: the token bucket of a
rule's rate (counts of starts granted, never durations)."""

from __future__ import annotations

from typing import Any

from coalescer.config.model import RateLimit
from coalescer.store.keys import rate_bucket
from coalescer.store.scripts import Scripts


async def test_a_fresh_bucket_grants_its_burst_then_says_how_long_to_wait(
        redis_client: Any, namespace: str) -> None:
    scripts, bucket = Scripts(redis_client), rate_bucket(namespace, "r")
    per_minute = RateLimit(count=6, per=60.0)  # burst 1, a token every 10 s
    first = await scripts.take_rate(bucket, per_minute, 5)
    assert first.granted == 1
    assert 9_000 < first.wait_ms <= 10_000  # the next token, not all five
    again = await scripts.take_rate(bucket, per_minute, 5)
    assert again.granted == 0 and again.wait_ms <= first.wait_ms
    assert 0 < await redis_client.pttl(bucket) <= 11_000  # gone once full again


async def test_starts_given_back_are_granted_again_and_never_overfill(
        redis_client: Any, namespace: str) -> None:
    scripts, bucket = Scripts(redis_client), rate_bucket(namespace, "r")
    rate = RateLimit(count=60, per=60.0)  # burst 1
    assert (await scripts.take_rate(bucket, rate, 1)).granted == 1
    assert (await scripts.take_rate(bucket, rate, 0, give_back=1)).granted == 0
    back = await scripts.take_rate(bucket, rate, 3)
    assert back.granted == 1  # the one given back; the bucket holds one at most
    assert (await scripts.take_rate(bucket, rate, 0, give_back=5)).wait_ms == 0
    assert (await scripts.take_rate(bucket, rate, 3)).granted == 1  # capped at its size


async def test_asking_for_nothing_grants_nothing_and_waits_for_nothing(
        redis_client: Any, namespace: str) -> None:
    scripts, bucket = Scripts(redis_client), rate_bucket(namespace, "r")
    grant = await scripts.take_rate(bucket, RateLimit(count=100, per=1.0), 0)
    assert (grant.granted, grant.wait_ms) == (0, 0)
    big = await scripts.take_rate(bucket, RateLimit(count=100, per=1.0), 50)
    assert big.granted == 10  # a tenth of a second's starts
    assert 1 <= big.wait_ms <= 100  # until ten more (the bucket's size) are there
