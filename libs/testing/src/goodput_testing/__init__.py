"""What every Goodput test folder shares: ports, a Redis, waiting on a condition instead of sleeping, and a stand-in
for kube-apiserver's EndpointSlice list/watch (:class:`KubeApiStandIn`; no API server can run here).

Installed, this package is a pytest plugin (entry point ``pytest11``): the fixtures of :mod:`goodput_testing.plugin`
(``redis_url``, ``redis_prefix``, ``redis_session_prefix``) are there in every test folder without an import. The
helpers below are imported where a test needs them; :class:`ChartPods` runs the chart's rendered Deployments as podman
containers (tests/containers).

Example:
    >>> port = free_port()
    >>> 1024 <= port < 65536
    True
    >>> wait_until(lambda: port, timeout=1.0) == port
    True
"""

from typing import TYPE_CHECKING

from goodput_testing._pods import ChartPods, podman
from goodput_testing._ports import dead_port, free_port
from goodput_testing._procs import ServiceProcess, SimBackend, sim_backend, sim_worker_env
from goodput_testing._redis import RedisServer, delete_keys, redis_answers
from goodput_testing._wait import async_wait_until, wait_until

__all__ = ["ChartPods", "KubeApiStandIn", "RedisServer", "ServiceProcess", "SimBackend", "async_wait_until",
           "dead_port", "delete_keys", "endpoint_slice", "free_port", "podman", "redis_answers", "sim_backend",
           "sim_worker_env", "wait_until"]

if TYPE_CHECKING:
    from goodput_testing._kubeapi import KubeApiStandIn, endpoint_slice


def __getattr__(name: str) -> object:
    """The kube-apiserver stand-in (it imports aiohttp) loads on first use, not with the pytest plugin."""
    if name in ("KubeApiStandIn", "endpoint_slice"):
        from goodput_testing import _kubeapi

        return getattr(_kubeapi, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
