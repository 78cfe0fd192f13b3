"""The shared plugin as a test folder sees it: fixtures without an import, a Redis for the session, and every key a
test writes gone after it."""

from __future__ import annotations

import shutil

import pytest
import redis

from goodput_testing import RedisServer, dead_port, redis_answers

pytest_plugins = ["pytester"]
INNER = ("-p", "no:cacheprovider", "-o", "asyncio_default_fixture_loop_scope=function")


def test_the_fixtures_need_no_import_and_keys_are_dropped_after_each_test(pytester: pytest.Pytester,
                                                                          redis_url: str) -> None:
    pytester.makepyfile("""
        import redis

        seen = []

        def test_writes(redis_url, redis_prefix, redis_session_prefix):
            assert redis_prefix.startswith(redis_session_prefix + "-")
            seen.append(redis_prefix)
            redis.Redis.from_url(redis_url).set(redis_prefix + ":answer", "42")

        def test_a_later_test_gets_a_fresh_prefix_and_the_earlier_keys_are_gone(redis_url, redis_prefix):
            client = redis.Redis.from_url(redis_url)
            assert redis_prefix != seen[0]
            assert client.get(seen[0] + ":answer") is None
    """)
    pytester.runpytest(*INNER).assert_outcomes(passed=2)


def test_two_sessions_on_one_redis_get_their_own_prefixes(pytester: pytest.Pytester, redis_url: str) -> None:
    pytester.makepyfile("""
        import pathlib
        import redis

        def test_leaves_a_key(redis_url, redis_session_prefix):
            redis.Redis.from_url(redis_url).set(redis_session_prefix + ":left-behind", "1")
            with pathlib.Path("prefixes.txt").open("a") as f:
                f.write(redis_session_prefix + "\\n")
    """)
    for _ in range(2):
        pytester.runpytest(*INNER).assert_outcomes(passed=1)
    prefixes = (pytester.path / "prefixes.txt").read_text().split()
    assert len(set(prefixes)) == 2
    client = redis.Redis.from_url(redis_url)
    assert not any(list(client.scan_iter(match=f"{p}*")) for p in prefixes)  # deleted when each session ended
    client.close()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (make install)")
def test_without_a_local_redis_the_session_starts_its_own(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("""
        import goodput_testing.plugin
        from goodput_testing import dead_port

        goodput_testing.plugin.LOCAL_REDIS_PORT = dead_port()  # as on a machine where no Redis runs
    """)
    pytester.makepyfile("""
        import redis

        def test_uses_it(redis_url, redis_prefix):
            assert not redis_url.startswith("redis://127.0.0.1:6379/")
            client = redis.Redis.from_url(redis_url)
            client.set(redis_prefix + ":k", "v")
            assert client.get(redis_prefix + ":k") == b"v"
    """)
    pytester.runpytest(*INNER).assert_outcomes(passed=1)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (make install)")
def test_a_started_redis_server_answers_until_it_is_stopped() -> None:
    with RedisServer() as server:
        assert redis_answers(port=server.port)
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    assert not redis_answers(port=server.port)


def test_a_dead_port_refuses_connections() -> None:
    assert not redis_answers(port=dead_port())
