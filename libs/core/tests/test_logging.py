from __future__ import annotations

import io
import json
import logging

from goodput_core.context import request_context
from goodput_core.logging import JsonFormatter


def test_json_lines_carry_request_and_tenant_ids() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("gateway"))
    log = logging.getLogger("goodput.test.logging")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with request_context(request_id="req-123", tenant="acme"):
            log.info("admitted", extra={"worker": "w1"})
        log.info("outside")
    finally:
        log.removeHandler(handler)
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["request_id"] == "req-123" and inside["tenant_id"] == "acme"
    assert inside["service"] == "gateway" and inside["msg"] == "admitted" and inside["worker"] == "w1"
    assert "request_id" not in outside


def test_request_context_in_a_generator_finalised_elsewhere() -> None:
    import contextvars

    def stream():  # type: ignore[no-untyped-def]
        with request_context(request_id="req-9", tenant="t"):
            yield 1
            yield 2

    gen = stream()
    contextvars.copy_context().run(next, gen)  # entered in one context...
    gen.close()  # ...finalised in another: no ValueError escapes
