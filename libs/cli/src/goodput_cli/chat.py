"""`goodput chat`: one question to the gateway's OpenAI-compatible API, the answer streamed as it is generated."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from goodput_cli.keys import read_dev_key

__all__ = ["DEFAULT_GATEWAY_URL", "DEV_MODEL", "ChatError", "resolve_key", "stream_chat"]

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8080"
DEV_MODEL = "smollm2-135m-instruct"


class ChatError(Exception):
    """A failure worth one line to the user (no traceback)."""


def resolve_key(explicit: str | None, workdir: Path) -> str:
    """--key, then $GOODPUT_API_KEY, then the dev key of a `goodput up` run in this directory."""
    key = explicit or os.environ.get("GOODPUT_API_KEY") or read_dev_key(workdir)
    if not key:
        raise ChatError("no API key: pass --key, set GOODPUT_API_KEY, or run `goodput up` in this directory "
                        f"(it writes {workdir / 'dev-key'})")
    return key


def stream_chat(*, question: str, url: str, key: str, model: str, max_tokens: int, priority: str | None,
                write: Callable[[str], None], timeout_s: float = 300.0) -> None:
    """Streams the answer through ``write``; raises ChatError with a readable message on any API failure."""
    import openai  # lazy: keeps `goodput status` and --help fast

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=key, max_retries=0, timeout=timeout_s)
    extra = {"priority": priority} if priority else None
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, stream=True,
            extra_body=extra)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                write(chunk.choices[0].delta.content)
    except openai.APITimeoutError:
        raise ChatError(f"the gateway at {url} did not answer within {timeout_s:.0f} s") from None
    except openai.APIConnectionError:
        raise ChatError(f"cannot reach the gateway at {url} (is `goodput up` running?)") from None
    except openai.AuthenticationError as err:
        raise ChatError(f"the gateway refused the API key (401): {_message(err)}") from None
    except openai.RateLimitError as err:
        retry = err.response.headers.get("retry-after")
        hint = f"; retry after {retry} s" if retry else ""
        raise ChatError(f"the gateway shed the request (429): {_message(err)}{hint}") from None
    except openai.APIStatusError as err:
        raise ChatError(f"the gateway answered {err.status_code}: {_message(err)}") from None
    except openai.APIError as err:
        raise ChatError(f"the stream failed: {_message(err)}") from None


def _message(err: Exception) -> str:
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(getattr(err, "message", None) or err)
