"""The knowledge-base version contract, through a real Redis: what the indexer writes is what the cache reads."""

from __future__ import annotations

import pytest
import redis

from goodput_contracts import DEFAULT_CHANNEL, VersionChange, kb_key, version_key
from goodput_testing import wait_until


def test_the_version_key_sits_beside_the_indexers_other_keys() -> None:
    assert version_key("acme", "handbook") == "goodput:kb:acme:handbook:version"
    assert kb_key("acme", "handbook", "lock", prefix="p") == "p:kb:acme:handbook:lock"
    assert DEFAULT_CHANNEL == "goodput:kb-version"


def test_an_announcement_survives_a_round_trip_through_redis_pubsub(redis_url: str, redis_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)
    channel = f"{redis_prefix}:kb-version"
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(channel)
    try:
        sub.get_message(timeout=1.0)
        r.publish(channel, VersionChange("acme", "handbook", 7).encode())
        msg = wait_until(lambda: sub.get_message(timeout=0.5), timeout=10, interval=0)
        assert VersionChange.decode(msg["data"]) == VersionChange("acme", "handbook", 7)
    finally:
        sub.close()
        r.close()


@pytest.mark.parametrize("raw", [b"not json", b"{}", b'{"tenant": "a", "knowledge_base": "b", "version": "x"}', b"[]"])
def test_anything_else_on_the_channel_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="not a knowledge-base version change"):
        VersionChange.decode(raw)
