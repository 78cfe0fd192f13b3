"""What every Goodput test folder shares: ports, a Redis, and waiting on a condition instead of sleeping.

Installed, this package is a pytest plugin (entry point ``pytest11``): the fixtures of :mod:`goodput_testing.plugin`
(``redis_url``, ``redis_prefix``, ``redis_session_prefix``) are there in every test folder without an import. The
helpers below are imported where a test needs them.

Example:
    >>> port = free_port()
    >>> 1024 <= port < 65536
    True
    >>> wait_until(lambda: port, timeout=1.0) == port
    True
"""

from goodput_testing._ports import dead_port, free_port
from goodput_testing._redis import RedisServer, delete_keys, redis_answers
from goodput_testing._wait import async_wait_until, wait_until

__all__ = ["RedisServer", "async_wait_until", "dead_port", "delete_keys", "free_port", "redis_answers", "wait_until"]
