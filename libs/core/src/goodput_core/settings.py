"""Settings base: every service subclasses :class:`ServiceSettings` with its own env prefix.

A bad value stops the service at start with a message naming the variable (fail fast), never at first use.

Example:
    >>> class SchedulerSettings(ServiceSettings):
    ...     model_config = service_config("GOODPUT_SCHEDULER_")
    ...     grpc_port: int = 50052
    >>> settings = load_settings(SchedulerSettings)
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from goodput_contracts.sharing import SharingGroups, parse_sharing_groups
from goodput_core.tls import RELEASE_PATTERN, TRUST_DOMAIN_PATTERN, common_identity


class SettingsGroup(BaseModel):
    """A group of a service's settings: one environment variable per field, ``<prefix><GROUP>__<FIELD>``, or the
    whole group as JSON in ``<prefix><GROUP>`` (read where the service's config is :func:`service_config` nested)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def service_config(prefix: str, *, nested: bool = False) -> SettingsConfigDict:
    """A service's settings from ``<prefix><NAME>``; with ``nested``, a group's field from ``<prefix><GROUP>__<FIELD>``
    too (a settings group is a pydantic model; the whole group may also be given as JSON in ``<prefix><GROUP>``)."""
    return SettingsConfigDict(env_prefix=prefix, extra="ignore", validate_default=True, frozen=True,
                              env_nested_delimiter="__" if nested else None)


def _insecure_default() -> bool:
    """``GOODPUT_INSECURE_INTERNAL`` (one switch for a whole local platform); a service's own
    ``<PREFIX>INSECURE_INTERNAL`` wins over it."""
    return os.environ.get("GOODPUT_INSECURE_INTERNAL", "").strip().lower() in ("1", "true", "yes", "on")


class ServiceSettings(BaseSettings):
    """Settings every service has. Subclasses set ``model_config = service_config("GOODPUT_<SVC>_")``."""

    model_config = service_config("GOODPUT_")

    grpc_host: str = Field("127.0.0.1", description="Address the gRPC server binds (0.0.0.0 in a pod).")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port.")
    http_port: int = Field(0, ge=0, le=65535, description="Port of /metrics and /healthz (REST on the gateway).")
    metrics_port: int = Field(0, ge=0, le=65535, description="Port of /metrics and /healthz of its own (0 = on "
                              "http_port).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"
    otel_exporter: Literal["none", "otlp", "console", "file"] = Field(
        "none", description="Where spans go; `otlp` uses the standard OTEL_EXPORTER_OTLP_ENDPOINT.")
    otel_file: str = Field("", description="JSON-lines span file when otel_exporter=file.")
    drain_grace_s: float = Field(30.0, ge=0, description="Seconds in-flight RPCs get to finish after SIGTERM.")
    # Mutual TLS on every internal hop (goodput_core.tls): the server requires a client certificate from the CA,
    # and every internal client presents this one.
    tls_cert_file: str = Field("", description="PEM certificate of this service (its identity in the URI SAN).")
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file.")
    tls_ca_file: str = Field("", description="PEM CA bundle peers' certificates must chain to.")
    insecure_internal: bool = Field(default_factory=_insecure_default,
                                    description="Plaintext internal gRPC without identities (never in production).")
    # The identity prefix spiffe://<trust domain>/<release>/ (goodput_core.tls): a certificate of the same CA made
    # for another release or trust domain names no identity here.
    tls_trust_domain: str = Field(default_factory=lambda: common_identity(os.environ)[0],
                                  pattern=TRUST_DOMAIN_PATTERN, description="SPIFFE trust domain of the identities "
                                  "(also GOODPUT_TLS_TRUST_DOMAIN for every service).")
    tls_release: str = Field(default_factory=lambda: common_identity(os.environ)[1], pattern=RELEASE_PATTERN,
                             description="The release the identities belong to: one to four path segments after "
                             "the trust domain (the chart: <namespace>/<release>; also GOODPUT_TLS_RELEASE).")


S = TypeVar("S", bound=ServiceSettings)


def env_prefix(cls: type[ServiceSettings]) -> str:
    return str(cls.model_config.get("env_prefix", ""))


def load_settings(cls: type[S]) -> S:
    """Reads settings from the environment; on a bad value prints which variable is wrong and exits with 2."""
    try:
        return cls()
    except ValidationError as err:
        prefix = env_prefix(cls)
        lines = [f"invalid configuration for {cls.__name__}:"]
        for e in err.errors():
            # a group's field is <GROUP>__<FIELD> where the class reads nested variables
            joiner = cls.model_config.get("env_nested_delimiter") or "_"
            name = prefix + joiner.join(str(p) for p in e["loc"]).upper()
            lines.append(f"  {name}={e.get('input')!r}: {e['msg']}")
        print("\n".join(lines), file=sys.stderr)
        raise SystemExit(2) from None


def _checked_groups(value: dict[str, list[str]]) -> dict[str, list[str]]:
    SharingGroups(value)  # a tenant in two groups, or an unnamed group, is refused at start
    return value


# CACHE_SHARING_GROUPS of the inference workers and the scheduler, read the same way by both (a JSON object
# {"group": ["tenant", ...]}, empty = every tenant alone): goodput_contracts.sharing.
SharingGroupsSetting = Annotated[dict[str, list[str]], NoDecode, BeforeValidator(parse_sharing_groups),
                                 AfterValidator(_checked_groups)]

