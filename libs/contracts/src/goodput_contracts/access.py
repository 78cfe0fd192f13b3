"""Who may call what, inside the platform: per service, the peer identities allowed on each gRPC method, and those
whose ``tenant`` field the service believes. Read by ``goodput_core.authz`` on every internal server; written
here, next to the topology, so that a new caller shows up in one reviewed table.

An identity is a topology key (``gateway``, ``jobsWorker``, ``indexWorker``…) or :data:`OPERATOR` (the CLI, the
local supervisor, an SRE's tooling). It travels in the caller's mutual-TLS certificate as the URI SAN
``spiffe://goodput/<identity>`` (or the common name). A method missing from its service's table is refused to
every peer; the standard health and reflection services are open to any peer with a valid certificate.

A request that names a tenant (the ``tenant_field``, a dotted path into the request) is believed only from a peer
in the rule's ``tenant_from``: by default the peers that act for tenants (:data:`TENANT_ACTORS`: the gateway, which
authenticated the API key, and its jobs worker, which runs parked requests as their tenant) among the callers;
a rule may add a peer that works on a tenant's data on a tenant actor's behalf (the embedder writing what the
gateway asked it to index) or as an administrator (the operator).

Example:
    >>> rule = ACCESS["scheduler"]["/goodput.scheduler.v1.Scheduler/RegisterWorker"]
    >>> sorted(rule.callers)
    ['inference']
    >>> lookup = "/goodput.cache.v1.Cache/Lookup"
    >>> allowed("cache", lookup, "gateway"), allowed("cache", lookup, "scheduler")
    (True, False)
    >>> allowed("retriever", "/grpc.health.v1.Health/Check", "cache")
    True
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ACCESS", "IDENTITIES", "OPEN_SERVICES", "OPERATOR", "TENANT_ACTORS", "Rule", "allowed", "rule_for"]

OPERATOR = "operator"
# Peers allowed to name the tenant a call is for: they authenticated it themselves (API key → tenant).
TENANT_ACTORS = frozenset({"gateway", "jobsWorker"})
# Open to every peer with a certificate from the platform's CA.
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")


@dataclass(frozen=True)
class Rule:
    callers: frozenset[str]
    # Dotted path of the request's tenant field; empty = the request names no tenant.
    tenant_field: str = ""
    # Peers (besides TENANT_ACTORS among the callers) whose tenant field is believed.
    tenant_also: frozenset[str] = frozenset()

    @property
    def tenant_from(self) -> frozenset[str]:
        return (TENANT_ACTORS & self.callers) | self.tenant_also


def _r(*callers: str, tenant: str = "", tenant_also: tuple[str, ...] = ()) -> Rule:
    return Rule(frozenset(callers), tenant, frozenset(tenant_also))


_GW = ("gateway", "jobsWorker")
_SCHED = "/goodput.scheduler.v1.Scheduler/"
_INF = "/goodput.inference.v1.Inference/"
_EMB = "/goodput.embedder.v1.Embedding/"
_IDX = "/goodput.embedder.v1.Indexer/"
_RET = "/goodput.retriever.v1.Retrieval/"
_STORE = "/goodput.retriever.v1.IndexStore/"
_CACHE = "/goodput.cache.v1.Cache/"
_INDEXERS = ("embedder", "indexWorker")

ACCESS: dict[str, dict[str, Rule]] = {
    "scheduler": {
        # Many leases on one stream: each admit's tenant is believed because only tenant actors may open it.
        _SCHED + "LeaseBatches": _r(*_GW),
        _SCHED + "ListWorkers": _r(*_GW, OPERATOR),
        _SCHED + "RegisterWorker": _r("inference"),
        _SCHED + "DeregisterWorker": _r("inference", OPERATOR),
    },
    "inference": {
        _INF + "Generate": _r(*_GW, tenant="tenant"),
        _INF + "GetLoad": _r("scheduler", *_GW, OPERATOR),
        _INF + "GetModelInfo": _r("scheduler", *_GW, OPERATOR),
    },
    "embedder": {
        _EMB + "Embed": _r(*_GW, "retriever", "cache"),
        _EMB + "DescribeModel": _r(*_GW, "retriever", "cache", OPERATOR),
        _IDX + "IndexDocuments": _r(*_GW, OPERATOR, tenant="tenant", tenant_also=(OPERATOR,)),
        _IDX + "Reindex": _r(*_GW, OPERATOR, tenant="tenant", tenant_also=(OPERATOR,)),
        _IDX + "JobStatus": _r(*_GW, OPERATOR),
    },
    "retriever": {
        _RET + "Search": _r(*_GW, tenant="tenant"),
        # The stores' write side: the indexer writes what a tenant actor asked it to index.
        **{_STORE + m: _r(*_INDEXERS, tenant="tenant", tenant_also=_INDEXERS)
           for m in ("Open", "Write", "BeginRebuild", "CommitRebuild")},
    },
    "cache": {
        _CACHE + "Lookup": _r(*_GW, tenant="key.tenant"),
        _CACHE + "Store": _r(*_GW, tenant="key.tenant"),
        _CACHE + "Invalidate": _r(*_INDEXERS, OPERATOR, tenant="tenant", tenant_also=(*_INDEXERS, OPERATOR)),
        _CACHE + "Stats": _r(*_GW, OPERATOR, tenant="tenant"),
    },
}

# Every identity a certificate may name: the topology's keys and the operator.
IDENTITIES = ("gateway", "scheduler", "inference", "embedder", "retriever", "cache", "indexWorker", "jobsWorker",
              OPERATOR)


def rule_for(service: str, method: str) -> Rule | None:
    """The rule of ``method`` (``/pkg.Service/Method``) on ``service``; None when nobody may call it."""
    return ACCESS.get(service, {}).get(method)


def allowed(service: str, method: str, peer: str) -> bool:
    """Whether ``peer`` may call ``method`` on ``service`` at all (the tenant check comes on top)."""
    if method.lstrip("/").split("/", 1)[0] in OPEN_SERVICES:
        return True
    rule = rule_for(service, method)
    return rule is not None and peer in rule.callers
