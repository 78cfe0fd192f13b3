"""Scheduler settings (env prefix GOODPUT_SCHEDULER_)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from goodput_core.settings import ServiceSettings, service_config


class SchedulerSettings(ServiceSettings):
    model_config = service_config("GOODPUT_SCHEDULER_")

    grpc_port: int = 50052
    http_port: int = 9102
    workers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Inference workers, comma-separated: host:port, or dns:///name:port (every address the name "
                    "resolves to, re-resolved; a headless Service).")
    discovery_interval_s: float = Field(5.0, gt=0, description="Seconds between DNS look-ups of `dns:///` "
                                                                "worker entries.")
    health_interval_s: float = Field(1.0, gt=0, description="Seconds between health/load checks of a worker.")
    health_timeout_s: float = Field(1.0, gt=0, description="Timeout of one health or load check.")
    unhealthy_after: int = Field(2, ge=1, description="Consecutive failed checks that eject a worker.")
    healthy_after: int = Field(1, ge=1, description="Consecutive passed checks that re-admit a worker.")
    max_inflight_per_worker: int = Field(64, ge=1, description="Leases one worker may hold at once.")
    max_queue: int = Field(1000, ge=0, description="Requests that may wait for capacity; more are shed.")
    no_worker_wait_s: float = Field(10.0, ge=0, description="How long a request waits for a healthy worker "
                                                            "to appear before UNAVAILABLE.")
    admit_timeout_s: float = Field(5.0, gt=0, description="How long the first (admit) message may take.")
    kv_weight: float = Field(1.0, ge=0, description="Placement: weight of KV-cache usage in the load score.")
    queue_weight: float = Field(1.0, ge=0, description="Placement: weight of the engine's waiting queue.")

    @field_validator("workers", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [w.strip() for w in value.split(",") if w.strip()]
        return value
