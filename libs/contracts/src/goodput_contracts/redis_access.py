"""Who may touch what in Redis: per identity (the topology keys of :mod:`goodput_contracts.access`), the key
patterns, channels and commands of its own Redis ACL user. The same idea as the gRPC access table, one table, so
that the cache's credentials cannot write a job and the embedder's cannot touch a tenant's budget.

A grant names its key families by the *setting* that holds their prefix (``GOODPUT_GATEWAY_JOBS__PREFIX``…) and
that setting's default, so a deployment that moves a prefix moves the grant with it: :func:`acl_rules` reads the
service's own environment. Commands: the read, write, transaction and connection families minus every command Redis
marks dangerous (FLUSHALL, KEYS, CONFIG, DEBUG, ACL…), ``TIME`` (the quota and Celery scripts call it), scripts by
hash only where the identity runs scripts, pub/sub only on its own channel and only in the direction it uses.

The Celery apps keep every key of their broker under ``<queue>:`` (kombu's ``global_keyprefix``, in
:func:`celery_conf`), so each app's user holds its own queue and nothing of the other's.

Example:
    >>> rules = acl_rules("cache", {})
    >>> "~goodput:cache:*" in rules, "%R~goodput:kb:*" in rules, "~goodput:jobs:*" in rules
    (True, True, False)
    >>> "&goodput:kb-version" in rules, "+subscribe" in rules, "+publish" in rules
    (True, True, False)
    >>> [r for r in acl_rules("embedder", {"GOODPUT_EMBEDDER_KEY_PREFIX": "acme"}) if r.startswith("~")]
    ['~acme:job:*', '~acme:jobs:outcomes', '~acme:kb:*', '~goodput-index:*']
    >>> user_name("staging", "jobsWorker")
    'staging-jobsWorker'
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from goodput_contracts.kb_version import DEFAULT_CHANNEL, DEFAULT_KEY_PREFIX

__all__ = ["REDIS_ACCESS", "Grant", "Keys", "acl_rules", "apply", "celery_conf", "new_password", "remove",
           "user_name", "user_url"]


@dataclass(frozen=True)
class Keys:
    """A key family: the value of ``setting`` (``default`` when unset) followed by ``suffix``; ``read`` = read-only."""

    setting: str
    default: str
    suffix: str = ":*"
    read: bool = False

    def pattern(self, env: Mapping[str, str]) -> str:
        return f"{'%R~' if self.read else '~'}{env.get(self.setting) or self.default}{self.suffix}"


@dataclass(frozen=True)
class Grant:
    keys: tuple[Keys, ...]
    scripts: bool = True
    channel: str = ""  # the setting naming its one pub/sub channel ("" = none)
    publish: bool = False
    subscribe: bool = False


def celery_conf(queue: str) -> dict[str, Any]:
    """The Celery settings of an app whose broker is Redis and whose one queue is ``queue``: every broker key
    under ``<queue>:`` (kombu's ``global_keyprefix``: its user's grant), late acknowledgement with redelivery of
    a dead worker's task, and no remote control (anyone who could publish on its channel could steer the workers).

    >>> celery_conf("goodput-jobs")["broker_transport_options"]["global_keyprefix"]
    'goodput-jobs:'
    """
    return {"task_default_queue": queue, "task_acks_late": True, "task_reject_on_worker_lost": True,
            "worker_prefetch_multiplier": 1, "broker_connection_retry_on_startup": True,
            "worker_enable_remote_control": False,
            # An ETA task waits in its worker; on a crash Redis redelivers it after this timeout.
            "broker_transport_options": {"visibility_timeout": 3600, "global_keyprefix": f"{queue}:"}}


_GW, _EMB, _CACHE = "GOODPUT_GATEWAY_", "GOODPUT_EMBEDDER_", "GOODPUT_CACHE_"
_QUOTA = Keys(_GW + "QUOTAS__PREFIX", "goodput:quota")  # counters, budgets, the epoch and the storage ledger
_USAGE = Keys(_GW + "METERING__USAGE_PREFIX", "goodput:usage")
_JOBS = Keys(_GW + "JOBS__PREFIX", "goodput:jobs")  # jobs, files, batches
_FEEDBACK = Keys(_GW + "FEEDBACK__PREFIX", "goodput:feedback")
_JOBS_QUEUE = Keys(_GW + "JOBS__QUEUE", "goodput-jobs")
_INDEXER = (Keys(_EMB + "KEY_PREFIX", DEFAULT_KEY_PREFIX, ":job:*"),
            Keys(_EMB + "KEY_PREFIX", DEFAULT_KEY_PREFIX, ":jobs:outcomes"),
            Keys(_EMB + "KEY_PREFIX", DEFAULT_KEY_PREFIX, ":kb:*"),
            Keys(_EMB + "INDEX_QUEUE", "goodput-index"))
# Channels are not a key family: one exact name, from the setting or the contract's default.
_CHANNEL_DEFAULTS = {_EMB + "VERSION_CHANNEL": DEFAULT_CHANNEL, _CACHE + "VERSION_CHANNEL": DEFAULT_CHANNEL}

REDIS_ACCESS: dict[str, Grant] = {
    # Tenants' quotas, usage and stored data; the producer side of the jobs queue.
    "gateway": Grant((_QUOTA, _USAGE, _JOBS, Keys(_GW + "RESPONSES__PREFIX", "goodput:responses"), _FEEDBACK,
                      Keys(_GW + "RESUME__PREFIX", "goodput:streams"), _JOBS_QUEUE)),
    # Runs parked requests as their tenant: the jobs, their queue, and the quotas and usage they are counted in.
    "jobsWorker": Grant((_QUOTA, _USAGE, _JOBS, _FEEDBACK, _JOBS_QUEUE)),
    # Index jobs, knowledge-base documents and versions; announces each new version.
    "embedder": Grant(_INDEXER, channel=_EMB + "VERSION_CHANNEL", publish=True),
    "indexWorker": Grant(_INDEXER, channel=_EMB + "VERSION_CHANNEL", publish=True),
    # Its entries; the indexer's versions read-only, their announcements heard, never sent.
    "cache": Grant((Keys(_CACHE + "KEY_PREFIX", "goodput:cache"),
                    Keys(_CACHE + "KB_KEY_PREFIX", DEFAULT_KEY_PREFIX, ":kb:*", read=True)),
                   scripts=False, channel=_CACHE + "VERSION_CHANNEL", subscribe=True),
    # Leader election of scheduler replicas (LEADER_ELECTION=redis): the lock key alone.
    "scheduler": Grant((Keys("GOODPUT_SCHEDULER_LEADER_KEY", "goodput:scheduler:leader", "*"),)),
}

_COMMANDS = ("+@read", "+@write", "+@transaction", "+@connection", "+time")
_SCRIPTS = ("+eval", "+evalsha", "+script|load", "+script|exists")


def acl_rules(identity: str, env: Mapping[str, str]) -> list[str]:
    """The ``ACL SETUSER`` rules (after ``reset on >password``) of ``identity``, its prefixes read from ``env``
    (the service's environment). Dangerous commands go last so that no family above brings one back."""
    grant = REDIS_ACCESS[identity]
    rules = [k.pattern(env) for k in grant.keys]
    if grant.channel:
        rules.append(f"&{env.get(grant.channel) or _CHANNEL_DEFAULTS[grant.channel]}")
    rules += [*_COMMANDS, *(_SCRIPTS if grant.scripts else ())]
    rules += ["+publish"] if grant.publish else []
    rules += ["+subscribe", "+unsubscribe"] if grant.subscribe else []
    return [*rules, "-@dangerous"]


def user_name(namespace: str, identity: str) -> str:
    """The ACL user of ``identity`` in a platform whose users are named after ``namespace``."""
    return f"{namespace}-{identity}"


def user_url(url: str, user: str, password: str) -> str:
    """``url`` with ``user`` and ``password`` as its credentials (any it had are replaced).

    >>> user_url("redis://:admin@10.0.0.1:6379/2", "goodput-cache", "p/w")
    'redis://goodput-cache:p%2Fw@10.0.0.1:6379/2'
    """
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{quote(user, safe='')}:{quote(password, safe='')}@{host}", parts.path,
                       parts.query, parts.fragment))


def new_password() -> str:
    return secrets.token_urlsafe(32)


def apply(client: Any, namespace: str, users: Mapping[str, tuple[str, Mapping[str, str]]]) -> None:
    """Creates (or resets) the ACL user of each identity in ``users`` (identity -> (password, its environment)) on
    the Redis of ``client`` (a redis-py client with rights to run ``ACL SETUSER``)."""
    for identity, (password, env) in users.items():
        client.execute_command("ACL", "SETUSER", user_name(namespace, identity), "reset", "on", f">{password}",
                               *acl_rules(identity, env))


def remove(client: Any, namespace: str, identities: Iterable[str]) -> None:
    client.execute_command("ACL", "DELUSER", *(user_name(namespace, i) for i in identities))
