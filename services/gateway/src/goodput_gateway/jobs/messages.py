"""Jobs' messages: the Celery app (Redis broker) that sends them and the :data:`Send` function :mod:`.store` uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from goodput_contracts.redis_access import celery_conf

__all__ = ["Send", "celery_client", "celery_send"]

Send = Callable[[str, int, float], None]
"""Sends a job's message: ``send(job_id, dispatch, delay_s)``."""


_apps: dict[tuple[str, str], Any] = {}


def celery_client(settings: Any) -> Any:
    """The Celery app that sends the jobs' messages (Redis broker; one per broker URL and queue in a process); the
    jobs worker (:mod:`goodput_gateway.worker`) registers the task that runs them on the same app."""
    key = (settings.redis_url, settings.jobs.queue)
    app = _apps.get(key)
    if app is None:
        from celery import Celery  # lazy: only processes that park or run jobs need Celery

        app = Celery("goodput_gateway.jobs", broker=settings.redis_url)
        app.conf.update(celery_conf(settings.jobs.queue))
        _apps[key] = app
    return app


def celery_send(settings: Any) -> Send:
    def send(job_id: str, dispatch: int, delay_s: float) -> None:
        celery_client(settings).send_task("goodput.jobs.run", args=[job_id, dispatch], countdown=max(delay_s, 0.0),
                                          queue=settings.jobs.queue)
    return send
