"""The services' topology: ports, env prefixes, who calls whom. One definition, read by the local supervisor
(``goodput up``) and checked against the Helm chart's ``goodput.serviceMeta`` and docs/services.md by a test.

Keys are the chart's values keys (``indexWorker``, ``jobsWorker``); ``component`` is the chart's
``app.kubernetes.io/component``. A Celery worker has no gRPC port (``grpc_port == 0``); it runs ``celery_app`` on
the queue named by its ``queue_setting`` and serves ``/metrics`` on the port of its ``http_port_setting``.

Example:
    >>> SERVICES["embedder"].grpc_port
    50053
    >>> SERVICES["gateway"].env("SCHEDULER_ADDR")
    'GOODPUT_GATEWAY_SCHEDULER_ADDR'
    >>> [p.service for p in SERVICES["retriever"].peers]
    ['embedder']
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Peer", "SERVICES", "Service", "callers"]


@dataclass(frozen=True)
class Peer:
    """A service this one calls, and the setting (without the prefix) that holds the peer's address."""

    service: str
    setting: str
    # The caller runs without it (empty = that feature off, or done in-process).
    optional: bool = False


@dataclass(frozen=True)
class Service:
    key: str
    component: str
    package: str
    prefix: str
    grpc_port: int
    http_port: int
    http_port_setting: str = "HTTP_PORT"
    # /metrics on a port of its own (METRICS_PORT) where the HTTP port is public; 0 = /metrics on the HTTP port.
    metrics_port: int = 0
    celery_app: str = ""
    queue_setting: str = ""
    default_queue: str = ""
    peers: tuple[Peer, ...] = ()
    # Reached by peers not through an address setting: the gateway calls the worker the scheduler granted.
    also_calls: tuple[str, ...] = ()
    external: tuple[str, ...] = ()
    # One process per replica on consecutive local ports (the n-th local inference worker is grpc_port + n).
    per_instance: bool = False
    description: str = ""

    def env(self, setting: str) -> str:
        return self.prefix + setting

    @property
    def calls(self) -> tuple[str, ...]:
        """Every service this one sends RPCs to (the chart's ``egressTo``)."""
        return tuple(p.service for p in self.peers) + self.also_calls

    @property
    def is_celery_worker(self) -> bool:
        return bool(self.celery_app)


_GATEWAY_PEERS = (Peer("scheduler", "SCHEDULER_ADDR"), Peer("cache", "CACHE_ADDR", optional=True),
                  Peer("retriever", "RETRIEVER_ADDR", optional=True), Peer("embedder", "EMBEDDER_ADDR", optional=True))

SERVICES: dict[str, Service] = {s.key: s for s in (
    Service("gateway", "gateway", "goodput_gateway", "GOODPUT_GATEWAY_", 50051, 8080, metrics_port=8090,
            peers=_GATEWAY_PEERS,
            also_calls=("inference",), external=("redis",), description="REST + gRPC front door"),
    Service("scheduler", "scheduler", "goodput_scheduler", "GOODPUT_SCHEDULER_", 50052, 9102,
            peers=(Peer("inference", "WORKERS"),), external=(), description="queues, admission, placement"),
    Service("inference", "inference", "goodput_inference", "GOODPUT_INFERENCE_", 50061, 9161, per_instance=True,
            description="one vLLM engine"),
    Service("embedder", "embedder", "goodput_embedder", "GOODPUT_EMBEDDER_", 50053, 9103,
            peers=(Peer("retriever", "RETRIEVER_ADDR"),), external=("redis", "qdrant", "elasticsearch"),
            description="Embedding + Indexer"),
    Service("retriever", "retriever", "goodput_retriever", "GOODPUT_RETRIEVER_", 50054, 9104,
            peers=(Peer("embedder", "EMBEDDER_ADDR"),), external=("qdrant", "elasticsearch"),
            description="hybrid search; owner of the stores"),
    Service("cache", "cache", "goodput_cache", "GOODPUT_CACHE_", 50055, 9105,
            peers=(Peer("embedder", "EMBEDDER_ADDR", optional=True),), external=("redis",),
            description="L1 exact + L2 semantic response cache"),
    Service("indexWorker", "indexing-worker", "goodput_embedder", "GOODPUT_EMBEDDER_", 0, 9106,
            http_port_setting="WORKER_HTTP_PORT", celery_app="goodput_embedder.jobs", queue_setting="INDEX_QUEUE",
            default_queue="goodput-index", peers=(Peer("retriever", "RETRIEVER_ADDR"),),
            external=("redis", "qdrant", "elasticsearch"), description="Celery: Reindex jobs"),
    # A job runs through the gateway's own pipeline, so it calls what the gateway calls.
    Service("jobsWorker", "jobs-worker", "goodput_gateway", "GOODPUT_GATEWAY_", 0, 9107,
            http_port_setting="JOBS__WORKER_HTTP_PORT", celery_app="goodput_gateway.worker",
            queue_setting="JOBS__QUEUE",
            default_queue="goodput-jobs", peers=_GATEWAY_PEERS, also_calls=("inference",), external=("redis",),
            description="Celery: deferred P2 requests"),
)}


def callers(key: str) -> list[str]:
    """The services that call ``key`` (the chart's ``ingressFrom``), in SERVICES order."""
    return [s.key for s in SERVICES.values() if key in s.calls]
