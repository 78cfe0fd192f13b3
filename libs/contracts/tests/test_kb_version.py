"""The knowledge-base version contract, through a real Redis: what the indexer writes is what the cache reads."""

from __future__ import annotations

import socket
import uuid

import pytest
import redis

from goodput_contracts import DEFAULT_CHANNEL, VersionChange, kb_key, version_key


def _redis() -> redis.Redis:
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=0.5).close()
    except OSError:
        pytest.fail("no Redis on 127.0.0.1:6379 (make install installs redis-server)", pytrace=False)
    return redis.Redis(host="127.0.0.1", port=6379, db=0)


def test_the_version_key_sits_beside_the_indexers_other_keys() -> None:
    assert version_key("acme", "handbook") == "goodput:kb:acme:handbook:version"
    assert kb_key("acme", "handbook", "lock", prefix="p") == "p:kb:acme:handbook:lock"
    assert DEFAULT_CHANNEL == "goodput:kb-version"


def test_an_announcement_survives_a_round_trip_through_redis_pubsub() -> None:
    r = _redis()
    channel = f"test:kb-version:{uuid.uuid4().hex}"
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(channel)
    try:
        sub.get_message(timeout=1.0)
        r.publish(channel, VersionChange("acme", "handbook", 7).encode())
        msg = None
        for _ in range(20):
            msg = sub.get_message(timeout=0.5)
            if msg:
                break
        assert msg is not None
        assert VersionChange.decode(msg["data"]) == VersionChange("acme", "handbook", 7)
    finally:
        sub.close()


@pytest.mark.parametrize("raw", [b"not json", b"{}", b'{"tenant": "a", "knowledge_base": "b", "version": "x"}', b"[]"])
def test_anything_else_on_the_channel_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError, match="not a knowledge-base version change"):
        VersionChange.decode(raw)
