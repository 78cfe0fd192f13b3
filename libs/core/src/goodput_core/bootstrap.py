"""What every service's ``__main__`` does first: settings (fail fast), logging, tracing, a metrics registry.

Example::

    rt = bootstrap("scheduler", SchedulerSettings)
    runner = ServiceRunner(name="scheduler", settings=rt.settings, registry=rt.registry, provider=rt.provider)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Generic, TypeVar

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, ProcessCollector

from goodput_core.logging import configure_logging
from goodput_core.settings import ServiceSettings, load_settings
from goodput_core.tls import TlsConfigError, configured_files
from goodput_core.tracing import setup_tracing

S = TypeVar("S", bound=ServiceSettings)


@dataclass
class Runtime(Generic[S]):
    settings: S
    registry: CollectorRegistry
    provider: TracerProvider


def bootstrap(service: str, settings_cls: type[S]) -> Runtime[S]:
    settings = load_settings(settings_cls)
    try:
        configured_files(settings, warn=False)
    except TlsConfigError as err:
        print(f"invalid configuration for {settings_cls.__name__}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(service=service, level=settings.log_level, fmt=settings.log_format)
    provider = setup_tracing(service=service, exporter=settings.otel_exporter, file=settings.otel_file)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return Runtime(settings=settings, registry=registry, provider=provider)
